"""The numerics simulator's prediction for a layout that communicates gradients in bf16.

Before such a layout trains, every rank computes its own gradient of the first step with an
unsharded copy of the model (fp32, its slice of the batch), and rank 0 replays the reduction on
those gradients exactly as the engine performs it on gloo: each rank's gradient is rounded to
bf16, scaled by ``1 / world``, and the ranks' values are summed in fp32 and rounded to bf16 once
(:func:`mfsdp.fsdp.collectives.Communicator.reduce_scatter`). NCCL's ring instead rounds to bf16
after every hop; that error is predicted too. Each is the relative L2 error of a parameter's
reduced gradient against the exact mean (fp64). With SGD the first update is ``-lr`` times the
gradient, so the measured step-1 error of the layout should match the first prediction.
"""

from __future__ import annotations

from typing import Any

import torch

from mfsdp.check.models import build_model, next_token_loss

__all__ = ["predict_bf16_reduction", "reduction_errors"]


def reduction_errors(grads: torch.Tensor) -> tuple[float, float]:
    """``grads``: ``[ranks, n]`` fp32, each rank's gradient of one parameter. Returns the relative
    L2 error of the mean reduced in bf16 (fp32 accumulation, mfsdp on gloo; bf16 ring, NCCL)."""
    n = grads.shape[0]
    exact = grads.double().mean(0)
    scaled = grads.to(torch.bfloat16) * (1.0 / n)  # cast, then the pre-scale, as the reducer does
    accum = scaled.float().sum(0).to(torch.bfloat16).double()
    ring = scaled[0]
    for row in scaled[1:]:
        ring = (ring.float() + row.float()).to(torch.bfloat16)
    norm = exact.norm().clamp_min(1e-30)
    return ((accum - exact).norm() / norm).item(), ((ring.double() - exact).norm() / norm).item()


def predict_bf16_reduction(settings: dict, tokens: torch.Tensor) -> dict[str, Any] | None:
    """Collective over the launched ranks: ``tokens`` is this rank's slice of the first step's
    batch. Rank 0 returns ``{"param", "error", "ring_error", "errors"}``: the parameter with the
    largest predicted error, its errors on gloo and on an NCCL ring, and every parameter's gloo
    error; other ranks return ``None``."""
    import torch.distributed as dist

    model = build_model(settings.model, settings.seed)
    next_token_loss(model, tokens).backward()
    named = [(n, p.grad) for n, p in model.named_parameters()
             if p.requires_grad and p.grad is not None]
    flat = torch.cat([g.reshape(-1).float() for _, g in named])
    parts = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, flat)
    if dist.get_rank() != 0:
        return None
    grads, errors, ring, offset = torch.stack(parts), {}, {}, 0
    for name, g in named:
        errors[name], ring[name] = reduction_errors(grads[:, offset:offset + g.numel()])
        offset += g.numel()
    worst = max(errors, key=errors.get)
    return {"param": worst, "error": errors[worst], "ring_error": ring[worst], "errors": errors}
