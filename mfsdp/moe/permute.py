"""Permutation helpers: group tokens by expert, scatter them back with their routing weights, and
reorder chunks (from "by source rank, then expert" to "by expert, then source rank").

>>> tokens = torch.arange(3.0).unsqueeze(1)          # three tokens, hidden size 1
>>> routing_map = torch.tensor([[0, 1], [1, 0], [1, 1]]).bool()
>>> permuted, index = permute(tokens, routing_map)
>>> permuted.flatten().tolist(), index.tolist()      # expert 0's tokens, then expert 1's
([1.0, 2.0, 0.0, 2.0], [1, 2, 0, 2])
>>> probs = routing_map.float() * 0.5
>>> unpermute(permuted, index, probs, routing_map, num_tokens=3).flatten().tolist()
[0.0, 0.5, 2.0]
"""

from __future__ import annotations

import torch

__all__ = ["permute", "sort_chunks_by_index", "unpermute"]


def permute(tokens: torch.Tensor, routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy each token once per chosen expert, grouped by expert (token order kept inside a group).

    Returns the permuted rows and, for each row, the index of the token it came from.
    """
    num_tokens = routing_map.shape[0]
    index = torch.arange(num_tokens, device=tokens.device).expand(routing_map.shape[1], -1)
    index = index.masked_select(routing_map.t().contiguous())
    return tokens.index_select(0, index), index


def unpermute(permuted: torch.Tensor, index: torch.Tensor, probs: torch.Tensor | None,
              routing_map: torch.Tensor | None, num_tokens: int) -> torch.Tensor:
    """Inverse of :func:`~mfsdp.moe.permute`: weight each row by its routing weight and sum rows per token.

    With ``probs=None`` the rows are summed unweighted.
    """
    rows = permuted
    if probs is not None:
        weights = probs.t().contiguous().masked_select(routing_map.t().contiguous())
        rows = rows * weights.unsqueeze(1).to(rows.dtype)
    out = torch.zeros(num_tokens, permuted.shape[1], dtype=rows.dtype, device=rows.device)
    return out.index_add(0, index, rows)


def sort_chunks_by_index(x: torch.Tensor, split_sizes: list[int], order: list[int]) -> torch.Tensor:
    """Split ``x`` into chunks of ``split_sizes`` rows and concatenate them in ``order``.

    >>> sort_chunks_by_index(torch.arange(5), [2, 1, 2], [2, 0, 1]).tolist()
    [3, 4, 0, 1, 2]
    """
    if sum(split_sizes) != x.shape[0]:
        raise ValueError(f"split sizes sum to {sum(split_sizes)} but x has {x.shape[0]} rows")
    chunks = torch.split(x, split_sizes, dim=0)
    return torch.cat([chunks[i] for i in order], dim=0)
