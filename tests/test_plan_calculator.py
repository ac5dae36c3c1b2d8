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

from mfsdp.tools.plan_export import DEVICES, EFFICIENCY, GRID, check, direct, export, lookup

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
    """Every layout of ``grid`` (EP only for the MoE preset), each on a GPU, efficiency and
    layer (``transformer_impl``: each of ``grid``'s in turn, not all of them for each layout,
    which would double the cases) of the calculator's, in turn."""
    import itertools

    names = [name for name in grid if name != "transformer_impl"]
    layers = grid["transformer_impl"]
    out = []
    for combo in itertools.product(*(grid[name] for name in names)):
        inputs = dict(zip(names, combo))
        if inputs["ep"] > 1 and inputs["preset"] != "deepseek-v3":
            continue
        inputs["device"] = list(DEVICES)[len(out) % len(DEVICES)]
        inputs["efficiency"] = EFFICIENCY[len(out) // len(DEVICES) % len(EFFICIENCY)]
        inputs["transformer_impl"] = layers[len(out) // len(DEVICES) % len(layers)]
        out.append(inputs)
    return out


def _assert_close(got, want, rel: float, where) -> None:
    """``got`` equals ``want`` (numbers, strings, or dicts of them, keys in the same order) to
    ``rel``."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), (where, got, want)
        for name in want:
            _assert_close(got[name], want[name], rel, (where, name))
    elif isinstance(want, str):
        assert got == want, (where, got, want)
    else:
        assert got == pytest.approx(want, rel=rel, abs=1e-12), where


def test_the_lookup_equals_the_planner_on_every_layout_of_a_grid(tables):
    """Every layout of SMALL (valid or not), each on one of the calculator's GPUs at one of its
    efficiencies: the tables, combined, give the planner's numbers (memory, time, and each
    group's traffic, seconds and links, in ``plan().comm``'s order) to 1e-8."""
    cases = _inputs(SMALL)
    assert len(cases) > 1000
    invalid = 0
    for inputs in cases:
        got, want = lookup(tables, **inputs), direct(**inputs)
        if isinstance(want, str):
            assert got == want, inputs
            invalid += 1
            continue
        _assert_close(got, want, 1e-8, inputs)
    assert 0 < invalid < len(cases)


def test_any_efficiency_scales_the_compute_as_step_time_does(tables):
    """An efficiency the form does not offer (0.23 and 0.97 on every GPU, a few layouts) gives the
    planner's compute, step time and MFU from the same tables: none is stored per efficiency."""
    cases = [c for c in _inputs(SMALL) if not isinstance(direct(**c), str)][::250]
    for inputs in cases:
        for device in DEVICES:
            for efficiency in (0.23, 0.97):
                case = dict(inputs, device=device, efficiency=efficiency)
                _assert_close(lookup(tables, **case), direct(**case), 1e-8, case)
    with pytest.raises(ValueError, match="efficiency=1.5 must be in"):
        lookup(tables, **dict(cases[0], efficiency=1.5))
    with pytest.raises(ValueError, match="device='A100' is not one of"):
        lookup(tables, **dict(cases[0], device="A100"))


def test_a_table_with_another_gpus_seconds_is_caught(tables):
    """The build's check fails on tables whose FSDP seconds for GB200 are H100's (a column
    mix-up), instead of publishing them."""
    broken = json.loads(json.dumps(tables))
    cols = broken["columns"]["state"]
    h100, gb200 = cols.index("s:h100:dp_shard"), cols.index("s:gb200:dp_shard")
    for preset, rows in broken["state"].items():
        for r in rows:
            if not isinstance(r, int):
                r[gb200] = r[h100]
    with pytest.raises(AssertionError):
        check(broken, samples=100)


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
                f"const d = {data}; const {{compute, command, bar, resultHtml}} = module.exports; "
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
                [node, "-e", "const {compute, command, bar, resultHtml} = "
                 f"require({json.dumps(str(SCRIPT))}); "
                 f"const d = require({json.dumps(str(Path(tmp) / 'data.json'))}); "
                 f"console.log(JSON.stringify(d.cases.map(c => {call})));"],
                capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, proc.stderr
            return json.loads(proc.stdout)
    skip_or_fail("neither Chromium nor node is installed (apt-get install chromium)")


def test_the_page_script_gives_the_planners_numbers(tables):
    """The script the planner page runs, on 400 layouts of the grid, GPUs and efficiencies: the
    planner's memory terms, step time, tokens/s, MFU and traffic to 1e-8, and its error message
    for an invalid layout."""
    import random

    cases = random.Random(0).sample(_inputs(SMALL), 400)
    got = _run_script(tables, cases)
    assert len(got) == len(cases)
    for inputs, result in zip(cases, got):
        want = direct(**inputs)
        if isinstance(want, str):
            assert result == want, inputs
            continue
        _assert_close(result, want, 1e-8, inputs)


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
                micro_batch=1, seq_length=4096, recompute="full", transformer_impl="local",
                device="H100", efficiency=0.4)
    assert all(case[name] in values for name, values in GRID.items()), case  # the form offers it
    one = export({name: [case[name]] for name in GRID}, samples=1)
    assert one["ep"]["deepseek-v3"] == [32]  # EP 32 divides the 256 experts
    (got,) = _run_script(one, [case])
    _assert_close(got, direct(**case), 1e-8, case)
    page = plan(PRESETS["deepseek-v3"], Layout(world_size=256, strategy="optim_grads_params",
                                               dp_outer=2, outer_strategy="optim", ep=32,
                                               recompute=True))
    assert got["total"] == pytest.approx(page.total / GiB, rel=1e-8) and page.fits(80)
    assert 80 - 4 - 5 < got["total"] <= 80 - 4  # the page's "Fits" and "Tight" (4 GiB for CUDA)
    (printed,) = _run_script(one, [case], call="command(c, d.tables)")
    line = printed.replace("\\\n", " ").split()
    assert line[:2] == ["mfsdp", "plan"] and "--outer-dp-sharding-strategy" in line, line
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(line[1:]) in (0, None)
    total = re.search(r"^total +(\d+\.\d\d)$", out.getvalue(), re.M)[1]
    assert total == f"{got['total']:.2f}", (total, out.getvalue())


def test_the_calculators_gpus_are_mfsdp_plans(tables):
    """Every GPU of ``mfsdp plan --gpu`` (plan_time.GPUS) is a choice of the form, with its
    memory (``--device-gib``'s default for it) in the form, the tables and the fit; a GPU is
    timed by columns of the same peak, links and efficiency (an H200 by the H100's: the tables
    hold no second copy of them)."""
    import sys
    from dataclasses import replace

    from mfsdp.tools.plan_time import GPUS

    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    from planner_calculator import form_html

    assert sorted(gpu for _, gpu in DEVICES.values()) == sorted(GPUS)
    form = form_html(prerender=False)
    for name, (gib, gpu) in DEVICES.items():
        assert gib == GPUS[gpu].memory_gib, name
        assert tables["devices"][name]["device_gib"] == GPUS[gpu].memory_gib, name
        assert f">{name} ({GPUS[gpu].memory_gib:g} GiB)</option>" in form, name
        timed = tables["devices"][name]["timed"]
        assert replace(GPUS[timed], name="", memory_gib=1.0) == \
            replace(GPUS[gpu], name="", memory_gib=1.0), name
    assert tables["devices"]["H200"]["timed"] == "h100"
    assert not any(":h200:" in c for cols in tables["columns"].values() for c in cols)
    from planner_calculator import result_html

    fit = [c for c in _inputs(SMALL) if c["device"] == "H200" and not isinstance(
        direct(**c), str) and 80 - 4 < direct(**c)["total"] <= 140 - 4][:3]  # not on 80 GiB
    assert fit
    for case in fit:
        _assert_close(lookup(tables, **case), direct(**case), 1e-8, case)
        shown = result_html(lookup(tables, **case), case, tables)
        assert ">Fits on H200 (140 GiB: total at most 136 GiB" in shown, case


def test_the_layer_is_mfsdp_plans_transformer_impl(tables):
    """The form's layer choice is ``mfsdp plan --transformer-impl``: for a Llama layout the
    tables give the planner's numbers under each (to 1e-8), Megatron-LM's estimate is not the
    measured layer's (the axis is not ignored), and the command (the build's and the
    script's) adds ``--transformer-impl transformer_engine`` exactly when it is chosen and
    prints the same total."""
    import sys

    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    from planner_calculator import LAYERS, command, form_html
    from test_browser import _plan_cli

    assert list(LAYERS) == GRID["transformer_impl"] == ["local", "transformer_engine"]
    form = form_html(prerender=False)
    assert all(f">{html_text}</option>" in form for html_text in (
        "mfsdp train (measured)",
        "Megatron-LM with Transformer Engine (Megatron-LM&#x27;s estimate)"))
    base = dict(preset="llama3-70b", world_size=256, strategy="optim_grads_params",
                dp_outer=1, outer_strategy="no_shard", tp=8, cp=1, ep=1,
                sequence_parallel=True, micro_batch=1, seq_length=4096, recompute="none",
                device="H100", efficiency=0.4)
    cases = [dict(base, transformer_impl=impl) for impl in GRID["transformer_impl"]]
    got = [lookup(tables, **c) for c in cases]
    for case, result in zip(cases, got):
        _assert_close(result, direct(**case), 1e-8, case)
    assert got[0]["activations"] != pytest.approx(got[1]["activations"], rel=1e-3)
    assert got[0]["weights"] == got[1]["weights"] and got[0]["step_s"] == got[1]["step_s"]
    script = _run_script(tables, cases, call="command(c, d.tables)")
    for case, result, printed in zip(cases, got, script):
        assert printed == command(case, tables)
        engine = case["transformer_impl"] == "transformer_engine"
        assert ("--transformer-impl transformer_engine" in printed) == engine, printed
        assert _plan_cli(printed.replace("\\\n", " ").split()[2:])["total"] == \
            f"{result['total']:.2f}"


def _shown(markup: str) -> dict:
    """The text of every ``data-out`` element of a result's HTML, and its command."""
    import html
    import re

    out = {m[1]: html.unescape(re.sub(r"<[^>]+>", "", m[2])) for m in
           re.finditer(r'data-out="([^"]+)">(.*?)</(?:td|b|span|p)>', markup)}
    out["command"] = html.unescape(re.search(r'<pre class="mfsdp-calc-command">(.*?)</pre>',
                                             markup, re.S)[1])
    return out


def test_the_prerendered_result_is_the_scripts_and_mfsdp_plans(tables):
    """The result the build writes into the page (``planner_calculator.result_html``) shows, for
    the form's defaults and for a layout on each GPU (at various efficiencies), the same text in
    every ``data-out`` element and the same command as the page's script (``resultHtml``), and those
    are the strings ``mfsdp plan`` prints for the printed command (memory, fit, time, each
    group's traffic)."""
    import random
    import sys

    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    from planner_calculator import defaults, result_html
    from test_browser import _plan_cli

    start = defaults()
    one = export({name: [start[name]] for name in GRID}, samples=1)  # the default's rows
    layouts = _inputs(SMALL)
    random.Random(2).shuffle(layouts)
    cases = [next(c for c in layouts if c["device"] == device and
                  not isinstance(direct(**c), str)) for device in DEVICES]
    call = "resultHtml(compute(d.tables, c), c, d.tables)"
    scripts = _run_script(one, [start], call=call) + _run_script(tables, cases, call=call)
    for case, script in zip([start] + cases, scripts):
        table = one if case is start else tables
        built = _shown(result_html(lookup(table, **case), case, table))
        assert built == _shown(script), case
        want = _plan_cli(built["command"].replace("\\\n", " ").split()[2:])
        fits = built.pop("fits")
        assert fits.startswith("Fits") == want.pop("fits"), (case, fits)
        assert ("Tight" in fits) == want.pop("tight"), (case, fits)
        for name, value in want.items():
            assert built[name] == value, (case, name, built[name], value)


def test_the_calculator_says_loading_then_names_a_table_it_could_not_load(tmp_path):
    """The form as the planner page holds it (the default inputs' result written in), run by
    the page's script in Chromium with fetch replaced: while a table loads, "Loading the
    planner's tables..." above the written result (and no claim that JavaScript is missing:
    that advice is in <noscript>); when its fetch fails, one error line naming the file, the
    written result kept and the inputs disabled."""
    import html
    import re
    import sys

    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    from planner_calculator import TABLES, defaults, form_html, result_html

    small = {name: [value] for name, value in defaults().items() if name in GRID}
    one = export(small, samples=1)
    form = form_html(prerender=False).replace(
        '<div class="mfsdp-calc-result" aria-live="polite"></div>',
        '<div class="mfsdp-calc-result" aria-live="polite">'
        f"{result_html(lookup(one, **defaults()), defaults(), one)}</div>")
    assert "mfsdp-calc-command" in form  # the result was written in
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
    status = re.findall(r'<p class="(mfsdp-calc-status[^"]*)"[^>]*>(.*?)</p>', proc.stdout, re.S)
    assert len(status) == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    shown = [html.unescape(re.sub(r"<[^>]+>", "", text)).strip() for _, text in status]
    assert shown[0] == "Loading the planner's tables...", shown
    assert "mfsdp-calc-error" in status[1][0] and "mfsdp-calc-error" not in status[0][0]
    assert shown[1].startswith("The calculator could not load _static/missing.json (Failed to "
                               "fetch): the result below is for the default inputs only; run "
                               "mfsdp plan instead"), shown
    written = _shown(form)
    parts = [part.split("<script>")[0]
             for part in proc.stdout.split('<div class="mfsdp-calculator"')[1:]]
    assert [_shown(part) for part in parts] == [written, written]  # the defaults' numbers stay
    second = parts[1]
    assert second.count("<select") == second.count("disabled") > 10
