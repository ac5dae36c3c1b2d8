"""bf16 gradient reduction numerics, measured on real per-rank gradients.

:func:`reduction_errors` runs in every rank of :func:`mfsdp.launch.launch`: each rank computes the
gradient of the same model on its own slice of the batch, the ranks exchange them exactly (fp32),
and every rank then reduces them four ways and compares with the exact mean (fp64):

* ``fp32``: a ring in fp32 (add one rank's contribution per hop, round to fp32);
* ``bf16_fp32_accum``: values sent in bf16, summed in fp32 on arrival, rounded once. This is what
  mfsdp's gloo reduce-scatter does with ``grad_comm_dtype=torch.bfloat16`` (``all_to_all`` of bf16
  chunks, then one ``sum``, which accumulates in fp32);
* ``bf16_ring``: a ring in bf16, rounding to bf16 after every hop, as a bf16 ring reduce-scatter
  does;
* ``bf16_tree``: pairwise (tree) summation in bf16, rounding at every level.

>>> a, b = fit_power_law([2, 4, 8], [1e-3, 2e-3, 4e-3])  # error = a * N ** b
>>> round(a, 6), round(b, 6)
(0.0005, 1.0)
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["METHODS", "fit_power_law", "reduction_errors"]

METHODS = ("fp32", "bf16_fp32_accum", "bf16_ring", "bf16_tree")


def _tree_bf16(parts: list[torch.Tensor]) -> torch.Tensor:
    level = [p.bfloat16() for p in parts]
    while len(level) > 1:
        nxt = [(level[i].float() + level[i + 1].float()).bfloat16()
               for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0].float()


def reduction_errors(dim: int = 64, hidden: int = 256, blocks: int = 3, local_batch: int = 16,
                     seed: int = 0) -> dict[str, float]:
    """Relative L2 error of the mean gradient under each method (see module doc), on this world."""
    from mfsdp.models import ToyModel

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model = ToyModel(dim, hidden, blocks)
    g = torch.Generator().manual_seed(seed + 1 + rank)  # every rank its own data
    x = torch.randn(local_batch, dim, generator=g)
    torch.nn.functional.mse_loss(model(x), torch.sin(x)).backward()
    mine = torch.cat([p.grad.flatten() for p in model.parameters()])
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine)
    exact = torch.stack([p.double() for p in parts]).sum(0) / world
    ring32 = parts[0].clone()
    ring16 = parts[0].bfloat16()
    for p in parts[1:]:
        ring32 = ring32 + p
        ring16 = (ring16.float() + p.bfloat16().float()).bfloat16()
    results = {
        "fp32": ring32 / world,
        "bf16_fp32_accum": torch.stack([p.bfloat16() for p in parts]).sum(0).float() / world,
        "bf16_ring": ring16.float() / world,
        "bf16_tree": _tree_bf16(parts) / world,
    }
    norm = exact.norm().item()
    return {k: ((v.double() - exact).norm().item() / norm) for k, v in results.items()}


def fit_power_law(ns: list[int], errs: list[float]) -> tuple[float, float]:
    """Least-squares fit of ``err = a * N ** b`` in log-log space; returns ``(a, b)``."""
    xs = [math.log(n) for n in ns]
    ys = [math.log(e) for e in errs]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return math.exp(my - b * mx), b
