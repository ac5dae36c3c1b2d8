"""Expert MLPs: one module per expert (:class:`SequentialExperts`) or one stacked weight and one
batched computation (:class:`FusedExperts`).

Both take the rows a dispatcher produced, grouped by local expert, with the count per expert, and
return one output row per input row. They compute the same function from the same weights
(:meth:`FusedExperts.from_sequential` copies them).

The fused fast path reads its children's weights directly and never calls the children's
``forward``. Hooks registered on those children (FSDP's all-gather before forward, release after)
would then never run; :class:`FusedExperts` replays them around the fused computation
(``hook_mode="replay"``). See ``docs/fused-experts.md``.

>>> seq = SequentialExperts(num_experts=2, dim=4, ffn=8)
>>> fused = FusedExperts.from_sequential(seq)
>>> x = torch.randn(5, 4)
>>> torch.allclose(seq(x, [2, 3]), fused(x, [2, 3]), atol=1e-6)
True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ExpertMLP", "FusedExperts", "GroupedLinear", "SequentialExperts",
           "replay_forward_hooks", "replay_forward_pre_hooks"]

HOOK_MODES = ("replay", "none")


def _activate(h: torch.Tensor, swiglu: bool) -> torch.Tensor:
    if swiglu:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h)


class ExpertMLP(nn.Module):
    """One expert: ``linear_fc2(act(linear_fc1(x)))`` without biases; SwiGLU stacks gate and up."""

    def __init__(self, dim: int, ffn: int, swiglu: bool = False):
        super().__init__()
        self.swiglu = swiglu
        self.linear_fc1 = nn.Linear(dim, 2 * ffn if swiglu else ffn, bias=False)
        self.linear_fc2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(_activate(self.linear_fc1(x), self.swiglu))


class SequentialExperts(nn.Module):
    """``num_experts`` :class:`~mfsdp.moe.experts.ExpertMLP` modules run one after another."""

    def __init__(self, num_experts: int, dim: int, ffn: int, swiglu: bool = False):
        super().__init__()
        self.local_experts = nn.ModuleList(ExpertMLP(dim, ffn, swiglu) for _ in range(num_experts))

    def forward(self, tokens: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """Run expert ``j`` on the ``j``-th group of ``tokens_per_expert[j]`` rows."""
        chunks = torch.split(tokens, list(tokens_per_expert))
        outs = [expert(c) for expert, c in zip(self.local_experts, chunks)]
        return torch.cat(outs) if outs else tokens


class GroupedLinear(nn.Module):
    """A bias-free linear layer per expert with one stacked weight ``[experts, out, in]``.

    Its own ``forward`` (the slow path) loops over experts; :class:`FusedExperts` bypasses it.
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform in ``+-1/sqrt(in_features)``, as ``nn.Linear`` without bias."""
        bound = self.weight.shape[2] ** -0.5
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        chunks = torch.split(x, list(tokens_per_expert))
        return torch.cat([c @ w.t() for c, w in zip(chunks, self.weight)])


def replay_forward_pre_hooks(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Run ``module``'s forward pre-hooks as ``module(*args, **kwargs)`` would (both signatures).

    Returns the possibly replaced ``(args, kwargs)``.
    """
    for hook_id, hook in list(module._forward_pre_hooks.items()):
        if hook_id in module._forward_pre_hooks_with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                args, kwargs = result
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    return args, kwargs


def replay_forward_hooks(module: nn.Module, args: tuple, kwargs: dict, output):
    """Run ``module``'s forward hooks on ``output`` (both signatures); return the final output."""
    for hook_id, hook in list(module._forward_hooks.items()):
        if hook_id in module._forward_hooks_with_kwargs:
            result = hook(module, args, kwargs, output)
        else:
            result = hook(module, args, output)
        if result is not None:
            output = result
    return output


class FusedExperts(nn.Module):
    """All local experts in two :class:`~mfsdp.moe.GroupedLinear` children and one padded batched matmul each.

    Args:
        hook_mode: ``"replay"`` runs the children's forward pre-hooks before the fused computation
            and their forward hooks after it (on the fused output); ``"none"`` skips them, which is
            the bug this class exists to avoid (kept to demonstrate it).
    """

    def __init__(self, num_experts: int, dim: int, ffn: int, swiglu: bool = False,
                 hook_mode: str = "replay"):
        super().__init__()
        if hook_mode not in HOOK_MODES:
            raise ValueError(f"hook_mode={hook_mode!r}: choose one of {HOOK_MODES}")
        self.swiglu, self.hook_mode = swiglu, hook_mode
        self.linear_fc1 = GroupedLinear(num_experts, dim, 2 * ffn if swiglu else ffn)
        self.linear_fc2 = GroupedLinear(num_experts, ffn, dim)

    @classmethod
    def from_sequential(cls, seq: SequentialExperts, hook_mode: str = "replay") -> "FusedExperts":
        """Stack the weights of a :class:`SequentialExperts` into a new fused module."""
        first = seq.local_experts[0]
        fc1, fc2 = first.linear_fc1, first.linear_fc2
        with torch.random.fork_rng(devices=[]):  # leave the caller's random stream untouched
            out = cls(len(seq.local_experts), fc1.in_features, fc2.in_features, first.swiglu,
                      hook_mode)
        with torch.no_grad():
            out.linear_fc1.weight.copy_(torch.stack([e.linear_fc1.weight
                                                     for e in seq.local_experts]))
            out.linear_fc2.weight.copy_(torch.stack([e.linear_fc2.weight
                                                     for e in seq.local_experts]))
        return out

    def forward(self, tokens: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        children = (self.linear_fc1, self.linear_fc2)
        args, kwargs = (tokens, tokens_per_expert), {}
        if self.hook_mode == "replay":
            for child in children:
                replay_forward_pre_hooks(child, args, kwargs)
        out = self._fused(tokens, list(tokens_per_expert))
        if self.hook_mode == "replay":
            for child in children:
                out = replay_forward_hooks(child, args, kwargs, out)
        return out

    def _fused(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Pad each expert's rows to the largest count, two ``bmm`` calls, un-pad."""
        E, n = len(counts), tokens.shape[0]
        if n == 0:
            return tokens.new_zeros(0, self.linear_fc2.weight.shape[1])
        biggest = max(counts)
        expert = torch.repeat_interleave(torch.arange(E, device=tokens.device),
                                         torch.tensor(counts, device=tokens.device))
        starts = torch.tensor([0] + counts[:-1], device=tokens.device).cumsum(0)
        pos = torch.arange(n, device=tokens.device) - starts[expert]
        flat = expert * biggest + pos
        padded = tokens.new_zeros(E * biggest, tokens.shape[1]).index_copy(0, flat, tokens)
        h = torch.bmm(padded.view(E, biggest, -1), self.linear_fc1.weight.transpose(1, 2))
        h = _activate(h, self.swiglu)
        y = torch.bmm(h, self.linear_fc2.weight.transpose(1, 2))
        return y.reshape(E * biggest, -1).index_select(0, flat)
