"""The sharding engine against a single-process reference, on real gloo ranks.

Tolerances are stated and justified in ``tests/reference.py``.
"""

from __future__ import annotations

import pytest
from reference import assert_matches_reference, run_sharded

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
PARITY = [dict(strategy=s, optimizer=o, dtype=d, main_grads_dtype="fp32" if d == "bf16" else None)
          for s in STRATEGIES for o in ("sgd", "adamw") for d in ("fp32", "bf16")]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("cfg", PARITY, ids=lambda c: f"{c['strategy']}-{c['optimizer']}-{c['dtype']}")
def test_matches_single_process_reference(cfg, world_size):
    shard = run_sharded(world_size, cfg, PARITY)
    assert_matches_reference(cfg, world_size, shard)


ACCUM = [dict(strategy=s, micro_batches=4, local_batch=8) for s in STRATEGIES]
# Every micro-batch synchronising (no no_sync, the default of a plain loop), with the mean and
# the per-token loss, and on the MoE model: the reduced gradients must not be reduced again.
ACCUM += [dict(strategy=s, micro_batches=4, local_batch=8, sync_micro_batches=True,
               per_token_loss=t) for s in STRATEGIES for t in (False, True)]
ACCUM += [dict(strategy="no_shard", micro_batches=2, local_batch=8, sync_micro_batches=True,
               model="moe", ep=2)]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("cfg", ACCUM, ids=lambda c: "-".join(
    [c["strategy"]] + (["synced"] if c.get("sync_micro_batches") else [])
    + (["per_token"] if c.get("per_token_loss") else []) + ([c["model"]] if "model" in c else [])))
def test_gradient_accumulation_equals_one_large_batch(cfg, world_size):
    # world 1 is the regression case "shard group of size 1 with gradient accumulation":
    # gradients must not double per micro-batch.
    if cfg.get("ep", 1) > world_size:
        pytest.skip("EP 2 needs 2 ranks")
    batch = [c for c in ACCUM if c.get("ep", 1) <= world_size]
    assert_matches_reference(cfg, world_size, run_sharded(world_size, cfg, batch))


EDGE = [
    dict(strategy="optim_grads_params", optimizer="adamw", model_kwargs={"tie_weights": True}),
    dict(strategy="optim_grads_params", optimizer="adamw", model_kwargs={"frozen_input": True}),
    dict(strategy="optim_grads_params", optimizer="adamw", model_kwargs={"unused_block": True}),
    dict(strategy="optim", optimizer="adamw", model_kwargs={"unused_block": True}),
    dict(strategy="optim_grads_params", clip=0.05),
    dict(strategy="optim_grads", per_token_loss=True),
    # (overlap_grad_reduce=False and disable_bucketing: tests/test_engine_arguments.py reads their
    # schedules in the communication log and matches the reference)
    dict(strategy="optim_grads_params", fsdp_kwargs={"overlap_param_gather": False}),
    dict(strategy="optim_grads", fsdp_kwargs={"average_in_collective": True}),
]


@pytest.mark.slow
@pytest.mark.parametrize("cfg", EDGE, ids=lambda c: "-".join(
    [c["strategy"]] + [f"{k}" for k in {**c.get("model_kwargs", {}), **c.get("fsdp_kwargs", {})}]
    + (["clip"] if c.get("clip") else []) + (["per_token"] if c.get("per_token_loss") else [])))
def test_shared_frozen_unused_and_options(cfg):
    """Tied weights, frozen weights, a unit that runs no forward, clipping, per-token loss."""
    assert_matches_reference(cfg, 2, run_sharded(2, cfg, EDGE))


def _hook_labels() -> list[str]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from mfsdp import fully_shard
    from mfsdp.models import Block, ToyModel

    torch.manual_seed(0)
    model, _ = fully_shard(ToyModel(16, 32, 2), fsdp_unit_modules=[Block],
                           zero_dp_strategy="optim_grads_params")
    x = torch.randn(4, 16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(x).square().sum().backward()
    return sorted({e.name for e in prof.events() if e.name.startswith("mfsdp::")})


def test_every_hook_carries_a_profiler_label_with_its_unit():
    from mfsdp.launch import launch

    labels = launch(_hook_labels, 1)[0]
    for unit in ("blocks.0", "blocks.1"):
        for hook in ("pre_forward", "post_forward", "pre_backward", "post_backward",
                     "post_accumulate_grad"):
            assert f"mfsdp::{hook} ({unit})" in labels, (hook, unit, labels)
    assert "mfsdp::pre_forward (root)" in labels
