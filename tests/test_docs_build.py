"""The strict docs build is part of the test suite: a recipe that stops running is a failed test."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
