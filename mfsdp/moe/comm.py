"""Differentiable collectives with uneven sizes, used by the token dispatchers.

Each forward collective's backward is its transpose: an uneven all-gather's backward is an uneven
reduce-scatter and the other way round. Sizes are padded to the group's largest count on the wire
and trimmed on arrival, because ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` need equal
chunks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_gather_v", "all_to_all_v", "gather_sizes", "reduce_scatter_v"]


def gather_sizes(n: int, group: dist.ProcessGroup | None, device) -> list[int]:
    """Every rank's ``n`` (one small all-gather)."""
    t = torch.tensor([n], dtype=torch.int64, device=device)
    out = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(out, t, group=group)
    return out.tolist()


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x.contiguous()
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


def _all_gather_v(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    ws, biggest = len(sizes), max(sizes)
    out = x.new_empty(ws * biggest, *x.shape[1:])
    dist.all_gather_into_tensor(out, _pad_rows(x, biggest), group=group)
    return torch.cat([c[:n] for c, n in zip(out.chunk(ws), sizes)])


def _reduce_scatter_v(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    biggest, rank = max(sizes), dist.get_rank(group)
    chunks = [_pad_rows(c, biggest) for c in torch.split(x, sizes)]
    out = x.new_empty(biggest, *x.shape[1:])
    dist.reduce_scatter_tensor(out, torch.cat(chunks), group=group)
    return out[:sizes[rank]]


# each uneven collective and its transpose, the collective of its backward
_TRANSPOSE = {_all_gather_v: _reduce_scatter_v, _reduce_scatter_v: _all_gather_v}


class _UnevenCollective(torch.autograd.Function):
    """``op`` (an uneven all-gather or reduce-scatter) forward, its transpose backward."""

    @staticmethod
    def forward(ctx, x, sizes, group, op):
        ctx.sizes, ctx.group, ctx.op = sizes, group, op
        return op(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _TRANSPOSE[ctx.op](grad.contiguous(), ctx.sizes, ctx.group), None, None, None


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_gather_v(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Concatenate every rank's ``x`` (rank ``r`` holds ``sizes[r]`` rows); differentiable."""
    return _UnevenCollective.apply(x, sizes, group, _all_gather_v)


def reduce_scatter_v(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's ``sizes[rank]`` rows; differentiable."""
    return _UnevenCollective.apply(x, sizes, group, _reduce_scatter_v)


def all_to_all_v(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Send ``in_splits[r]`` rows of ``x`` to rank ``r``, receive ``out_splits[r]``; differentiable."""
    return _AllToAllV.apply(x, out_splits, in_splits, group)
