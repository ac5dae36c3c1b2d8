"""The strict docs build is part of the test suite: a recipe that stops running is a failed test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def built_site(tmp_path_factory):
    """Build the guide once per session with ``-W --keep-going`` (offline) and return the HTML dir."""
    out = ROOT / "build" / "test-html"
    env = dict(os.environ, MFSDP_DOCS_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-q", "-E",
         str(ROOT), str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, f"docs build failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return out


@pytest.mark.slow
@pytest.mark.docs
def test_docs_build_is_clean_and_recipes_ran(built_site):
    landing = built_site / "docs" / "index.html"
    assert landing.exists()
    recipe = (built_site / "docs" / "recipes" / "plot_hello_ranks.html").read_text()
    assert "all-reduce sum" in recipe  # the recipe's printed output made it onto its page
    assert "sphx_glr_plot_hello_ranks_001.png" in recipe  # and its figure


@pytest.mark.docs
def test_every_recipe_is_listed_in_the_gallery(built_site):
    recipes = sorted(p.stem for p in (ROOT / "recipes").glob("plot_*.py"))
    index = (built_site / "docs" / "recipes" / "index.html").read_text()
    missing = [r for r in recipes if f"{r}.html" not in index]
    assert not missing, f"recipes missing from the gallery: {missing}"
