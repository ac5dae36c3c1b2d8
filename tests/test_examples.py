"""The guide's runnable examples, run as a user runs them: ``torchrun -m mfsdp.examples...``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(args: list[str], cwd, ranks: int) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
         "--standalone", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


def _losses(out: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"step +(\d+) +loss (\S+)", out)}


@pytest.mark.slow
@pytest.mark.extended  # `make test`'s 25-minute budget
def test_training_script_resumes_on_another_layout_with_the_same_losses(tmp_path):
    """The complete training script (accumulation, clipping, LR schedule, meta-device init, a
    bf16/fp32 policy): saved after step 3 under FSDP over 4 ranks, resumed as HSDP (2 x 2), it
    prints the straight run's losses for steps 4-6 (1e-6 relative: only the reduction order of
    the gradient norm differs between layouts)."""
    script = ["-m", "mfsdp.examples.train_script", "--steps", "6"]
    straight = _losses(_torchrun(script + ["--save", "ckpt", "--save-at", "3"], tmp_path, 4))
    resumed = _losses(_torchrun(script + ["--load", "ckpt", "--dp-outer", "2"], tmp_path, 4))
    assert sorted(straight) == [1, 2, 3, 4, 5, 6] and sorted(resumed) == [4, 5, 6]
    for step, loss in resumed.items():
        assert loss == pytest.approx(straight[step], rel=1e-6), step
    assert straight[6] < straight[1]  # it learns


def test_quickstart_runs_under_torchrun(tmp_path):
    """The quickstart is the whole script: process group, device, fully_shard, loop."""
    out = _torchrun(["-m", "mfsdp.examples"], tmp_path, 2)
    losses = [float(v) for v in re.search(r"losses: \[(.*)\]", out).group(1).split(", ")]
    assert len(losses) == 5 and losses[-1] < losses[0] / 2


def test_recipes_show_the_code_they_run():
    """#30: a recipe calls the public API or an example whose code is on its page, never a hidden
    harness: every function a recipe imports from ``mfsdp.testing`` or launches from
    ``mfsdp.examples`` is shown by a ``literalinclude`` of that function, on its page or on the
    recipe page it links to (the training script's), and the bench CLI is run as the command the
    page shows."""
    import ast
    import re

    pages = {p.stem: p.read_text() for p in sorted((ROOT / "recipes").glob("plot_*.py"))}
    shown = {stem: set(re.findall(r":pyobject: (\w+)", text)) for stem, text in pages.items()}
    hidden = []
    for stem, text in pages.items():
        linked = set(re.findall(r":ref:`sphx_glr_docs_recipes_(plot_\w+)\.py`", text))
        visible = shown[stem].union(*(shown[s] for s in linked if s in shown))
        used = []
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(
                    ("mfsdp.testing", "mfsdp.examples", "mfsdp.tools.benchmark", "mfsdp.bench")):
                used += [a.name for a in node.names if not a.name.isupper()]
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(
                    r"mfsdp\.(examples|testing)\.[\w.]+:\w+", node.value):
                used.append(node.value.rpartition(":")[2])
        hidden += [f"{stem}: {name}" for name in used if name not in visible]
    assert hidden == []


def test_recipes_draw_no_text_below_10_points():
    """The browser test scales 10 pt at 100 dpi by each plot's rendered width; that holds only if
    no recipe draws smaller text (``fontsize`` under 10 or a relative size below "medium") or
    changes the resolution."""
    import re

    small = []
    for path in sorted((ROOT / "recipes").glob("plot_*.py")):
        text = path.read_text()
        for m in re.finditer(r"fontsize\s*=\s*([\d.]+|\"[\w-]+\"|'[\w-]+')", text):
            value = m.group(1).strip("\"'")
            if (value.replace(".", "").isdigit() and float(value) < 10) or value in (
                    "small", "x-small", "xx-small", "smaller"):
                small.append(f"{path.name}: {m.group(0)}")
        small += [f"{path.name}: {m.group(0)}" for m in re.finditer(
            r"rcParams\[[\"'](font\.size|\w+\.labelsize|savefig\.dpi|figure\.dpi)[\"']\]", text)]
        small += [f"{path.name}: dpi" for m in re.finditer(r"\bdpi\s*=", text)]
    assert small == []


def _cells(text: str) -> list[str]:
    """A recipe's code cells as sphinx-gallery splits them (at ``# %%`` lines)."""
    return re.split(r"(?m)^# %%.*$", text)


def test_recipes_draw_each_figure_in_the_cell_that_shows_it():
    """sphinx-gallery saves the figures open at the end of a cell: an axes made by
    ``plt.subplots`` in one cell and drawn in a later one is saved empty (#38: the memory recipe's
    right panel was an empty 0-1 box, and so was its thumbnail). No cell may call a method of an
    axes or figure that an earlier cell made."""
    import ast

    def made_by_subplots(tree) -> set[str]:
        names = set()
        for node in ast.walk(tree):
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                    and getattr(node.value.func, "attr", "") in ("subplots", "figure", "subplot")):
                for target in node.targets:
                    names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        return names

    late = []
    for path in sorted((ROOT / "recipes").glob("plot_*.py")):
        earlier: set[str] = set()
        for i, cell in enumerate(_cells(path.read_text())):
            tree = ast.parse(cell)
            made_here = made_by_subplots(tree)
            used = {n.value.id for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                    and isinstance(n.value, ast.Name) and n.value.id in earlier - made_here}
            late += [f"{path.name}: cell {i} draws on {name}, made in an earlier cell"
                     for name in sorted(used)]
            earlier = (earlier | made_here)
    assert late == []


def test_the_figure_check_finds_empty_axes_and_covered_labels():
    """docs/_ext/recipe_figures.py, the scraper the docs build uses, warns (an error under -W) on
    an empty axes and on a legend over a label, and passes a figure drawn whole."""
    import sys

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    from recipe_figures import figure_problems

    fig, (left, right) = plt.subplots(1, 2)
    left.plot([0, 1], label="line")
    left.legend()
    assert figure_problems(fig) == ["axes 'axes 2' is empty (drawn in a later cell?)"]
    right.bar([0, 1], [1, 2])
    assert figure_problems(fig) == []
    fig, ax = plt.subplots()
    ax.plot([0, 1], label="a long label " * 3)
    ax.set_ylabel("bytes per parameter")
    ax.legend(loc="center left", bbox_to_anchor=(-0.4, 0.5))
    assert figure_problems(fig) == ["a legend covers the text 'bytes per parameter'"]
    plt.close("all")
