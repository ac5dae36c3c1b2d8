"""The planner page's calculator (docs/_static/mfsdp-planner.js) against the planner itself.

The calculator looks its numbers up in tables the docs build exports from the planner
(mfsdp/tools/plan_export.py). Here, without a build: the tables' split agrees with direct calls of
the planner, a table that disagrees is caught, and the page's own script (run in Chromium, or in
node where Chromium is missing) gives the planner's numbers. The built page against ``mfsdp plan``
is in tests/test_browser.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from conftest import skip_or_fail

from mfsdp.tools.plan_export import GRID, check, direct, export, lookup

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docs" / "_static" / "mfsdp-planner.js"

# A corner of the calculator's grid: a dense and an MoE preset, every strategy, small and large
# worlds, each parallelism on and off (EP up to 32), HSDP and HFSDP, every recompute choice.
SMALL = {**GRID, "preset": ["llama3-70b", "deepseek-v3"], "world_size": [8, 256],
         "dp_outer": [1, 2], "tp": [1, 8], "cp": [1, 2], "ep": [1, 8, 32], "micro_batch": [1, 4],
         "seq_length": [4096, 32768]}


@pytest.fixture(scope="module")
def tables():
    return export(SMALL, samples=50)


def _inputs(grid: dict) -> list[dict]:
    import itertools

    names = list(grid)
    out = []
    for combo in itertools.product(*grid.values()):
        inputs = dict(zip(names, combo))
        if inputs["ep"] > 1 and inputs["preset"] != "deepseek-v3":
            continue
        out.append(inputs)
    return out


def test_the_lookup_equals_the_planner_on_every_layout_of_a_grid(tables):
    """Every layout of SMALL (valid or not): the tables, combined, give the planner's numbers."""
    cases = _inputs(SMALL)
    assert len(cases) > 1000
    invalid = 0
    for inputs in cases:
        got, want = lookup(tables, **inputs), direct(**inputs)
        if isinstance(want, str):
            assert got == want, inputs
            invalid += 1
            continue
        assert got.keys() == want.keys()
        for name in want:
            assert got[name] == pytest.approx(want[name], rel=1e-8), (inputs, name)
    assert 0 < invalid < len(cases)


def test_a_table_that_disagrees_with_the_planner_is_caught(tables):
    """The build's check fails on tables that no longer follow the planner (here: one preset's
    activations doubled), instead of publishing them."""
    broken = json.loads(json.dumps(tables))
    broken["activations"]["llama3-70b"] = [r if isinstance(r, int) else [2 * r[0], *r[1:]]
                                           for r in broken["activations"]["llama3-70b"]]
    with pytest.raises(AssertionError):
        check(broken, samples=100)


def _run_script(tables: dict, cases: list[dict], call: str = "compute(d.tables, c)") -> list:
    """``call`` (default ``compute(tables, inputs)``) of the page's script for each case ``c``,
    in a JavaScript engine."""
    chromium = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")
                     if shutil.which(n)), None)
    node = shutil.which("node")
    with tempfile.TemporaryDirectory() as tmp:
        data = json.dumps({"tables": tables, "cases": cases})
        if chromium:
            page = Path(tmp) / "run.html"
            page.write_text(
                "<!doctype html><html><body><pre id=result></pre><script>var module = "
                f"{{exports: {{}}}};</script><script>{SCRIPT.read_text()}</script><script>"
                f"const d = {data}; const {{compute, command, bar}} = module.exports; "
                "document.getElementById('result').textContent = "
                f"JSON.stringify(d.cases.map(c => {call}));"
                "</script></body></html>")
            proc = subprocess.run(
                [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 f"--user-data-dir={tmp}/profile", "--dump-dom", page.as_uri()],
                capture_output=True, text=True, timeout=120)
            import html
            import re

            found = re.search(r'<pre id="result">(.*?)</pre>', proc.stdout, re.S)
            assert found, proc.stderr[-2000:]
            return json.loads(html.unescape(found.group(1)))
        if node:
            (Path(tmp) / "data.json").write_text(data)
            proc = subprocess.run(
                [node, "-e", f"const {{compute, command, bar}} = require({json.dumps(str(SCRIPT))}); "
                 f"const d = require({json.dumps(str(Path(tmp) / 'data.json'))}); "
                 f"console.log(JSON.stringify(d.cases.map(c => {call})));"],
                capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, proc.stderr
            return json.loads(proc.stdout)
    skip_or_fail("neither Chromium nor node is installed (apt-get install chromium)")


def test_the_page_script_gives_the_planners_numbers(tables):
    """The script the planner page runs, on 400 layouts of the grid: the planner's memory terms,
    step time, tokens/s and MFU to 1e-8, and its error message for an invalid layout."""
    import random

    cases = random.Random(0).sample(_inputs(SMALL), 400)
    got = _run_script(tables, cases)
    assert len(got) == len(cases)
    for inputs, result in zip(cases, got):
        want = direct(**inputs)
        if isinstance(want, str):
            assert result == want, inputs
            continue
        assert set(result) == set(want), inputs
        for name in want:
            assert result[name] == pytest.approx(want[name], rel=1e-8), (inputs, name)


def test_the_memory_bar_stacks_the_planners_terms_against_the_device(tables):
    """The page's memory bar (``bar`` of the page's script) on 60 valid layouts: one segment per
    memory term of the planner, in the table's order, as live at the step's peak moment
    (``Plan.peak_moment``: no ``grad_buffers`` at the loss's peak; the logits' gradient in place
    of the logits in backward), each starting where the one before ends, widths in proportion
    to the terms (1e-9), ending at the total, the 80 GiB line where 80 GiB falls, all inside
    the bar."""
    import random

    terms = ["weights", "main_weights", "grads", "optimizer", "gathered", "grad_buffers",
             "activations", "logits"]
    valid = [c for c in _inputs(SMALL) if not isinstance(direct(**c), str)]
    cases = random.Random(1).sample(valid, 60)
    got = _run_script(tables, cases, call="bar(compute(d.tables, c), 80)")
    over = 0
    for inputs, b in zip(cases, got):
        want = direct(**inputs)
        at_loss = want["logits"] >= want["grad_buffers"] + want["logits_grad"]
        live = dict(want, grad_buffers=0.0) if at_loss else \
            {**want, "logits' gradient": want["logits_grad"]}
        names = terms if at_loss else terms[:-1] + ["logits' gradient"]
        assert [s["name"] for s in b["segments"]] == names
        scale = b["scale"]
        assert scale == pytest.approx(1.05 * max(want["total"], 80), rel=1e-9)
        start = 0.0
        for seg in b["segments"]:
            assert seg["gib"] == pytest.approx(live[seg["name"]], rel=1e-9), inputs
            assert seg["start"] == pytest.approx(start, abs=1e-9)
            assert seg["width"] == pytest.approx(100 * live[seg["name"]] / scale, rel=1e-9)
            start += seg["width"]
        assert b["end"] * scale / 100 == pytest.approx(want["total"], rel=1e-9)
        assert b["limit"] * scale / 100 == pytest.approx(80, rel=1e-9)
        assert max(b["end"], b["limit"]) <= 100 / 1.05 + 1e-9
        over += want["total"] > 80
    assert 0 < over < len(cases)  # both sides of the line were drawn


def test_mfsdp_plan_refuses_a_split_larger_than_the_world_in_one_line(capsys):
    """TP x CP larger than the world: the layout's message (as the calculator shows it), not a
    ZeroDivisionError from the batch arithmetic."""
    from mfsdp.cli import main

    code = main(["plan", "llama3-8b", "--world-size", "8", "--tensor-model-parallel-size", "8",
                 "--context-parallel-size", "2"])
    err = capsys.readouterr().err
    want = direct(preset="llama3-8b", world_size=8, strategy="optim_grads_params", dp_outer=1,
                  outer_strategy="no_shard", tp=8, cp=2, ep=1, sequence_parallel=False,
                  micro_batch=1, seq_length=4096, recompute="none")
    assert code == 2 and err.startswith("mfsdp plan: error: ") and want in err, err


def test_the_calculator_sets_the_guides_deepseek_v3_layout():
    """The planner page's DeepSeek-V3 example (256 GPUs, EP 32, 2 outer groups under HFSDP,
    full recompute) is a choice of the form: the page's script gives the planner's numbers for
    it, the total of the page's own ``plan`` call, the page's verdict (73.5 GiB: it fits 80 GiB,
    tightly, as the page says), and a command that ``mfsdp plan`` prints the same total for."""
    import contextlib
    import io
    import re

    from mfsdp.cli import main
    from mfsdp.tools.plan import GiB, PRESETS, Layout, plan

    case = dict(preset="deepseek-v3", world_size=256, strategy="optim_grads_params", dp_outer=2,
                outer_strategy="optim", tp=1, cp=1, ep=32, sequence_parallel=False,
                micro_batch=1, seq_length=4096, recompute="full")
    assert all(case[name] in values for name, values in GRID.items()), case  # the form offers it
    one = export({name: [value] for name, value in case.items()}, samples=1)
    assert one["ep"]["deepseek-v3"] == [32]  # EP 32 divides the 256 experts
    (got,) = _run_script(one, [case])
    want = direct(**case)
    assert set(got) == set(want)
    for name in want:
        assert got[name] == pytest.approx(want[name], rel=1e-8), name
    page = plan(PRESETS["deepseek-v3"], Layout(world_size=256, strategy="optim_grads_params",
                                               dp_outer=2, outer_strategy="optim", ep=32,
                                               recompute=True))
    assert got["total"] == pytest.approx(page.total / GiB, rel=1e-8) and page.fits(80)
    assert 80 - 4 - 5 < got["total"] <= 80 - 4  # the page's "Fits" and "Tight" (4 GiB for CUDA)
    (printed,) = _run_script(one, [case], call="command(c)")
    line = printed.replace("\\\n", " ").split()
    assert line[:2] == ["mfsdp", "plan"] and "--outer-dp-sharding-strategy" in line, line
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(line[1:]) in (0, None)
    total = re.search(r"^total +(\d+\.\d\d)$", out.getvalue(), re.M)[1]
    assert total == f"{got['total']:.2f}", (total, out.getvalue())


def test_the_calculator_says_loading_then_names_a_table_it_could_not_load(tmp_path):
    """The form as the planner page holds it, run by the page's script in Chromium with fetch
    replaced: while a table loads, "Loading the planner's tables..." (and no claim that
    JavaScript is missing: that advice is in <noscript>); when its fetch fails, one error line
    naming the file."""
    import html
    import re
    import sys

    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    from planner_calculator import TABLES, form_html

    form = form_html()
    advice = re.search(r"<noscript>(.*?)</noscript>", form, re.S)
    assert advice and "needs JavaScript" in advice.group(1) and "mfsdp plan" in advice.group(1)
    assert "JavaScript" not in form.replace(advice.group(0), "")
    chromium = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")
                     if shutil.which(n)), None)
    if chromium is None:
        skip_or_fail("Chromium is not installed (apt-get install chromium)")
    # two calculators: one whose tables never arrive, one whose fetch fails
    failing = form.replace(f'data-tables="{TABLES}"', 'data-tables="missing.json"')
    page = tmp_path / "page.html"
    page.write_text(
        "<!doctype html><html><body><script>window.fetch = url => String(url).includes("
        "'missing') ? Promise.reject(new TypeError('Failed to fetch')) : new Promise(() => {});"
        f"</script>{form}{failing}<script>{SCRIPT.read_text()}</script></body></html>")
    proc = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         f"--user-data-dir={tmp_path}/profile", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120)
    results = re.findall(r'<div class="mfsdp-calc-result"[^>]*>(.*?)</div>', proc.stdout, re.S)
    assert len(results) == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    shown = [html.unescape(re.sub(r"<noscript>.*?</noscript>|<[^>]+>", "", r)).strip()
             for r in results]
    assert shown[0] == "Loading the planner's tables...", shown
    assert 'data-out="error"' in results[1] and "mfsdp-calc-error" in results[1]
    assert shown[1].startswith("The calculator could not load _static/missing.json (Failed to "
                               "fetch): run mfsdp plan instead"), shown
