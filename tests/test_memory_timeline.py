"""The memory timeline of a step (:mod:`mfsdp.tools.memory_timeline`) against the engine's own
counters, on 2 gloo ranks.

The timeline reads the buffers' storages; the engine counts the bytes it allocates and releases
(``model.fsdp_state().memory``: the gathered weights of the non-root units, the full gradient
buffers of every unit). The two are kept apart in the engine, so they check each other: after
every event, exactly (fp32 throughout: no cast copies in flight).
"""

from __future__ import annotations

import pytest
import torch

from mfsdp.launch import launch
from mfsdp.tools.memory_timeline import record_memory_timeline


def counters_at_every_event(double_buffer: bool) -> dict:
    """Two ZeRO-3 steps of a toy MLP, one unit per block, recorded; beside each event the
    timeline's latest sample and the engine's counters at that moment."""
    import mfsdp
    from mfsdp.models import Block, ToyModel

    torch.manual_seed(0)
    model = ToyModel(dim=32, hidden=64, num_blocks=4)
    model, opt = mfsdp.fully_shard(
        model, torch.optim.AdamW(model.parameters()),
        fsdp_unit_modules=[Block], zero_dp_strategy="optim_grads_params",
        fsdp_double_buffer=double_buffer)
    state = model.fsdp_state()
    timeline = record_memory_timeline(model)
    pairs = []
    state.memory_watchers.append(lambda event, unit: pairs.append(
        (tuple(timeline[-1]), state.memory["gathered_bytes"], state.memory["grad_full_bytes"])))
    for _ in range(2):
        model(torch.randn(8, 32)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    timeline.close()
    root = sum(b.plan.padded_numel * b.full.element_size() for b in state.buckets if not b.unit)
    return {"pairs": pairs, "samples": [tuple(s) for s in timeline], "peaks": timeline.peaks(),
            "without_root": timeline.peaks(root=False), "engine": dict(state.memory),
            "root": root}


@pytest.mark.parametrize("double_buffer", [False, True], ids=["own-storage", "double-buffer"])
def test_timeline_equals_the_engine_counters_after_every_event(double_buffer):
    for rank, r in enumerate(launch(counters_at_every_event, 2, args=(double_buffer,))):
        assert len(r["pairs"]) > 20, rank  # gathers, releases, gradient buffers: 2 steps
        for (label, gathered, grads, phase, root_g, root_grads), counted_g, counted_grads in \
                r["pairs"]:
            # the engine counts non-root weights, and every unit's gradient buffers: exactly
            assert gathered - root_g == counted_g, (rank, label)
            assert grads == counted_grads, (rank, label)
        engine = r["engine"]
        assert r["without_root"]["gathered"] == engine["peak_gathered_bytes"] > 0, rank
        assert r["peaks"]["grad_buffers"] == engine["peak_grad_full_bytes"] > 0, rank
        # the root's weights: gathered from its forward to the end of its backward
        backward = [s for s in r["samples"] if s[3] == "backward"]
        held = [s[4] for s in backward if s[0] != "release (root)"]
        assert held and held == [r["root"]] * len(held), rank
        assert [s[4] for s in backward if s[0] == "release (root)"] == [0, 0], rank
        assert r["peaks"]["gathered"] == r["without_root"]["gathered"] + r["root"], rank
        phases = [s[3] for s in r["samples"]]
        assert phases.index("backward") > phases.index("forward"), rank
        assert r["samples"][-1][1:3] == (0, 0), rank  # nothing left after the step


def test_record_refuses_what_is_not_sharded():
    with pytest.raises(TypeError, match="mfsdp.fully_shard"):
        record_memory_timeline(torch.nn.Linear(2, 2))
