"""Where a rank of ``mfsdp train`` sits (its data-parallel place, its tensor- and context-parallel
groups) and how a micro-batch is laid out for it.

Megatron-LM's rank order (TP fastest, then CP, then DP; see :class:`mfsdp.ParallelLayout`): the TP
and CP ranks of a replica use the same samples, which its first TP and CP rank reads and sends
them (:meth:`TrainParallel.read_once`), the data-parallel ranks (``dp`` groups) different ones; each CP rank takes its load-balanced share of every sequence
(:mod:`mfsdp.models.context_parallel`). Gradients are averaged over the ranks that hold different
tokens (``dp x cp`` and the outer replicas), never over TP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from mfsdp.models.config import GPTConfig
    from mfsdp.trainer.config import ParallelConfig, TrainConfig

from mfsdp.models.context_parallel import (ContextParallelSplit, next_token_targets,
                                           pad_sequences)

__all__ = ["TrainParallel", "MicroBatch", "build_parallel", "build_sharded_model", "micro_batch",
           "pad_for_sequence_parallel"]


@dataclass
class TrainParallel:
    """This rank's place in the training layout."""

    layout: object  # mfsdp.ParallelLayout
    groups: object  # mfsdp.ProcessGroups, or None: everything over the world
    dp_rank: int  # index among the ranks that read different samples
    dp_size: int
    dp_group: dist.ProcessGroup | None  # those ranks (None: the world)
    tp_mesh: object  # a 1-D DeviceMesh over this rank's TP group, or None
    sequence_parallel: bool
    cp_group: dist.ProcessGroup | None = None  # this rank's CP group (None: no CP)
    cp: int = 1

    @property
    def tp(self) -> int:
        return self.tp_mesh.size() if self.tp_mesh is not None else 1

    @property
    def grad_ranks(self) -> int:
        """How many ranks the engine averages gradients over, ``dp x cp`` (different tokens)."""
        return self.dp_size * self.cp

    def read_once(self, read: Callable[[], Any]) -> Any:
        """``read()`` on this data-parallel place's first TP and CP rank only, its result sent
        to the other TP and CP ranks (as Megatron-LM's TP rank 0 reads and broadcasts the
        batch): a replica reads its samples once, whatever its TP x CP size."""
        tp_group = self.tp_mesh.get_group() if self.tp_mesh is not None else None
        tp_first = tp_group is None or dist.get_rank(tp_group) == 0
        cp_first = self.cp_group is None or dist.get_rank(self.cp_group) == 0
        box = [read() if tp_first and cp_first else None]
        if self.cp_group is not None and tp_first:  # first along CP (at TP index 0) ...
            dist.broadcast_object_list(box, group=self.cp_group, group_src=0)
        if tp_group is not None:  # ... then along TP
            dist.broadcast_object_list(box, group=tp_group, group_src=0)
        return box[0]

    def sum_over_tokens(self, t: torch.Tensor) -> None:
        """Sum ``t`` in place over every rank holding different tokens (not over TP)."""
        dist.all_reduce(t, group=self.dp_group)
        if self.cp_group is not None:
            dist.all_reduce(t, group=self.cp_group)


def build_parallel(parallel: ParallelConfig, world: int, cfg: GPTConfig, device: torch.device,
                   log: Callable[..., None]) -> TrainParallel:
    """Create the groups the ``parallel`` group asks for (a
    :class:`~mfsdp.trainer.config.ParallelConfig`; a collective call) and say where this rank
    is."""
    from torch.distributed.device_mesh import DeviceMesh

    from mfsdp.layout import ParallelLayout  # (not `mfsdp`: mfsdp.check imports this module)

    tp = parallel.tensor_model_parallel_size
    cp = parallel.context_parallel_size
    ep = parallel.expert_model_parallel_size
    outer = parallel.num_distributed_optimizer_instances
    sp = parallel.sequence_parallel
    if sp and tp == 1:  # Megatron-LM's rule
        log("note: disabling sequence parallelism because tensor model parallelism is disabled "
            "(--tensor-model-parallel-size 1)", flush=True)
        sp = False
    try:
        layout = ParallelLayout(world, outer, ep, cfg.num_experts or None, tp=tp, cp=cp)
    except ValueError as exc:  # a layout these flags cannot make: the flags are the fix
        raise SystemExit(f"--expert-model-parallel-size {ep}, --tensor-model-parallel-size {tp}, "
                         f"--context-parallel-size {cp}, --num-distributed-optimizer-instances "
                         f"{outer} on {world} ranks: {exc}") from None
    groups = None
    if parallel.use_megatron_fsdp and (ep > 1 or outer > 1 or tp > 1 or cp > 1
                                   or parallel.create_all_gather_group):
        groups = layout.create_groups(all_gather_groups=parallel.create_all_gather_group)
    rank = dist.get_rank()
    dp_ranks = layout.group_of("dp", rank)
    dp_group = groups["dp"] if groups is not None and tp * cp > 1 else None
    tp_mesh = DeviceMesh.from_group(groups["tp"], device.type) if tp > 1 else None
    return TrainParallel(layout, groups, dp_ranks.index(rank), len(dp_ranks), dp_group, tp_mesh,
                         sp, groups["cp"] if cp > 1 else None, cp)


def build_sharded_model(config: TrainConfig, cfg: GPTConfig, world: int, device: torch.device,
                        log: Callable[..., None]) -> tuple:
    """The trainer's model: every rank builds the same :class:`~mfsdp.models.gpt.GPT` of ``cfg``,
    splits it over TP and shards it over the data-parallel ranks (``--use-megatron-fsdp``) or
    replicates it (PyTorch's DDP), with its optimizer; returns ``(model, inner, optimizer,
    parallel)``. ``config`` is the :class:`~mfsdp.trainer.config.TrainConfig`; a collective call.

    ``mfsdp plan --dry-run`` calls it too, with ``device`` the meta device on a fake process
    group: the layout it checks is the one the trainer builds.
    """
    import contextlib

    from mfsdp.fsdp.api import fully_shard  # (not `mfsdp`: mfsdp.check imports this module)
    from mfsdp.models.gpt import GPT, TransformerLayer
    from mfsdp.models.tensor_parallel import apply_tensor_parallel
    from mfsdp.moe import shard_experts
    from mfsdp.trainer.build import build_param_groups, make_optimizer, precision_policy

    c = config
    dtype = torch.bfloat16 if c.precision.bf16 else torch.float32
    torch.manual_seed(c.training.seed)  # every rank builds the same model
    meta = c.parallel.init_model_with_meta_device  # (refused without --use-megatron-fsdp)
    # Sharding onto the meta device (a dry run) builds on meta under every strategy.
    with torch.device("meta") if meta or device.type == "meta" else contextlib.nullcontext():
        model = GPT(cfg)
    if c.training.compile:  # each layer's forward; the sharding hooks stay outside it
        model.compile_layers()
    model = model.to(dtype=dtype) if meta else model.to(device=device, dtype=dtype)
    par = build_parallel(c.parallel, world, cfg, device, log)
    groups = par.groups
    if par.tp_mesh is not None:  # Megatron-LM's split, before the data-parallel sharding
        apply_tensor_parallel(model, par.tp_mesh, par.sequence_parallel,
                              vocab_parallel_loss=True)
    if c.parallel.use_megatron_fsdp:
        global_names = shard_experts(model, groups["ep"] if groups else None)
        opt = make_optimizer(build_param_groups(model, c.training), c.training)
        model, opt = fully_shard(
            model, opt, fsdp_unit_modules=[TransformerLayer],
            zero_dp_strategy=c.parallel.data_parallel_sharding_strategy,
            outer_dp_sharding_strategy=c.parallel.outer_dp_sharding_strategy,
            process_groups=groups, device=device, init_model_with_meta_device=meta,
            mixed_precision_policy=precision_policy(c.precision),
            overlap_grad_reduce=c.parallel.overlap_grad_reduce,
            overlap_param_gather=c.parallel.overlap_param_gather,
            calculate_per_token_loss=c.parallel.calculate_per_token_loss,
            fsdp_double_buffer=c.parallel.fsdp_double_buffer)
        if global_names:
            model.fsdp_state().set_global_names(global_names)
        inner = model.module
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        inner = model
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        opt = make_optimizer(build_param_groups(inner, c.training), c.training)
    return model, inner, opt, par


def pad_for_sequence_parallel(tokens: torch.Tensor, cu_seqlens: torch.Tensor,
                              tp: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Packed ``tokens`` padded to a multiple of ``tp`` (sequence parallelism splits the token
    dimension evenly) by one extra sequence, which attends only to itself and which the loss
    leaves out; returns ``(tokens, cu_seqlens, real tokens)``.

    >>> t, cu, n = pad_for_sequence_parallel(torch.arange(5), torch.tensor([0, 2, 5]), 4)
    >>> t.tolist(), cu.tolist(), n
    ([0, 1, 2, 3, 4, 0, 0, 0], [0, 2, 5, 8], 5)
    """
    n = tokens.numel()
    pad = -n % tp
    if pad == 0:
        return tokens, cu_seqlens, n
    tokens = torch.cat([tokens, tokens.new_zeros(pad)])
    cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([n + pad])])
    return tokens, cu_seqlens, n


@dataclass
class MicroBatch:
    """What one rank feeds the model for one packed micro-batch, and the loss's targets."""

    tokens: torch.Tensor  # this rank's tokens (all of them without CP)
    cu_seqlens: torch.Tensor | None
    context: ContextParallelSplit | None
    targets: torch.Tensor  # the next token of each fed token
    valid: torch.Tensor  # which fed tokens predict one (not padding, not a sequence's last)
    real: torch.Tensor  # which fed tokens are not padding

    def loss(self, model: torch.nn.Module, routers: Sequence[tuple[str, torch.nn.Module]] = ()
             ) -> tuple[torch.Tensor, int]:
        """``(summed next-token cross-entropy, predicted tokens)`` of this rank's tokens; the
        ``routers`` (``(name, router)`` pairs) count only real tokens toward their load."""
        padded = not bool(self.real.all())
        for _, router in routers:
            router.count_mask = self.real if padded else None
        if self.context is not None:
            logits = model(self.tokens, context=self.context)
        else:
            logits = model(self.tokens, self.cu_seqlens)
        # Under TP the logits are split over the vocabulary: a vocabulary-parallel loss.
        from mfsdp.models.tensor_parallel import vocab_parallel_cross_entropy

        return (vocab_parallel_cross_entropy(logits, self.targets, self.valid),
                int(self.valid.sum()))


def micro_batch(samples: list, par: TrainParallel, device: torch.device) -> MicroBatch:
    """Pack ``samples`` for this rank: under sequence parallelism padded to a multiple of the TP
    size; under context parallelism every sequence padded to a multiple of ``2 x cp`` (x TP with
    SP) and this rank's load-balanced share taken."""
    from mfsdp.models.gpt import pack_sequences

    tokens, cu = pack_sequences(samples)
    if par.cp > 1:
        tokens, cu, real = pad_sequences(tokens, cu, 2 * par.cp * (par.tp if par.sequence_parallel
                                                                    else 1))
        targets, valid = next_token_targets(tokens, cu, real)
        split = ContextParallelSplit.build(cu, par.cp_group, device)
        mine = split.index.cpu()
        return MicroBatch(tokens[mine].to(device), None, split, targets[mine].to(device),
                          valid[mine].to(device), real[mine].to(device))
    real = torch.ones_like(tokens, dtype=torch.bool)
    if par.sequence_parallel:
        tokens, cu, n = pad_for_sequence_parallel(tokens, cu, par.tp)
        real = torch.arange(tokens.numel()) < n
    targets, valid = next_token_targets(tokens, cu, real)
    return MicroBatch(tokens.to(device), cu.to(device), None, targets.to(device),
                      valid.to(device), real.to(device))
