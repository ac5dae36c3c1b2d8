"""The layout page's search (mfsdp/tools/plan_layouts.py) against a brute force over the planner,
and its commands against ``mfsdp plan``."""

from __future__ import annotations

import contextlib
import io
import re

import pytest

from mfsdp.tools.plan import GiB, PRESETS, Layout, estimate, plan
from mfsdp.tools.plan_cli import TIGHT_GIB
from mfsdp.tools.plan_layouts import choose, table


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


@pytest.mark.parametrize("preset, seq, device_gib", [("llama3-70b", 8192, 80.0),
                                                     ("deepseek-v3", 8192, 140.0)])
def test_the_command_prints_the_same_total(preset, seq, device_gib):
    """The page's command for a row, run through ``mfsdp plan``: the total it prints is the
    row's, and it says the layout fits."""
    from mfsdp.cli import main

    c = choose(preset, seq, device_gib, spare_gib=TIGHT_GIB)
    argv = c.command().replace("\\\n", " ").split()
    assert argv[:2] == ["mfsdp", "plan"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv[1:]) in (0, None)
    total = re.search(r"^total +(\d+\.\d\d)$", out.getvalue(), re.M)[1]
    assert total == f"{c.total / GiB:.2f}"
    assert f"fits on {device_gib:g} GiB: yes" in out.getvalue()


def test_the_table_fits_the_page_and_a_bad_input_is_refused():
    text = table(rows=(("llama3-8b", 8192),))
    assert max(len(line) for line in text.splitlines()) <= 88
    assert len(text.splitlines()) == 3
    with pytest.raises(ValueError, match="is not a planner preset"):
        choose("llama4", 8192)
    with pytest.raises(ValueError, match="spare_gib"):
        choose("llama3-8b", 8192, 80.0, spare_gib=80.0)
