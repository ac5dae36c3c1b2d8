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

Verified on megatron-core 0.19.2's own checkpoint of a dense GPT (local spec, one data-parallel
rank, tensor and pipeline parallelism 1): every main weight and Adam moment equal to its
optimizer's. A checkpoint of several data-parallel groups (tensor or pipeline parallelism
above 1, whose buckets hold each rank's shard) or several buffers (experts, mixed dtypes) is
refused with the fix.
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
    of a bucket, every other key is ``source``'s. ``fields`` maps each field to the keys it has
    state for, ``common`` is the checkpoint's common state with the optimizer's param groups put
    where the model-space layouts keep them. A ``CheckpointError`` refuses, in one line, a layout
    that does not add up."""

    def __init__(self, directory: Path, source: DCPSource, common: dict, plan: dict, model):
        self.source, self.directory = source, directory
        buckets, sizes = self._buckets(source)
        ref = dict(model.named_parameters())
        problem, furthest = "", -1
        for order in megatron_parameter_orders(list(ref), plan):
            placed, why = _place(order[::-1], ref, sizes)
            matched = -1
            if placed is not None:
                matched, why = self._check_main_weights(placed, plan, buckets)
                if not why:
                    break
            if matched > furthest:  # the order that went furthest names what differs
                problem, furthest = why, matched
        else:
            raise CheckpointError(f"{directory}: the distributed optimizer's dp_reshardable "
                                  f"buckets do not map onto the model: {problem}; is the model "
                                  f"config the one it was trained with? Else {_FIX}")
        self.fields: dict[str, set[str]] = {}
        self._virtual: dict[tuple[str, tuple], tuple[str, int, int, tuple]] = {}
        for name, (b, start, stop) in placed.items():
            key, index = plan[name]
            for field, bucket_key in buckets[b].items():
                self.fields.setdefault(field, set()).add(key)
                self._virtual[(f"optimizer.state.{field}.{key}", tuple(index))] = (
                    bucket_key, start, stop, tuple(ref[name].shape))
        self.common = dict(common, optimizer=self._optimizer_common(source))

    def _buckets(self, source: DCPSource) -> tuple[list[dict[str, str]], list[int]]:
        """Each bucket's tensor key by field and its length, checked against
        ``per_bucket_numel_unpadded``."""
        found: dict[tuple, dict[str, str]] = {}
        for key in source.tensors:
            m = _KEY.match(key)
            if m:
                found.setdefault(m.groups()[:3], {}).setdefault(int(m.group(4)), {})
                found[m.groups()[:3]][int(m.group(4))][m.group(5)] = key
        if len(found) != 1:
            what = sorted({f"dp_group_idx_{g[0]}.gbuf_idx_{g[1]}" for g in found})
            raise CheckpointError(f"{self.directory}: its dp_reshardable optimizer state has "
                                  f"{len(found)} buffers ({', '.join(what)}: tensor or pipeline "
                                  "parallelism above 1, experts, or mixed dtypes); mfsdp maps "
                                  f"one; {_FIX}")
        (group, gbuf, _), per_bucket = next(iter(found.items()))
        buckets = [per_bucket.get(b, {}) for b in range(max(per_bucket) + 1)]
        saved = self._saved_sizes(source, group, int(gbuf))
        for b, fields in enumerate(buckets):
            lengths = {source.tensors[k][0][0] for k in fields.values()}
            want = saved[b] if saved and b < len(saved) else None
            if not fields or len(lengths) != 1 or (want is not None and lengths != {want}):
                raise CheckpointError(
                    f"{self.directory}: bucket {b} of its dp_reshardable optimizer state holds "
                    f"{sorted(lengths)} elements per field where per_bucket_numel_unpadded says "
                    f"{want}: the checkpoint is damaged; {_FIX}")
        if saved is not None and len(saved) != len(buckets):
            raise CheckpointError(f"{self.directory}: per_bucket_numel_unpadded names "
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

    def _check_main_weights(self, placed: dict, plan: dict,
                            buckets: list[dict[str, str]]) -> tuple[int, str]:
        """How many placed ``param`` slices equal their model weights (cast to the weight's
        dtype) in order, and ``""`` where all do, else what differs at the first that does not."""
        for i, (name, (b, start, stop)) in enumerate(placed.items()):
            if "param" not in buckets[b]:
                return i, f"bucket {b} has no main weights ('param') to place the weights by"
            main = self.source.get_range(buckets[b]["param"], start, stop)
            weight = self.source.get(*plan[name])
            if not torch.equal(main.to(weight.dtype).view(weight.shape), weight):
                return i, (f"the main weights at [{start}:{stop}] of bucket {b} are not "
                           f"{plan[name][0]} (mfsdp's {name}) in any parameter order mfsdp "
                           "knows (megatron-core's local and Transformer Engine layer specs)")
        return len(placed), ""

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
        """Tensor ``key`` (``[index]``): a weight's state from its bucket, else ``source``'s."""
        found = self._virtual.get((key, tuple(index)))
        if found is None:
            return self.source.get(key, index)
        bucket_key, start, stop, shape = found
        return self.source.get_range(bucket_key, start, stop).view(shape)


def _place(order: list[str], ref: dict, sizes: list[int]) -> tuple[dict | None, str]:
    """Place the parameters (``order``: the buffer's, reversed ``model.parameters()``) in
    buckets of ``sizes`` elements as megatron-core does (each start on a 64-element boundary;
    a bucket ends where its saved length ends): name -> (bucket, start, stop), or ``None`` and
    why not."""
    placed: dict[str, tuple[int, int, int]] = {}
    b, cursor = 0, 0
    for name in order:
        n = ref[name].numel()
        start = -(-cursor // 64) * 64
        if b < len(sizes) and start >= sizes[b]:
            b, start = b + 1, 0
        if b >= len(sizes) or start + n > sizes[b]:
            total = sum(p.numel() for p in ref.values())
            return None, (f"the model's {total} parameter elements, each on a 64-element "
                          f"boundary, do not fill buckets of {sizes} elements")
        placed[name] = (b, start, start + n)
        cursor = start + n
    if b != len(sizes) - 1 or -(-cursor // 64) * 64 < sizes[b]:
        return None, (f"the model's parameters fill {cursor} of the last bucket's "
                      f"{sizes[min(b, len(sizes) - 1)]} elements (bucket {b} of {len(sizes)})")
    return placed, ""
