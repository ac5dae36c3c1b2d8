"""The MoE layer: router, token dispatcher, experts and an optional shared expert.

>>> layer = MoELayer(dim=8, ffn=16, num_experts=4, topk=2, dispatcher="alltoall")
>>> layer(torch.randn(6, 8)).shape
torch.Size([6, 8])
>>> layer.dispatcher.tokens_per_expert  # rows each expert computed (6 tokens x top-2)
[...]
>>> sum(layer.dispatcher.tokens_per_expert)
12
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mfsdp.fsdp.registry import declare_checkpoint_names
from mfsdp.moe.dispatcher import local_experts, make_dispatcher
from mfsdp.moe.experts import ExpertMLP, FusedExperts, SequentialExperts
from mfsdp.moe.router import TopKRouter

__all__ = ["MoELayer", "collect_aux_losses", "shard_experts"]


class MoELayer(nn.Module):
    """Route each token to ``topk`` of ``num_experts`` experts and sum their weighted outputs.

    Args:
        dim, ffn: model width and each expert's hidden width.
        dispatcher: ``"allgather"``, ``"alltoall"`` or ``"flex"`` (with ``flex_backend``
            ``"torch"`` or ``"deepep"``).
        fused: :class:`~mfsdp.moe.experts.FusedExperts` instead of one module per expert.
        shared_ffn: hidden width of a shared expert every token also goes through (0: none).
        shared_gate: scale the shared expert's output by ``sigmoid(shared_expert_gate(x))``
            (Qwen2-MoE's gated shared expert).
        router_kwargs: passed to :class:`~mfsdp.moe.router.TopKRouter` (``score_func``,
            ``num_groups``, ``group_topk``, ``expert_bias``, ``aux_loss_coeff``, ...).
    """

    def __init__(self, dim: int, ffn: int, num_experts: int, topk: int = 1,
                 dispatcher: str = "alltoall", flex_backend: str = "torch", fused: bool = False,
                 swiglu: bool = False, shared_ffn: int = 0, shared_gate: bool = False,
                 hook_mode: str = "replay", **router_kwargs):
        super().__init__()
        self.num_experts, self.dispatcher_kind, self.flex_backend = num_experts, dispatcher, flex_backend
        self.router = TopKRouter(dim, num_experts, topk, **router_kwargs)
        seq = SequentialExperts(num_experts, dim, ffn, swiglu)
        self.experts = FusedExperts.from_sequential(seq, hook_mode) if fused else seq
        self.shared_expert = ExpertMLP(dim, shared_ffn, swiglu) if shared_ffn else None
        if shared_gate and not shared_ffn:
            raise ValueError("shared_gate needs a shared expert (shared_ffn > 0)")
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False) if shared_gate else None
        self.dispatcher = make_dispatcher(dispatcher, num_experts, None, flex_backend)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden``: ``[tokens, dim]`` (any leading shape is flattened and restored)."""
        shape = hidden.shape
        flat = hidden.reshape(-1, shape[-1])
        probs, routing_map = self.router(flat)
        out = self.dispatcher(flat, probs.to(flat.dtype), routing_map, self.experts)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out.reshape(shape)


def collect_aux_losses(model: nn.Module) -> torch.Tensor:
    """The sum of every router's auxiliary and z-losses from the last forward (0 if none)."""
    total = torch.zeros(())
    for m in model.modules():
        if isinstance(m, TopKRouter):
            for v in m.losses.values():
                total = total + v
    return total


def shard_experts(model: nn.Module, ep_group: dist.ProcessGroup | None) -> dict[str, str]:
    """Keep only this EP rank's experts in every :class:`~mfsdp.moe.MoELayer` and point its dispatcher at the
    EP group. Call it on a model built identically on every rank (same seed), before sharding.

    Returns the renaming local parameter name -> global name for one-module-per-expert layers
    (fused experts keep their stacked local names). The renaming is also declared for ``model``,
    and :func:`mfsdp.fully_shard` applies it to checkpoints (no need to call
    ``set_global_names``; see :func:`mfsdp.fsdp.registry.declare_checkpoint_names`).
    """
    names: dict[str, str] = {}
    for path, m in model.named_modules():
        if not isinstance(m, MoELayer):
            continue
        keep = local_experts(m.num_experts, ep_group, where=f"{path}: ")
        if isinstance(m.experts, FusedExperts):
            with torch.no_grad():
                for child in (m.experts.linear_fc1, m.experts.linear_fc2):
                    child.weight = nn.Parameter(child.weight[keep.start:keep.stop].clone())
        else:
            m.experts.local_experts = nn.ModuleList(m.experts.local_experts[j] for j in keep)
            for local, j in enumerate(keep):
                for pname, _ in m.experts.local_experts[local].named_parameters():
                    prefix = f"{path}.experts.local_experts"
                    names[f"{prefix}.{local}.{pname}"] = f"{prefix}.{j}.{pname}"
        m.dispatcher = make_dispatcher(m.dispatcher_kind, m.num_experts, ep_group, m.flex_backend)
    declare_checkpoint_names(model, names)
    return names
