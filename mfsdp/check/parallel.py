"""The tensor-, sequence-, context- and expert-parallel layouts of ``mfsdp check``: which models
allow them, and one rank's side of a run, built from the trainer's own pieces.

Nothing here splits a model itself. The groups come from the trainer's
:func:`mfsdp.trainer.parallel.build_parallel` (:class:`mfsdp.ParallelLayout`), the TP split from
:func:`mfsdp.models.tensor_parallel.apply_tensor_parallel` (Megatron-LM's plan for
:class:`mfsdp.models.gpt.GPT`), the experts from :func:`mfsdp.moe.shard_experts`, a rank's tokens
and loss from :func:`mfsdp.trainer.parallel.micro_batch` (CP's load-balanced split, SP's padding)
and the loss is scaled as ``mfsdp train`` scales it. These layouts therefore need mfsdp's GPT (a
trainer preset, or a factory returning one); for other models they are skipped, with the reason.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from mfsdp.check.layouts import Layout

__all__ = ["model_refuses", "ParallelRun"]


def model_refuses(layout: Layout, model: nn.Module, nproc: int, global_batch: int,
                  seq_len: int) -> str | None:
    """Why ``model`` cannot run ``layout`` on ``nproc`` ranks (one line), or ``None`` when it can.

    >>> from mfsdp.check.layouts import LAYOUTS
    >>> print(model_refuses(LAYOUTS["tp"], nn.Linear(2, 2), 2, 4, 16))
    tensor parallelism needs mfsdp's GPT (mfsdp.models.gpt.GPT, e.g. a trainer preset), whose TP plan mfsdp.models.tensor_parallel holds; Linear has none
    """
    if not layout.parallel:
        return None
    from mfsdp.models.gpt import GPT

    what = layout.parallel_kind()
    if not isinstance(model, GPT):
        where = {"tensor parallelism": ", whose TP plan mfsdp.models.tensor_parallel holds",
                 "context parallelism": ", whose attention takes a CP split",
                 "expert parallelism": ", whose MoE layers mfsdp.moe.shard_experts splits"}[what]
        return (f"{what} needs mfsdp's GPT (mfsdp.models.gpt.GPT, e.g. a trainer preset){where}; "
                f"{type(model).__name__} has none")
    cfg = model.config
    from mfsdp.layout import ParallelLayout

    try:
        ParallelLayout(nproc, ep=layout.ep, num_experts=cfg.num_experts or None, tp=layout.tp,
                       cp=layout.cp)
    except ValueError as exc:
        return f"{nproc} ranks: {exc}"
    dp = nproc // (layout.tp * layout.cp)
    if global_batch % dp:
        return f"global batch {global_batch} is not divisible by the {dp} data-parallel places"
    if layout.tp > 1:
        from mfsdp.models.tensor_parallel import check_tensor_parallel

        try:
            check_tensor_parallel(cfg, layout.tp, layout.sequence_parallel)
        except ValueError as exc:
            return str(exc)
    if layout.cp > 1 and seq_len % (2 * layout.cp):
        return (f"--seq-len {seq_len} is not divisible by 2 x cp = {2 * layout.cp} (CP cuts "
                "each sequence into 2 x cp chunks); give a multiple")
    if layout.ep > 1 and not cfg.num_experts:
        return "a dense model (num_experts=0) has no experts to split over EP"
    if layout.ep > 1 and cfg.moe_grouped_gemm:
        return ("fused experts (moe_grouped_gemm) keep stacked local names under EP; mfsdp "
                "check compares one-module-per-expert layers only")
    return None


class ParallelRun:
    """One rank's parallel layout: its groups (the trainer's :class:`TrainParallel`), the sharded
    model's tokens and loss, and its full parameters under their global names."""

    def __init__(self, layout: Layout, model: nn.Module, world: int, global_batch: int,
                 seq_len: int):
        from mfsdp.trainer.parallel import build_parallel

        args = SimpleNamespace(tensor_model_parallel_size=layout.tp,
                               context_parallel_size=layout.cp,
                               expert_model_parallel_size=layout.ep,
                               num_distributed_optimizer_instances=layout.dp_outer,
                               sequence_parallel=layout.sequence_parallel,
                               use_megatron_fsdp=True, create_all_gather_group=False)
        self.layout = layout
        # this rank's place: its data-parallel slice, TP mesh and CP group (the trainer's)
        self.par = build_parallel(args, world, model.config, torch.device("cpu"), print)
        # every rank's predicted tokens of a step: the loss is a mean over them
        self.global_tokens = global_batch * (seq_len - 1)
        # local parameter name -> global name of this rank's experts (empty without EP)
        self.expert_names: dict[str, str] = {}

    @property
    def groups(self):
        """The :class:`mfsdp.ProcessGroups` for ``fully_shard(process_groups=...)``."""
        return self.par.groups

    def split(self, model: nn.Module) -> nn.Module:
        """Split ``model`` over TP (Megatron-LM's plan, the logits left split over the
        vocabulary as the trainer does) and keep this rank's experts, with the layout's
        dispatcher; before sharding."""
        from mfsdp.models.tensor_parallel import apply_tensor_parallel
        from mfsdp.moe import MoELayer, shard_experts

        if self.par.tp_mesh is not None:
            apply_tensor_parallel(model, self.par.tp_mesh, self.par.sequence_parallel,
                                  vocab_parallel_loss=True)
        if self.layout.ep > 1:
            for m in model.modules():
                if isinstance(m, MoELayer) and self.layout.dispatcher:
                    m.dispatcher_kind = self.layout.dispatcher
            self.expert_names = shard_experts(model, self.groups["ep"])
        return model

    def loss_backward(self, model, tokens: torch.Tensor) -> torch.Tensor:
        """Forward and backward of this rank's share of ``tokens`` (the global batch ``[B, S]``);
        return the global mean loss (the same on every rank)."""
        from mfsdp.models.tensor_parallel import loss_parallel_context
        from mfsdp.trainer.parallel import micro_batch

        par = self.par
        per = tokens.shape[0] // par.dp_size
        rows = list(tokens[par.dp_rank * per:(par.dp_rank + 1) * per])
        batch = micro_batch(rows, par, torch.device("cpu"))
        loss_sum, _ = batch.loss(model)
        # the engine averages gradients over dp x cp: scale as mfsdp train does
        with loss_parallel_context(par.tp):
            (loss_sum * par.grad_ranks / self.global_tokens).backward()
        total = loss_sum.detach().double().reshape(())
        par.sum_over_tokens(total)
        return total / self.global_tokens

    def full_parameters(self, model) -> dict[str, torch.Tensor]:
        """Every parameter, full, under its global name (a collective call). Under EP each rank
        holds its own experts: they are gathered from every rank."""
        import torch.distributed as dist

        full = model.full_parameters()
        full = {(n[len("module."):] if n.startswith("module.") else n): p
                for n, p in full.items()}
        if self.layout.ep == 1:
            return full
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, {self.expert_names.get(n, n): p for n, p in full.items()})
        return {n: p for part in parts for n, p in part.items()}
