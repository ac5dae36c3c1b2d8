"""Context parallelism for :class:`mfsdp.models.gpt.GPT`: each sequence split over ``cp`` ranks,
attention exact over the whole causal sequence.

Megatron-LM's load-balanced split: every sequence of a packed micro-batch is cut into ``2 x cp``
equal chunks and CP rank ``r`` takes chunks ``r`` and ``2 cp - 1 - r``, so that under the causal
mask every rank has the same amount of work. Attention gathers the keys and values of every CP
rank (as Llama 3 does: one all-gather per layer in forward, their gradients reduce-scattered in
backward) and masks them by the tokens' places in the packed batch: a query sees the keys of its
own sequence at or before its position. Position ids (RoPE) and the loss's targets follow each
token to its rank.

>>> split_indices([0, 8], cp=2, rank=0).tolist()  # chunks 0 and 3 of one 8-token sequence
[0, 1, 6, 7]
>>> split_indices([0, 8], cp=2, rank=1).tolist()
[2, 3, 4, 5]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["ContextParallelSplit", "split_indices", "pad_sequences", "next_token_targets"]


def split_indices(cu_seqlens, cp: int, rank: int) -> torch.Tensor:
    """Indices (into the packed batch) of CP rank ``rank``'s tokens: chunks ``rank`` and
    ``2 cp - 1 - rank`` of every sequence (each sequence's length must divide by ``2 cp``)."""
    bounds = [int(b) for b in cu_seqlens]
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        n = b - a
        if n % (2 * cp):
            raise ValueError(f"a sequence of {n} tokens cannot be split into 2 x cp = {2 * cp} "
                             "chunks; pad every sequence to a multiple (pad_sequences)")
        c = n // (2 * cp)
        for chunk in (rank, 2 * cp - 1 - rank):
            out.append(torch.arange(a + chunk * c, a + (chunk + 1) * c))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def pad_sequences(tokens: torch.Tensor, cu_seqlens: torch.Tensor,
                  multiple: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad every packed sequence at its end to a multiple of ``multiple`` tokens; return the
    tokens, the new offsets and which tokens are real (padding attends like a continuation of its
    sequence, which no real token sees under the causal mask, and is left out of the loss).

    >>> tokens, cu_seqlens = torch.tensor([5, 6, 7, 8, 9]), torch.tensor([0, 2, 5])
    >>> t, cu, real = pad_sequences(tokens, cu_seqlens, 4)
    >>> t.tolist(), cu.tolist(), real.int().tolist()
    ([5, 6, 0, 0, 7, 8, 9, 0], [0, 4, 8], [1, 1, 0, 0, 1, 1, 1, 0])
    """
    bounds = cu_seqlens.tolist()
    parts, reals, new = [], [], [0]
    for a, b in zip(bounds[:-1], bounds[1:]):
        n = b - a
        pad = -n % multiple
        parts += [tokens[a:b], tokens.new_zeros(pad)]
        reals += [torch.ones(n, dtype=torch.bool), torch.zeros(pad, dtype=torch.bool)]
        new.append(new[-1] + n + pad)
    return torch.cat(parts), torch.tensor(new, dtype=cu_seqlens.dtype), torch.cat(reals)


def next_token_targets(tokens: torch.Tensor, cu_seqlens: torch.Tensor,
                       real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(targets, valid)`` for every packed token: the next token of its sequence, valid when
    that next token is real (the last real token of a sequence predicts nothing)."""
    targets = torch.roll(tokens, -1)
    valid = real & torch.roll(real, -1)
    valid[cu_seqlens[1:] - 1] = False
    return targets, valid


@dataclass(frozen=True)
class ContextParallelSplit:
    """One micro-batch split over a CP group: what attention needs to be exact across ranks.

    Built by :meth:`build` on every rank of the group from the same packed offsets. Passed to
    :meth:`mfsdp.models.gpt.GPT.forward` as ``context=``, it travels to attention in place of the
    packed-sequence mask.
    """

    group: dist.ProcessGroup
    size: int
    rank: int
    index: torch.Tensor  # this rank's tokens (indices into the packed batch)
    mask: torch.Tensor  # [local tokens, all tokens]: query may attend key (keys in rank order)
    cu_seqlens: torch.Tensor  # the whole packed batch's offsets

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, group: dist.ProcessGroup,
              device: torch.device) -> "ContextParallelSplit":
        """The split of the packed batch with offsets ``cu_seqlens`` for this rank of ``group``."""
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        every = torch.cat([split_indices(cu_seqlens, size, r) for r in range(size)])
        n = every.numel() // size  # every rank holds the same number of tokens
        mine = every[rank * n:(rank + 1) * n]
        seq = torch.bucketize(torch.arange(int(cu_seqlens[-1])), cu_seqlens[1:].cpu(), right=True)
        q, k = mine.unsqueeze(1), every.unsqueeze(0)
        mask = (seq[q] == seq[k]) & (k <= q)
        return cls(group, size, rank, mine.to(device), mask.to(device), cu_seqlens.to(device))

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every CP rank's ``t`` (keys or values of its tokens), concatenated in rank order; the
        backward sums each rank's gradients back to it."""
        return _GatherTokens.apply(t, self.group, self.size, self.rank)


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0 (equal shares); backward: every rank's gradient for my share,
    summed (a reduce-scatter, written as an all-reduce so that gloo runs it too)."""

    @staticmethod
    def forward(ctx, t, group, size, rank):
        ctx.group, ctx.rank, ctx.n = group, rank, t.shape[0]
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n], None, None, None
