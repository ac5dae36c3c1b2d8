"""HSDP, HFSDP, expert parallelism, separate all-gather groups and the double buffer, on real ranks.

Every configuration is compared with the single-process reference on the same global batch
(tolerances in ``tests/reference.py``).
"""

from __future__ import annotations

import pytest
from reference import assert_matches_reference, run_sharded

DB = {"fsdp_double_buffer": True}
DENSE_4 = [
    dict(strategy="optim_grads_params"),
    dict(strategy="optim_grads_params", dp_outer=2),
    dict(strategy="optim_grads", dp_outer=2),
    dict(strategy="no_shard", dp_outer=2),
    dict(strategy="optim_grads_params", dp_outer=2, outer_strategy="optim"),
    dict(strategy="optim_grads_params", dp_outer=2, outer_strategy="optim", optimizer="adamw"),
    dict(strategy="optim_grads_params", dp_outer=2, micro_batches=4, local_batch=8),
    dict(strategy="optim_grads_params", dp_outer=2, outer_strategy="optim", micro_batches=4,
         local_batch=8),
    dict(strategy="optim_grads", dp_outer=2, micro_batches=4, local_batch=8),
    dict(strategy="optim_grads_params", ag_groups=True),
    dict(strategy="optim_grads_params", fsdp_kwargs=DB),
    dict(strategy="optim_grads_params", dp_outer=2, fsdp_kwargs=DB, dtype="bf16",
         main_grads_dtype="fp32"),
    dict(model="moe", strategy="optim_grads_params", ep=2),
    dict(model="moe", strategy="optim_grads", ep=2, optimizer="adamw"),
    dict(model="moe", strategy="optim_grads_params", ep=4),
    dict(model="moe", strategy="optim_grads_params", ep=2, fsdp_kwargs=DB),
    dict(strategy="optim_grads_params", dp_outer=2, outer_strategy="optim", device_mesh=True),
    dict(strategy="optim_grads_params", fsdp_kwargs={"prefetch_depth": 2}),
]
MOE_8 = [
    dict(model="moe", strategy="optim_grads_params", ep=2, dp_outer=2),
    dict(model="moe", strategy="optim_grads_params", ep=2, dp_outer=2, outer_strategy="optim"),
    dict(model="moe", strategy="optim_grads_params", ep=2, dp_outer=2, outer_strategy="optim",
         ag_groups=True, fsdp_kwargs=DB, optimizer="adamw"),
    dict(model="moe", strategy="optim_grads_params", ep=2, dp_outer=2, micro_batches=4,
         local_batch=8),
    # upstream's style: device_mesh + expt_device_mesh + hybrid_fsdp_group instead of groups
    dict(model="moe", strategy="optim_grads_params", ep=2, dp_outer=2, device_mesh=True),
]


def _id(c: dict) -> str:
    parts = [c.get("model", "toy"), c["strategy"]]
    for key in ("ep", "dp_outer"):
        if c.get(key):
            parts.append(f"{key}{c[key]}")
    if c.get("outer_strategy"):
        parts.append(f"outer-{c['outer_strategy']}")
    for key in ("micro_batches", "ag_groups", "optimizer", "dtype"):
        if key in c:
            parts.append(f"{key}={c[key]}")
    for key, value in c.get("fsdp_kwargs", {}).items():
        parts.append(f"{key}={value}")
    if c.get("device_mesh"):
        parts.append("device_mesh")
    return "-".join(map(str, parts))


@pytest.mark.slow
@pytest.mark.parametrize("cfg", DENSE_4, ids=_id)
def test_four_ranks_match_reference(cfg):
    assert_matches_reference(cfg, 4, run_sharded(4, cfg, DENSE_4))


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("cfg", MOE_8, ids=_id)
def test_eight_ranks_ep_with_hsdp_match_reference(cfg):
    assert_matches_reference(cfg, 8, run_sharded(8, cfg, MOE_8))


def _sent(records, group=None, op=None):
    return sum(r["sent_bytes"] for r in records
               if (group is None or r["group"] == group) and (op is None or r["op"] == op))


@pytest.mark.slow
def test_outer_groups_carry_only_shard_sized_outer_traffic():
    hsdp = run_sharded(4, DENSE_4[1], DENSE_4)
    hfsdp = run_sharded(4, DENSE_4[4], DENSE_4)
    model = 4 * hsdp["padded_numel"]  # fp32 bytes of the whole model
    shard = model / 2  # inner shard group of 2 ranks
    steady = hsdp["comm"][-1]
    # HSDP: the outer all-reduce moves the gradient shard (2 (O-1)/O of it), not the model
    assert _sent(steady, "dp_outer", "all_reduce") == pytest.approx(shard, abs=8)
    # ... while the shard group moves the model: 2 all-gathers + 1 reduce-scatter, (N-1)/N each,
    # but the root unit is gathered once (it keeps its weights from forward into backward)
    assert _sent(steady, "dp_shard") - _sent(steady, "dp_shard", "flags") == pytest.approx(
        0.5 * (3 * model - hsdp["root_bytes"]), abs=16)
    # HFSDP: outer reduce-scatter of the shard and all-gather of the refreshed shard
    steady = hfsdp["comm"][-1]
    shard = 4 * hfsdp["padded_numel"] / 2  # its own padding: sub-shards over 2 x 2 ranks
    assert _sent(steady, "dp_outer", "reduce_scatter") == pytest.approx(shard / 2, abs=8)
    assert _sent(steady, "dp_outer", "all_gather") == pytest.approx(shard / 2, abs=8)


@pytest.mark.slow
def test_outer_reduction_only_on_the_last_micro_batch():
    run = run_sharded(4, DENSE_4[6], DENSE_4)
    outer_reductions = [r for r in run["comm"][-1] if r["group"] == "dp_outer"
                        and r["op"] == "all_reduce"]
    inner_reductions = [r for r in run["comm"][-1] if r["op"] == "reduce_scatter"]
    buckets = len(inner_reductions) // 4  # every micro-batch reduce-scatters every bucket
    assert len(outer_reductions) == buckets


@pytest.mark.slow
def test_all_gathers_use_the_separate_group():
    run = run_sharded(4, DENSE_4[9], DENSE_4)
    groups = {(r["op"], r["group"]) for r in run["comm"][-1]}
    assert ("all_gather", "dp_shard_ag") in groups
    assert ("reduce_scatter", "dp_shard") in groups
    assert ("all_gather", "dp_shard") not in groups


@pytest.mark.slow
def test_double_buffer_holds_exactly_two_units():
    for cfg in (DENSE_4[10], DENSE_4[15]):
        run = run_sharded(4, cfg, DENSE_4)
        assert run["peaks"]["peak_gathered_bytes"] <= 2 * run["unit_bytes"]
        assert run["pool_bytes"] == 2 * run["slot_bytes"] > 0
    dense = run_sharded(4, DENSE_4[10], DENSE_4)
    assert dense["peaks"]["peak_gathered_bytes"] == 2 * dense["unit_bytes"]


@pytest.mark.slow
def test_prefetch_depth_bounds_gathered_weights():
    one, two = run_sharded(4, DENSE_4[0], DENSE_4), run_sharded(4, DENSE_4[-1], DENSE_4)
    assert one["peaks"]["peak_gathered_bytes"] <= 2 * one["unit_bytes"]
    assert 2 * two["unit_bytes"] < two["peaks"]["peak_gathered_bytes"] <= 3 * two["unit_bytes"]
