"""The reduction simulations against independent references: a per-element loop in NCCL's ring
order, and the engine's real gloo reduce-scatter on 4 ranks."""

from __future__ import annotations

import torch

from mfsdp.launch import launch
from mfsdp.numerics import (engine_reduce_scatter, fp32_accum_reduce, rank_gradients,
                            ring_reduce, simulate_reduction)


def _ring_by_hand(grads: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Element by element: the element's chunk ``c`` starts at rank ``c + 1``, one rank per hop."""
    world, n = grads.shape
    per = -(-n // world)
    out = torch.empty(n)
    for i in range(n):
        c = i // per
        acc = grads[(c + 1) % world, i].to(dtype)
        for hop in range(2, world + 1):
            acc = (acc.float() + grads[(c + hop) % world, i].to(dtype).float()).to(dtype)
        out[i] = acc.float()
    return out


def test_ring_reduce_follows_the_ring_order_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    grads = torch.randn(8, 61, generator=g) * torch.logspace(-3, 1, 61)  # uneven chunks, scales
    grads[3] *= 100.0  # one large rank: the order matters
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(ring_reduce(grads, dtype), _ring_by_hand(grads, dtype)), dtype
    assert not torch.equal(ring_reduce(grads, torch.bfloat16),
                           fp32_accum_reduce(grads, torch.bfloat16))


def test_the_gloo_path_is_fp32_accumulation_bit_for_bit():
    grads = rank_gradients(4)[:, :4096]
    chunks = launch(engine_reduce_scatter, 4, args=(grads,))
    assert torch.equal(torch.cat(chunks), fp32_accum_reduce(grads, torch.bfloat16))


def test_errors_on_real_gradients_order_as_expected():
    errors = simulate_reduction(rank_gradients(64), [2, 64])
    for n in (2, 64):
        assert errors[n]["fp32_ring"] < 1e-6
        assert 5e-4 < errors[n]["bf16_fp32_accum"] < 5e-3  # bf16's 8 bits: about 2**-9
    # a bf16 ring loses more with every hop: worse at 64 ranks than at 2, and than fp32 sums
    assert errors[64]["bf16_ring"] > 2 * errors[2]["bf16_ring"]
    assert errors[64]["bf16_ring"] > 2 * errors[64]["bf16_fp32_accum"]
