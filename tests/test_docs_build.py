"""The strict docs build is part of the test suite: a recipe that stops running is a failed test."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.extended  # `make test-extended`: the build runs every recipe (3 min)


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


def _learning_path() -> list[str]:
    import sys

    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    from gallery_order import LEARNING_PATH

    return LEARNING_PATH


@pytest.mark.docs
def test_the_gallery_follows_the_learning_path(built_site):
    """The built gallery lists the recipes in the order of docs/_ext/gallery_order.py ("Hello,
    ranks" first), not alphabetically."""
    LEARNING_PATH = _learning_path()
    index = (built_site / "docs" / "recipes" / "index.html").read_text()
    where = [index.index(f"{name[:-3]}.html") for name in LEARNING_PATH]
    assert where == sorted(where)


@pytest.mark.docs
def test_no_broken_internal_links(built_site):
    """Every relative ``href``/``src`` in the built site points at a file that exists."""
    import re
    from urllib.parse import unquote, urlsplit

    broken = []
    for page in built_site.rglob("*.html"):
        # _sources holds page sources; _static holds theme files, among them jinja macro
        # templates (pydata-sphinx-theme's webpack-macros.html) that are not pages.
        if "_sources" in page.parts or "_static" in page.parts:
            continue
        for target in re.findall(r'(?:href|src)="([^"]+)"', page.read_text(errors="replace")):
            parts = urlsplit(target)
            if parts.scheme or target.startswith(("#", "//", "mailto:", "javascript:", "data:")):
                continue
            path = unquote(parts.path)
            if not path:
                continue
            resolved = (page.parent / path).resolve()
            if not resolved.exists():
                broken.append(f"{page.relative_to(built_site)} -> {target}")
    assert not broken, "broken internal links:\n" + "\n".join(sorted(set(broken))[:40])


@pytest.mark.docs
def test_recipe_times_are_recorded(built_site, capsys):
    """sphinx-gallery records every recipe's run time; print them (docs build time budget)."""
    import sys

    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    from recipe_times import recipe_times

    times = dict(recipe_times())
    recipes = {p.name for p in (ROOT / "recipes").glob("plot_*.py")}
    assert set(times) == recipes
    with capsys.disabled():
        print("\nrecipe times (s): " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))



@pytest.mark.docs
def test_no_page_shows_a_progress_bar(built_site):
    """#30: recipes and pages show results; a tqdm bar captured into a page (``it/s]``) is noise."""
    import re

    bars = [p.name for p in (built_site / "docs").rglob("*.html")
            if re.search(r"\d+(\.\d+)?(it|B)/s\]", p.read_text(errors="replace"))]
    assert bars == []
