"""``make docs``'s recipe report (docs/_ext/recipe_times.py): a cached rebuild says what it reused
instead of printing the full run's total as if it had just run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

from gallery_order import LEARNING_PATH  # noqa: E402
from recipe_times import ran_this_build, summary  # noqa: E402


def test_every_recipe_has_its_place_on_the_learning_path():
    """Every recipe file is named in docs/_ext/gallery_order.py (checked without a docs build, so
    a new recipe without its place fails ``make test``, not only the extended build)."""
    assert sorted(LEARNING_PATH) == sorted(p.name for p in (ROOT / "recipes").glob("plot_*.py"))


def test_a_recipe_counts_as_run_only_when_its_page_was_written_in_this_build(tmp_path):
    started = tmp_path / ".build-started"
    (tmp_path / "plot_old.rst").write_text("x")
    (tmp_path / "plot_new.rst").write_text("x")
    started.touch()
    os.utime(tmp_path / "plot_old.rst", (1, 1))  # written by an earlier build
    assert not ran_this_build("plot_old.py", tmp_path, started)
    assert ran_this_build("plot_new.py", tmp_path, started)
    assert ran_this_build("plot_old.py", tmp_path, tmp_path / "missing")  # no record: all ran


def test_a_cached_rebuild_reports_what_it_reused():
    rows = [("plot_a.py", 300.0), ("plot_b.py", 100.0), ("plot_c.py", 10.0)]
    lines = summary(rows, {"plot_a.py": False, "plot_b.py": False, "plot_c.py": True})
    assert lines[0] == "recipes run in this build: 1 of 3"
    assert "10.0 s  total run in this build" in lines[-2]
    assert lines[-1].startswith("recipes reused from an earlier build") and "2, which took 400.0 s" in lines[-1]
    assert summary(rows, dict.fromkeys(("plot_a.py", "plot_b.py", "plot_c.py"), False)) == [
        "recipes run in this build: 0 of 3",
        "recipes reused from an earlier build (nothing they depend on changed): 3, which took "
        "410.0 s when they ran"]
