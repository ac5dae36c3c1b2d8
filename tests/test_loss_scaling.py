"""Loss-scaling hooks of the sharded optimizer: unscale and a collective finiteness check."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mfsdp.launch import launch


def _scaled_steps(scale: float, poison_rank: int | None) -> dict:
    import mfsdp
    from mfsdp.models import Block, ToyModel

    torch.manual_seed(0)
    model = ToyModel(dim=16, hidden=32, num_blocks=2)
    model, opt = mfsdp.fully_shard(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   fsdp_unit_modules=[Block])
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    loss = model(x).pow(2).mean() * scale
    if poison_rank == dist.get_rank():
        loss = loss * float("inf")
    loss.backward()
    finite = opt.grads_are_finite()
    if finite:
        opt.unscale_(scale)
        opt.step()
    return {"finite": finite, "params": model.full_parameters()}


def test_unscaled_step_equals_unscaled_loss_and_overflow_is_seen_everywhere():
    plain = launch(_scaled_steps, 2, args=(1.0, None))
    scaled = launch(_scaled_steps, 2, args=(1024.0, None))
    for name, value in plain[0]["params"].items():
        torch.testing.assert_close(scaled[0]["params"][name], value, rtol=1e-5, atol=1e-7)
    poisoned = launch(_scaled_steps, 2, args=(1024.0, 1))
    assert [r["finite"] for r in poisoned] == [False, False]  # rank 0 skips the step too
