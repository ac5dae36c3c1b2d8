"""A small mixture-of-experts MLP with expert parallelism: the model of the HSDP/EP tests.

Each :class:`MoEBlock` routes every token to its top-1 expert (softmax router, output weighted by
the router probability). With an EP group of size ``ep``, rank ``r`` of the group holds experts
``[r * E / ep, (r + 1) * E / ep)`` and tokens travel to their expert's rank and back with two
differentiable ``all_to_all_single`` calls. Expert parameters are named ``...experts.<j>...`` so
that mfsdp shards them over the expert data-parallel groups. (The full MoE stack with its
dispatchers lives in ``mfsdp.moe``; this model is deliberately minimal.)

>>> model = ToyMoE(dim=8, hidden=16, num_blocks=2, num_experts=4)
>>> model(torch.randn(5, 8)).shape
torch.Size([5, 8])
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mfsdp.models.toy import Block
from mfsdp.moe.dispatcher import local_experts

__all__ = ["Expert", "MoEBlock", "ToyMoE", "keep_local_experts"]


class Expert(nn.Module):
    """One feed-forward expert."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class MoEBlock(nn.Module):
    """LayerNorm, top-1 router, experts (local ones only under EP), residual."""

    def __init__(self, dim: int, hidden: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, num_experts)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(num_experts))
        self.ep_group: dist.ProcessGroup | None = None  # set by keep_local_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        probs = torch.softmax(self.router(h).float(), dim=-1)
        prob, expert = probs.max(dim=-1)
        out = self._dispatch(h, expert) * prob.unsqueeze(-1).to(h.dtype)
        return x + out

    def _run_local(self, h: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h)
        for j, expert in enumerate(self.experts):
            idx = (local == j).nonzero(as_tuple=True)[0]
            out = out.index_add(0, idx, expert(h[idx]))
        return out

    def _dispatch(self, h: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        ep = dist.get_world_size(self.ep_group) if self.ep_group is not None else 1
        if ep == 1:
            return self._run_local(h, expert)
        from torch.distributed.nn.functional import all_to_all_single

        per_rank = self.num_experts // ep
        dest = expert // per_rank
        order = torch.argsort(dest, stable=True)
        send = torch.bincount(dest, minlength=ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.ep_group)
        send_sizes, recv_sizes = send.tolist(), recv.tolist()
        local_ids = torch.empty(sum(recv_sizes), dtype=expert.dtype)
        dist.all_to_all_single(local_ids, (expert % per_rank)[order], recv_sizes, send_sizes,
                               group=self.ep_group)
        tokens = all_to_all_single(torch.empty(sum(recv_sizes), h.shape[1], dtype=h.dtype),
                                   h[order], recv_sizes, send_sizes, group=self.ep_group)
        done = self._run_local(tokens, local_ids)
        back = all_to_all_single(torch.empty(h.shape[0], h.shape[1], dtype=h.dtype), done,
                                 send_sizes, recv_sizes, group=self.ep_group)
        return torch.zeros_like(h).index_add(0, order, back)


class ToyMoE(nn.Module):
    """Input projection, alternating dense :class:`Block` and :class:`MoEBlock`, head."""

    def __init__(self, dim: int = 32, hidden: int = 64, num_blocks: int = 2, num_experts: int = 4):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(
            MoEBlock(dim, hidden, num_experts) if i % 2 else Block(dim, hidden)
            for i in range(num_blocks))
        self.head = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def keep_local_experts(model: nn.Module, ep_group: dist.ProcessGroup | None) -> dict[str, str]:
    """Drop the experts this EP rank does not own; return local name -> global name.

    Call it on a model built identically on every rank (same seed), before sharding it.
    """
    names: dict[str, str] = {}
    for path, m in model.named_modules():
        if not isinstance(m, MoEBlock):
            continue
        keep = local_experts(m.num_experts, ep_group, where=f"{path}: ")
        m.experts = nn.ModuleList(m.experts[j] for j in keep)
        m.ep_group = ep_group
        for local, j in enumerate(keep):
            for pname, _ in m.experts[local].named_parameters():
                names[f"{path}.experts.{local}.{pname}"] = f"{path}.experts.{j}.{pname}"
    return names
