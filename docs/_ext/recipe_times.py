"""Print what the last build did with every recipe: ran it (and how long it took) or reused its
results from an earlier build.

``make docs`` runs it after the build: ``python docs/_ext/recipe_times.py``. sphinx-gallery keeps
each recipe's run time in ``sg_execution_times.rst``, also for a recipe it did not re-run (the time
of the build that ran it), so a total over that file is the cost of a full run, not of this build.
``conf.py`` records when a build began (``BUILD_STARTED``); a recipe whose page was written after
that ran in this build, any other was reused.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

GALLERY = Path(__file__).resolve().parents[1] / "recipes"
TIMES = GALLERY / "sg_execution_times.rst"
BUILD_STARTED = GALLERY / ".build-started"


def recipe_times(path: Path = TIMES) -> list[tuple[str, float]]:
    """``(recipe file, seconds)`` pairs, slowest first."""
    text = path.read_text()
    rows = re.findall(r"\(``([\w./-]+\.py)``\)\s*\n\s*- (\d+):(\d+\.\d+)", text)
    return sorted(((name, int(m) * 60 + float(s)) for name, m, s in rows), key=lambda r: -r[1])


def ran_this_build(name: str, gallery: Path = GALLERY, started: Path = BUILD_STARTED) -> bool:
    """Whether the last build executed recipe ``name`` (its generated page is newer than the
    build's start); without a record of the start, every recipe counts as run."""
    if not started.exists():
        return True
    page = gallery / (Path(name).stem + ".rst")
    return page.exists() and page.stat().st_mtime >= started.stat().st_mtime


def summary(rows: list[tuple[str, float]], ran: dict[str, bool]) -> list[str]:
    """The lines ``main`` prints: the recipes that ran with their times and total, then how many
    were reused and what running them cost when they last ran."""
    executed = [(n, s) for n, s in rows if ran[n]]
    reused = [(n, s) for n, s in rows if not ran[n]]
    lines = [f"recipes run in this build: {len(executed)} of {len(rows)}"]
    lines += [f"  {s:6.1f} s  {n}" for n, s in executed]
    if executed:
        lines.append(f"  {sum(s for _, s in executed):6.1f} s  total run in this build")
    if reused:
        lines.append(f"recipes reused from an earlier build (nothing they depend on changed): "
                     f"{len(reused)}, which took {sum(s for _, s in reused):.1f} s when they ran")
    return lines


def main() -> int:
    """Print the summary (nothing if the gallery has not been built)."""
    if not TIMES.exists():
        print("no recipe times yet: build the guide first", file=sys.stderr)
        return 0
    rows = recipe_times()
    print("\n".join(summary(rows, {n: ran_this_build(n) for n, _ in rows})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
