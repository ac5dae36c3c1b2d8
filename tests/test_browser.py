"""The built guide in a real browser (headless Chromium): cards, copy buttons, figures, diagrams,
search. Screenshots are saved under ``build/test-html/_screenshots`` for a human to look at.

Chromium comes from Debian's ``chromium`` package (``.ci/run`` installs it). Where it is missing
the tests skip and say why; in CI (``CI=true``) they fail instead.
"""

from __future__ import annotations

import functools
import http.server
import shutil
import subprocess
import tempfile
import threading
import urllib.parse
import urllib.request

import pytest
from conftest import skip_or_fail

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(n)), None)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-quic"]

pytestmark = [pytest.mark.slow, pytest.mark.docs, pytest.mark.extended]


@pytest.fixture(scope="module")
def site(built_site):
    if CHROMIUM is None:
        skip_or_fail("Chromium is not installed (apt-get install chromium; .ci/run does it)")
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # keep the test output readable
            pass

    handler = functools.partial(Quiet, directory=str(built_site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    shots = built_site / "_screenshots"
    shots.mkdir(exist_ok=True)
    yield f"http://127.0.0.1:{server.server_address[1]}", shots
    server.shutdown()


def _chromium(*args: str, budget_ms: int = 15000, timeout: float = 120) -> str:
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}",
                               f"--virtual-time-budget={budget_ms}", *args],
                              capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _page(site, path: str, shot: str) -> str:
    base, shots = site
    _chromium("--window-size=1280,1600", f"--screenshot={shots / shot}", f"{base}/{path}")
    assert (shots / shot).stat().st_size > 10_000  # a rendered page, not a blank one
    return _chromium("--dump-dom", f"{base}/{path}")


def test_landing_page_renders_its_cards(site):
    dom = _page(site, "docs/index.html", "landing.png")
    assert dom.count("sd-card ") >= 5
    for title in ("Quickstart", "Concepts", "Recipes", "API reference"):
        assert title in dom


def test_code_blocks_have_copy_buttons(site):
    dom = _page(site, "docs/quickstart.html", "quickstart.png")
    assert dom.count('class="copybtn') >= 3


def test_left_navigation_follows_the_readers_path(site):
    """Every page's left sidebar lists the guide in order, in the groups of the home page's
    cards: get started, concepts, train, sharding, MoE, checks, planning, GPU clusters, recipes,
    reference (the captions of the root toctree)."""
    import re

    dom = _chromium("--dump-dom", f"{site[0]}/docs/checkpointing.html")
    nav = dom[dom.index('aria-label="Guide navigation"'):]
    nav = nav[:nav.index("</nav>")]
    captions = re.findall(r'class="caption-text">([^<]+)<', nav)
    assert captions == ["Get started", "Concepts", "Train and convert", "Sharding and parallelism",
                        "Mixture of experts", "Check parity", "Plan memory and time",
                        "Run on GPU clusters", "Recipes", "Reference"], captions
    for page in ("quickstart.html", "slurm.html", "api.html"):
        assert f'href="{page}"' in nav, page


def test_gallery_page_shows_its_figure(site):
    dom = _page(site, "docs/recipes/plot_memory_per_strategy.html", "recipe.png")
    assert "sphx_glr_plot_memory_per_strategy_001.png" in dom
    with urllib.request.urlopen(
            f"{site[0]}/_images/sphx_glr_plot_memory_per_strategy_001.png") as r:
        assert r.status == 200 and r.read(8) == b"\x89PNG\r\n\x1a\n"


def test_mermaid_diagrams_render_to_svg(site):
    dom = _page(site, "docs/concepts.html", "concepts.png")
    assert dom.count('<svg id="mermaid-') >= 2  # both diagrams of the page


def test_search_finds_fully_shard(site):
    dom = _page(site, "search.html?q=fully_shard", "search.png")
    assert "mfsdp.fully_shard" in dom and "search-summary" in dom


# Pages whose numbers with units of time or throughput are not measurements, with the reason.
NOT_MEASURED = {
    "/docs/planner.html": "predictions of mfsdp plan; the measured and published numbers they are "
                          "compared with are on planner-accuracy, which dates them",
    "/docs/slurm.html": "the render's predicted step times and the links' GB/s that mfsdp plan "
                        "assumes and NVIDIA specifies (what mfsdp bandwidth is compared with); "
                        "nothing on it was measured",
}


def _external_links():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "_ext"))
    import external_links

    return external_links


def test_no_page_overflows_and_diagram_text_is_readable(site):
    """Every page of the guide at 1280 and 1920 px (API reference pages at 1280 px): no code
    block wraps (computed white-space "pre"; a recipe's printed output wraps as a terminal
    would), no element reaches past its column, no flag renders with an en dash, no literal (nor a sidebar entry) wrapped inside a word
    (only at spaces, dots, slashes, commas, underscores), plot text at least 10 px as rendered, diagram text at least 3/4 of the body
    text size, no overlapping diagram labels; no code block or table that scrolls sideways, no
    table-of-contents entry cut off, no issue reference outside a link, no project of
    docs/_ext/external_links.py named without a link to it, and a measured-on line on every page
    that shows measured numbers (every recipe; a guide page with times or rates). Measured in the
    browser by tests/browser/measure.html."""
    import html
    import json
    import re
    from pathlib import Path

    base, shots = site
    root = shots.parent
    shutil.copy(Path(__file__).parent / "browser" / "measure.html", root / "_measure.html")
    pages = sorted("/" + p.relative_to(root).as_posix() for p in (root / "docs").rglob("*.html"))
    assert len(pages) > 40, pages
    # the API pages (generated by autosummary, one template) at one width: they share a layout
    api = [p for p in pages if p.startswith("/docs/generated/")]
    guide = [p for p in pages if p not in api]
    assert len(guide) > 30 and len(api) > 30, (len(guide), len(api))
    results = {}
    projects = urllib.parse.quote(json.dumps(sorted(_external_links().PROJECTS.items())))
    for widths, group in (("1280,1920", guide), ("1280", api)):
        dom = _chromium("--dump-dom", f"{base}/_measure.html?widths={widths}&pages={','.join(group)}"
                        f"&projects={projects}", budget_ms=900_000, timeout=900)
        found = re.search(r'<pre id="result">(.*?)</pre>', dom, re.S)
        assert found and found.group(1), dom[-2000:]
        got = json.loads(html.unescape(found.group(1)))
        assert len(got) == len(widths.split(",")) * len(group)
        results.update(got)
    problems = []
    for key, r in sorted(results.items()):
        if "error" in r:
            problems.append(f"{key}: {r['error']}")
            continue
        problems += [f"{key}: {o['what']} overflows by {o['extra_px']} px: {o['text'][:60]!r}"
                     for o in r["overflow"]]
        problems += [f"{key}: diagram text {s['px']} px (body {r['body_px']} px): {s['text']!r}"
                     for s in r["small_text"][:3]]
        problems += [f"{key}: diagram labels overlap: {pair}" for pair in r["overlaps"][:3]]
        problems += [f"{key}: a literal breaks inside a word: {w!r}" for w in r["broken_words"][:3]]
        problems += [f"{key}: a code block wraps (white-space: {p['white_space']}): {p['text']!r}"
                     for p in r["wrapping_pre"][:3]]
        problems += [f"{key}: a flag renders with an en dash: {f!r}" for f in r["en_dash_flags"][:3]]
        problems += [f"{key}: plot text renders at {i['px']} px (< 10): {i['src']}"
                     for i in r["plot_text_px"] if i["px"] < 10][:3]
        problems += [f"{key}: a code block scrolls sideways by {p['extra_px']} px: {p['text']!r}"
                     for p in r["scrolling_pre"][:3]]
        problems += [f"{key}: a table scrolls sideways by {t['extra_px']} px: {t['text']!r}"
                     for t in r["scrolling_tables"][:3]]
        problems += [f"{key}: a table-of-contents entry is cut off: {e!r}" for e in r["cut_toc"][:3]]
        problems += [f"{key}: an issue reference is not a link: {t!r}"
                     for t in r["plain_issue_refs"][:3]]
        problems += [f"{key}: {name} is named but never linked" for name in r["unlinked_projects"]]
        page = key.split(" ", 1)[1]
        shows_measurements = r["recipe_output"] or (r["unit_numbers"] and page not in NOT_MEASURED)
        if shows_measurements and not r["measured_line"]:
            problems.append(f"{key}: shows measured numbers ({r['unit_numbers'] or 'recipe output'})"
                            " but not when, where and with what they were measured")
    assert not problems, "\n".join(problems[:40])
    assert sum(r["diagrams"] for r in results.values()) >= 2 * 4  # the diagrams did render
    assert sum(len(r["plot_text_px"]) for r in results.values()) >= 2 * 14  # the plots did


def _plan_cli(inputs: dict | list) -> dict | str:
    """What ``mfsdp plan`` prints for one calculator case (or for an argument list): its memory
    lines, whether it fits, its time estimate and each group's traffic (``sent G``, ``seconds
    G``, ``links G``) as the strings it prints, or the error it stops with. A case's GPU
    (``device``, default H100), ``efficiency`` (default 0.4) and layer (``transformer_impl``,
    default local) are passed as ``--gpu``, ``--compute-efficiency`` and ``--transformer-impl``
    whatever their value; ``--device-gib`` is not: the GPU's memory is its default."""
    import contextlib
    import io
    import re

    from mfsdp.tools.plan_cli import main
    from mfsdp.tools.plan_export import DEVICES

    if isinstance(inputs, list):
        argv = inputs
    else:
        _, gpu = DEVICES[inputs.get("device", "H100")]
        argv = [inputs["preset"], "--world-size", str(inputs["world_size"]),
                "--data-parallel-sharding-strategy", inputs["strategy"],
                "--num-distributed-optimizer-instances", str(inputs["dp_outer"]),
                "--outer-dp-sharding-strategy", inputs["outer_strategy"],
                "--tensor-model-parallel-size", str(inputs["tp"]),
                "--context-parallel-size", str(inputs["cp"]),
                "--expert-model-parallel-size", str(inputs["ep"]),
                "--micro-batch-size", str(inputs["micro_batch"]),
                "--seq-length", str(inputs["seq_length"]), "--gpu", gpu,
                "--compute-efficiency", str(inputs.get("efficiency", 0.4)),
                "--transformer-impl", inputs.get("transformer_impl", "local")]
        argv += ["--sequence-parallel"] if inputs["sequence_parallel"] else []
        if inputs["recompute"] != "none":
            argv += ["--recompute-granularity", inputs["recompute"]]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            main(argv)
    except ValueError as exc:
        return str(exc)
    text = out.getvalue()
    got = {m[1]: m[2] for m in re.finditer(r"^(\w+) +(\d+\.\d\d)$", text, re.M)}
    got.update({f"sent {m[1]}": m[2]
                for m in re.finditer(r"^sent (\w+) +(\d+\.\d\d)  \(GiB", text, re.M)})
    step = re.search(r"predicted step ([\d.]+) s: ([\d,]+) tokens/s per GPU, ([\d,]+) model "
                     r"TFLOP/s per GPU, MFU ([\d.]+)%", text)
    time = re.search(r"^time: compute ([\d.]+) s; communication (.*)$", text, re.M)
    got.update(step_s=step[1], tokens_per_gpu_s=step[2], tflops=step[3], mfu=step[4],
               compute_s=time[1])
    for m in re.finditer(r"(\w+) ([\d.]+) s \(([^)]+)\)", time[2]):
        got[f"seconds {m[1]}"], got[f"links {m[1]}"] = m[2], m[3]
    got["fits"] = "yes" in re.search(r"fits on [\d.]+ GiB: (yes|no)", text)[1]
    got["tight"] = "  tight: within" in text
    return got


def test_the_planner_calculator_agrees_with_mfsdp_plan(site):
    """The calculator on the built planner page, driven in Chromium over 60 layouts of its grid
    (every preset, strategy and recompute choice; TP, CP, EP, SP, outer size and strategy
    (HSDP, HFSDP), batch and sequence on and off; every GPU, efficiency and layer; some
    invalid): every memory term, the total, whether it fits the GPU (its memory, mfsdp plan's
    default --device-gib for its --gpu), the step time, tokens/s, model
    TFLOP/s and MFU, and each group's GiB sent, seconds and links are the strings `mfsdp plan`
    prints for the same flags; the FSDP traffic is called hidden exactly when the planner's
    FSDP seconds are at most its compute; the page's command prints the same; an invalid layout
    shows the planner's error. Before its script runs (and without JavaScript), the page holds
    the default inputs' result, the same strings."""
    import html
    import json
    import random
    import re
    from pathlib import Path

    from mfsdp.tools.plan_export import DEVICES, EFFICIENCY, GRID, direct

    base, shots = site
    root = shots.parent
    shutil.copy(Path(__file__).parent / "browser" / "calculator.html", root / "_calculator.html")
    rng = random.Random(51)
    cases = []
    for i in range(60):
        case = {name: rng.choice(values) for name, values in GRID.items()}
        case["preset"] = GRID["preset"][i % len(GRID["preset"])]
        case["recompute"] = GRID["recompute"][i % 3]
        case["device"] = list(DEVICES)[i % len(DEVICES)]
        case["efficiency"] = EFFICIENCY[(i // len(DEVICES)) % len(EFFICIENCY)]
        case["transformer_impl"] = GRID["transformer_impl"][(i // len(DEVICES)) % 2]
        if case["preset"] != "deepseek-v3":
            case["ep"] = 1
        cases.append(case)
    query = urllib.parse.quote(json.dumps(cases))
    dom = _chromium("--dump-dom", f"{base}/_calculator.html?page=/docs/planner.html&cases={query}",
                    budget_ms=120_000, timeout=300)
    found = re.search(r'<pre id="result">(.*?)</pre>', dom, re.S)
    assert found and found.group(1), dom[-2000:]
    got = json.loads(html.unescape(found.group(1)))
    assert isinstance(got, list) and len(got) == len(cases), got
    valid = commands = 0
    for case, page in zip(cases, got):
        want = _plan_cli(case)
        if isinstance(want, str):
            assert want in page.get("error", ""), (case, page)
            continue
        valid += 1
        assert page["fits"].startswith("Fits") == want.pop("fits"), (case, page)
        assert ("Tight" in page["fits"]) == want.pop("tight"), (case, page)
        traffic = {k for k in page if k.split(" ")[0] in ("sent", "seconds", "links")}
        assert traffic == {k for k in want if k.split(" ")[0] in ("sent", "seconds", "links")}
        for name, value in want.items():
            assert page[name] == value, (case, name, page[name], value)
        exact = direct(**case)
        hidden = exact["fsdp_s"] <= exact["compute_s"]
        assert ("is hidden under the compute" in page["overlap"]) == hidden, (case, page)
        assert page["command"].startswith(f"mfsdp plan {case['preset']} "), page["command"]
        outer = f"--outer-dp-sharding-strategy {case['outer_strategy']}"
        assert (outer in page["command"]) == (case["outer_strategy"] != "no_shard"), page
        engine = "--transformer-impl transformer_engine" in page["command"]
        assert engine == (case["transformer_impl"] == "transformer_engine"), page["command"]
        if valid % 4 == 0:  # the command, run, prints the page's numbers (15 of them)
            commands += 1
            line = page["command"].replace("\\\n", " ").split()
            again = _plan_cli(line[2:])
            assert again.pop("fits") == page["fits"].startswith("Fits"), (line, page)
            assert again.pop("tight") == ("Tight" in page["fits"]), (line, page)
            assert again == want
    assert valid >= 20 and commands >= 5, (valid, commands)
    # the page as served, no script run: the default inputs' result is already there
    sys_path = str(Path(__file__).resolve().parents[1] / "docs" / "_ext")
    import sys

    sys.path.insert(0, sys_path)
    from planner_calculator import defaults

    raw = urllib.request.urlopen(f"{base}/docs/planner.html").read().decode()
    result = re.search(r'<div class="mfsdp-calc-result"[^>]*>(.*?)<pre class="mfsdp-calc-command">'
                       r"(.*?)</pre>", raw, re.S)
    assert result, "no pre-rendered result in planner.html"
    shown = {m[1]: html.unescape(re.sub(r"<[^>]+>", "", m[2]))
             for m in re.finditer(r'data-out="([^"]+)">(.*?)</(?:td|b|span|p)>', result[1])}
    want = _plan_cli(defaults())
    assert shown.pop("fits").startswith("Fits") == want.pop("fits"), shown
    want.pop("tight")
    for name, value in want.items():
        assert shown[name] == value, (name, shown[name], value)
    assert _plan_cli(html.unescape(result[2]).replace("\\\n", " ").split()[2:]) == \
        _plan_cli(defaults())
