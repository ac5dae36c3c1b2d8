"""The layout page's search (mfsdp/tools/plan_layouts.py) against a brute force over the planner,
and its commands against ``mfsdp plan``."""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import replace

import pytest

from mfsdp.tools.plan import GiB, PRESETS, Layout, estimate, plan
from mfsdp.tools.plan_cli import TIGHT_GIB
from mfsdp.tools.plan_layouts import GPUS, ROWS, choose, table, why
from mfsdp.tools.plan_time import GPUS as PLAN_GPUS


def _fits(model, layout, device_gib, spare):
    return plan(model, layout).total <= (device_gib - 4 - spare) * GiB


@pytest.mark.parametrize("device_gib, spare", [(80.0, TIGHT_GIB), (80.0, 0.0), (140.0, 0.0)])
def test_no_layout_on_fewer_gpus_fits_and_none_on_as_many_is_faster(device_gib, spare):
    """Every TP, CP and recompute choice on every whole-node world up to the chosen one, planned
    directly: none on fewer GPUs fits, and none on as many fits and runs faster."""
    model = PRESETS["llama3-70b"]
    got = choose("llama3-70b", 8192, device_gib, spare_gib=spare)
    assert got is not None and _fits(model, got.layout, device_gib, spare)
    assert got.total == plan(model, got.layout).total
    for world in range(8, got.layout.world_size + 1, 8):
        for tp in (1, 2, 4, 8):
            for cp in (1, 2, 4, 8):
                for recompute in (None, "full"):
                    try:
                        layout = Layout(world, tp=tp, cp=cp, sequence_parallel=tp > 1,
                                        seq_length=8192, recompute_granularity=recompute)
                    except ValueError:
                        continue
                    if not _fits(model, layout, device_gib, spare):
                        continue
                    assert world == got.layout.world_size, layout
                    assert (estimate(model, layout).tokens_per_gpu_s
                            <= got.tokens_per_gpu_s * (1 + 1e-12)), layout


def test_an_moe_preset_gets_an_expert_parallel_layout_that_fits():
    got = choose("deepseek-v3", 4096, 80.0, spare_gib=TIGHT_GIB)
    assert got.layout.ep > 1 and PRESETS["deepseek-v3"].num_experts % got.layout.ep == 0
    assert got.fits and not got.tight and got.spare_gib >= TIGHT_GIB
    fewer = got.layout.world_size - 8
    for ep in (8, 16, 32, 64):  # the same recompute and CP, one node fewer: does not fit
        try:
            layout = Layout(fewer, ep=ep, cp=got.layout.cp, seq_length=4096,
                            recompute_granularity="full")
        except ValueError:
            continue
        assert not _fits(PRESETS["deepseek-v3"], layout, 80.0, TIGHT_GIB), layout


@pytest.mark.parametrize("preset, seq, device_gib, gpu", [
    ("llama3-70b", 8192, 80.0, "h100"), ("deepseek-v3", 8192, *GPUS["H200"]),
    ("llama3-70b", 8192, 140.0, "h100")])
def test_the_command_prints_the_same_total(preset, seq, device_gib, gpu):
    """The page's command for a row, run through ``mfsdp plan``: the total it prints is the
    row's, and it says the layout fits on the row's GPU, whose memory ``--gpu`` alone sets
    (``--device-gib`` only where the row's differs from the --gpu's)."""
    from mfsdp.cli import main

    c = choose(preset, seq, device_gib, gpu, spare_gib=TIGHT_GIB)
    argv = c.command().replace("\\\n", " ").split()
    assert argv[:2] == ["mfsdp", "plan"]
    assert ("--device-gib" in argv) == (device_gib != PLAN_GPUS[gpu].memory_gib), argv
    assert ("--gpu" in argv) == (gpu != "h100"), argv
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv[1:]) in (0, None)
    total = re.search(r"^total +(\d+\.\d\d)$", out.getvalue(), re.M)[1]
    assert total == f"{c.total / GiB:.2f}"
    assert f"fits on {device_gib:g} GiB: yes" in out.getvalue()


def test_the_table_fits_the_page_and_a_bad_input_is_refused():
    text = table(rows=(("llama3-8b", 8192),))
    assert max(len(line) for line in text.splitlines()) <= 88
    assert len(text.splitlines()) == 1 + len(GPUS)
    with pytest.raises(ValueError, match="is not a planner preset"):
        choose("llama4", 8192)
    with pytest.raises(ValueError, match="spare_gib"):
        choose("llama3-8b", 8192, 80.0, spare_gib=80.0)


def _drop_tp_cp(layout):
    return replace(layout, tp=1, cp=1, sequence_parallel=False)


def test_why_names_what_the_search_tried_planned_directly():
    """``why`` for rows whose reasons differ, against the planner called here: the layout without
    TP and CP (tight, or over the GPU in activations alone), without recomputation (how many GPUs
    the search without it needs), experts per GPU, and the fewest GPUs when tight."""
    for preset, seq, gpu_name in [("llama3-8b", 8192, "H100"), ("llama3-70b", 8192, "H100"),
                                  ("llama3-70b", 8192, "H200"), ("llama3-8b", 8192, "H200")]:
        device_gib, gpu = GPUS[gpu_name]
        model, c = PRESETS[preset], choose(preset, seq, device_gib, gpu, spare_gib=TIGHT_GIB)
        got = why(preset, seq, gpu_name)
        lay = c.layout
        if lay.tp * lay.cp == 1 and not lay.recompute_granularity:
            assert got == ""  # nothing to explain: ZeRO-3 alone, no recomputation
            continue
        flat = plan(model, _drop_tp_cp(lay))
        spare = device_gib - 4 - flat.total / GiB
        if 0 <= spare < TIGHT_GIB:
            assert f"leaves {spare:.1f} GiB: tight" in got
        elif flat.memory["activations"] > (device_gib - 4) * GiB:
            assert "activations alone exceed the GPU" in got
        if lay.recompute_granularity:  # no recomputation: the same search, brute force
            worlds = [w for w in range(8, 2 * lay.world_size + 1, 8)
                      if any(_fits(model, Layout(w, tp=tp, cp=cp, sequence_parallel=tp > 1,
                                                 seq_length=seq), device_gib, TIGHT_GIB)
                             for tp in (1, 2, 4, 8) for cp in (1, 2, 4, 8) if w % (tp * cp) == 0)]
            assert worlds and worlds[0] > lay.world_size
            assert f"no recompute needs {worlds[0]} GPUs" in got
    assert why("llama3-8b", 8192, "H100").startswith("CP 1 ")  # the 8B H100 row's CP 2
    assert "TP 1 CP 1: the activations alone exceed the GPU" == why("llama3-70b", 8192, "H200")
    with pytest.raises(ValueError, match="gpu_name='A100'"):
        why("llama3-8b", 8192, "A100")


def test_the_rules_of_thumb_hold_on_the_rows():
    """The page's rules of thumb (docs/layouts.md) on the rows they name, from ``choose``."""
    got = {(n, s, g): choose(n, s, *GPUS[g], spare_gib=TIGHT_GIB).layout
           for n, s in ROWS for g in GPUS}
    for (name, seq, gpu), lay in got.items():
        experts = PRESETS[name].num_experts
        if name == "llama3-8b":  # ZeRO-3 alone on one node; CP 2 on H100 only
            assert (lay.world_size, lay.tp, lay.ep) == (8, 1, 1)
            assert lay.cp == (2 if gpu == "H100" else 1)
        elif not experts:  # 70B, 405B: TP (with SP) or CP, at most 8 GPUs' worth
            assert 2 <= lay.tp * lay.cp <= 8 and lay.tp <= 8
            assert lay.tp == 1 or lay.sequence_parallel
            assert lay.cp <= 2 or (name, gpu, lay.tp, lay.cp) == ("llama3-70b", "GB200", 1, 4)
        else:  # MoE: 8 to 16 experts per GPU, TP 1, full recomputation
            assert lay.tp == 1 and 8 <= experts // lay.ep <= 16
        full = lay.recompute_granularity == "full"
        assert full == (name != "llama3-8b" and not (name == "llama3-70b" and gpu == "H200"))
    for name, seq in ROWS:  # more memory per GPU: never more GPUs; fewer from 70B on
        worlds = [got[name, seq, g].world_size for g in ("H100", "H200", "GB200")]
        assert worlds == sorted(worlds, reverse=True)
        assert (len(set(worlds)) == 3) == (name != "llama3-8b")
