"""Megatron-LM's ``dp_reshardable`` optimizer state (its default with
``--use-distributed-optimizer``), mapped back onto the model's weights.

megatron-core's distributed optimizer keeps its state in the flat buffers of DDP's
``_ParamAndGradBuffer``, and ``dp_reshardable`` saves those as they are: one 1-D tensor per
buffer, bucket and field, ``optimizer.distributed.dp_group_idx_<i>.gbuf_idx_<g>.dtype_<...>
.bucket_idx_<b>.<field>`` with fields ``param`` (the fp32 main weights), ``exp_avg`` and
``exp_avg_sq``; the param groups (with ``step``) and ``per_bucket_numel_unpadded`` are
ShardedObjects beside them. Each saved bucket is the bucket's own index space, the same at any
data-parallel size (every DP rank writes its slice at ``rank * local_numel + local_start``;
only the padding of a bucket's end to a DP multiple is left out). Within it, megatron-core's
``DistributedOptimizer._compute_per_buffer_param_layout`` places the parameters in reverse
``model.parameters()`` order, each starting on a 64-element boundary, a new bucket after
``bucket_size`` elements (and before a shared embedding).

The bucket boundaries are read, not recomputed: ``per_bucket_numel_unpadded`` gives each
bucket's length, so no DDP setting (bucket size, ``overlap_grad_reduce``, the DP size) is
needed. The parameter order is megatron-core's module order, which differs between its layer
specs where Transformer Engine fuses a norm into the next linear; each candidate order is placed
in the buckets and kept only if it fills every bucket exactly and its ``param`` slices equal the
checkpoint's model weights (cast to their dtype), so a wrong order or a damaged buffer is
refused in one line instead of giving shuffled state.

Under tensor parallelism every TP rank has its own data-parallel group (``dp_group_idx_<i>``,
megatron-core numbers them by model-parallel rank: the TP rank at pipeline parallelism 1), whose
buckets hold that rank's pieces of the weights in the same order. Each piece is where Megatron-LM
splits it, by :func:`mfsdp.models.tensor_parallel.tp_splits` (mfsdp's own TP plan): ``linear_qkv``
by whole query groups, ``linear_fc1`` by rows (SwiGLU: the rank's gate rows then its up rows),
``linear_proj`` and ``linear_fc2`` by input columns, the embedding and output layer by
vocabulary rows, norms whole on every rank. Every rank's ``param`` slice must equal its own piece
of the model weight, and the pieces are joined into the global tensors.

Verified on megatron-core 0.19.2's own checkpoints of a dense GPT (local spec, one data-parallel
rank; tensor parallelism 1 and 2, pipeline parallelism 1): every main weight and Adam moment
equal to its optimizer's. Pipeline parallelism above 1 (each stage's buckets hold its own
layers) and several buffers in a group (experts, mixed dtypes) are refused with the fix.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from mfsdp.checkpoint.dcp import DCPSource
from mfsdp.checkpoint.manifest import CheckpointError
from mfsdp.checkpoint.megatron_common import FUSED_NORMS

__all__ = ["BUCKETS", "BucketSource", "megatron_parameter_orders"]

BUCKETS = "optimizer.distributed."
_KEY = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)"
                  r"\.bucket_idx_(\d+)\.(\w+)$")
_FIX = ("save it from Megatron-LM with --dist-ckpt-optim-fully-reshardable, or convert the "
        "weights alone with --weights-only")
# megatron-core's TransformerLayer registers these in this order (Attention: linear_proj
# before SelfAttention's linear_qkv, q_layernorm, k_layernorm); mfsdp's order otherwise
_LAYER_ORDER = ("input_layernorm", "self_attention.linear_proj", "self_attention.",
                "pre_mlp_layernorm", "mlp.")


def megatron_parameter_orders(names: list[str], plan: dict) -> list[list[str]]:
    """The orders megatron-core's ``model.parameters()`` may have for mfsdp's parameter
    ``names`` (in mfsdp's order): its local layer spec (each norm its own module), and
    Transformer Engine's, where a norm the checkpoint names fused (``plan``: name -> (key,
    index)) is a parameter of the linear after it, registered before or after its weight."""
    def rank(name: str) -> tuple[int, int]:
        if not name.startswith("layers."):
            return 0, 0
        rest = name.split(".", 2)[2]
        return 1, next((i for i, p in enumerate(_LAYER_ORDER) if rest.startswith(p)),
                       len(_LAYER_ORDER))

    local = sorted(names, key=lambda n: (int(n.split(".")[1]) if n.startswith("layers.") else
                                         (-1 if n.startswith(("embedding", "position")) else
                                          1 << 30), rank(n)))
    orders = [local]
    for first in (True, False):
        order = [n for n in local if "layer_norm_" not in plan[n][0]]
        for n in [n for n in local if "layer_norm_" in plan[n][0]]:
            layer, rest = n.split(".", 2)[1:]
            fused = FUSED_NORMS.get(rest.rpartition(".")[0], "")
            target = f"layers.{layer}.{fused.rpartition('.')[0]}."  # the linear it is fused into
            at = [i for i, m in enumerate(order) if fused and m.startswith(target)]
            if not at:
                break
            order.insert(at[0] if first else at[-1] + 1, n)
        else:
            if order not in orders:
                orders.append(order)
    return orders


class BucketSource:
    """The ``torch_dist`` checkpoint ``source`` with its ``dp_reshardable`` buckets read as
    model-space state: ``get("optimizer.state.<field>.<key>", index)`` returns the weight's slice
    of a bucket (under tensor parallelism each TP rank's slice, joined), every other key is
    ``source``'s. ``fields`` maps each field to the keys it has state for, ``common`` is the
    checkpoint's common state with the optimizer's param groups put where the model-space layouts
    keep them. A ``CheckpointError`` refuses, in one line, a layout that does not add up."""

    def __init__(self, directory: Path, source: DCPSource, common: dict, plan: dict, model):
        self.source, self.directory = source, directory
        groups = self._buckets(source)  # per TP rank (its data-parallel group): buckets, sizes
        tp = self._tensor_parallel_size(common, len(groups))
        ref = dict(model.named_parameters())
        self.splits = _splits(model, tp)
        numel = {n: _local_shape(directory, n, p.shape, self.splits[n], tp).numel()
                 for n, p in ref.items()}
        problem, furthest = "", -1
        for order in megatron_parameter_orders(list(ref), plan):
            every, why, matched = [], "", -1
            for _, sizes in groups:
                placed, why = _place(order[::-1], numel, sizes)
                if placed is None:
                    break
                every.append(placed)
            else:
                matched, why = self._check_main_weights(every, plan, groups)
                if not why:
                    break
            if matched > furthest:  # the order that went furthest names what differs
                problem, furthest = why, matched
        else:
            raise CheckpointError(f"{directory}: the distributed optimizer's dp_reshardable "
                                  f"buckets do not map onto the model: {problem}; is the model "
                                  f"config the one it was trained with? Else {_FIX}")
        self.fields: dict[str, set[str]] = {}
        self._virtual: dict[tuple[str, tuple], tuple[list, torch.Size, str]] = {}
        for name in ref:
            key, index = plan[name]
            for field in groups[0][0][every[0][name][0]]:
                self.fields.setdefault(field, set()).add(key)
                pieces = []
                for (buckets, _), placed in zip(groups, every):
                    b, start, stop = placed[name]
                    pieces.append((buckets[b][field], start, stop))
                shape = _local_shape(directory, name, ref[name].shape, self.splits[name], tp)
                self._virtual[(f"optimizer.state.{field}.{key}", tuple(index))] = (
                    pieces, shape, name)
        self.common = dict(common, optimizer=self._optimizer_common(source))

    def _tensor_parallel_size(self, common: dict, n: int) -> int:
        """The tensor-parallel size of ``n`` data-parallel groups (megatron-core numbers them
        by model-parallel rank), checked against the saved ``args``: pipeline parallelism above
        1 (each stage's buckets hold its own layers) is refused."""
        args = common.get("args")
        pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
        tp = getattr(args, "tensor_model_parallel_size", None)
        if pp > 1 or (tp is not None and tp != n):
            raise CheckpointError(
                f"{self.directory}: its dp_reshardable optimizer state is of {n} data-parallel "
                f"groups, its arguments say tensor parallelism {tp or 'unsaved'} and "
                f"pipeline parallelism {pp}; mfsdp maps the buckets of one pipeline stage, one "
                f"group per TP rank; {_FIX}")
        return n

    def _buckets(self, source: DCPSource) -> list[tuple[list[dict[str, str]], list[int]]]:
        """Per data-parallel group (TP rank), each bucket's tensor key by field and each
        bucket's length, checked against ``per_bucket_numel_unpadded``."""
        found: dict[tuple, dict[str, str]] = {}
        for key in source.tensors:
            m = _KEY.match(key)
            if m:
                found.setdefault(m.groups()[:3], {}).setdefault(int(m.group(4)), {})
                found[m.groups()[:3]][int(m.group(4))][m.group(5)] = key
        ids = sorted({int(g[0]) for g in found})
        if not found or len(found) != len(ids) or ids != list(range(len(ids))):
            what = sorted({f"dp_group_idx_{g[0]}.gbuf_idx_{g[1]}" for g in found})
            raise CheckpointError(f"{self.directory}: its dp_reshardable optimizer state has "
                                  f"{len(found)} buffers in {len(ids)} data-parallel groups "
                                  f"({', '.join(what)}: experts, mixed dtypes, or a group "
                                  f"missing); mfsdp maps one buffer per group; {_FIX}")
        groups = [self._group(source, g[0], g[1], found[g])
                  for g in sorted(found, key=lambda g: int(g[0]))]
        want = sorted(groups[0][0][0])
        for i, (buckets, _) in enumerate(groups):
            for b, fields in enumerate(buckets):
                if sorted(fields) != want:
                    raise CheckpointError(
                        f"{self.directory}: bucket {b} of data-parallel group {i} of its "
                        f"dp_reshardable optimizer state holds {sorted(fields)}, bucket 0 of "
                        f"group 0 {want}: the checkpoint is damaged; {_FIX}")
        return groups

    def _group(self, source: DCPSource, group: str, gbuf: str,
               per_bucket: dict) -> tuple[list[dict[str, str]], list[int]]:
        """The buckets of data-parallel group ``group``'s buffer ``gbuf`` and their lengths."""
        buckets = [per_bucket.get(b, {}) for b in range(max(per_bucket) + 1)]
        saved = self._saved_sizes(source, group, int(gbuf))
        where = f" of data-parallel group {group}" if group != "0" else ""
        for b, fields in enumerate(buckets):
            lengths = {source.tensors[k][0][0] for k in fields.values()}
            want = saved[b] if saved and b < len(saved) else None
            if not fields or len(lengths) != 1 or (want is not None and lengths != {want}):
                raise CheckpointError(
                    f"{self.directory}: bucket {b}{where} of its dp_reshardable optimizer state "
                    f"holds {sorted(lengths)} elements per field where "
                    f"per_bucket_numel_unpadded says {want}: the checkpoint is damaged; {_FIX}")
        if saved is not None and len(saved) != len(buckets):
            raise CheckpointError(f"{self.directory}: per_bucket_numel_unpadded{where} names "
                                  f"{len(saved)} buckets, the checkpoint holds {len(buckets)}; "
                                  f"the checkpoint is damaged; {_FIX}")
        return buckets, [source.tensors[next(iter(f.values()))][0][0] for f in buckets]

    def _saved_sizes(self, source: DCPSource, group: str, gbuf: int) -> list[int] | None:
        """``per_bucket_numel_unpadded`` of buffer ``gbuf`` (``None`` where it is not saved)."""
        from mfsdp.checkpoint.megatron_common import SAFE_TYPES

        key = next((k for k in source.blob_keys if k.startswith(
            f"{BUCKETS}dp_group_idx_{group}.per_bucket_numel_unpadded/")), None)
        if key is None:
            return None
        value = source.object(key, SAFE_TYPES)
        value = value[0] if isinstance(value, list) and len(value) == 1 else value
        per_dtype = value[gbuf] if gbuf < len(value) else {}
        return [int(n) for sizes in per_dtype.values() for n in sizes]

    def _check_main_weights(self, every: list[dict], plan: dict, groups: list) -> tuple[int, str]:
        """How many weights have every TP rank's placed ``param`` slice equal to its piece of
        the model weight (cast to the weight's dtype), in order, and ``""`` where all do, else
        what differs at the first that does not."""
        tp = len(every)
        for i, name in enumerate(every[0]):
            weight = self.source.get(*plan[name])
            for r, placed in enumerate(every):
                b, start, stop = placed[name]
                buckets = groups[r][0]
                rank = f" (TP rank {r})" if tp > 1 else ""
                if "param" not in buckets[b]:
                    return i, (f"bucket {b}{rank} has no main weights ('param') to place the "
                               "weights by")
                piece = _piece(weight, self.splits[name], r, tp)
                main = self.source.get_range(buckets[b]["param"], start, stop)
                if not torch.equal(main.to(weight.dtype).view(piece.shape), piece):
                    how = _what(self.splits[name], tp)
                    return i, (f"the main weights at [{start}:{stop}] of bucket {b}{rank} are "
                               f"not {plan[name][0]} (mfsdp's {name}, {how}) in any "
                               "parameter order mfsdp knows (megatron-core's local and "
                               "Transformer Engine layer specs)")
        return len(every[0]), ""

    def _optimizer_common(self, source: DCPSource) -> dict:
        """The optimizer's param groups (the ``.optimizer`` ShardedObject) as the model-space
        layouts keep them in the common state."""
        from mfsdp.checkpoint.megatron_common import SAFE_TYPES

        key = next((k for k in source.blob_keys
                    if k.startswith(BUCKETS) and ".optimizer/" in k), None)
        value = source.object(key, SAFE_TYPES) if key else None
        value = value[0] if isinstance(value, list) and value else value
        if not isinstance(value, dict) or "param_groups" not in value:
            raise CheckpointError(f"{self.directory}: its dp_reshardable optimizer state has no "
                                  f"param groups ({BUCKETS}dp_group_idx_0.optimizer); {_FIX}")
        return {"optimizer": value, "param_state_sharding_type": "dp_reshardable"}

    def get(self, key: str, index: tuple[int, ...] = ()) -> torch.Tensor:
        """Tensor ``key`` (``[index]``): a weight's state from its bucket (each TP rank's piece,
        joined), else ``source``'s."""
        found = self._virtual.get((key, tuple(index)))
        if found is None:
            return self.source.get(key, index)
        pieces, shape, name = found
        return _join([self.source.get_range(k, start, stop).view(shape)
                      for k, start, stop in pieces], self.splits[name])


def _splits(model, tp: int) -> dict[str, tuple[int, int] | None]:
    """Each parameter's TP split (:func:`mfsdp.models.tensor_parallel.tp_splits`, Megatron-LM's
    rules), or none at TP 1."""
    from mfsdp.models.tensor_parallel import tp_splits

    if tp == 1:
        return {name: None for name, _ in model.named_parameters()}
    return tp_splits(model)


def _local_shape(directory: Path, name: str, shape, split, tp: int) -> torch.Size:
    """The shape of one TP rank's piece of a weight of ``shape`` split by ``split``."""
    if split is None:
        return torch.Size(shape)
    dim, factor = split
    if shape[dim] % (tp * factor):
        raise CheckpointError(f"{directory}: {name} of shape {tuple(shape)} does not split "
                              f"{tp} ways along dimension {dim}, as the {tp} data-parallel "
                              f"groups of its dp_reshardable optimizer state need; {_FIX}")
    return torch.Size([n // tp if d == dim else n for d, n in enumerate(shape)])


def _piece(full: torch.Tensor, split, r: int, tp: int) -> torch.Tensor:
    """TP rank ``r``'s piece of ``full``: its share of each of the ``split_factor`` blocks
    along the split dimension (``[gate_r; up_r]`` for SwiGLU), or ``full`` where replicated."""
    if split is None:
        return full
    dim, factor = split
    return torch.cat([block.chunk(tp, dim)[r] for block in full.chunk(factor, dim)], dim)


def _join(pieces: list[torch.Tensor], split) -> torch.Tensor:
    """The inverse of :func:`_piece`: the full tensor from every TP rank's piece (rank 0's where
    the weight is replicated)."""
    if split is None:
        return pieces[0]
    dim, factor = split
    blocks = [p.chunk(factor, dim) for p in pieces]
    return torch.cat([b[k] for k in range(factor) for b in blocks], dim)


def _what(split, tp: int) -> str:
    """How a weight is split over ``tp`` ranks, in words."""
    if tp == 1 or split is None:
        return "whole" if tp == 1 else "whole on every TP rank"
    dim, factor = split
    return f"split {tp} ways along dimension {dim}" + (" per gate/up half" if factor > 1 else "")


def _place(order: list[str], numel: dict, sizes: list[int]) -> tuple[dict | None, str]:
    """Place the parameters (``order``: the buffer's, reversed ``model.parameters()``;
    ``numel``: each one's element count on a TP rank) in buckets of ``sizes`` elements as
    megatron-core does (each start on a 64-element boundary; a bucket ends where its saved
    length ends): name -> (bucket, start, stop), or ``None`` and why not."""
    placed: dict[str, tuple[int, int, int]] = {}
    b, cursor = 0, 0
    for name in order:
        n = numel[name]
        start = -(-cursor // 64) * 64
        if b < len(sizes) and start >= sizes[b]:
            b, start = b + 1, 0
        if b >= len(sizes) or start + n > sizes[b]:
            total = sum(numel.values())
            return None, (f"the model's {total} parameter elements, each on a 64-element "
                          f"boundary, do not fill buckets of {sizes} elements")
        placed[name] = (b, start, start + n)
        cursor = start + n
    if b != len(sizes) - 1 or -(-cursor // 64) * 64 < sizes[b]:
        return None, (f"the model's parameters fill {cursor} of the last bucket's "
                      f"{sizes[min(b, len(sizes) - 1)]} elements (bucket {b} of {len(sizes)})")
    return placed, ""
