"""Upstream's remaining v1 methods and the v2 per-module API (``mfsdp.experimental``), on real gloo
ranks against single-process references.

Rank functions live at module level so that :func:`mfsdp.launch.launch` can import them.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mfsdp.launch import launch

LR = 0.5


# ------------------------------------------------------------------------------------------------
# v1: mixed_precision_context / reset_mixed_precision_policy
# ------------------------------------------------------------------------------------------------
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)


def _v1_precision_rank(strategies: list[str]) -> dict:
    import torch.distributed as dist

    import mfsdp

    out = {}
    for strategy in strategies:
        model = mfsdp.fully_shard_model(_mlp(), fsdp_unit_modules=[nn.Linear],
                                        zero_dp_strategy=strategy)
        opt = mfsdp.fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=LR))
        seen = []
        for step, comm in enumerate([torch.float16, None]):
            x, y = _batch(dist.get_rank(), step)
            policy = mfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float64,
                                                grad_comm_dtype=comm)
            with model.mixed_precision_context(policy):
                seen.append((model.mp_policy.main_params_dtype, model.mp_policy.grad_comm_dtype,
                             {b.comm_dtype for b in model.buckets}))
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            seen.append((model.mp_policy.main_params_dtype, model.mp_policy.grad_comm_dtype,
                         {b.comm_dtype for b in model.buckets}))
        try:
            with model.mixed_precision_context(mfsdp.MixedPrecisionPolicy(
                    grad_comm_dtype=torch.bfloat16)):
                raise KeyError("inside")
        except KeyError:
            pass
        seen.append((model.mp_policy.main_params_dtype, model.mp_policy.grad_comm_dtype,
                     {b.comm_dtype for b in model.buckets}))
        out[strategy] = (seen, {k: v.clone() for k, v in model.full_parameters().items()})
    return out


def _v1_reference(world: int, fp16_first_step: bool) -> dict[str, torch.Tensor]:
    """Plain SGD on one process; the first step's gradient reduced as the sharded model does
    under an fp16 communication dtype (each rank's gradient cast to fp16, pre-divided by the
    world size, summed in fp16) when ``fp16_first_step``."""
    model = _mlp()
    for step in range(2):
        grads = []
        for rank in range(world):
            model.zero_grad()
            x, y = _batch(rank, step)
            nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                if step == 0 and fp16_first_step:
                    total = torch.zeros_like(p, dtype=torch.float16)
                    for g in grads:
                        total += g[i].to(torch.float16) * (1.0 / world)
                    grad = total.float()
                else:
                    grad = sum(g[i] for g in grads) / world
                p -= LR * grad
    return dict(model.named_parameters())


@pytest.mark.slow
def test_mixed_precision_context_changes_grad_comm_dtype_for_one_step():
    """Upstream 0.6.1's ``mixed_precision_context``: the first step reduces gradients in fp16
    (the weights then equal a reference that rounds each rank's gradient to fp16 and sums in
    fp16, and differ from the fp32 reference), the second step in the main-gradient dtype again;
    the main-weight dtype stays what the model was built with; the policy is restored on exit,
    also when the block raises."""
    strategies = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
    results = launch(_v1_precision_rank, 2, args=(strategies,))
    fp16 = _v1_reference(2, True)
    fp32 = _v1_reference(2, False)
    for strategy in strategies:
        seen, params = results[0][strategy]
        f32 = torch.float32
        assert seen == [(f32, torch.float16, {torch.float16}), (f32, None, {f32}),
                        (f32, None, {f32}), (f32, None, {f32}), (f32, None, {f32})], strategy
        for name, value in params.items():
            key = name.removeprefix("module.")
            # fp32 arithmetic in a different order: a few ulps of the weights (~1e-7)
            assert torch.allclose(value, fp16[key], rtol=0, atol=2e-6), (strategy, name)
        # the fp16 rounding of the first step's gradient is visible (~5e-4 relative)
        worst = max((v - fp32[n.removeprefix("module.")]).abs().max().item()
                    for n, v in params.items())
        assert worst > 2e-5, (strategy, worst)
        for rank_result in results[1:]:
            for name, value in rank_result[strategy][1].items():
                assert torch.equal(value, params[name])


def test_reset_mixed_precision_policy_refuses_what_is_not_a_policy():
    from mfsdp.fsdp.module import FullyShardedModule
    with pytest.raises(TypeError, match="mixed_precision_policy"):
        FullyShardedModule.reset_mixed_precision_policy(object.__new__(FullyShardedModule),
                                                        torch.float16)
