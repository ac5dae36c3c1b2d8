"""A small residual MLP: the model the engine's tests and memory recipes train.

Every parameter gets a non-zero gradient on every step (no embedding rows that a batch misses), so
Adam's updates are comparable across layouts: see ``docs/sharding.md``.

>>> model = ToyModel(dim=8, hidden=16, num_blocks=2)
>>> model(torch.randn(3, 8)).shape
torch.Size([3, 8])
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Block", "ToyModel"]


class Block(nn.Module):
    """LayerNorm, MLP, residual: the FSDP unit of :class:`ToyModel`.

    With ``swiglu=True`` the MLP is gated: ``fc1`` holds the gate and up projections stacked
    (``2 * hidden`` rows, gate first), as Megatron stores them.
    """

    def __init__(self, dim: int, hidden: int, swiglu: bool = False):
        super().__init__()
        self.swiglu = swiglu
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * hidden if swiglu else hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(self.norm(x))
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = torch.nn.functional.silu(gate) * up
        else:
            h = torch.nn.functional.gelu(h)
        return x + self.fc2(h)


class ToyModel(nn.Module):
    """Input projection, ``num_blocks`` :class:`Block` units, output head.

    Args:
        tie_weights: the head reuses the input projection's weight (transposed use), a shared
            parameter that lives in the root unit.
        frozen_input: the input projection does not train (a frozen parameter).
        unused_block: one extra block that ``forward`` never runs (a unit with no forward).
        swiglu: gated MLPs with fused gate/up weights (see :class:`Block`).
    """

    def __init__(self, dim: int = 32, hidden: int = 64, num_blocks: int = 4,
                 tie_weights: bool = False, frozen_input: bool = False,
                 unused_block: bool = False, swiglu: bool = False):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden, swiglu) for _ in range(num_blocks))
        self.unused = Block(dim, hidden, swiglu) if unused_block else None
        self.head = nn.Linear(dim, dim, bias=False)
        self.tie_weights = tie_weights
        if tie_weights:
            del self.head.weight
            self.head.weight = self.inp.weight
        if frozen_input:
            self.inp.weight.requires_grad_(False)
            self.inp.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)
