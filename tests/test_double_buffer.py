"""The double buffer under every strategy: gathered weights (ZeRO-3) and full gradients (ZeRO-2/3)
of non-root units in two fixed slots, and the fallback for gradients whose slot is still held."""
import pytest
from reference import assert_matches_reference, run_sharded

from mfsdp.launch import RankError

DB = {"fsdp_double_buffer": True}
CASES = [
    dict(strategy="optim_grads", fsdp_kwargs=DB, steps=3),
    dict(strategy="optim_grads_params", fsdp_kwargs={"maxpool_double_buffer": True}, steps=3,
         optimizer="adamw"),
    dict(strategy="optim_grads", fsdp_kwargs={**DB, "overlap_grad_reduce": False,
                                              "fsdp_db_use_persist_buf_on_alloc_fail": True},
         steps=3),
    dict(strategy="optim", fsdp_kwargs=DB, steps=3),
    dict(strategy="no_shard", fsdp_kwargs={"maxpool_double_buffer": True}, steps=3),
]


@pytest.mark.parametrize("i", range(len(CASES)), ids=lambda i: CASES[i]["strategy"] + f"-{i}")
def test_double_buffer_matches_reference(i):
    """Every strategy trains as one process does (SGD and AdamW) with the double buffer on."""
    cfg = CASES[i]
    run = run_sharded(2, cfg, CASES)
    assert_matches_reference(cfg, 2, run)


def test_gradients_of_every_non_root_unit_live_in_the_two_slots():
    """ZeRO-2/3: each non-root bucket's gradients are placed in a slot in every backward, the slots
    are sized for the largest unit, and no gradient needed its own storage."""
    for cfg in CASES[:2]:
        run = run_sharded(2, cfg, CASES)
        pool = run["grad_pool"]
        assert pool["takes"] == run["grad_buckets"] * cfg["steps"] > 0
        assert pool["fallbacks"] == 0
        assert pool["slot_bytes"] >= run["unit_grad_bytes"] > 0


def test_held_slot_falls_back_only_when_asked():
    """Without overlap, every reduction waits for the end of backward, so the third unit finds
    its slot held: its gradients take their own storage with the fallback, and the backward stops
    with an error naming both units without it."""
    run = run_sharded(2, CASES[2], CASES)
    assert run["grad_pool"]["fallbacks"] > 0
    cfg = dict(CASES[0], fsdp_kwargs={**DB, "overlap_grad_reduce": False}, steps=1)
    with pytest.raises(RankError, match=r"fsdp_double_buffer: the gradients of unit '.+' need "
                                        r"slot \d, still held by the unreduced gradients of unit"):
        run_sharded(2, cfg, [cfg])


def test_nothing_is_pooled_where_nothing_is_temporary():
    """no_shard and ZeRO-1 keep their gradients between micro-batches and gather no weights: the
    switch is accepted (as upstream accepts it) and both pools stay empty."""
    for cfg in CASES[3:]:
        run = run_sharded(2, cfg, CASES)
        assert run["grad_pool"] is None and run["pool_bytes"] == 0


def test_fallback_without_double_buffer_is_refused():
    from mfsdp.config import EngineOptions

    with pytest.raises(ValueError, match="fsdp_db_use_persist_buf_on_alloc_fail=True is the "
                                         "double buffer's fallback; pass fsdp_double_buffer=True"):
        EngineOptions(fsdp_db_use_persist_buf_on_alloc_fail=True)
