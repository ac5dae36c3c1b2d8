"""Sphinx configuration. The repository root is the source directory.

Build with ``make docs`` (strict: ``-W --keep-going``). The guide lives in ``docs/`` (MyST markdown),
the recipes in ``recipes/`` are executed by sphinx-gallery into ``docs/recipes/`` (generated, ignored
by git). Set ``MFSDP_DOCS_OFFLINE=0`` to resolve links to the Python and PyTorch docs (needs network).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

import mfsdp  # noqa: E402

project = "mfsdp"
author = "the mfsdp authors"
copyright = "2026, the mfsdp authors"
release = version = mfsdp.__version__

root_doc = "docs/index"
# The root is the source directory: read only the guide (and what the gallery generates there).
include_patterns = ["docs/**"]
exclude_patterns = ["docs/conftest.py", "docs/_templates/**", "docs/_ext/**", "**/__pycache__", "docs/recipes/*.ipynb",
                    "docs/recipes/*.py", "docs/recipes/*.zip", "docs/recipes/*.json"]

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",  # renders the {doctest} blocks; pytest (Sybil) executes them
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
    "sphinx_gallery.gen_gallery",
    "sphinx_design",
    "sphinx_copybutton",
    "sphinxcontrib.mermaid",
    "cli_reference",  # docs/_ext: CLI reference tables generated from the argparse parsers
    "compat_matrix",  # docs/_ext: the compatibility matrix, measured and cached by a digest
    "planner_calculator",  # docs/_ext: the planner page's calculator, tables from mfsdp plan
    "layout_table",  # docs/_ext: the layouts page's table, from mfsdp.tools.plan_layouts
    "measured",  # docs/_ext: when, where and with what a page's numbers were measured
    "external_links",  # docs/_ext: issue references and named projects become links
    "source_archive",  # docs/_ext: the package's source as a download on the quickstart
]
templates_path = ["docs/_templates"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}

# Mermaid from build/vendor (fetched by `make vendor`) when present: diagrams render offline.
_VENDOR = ROOT / "build" / "vendor"
html_static_path = ["docs/_static"]
html_css_files = ["mfsdp.css"]
html_js_files = ["mfsdp-wrap.js", "mfsdp-planner.js"]
if (_VENDOR / "mermaid" / "mermaid.esm.min.mjs").exists():
    html_static_path.append(str(_VENDOR))
    mermaid_use_local = "mermaid/mermaid.esm.min.mjs"

# Diagrams at their natural size (text as large as the page's), scaled down only when wider than
# the column (docs/_static/mfsdp.css); compact sequence diagrams so they fit a 1280 px window.
mermaid_init_config = {
    "startOnLoad": False,
    "flowchart": {"useMaxWidth": False, "nodeSpacing": 30, "rankSpacing": 35},
    "sequence": {"useMaxWidth": False, "width": 100, "actorMargin": 25, "messageMargin": 30},
}

# No smart quotes: docutils would turn a flag's "--" into an en dash, and a copied flag would be
# invalid (tests/test_browser.py fails on a rendered "–flag").
smartquotes = False

myst_enable_extensions = ["colon_fence", "deflist", "attrs_inline"]
myst_fence_as_directive = ["mermaid"]
myst_heading_anchors = 3

autosummary_generate = True
# API pages: the page's table of contents lists members by their own names (``load_state_dict``,
# not ``FullyShardedModule.load_state_dict`` cut to fit the sidebar), and a signature longer
# than a code line breaks one argument per line.
toc_object_entries_show_parents = "hide"
maximum_signature_line_length = 88
autodoc_typehints = "description"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

nitpicky = True
OFFLINE = os.environ.get("MFSDP_DOCS_OFFLINE", "1") != "0"
if OFFLINE:
    intersphinx_mapping: dict = {}
    # Without the inventories, names from the standard library and torch cannot be resolved.
    nitpick_ignore_regex = [
        ("py:.*", r"(torch|nn|dist|os|collections|typing|pathlib|argparse|dataclasses|enum)\..*"),
        ("py:.*", r"(Path|Callable|Any|Iterable|Iterator|Sequence|Mapping|optional|TextIO|Module)"),
    ]
else:
    intersphinx_mapping = {
        "python": ("https://docs.python.org/3", None),
        "torch": ("https://docs.pytorch.org/docs/stable", None),
    }
    # Aliases in our signatures (nn., dist.) are not in the inventories under those names.
    nitpick_ignore_regex = [("py:.*", r"(nn|dist)\..*"), ("py:.*", r"(optional|TextIO|Module)")]

# Names our own annotations use unqualified (``from __future__ import annotations``); the objects
# are documented under their public names in the API reference.
nitpick_ignore = [("py:class", "ParallelLayout"), ("py:class", "EngineOptions"), ("py:class", "ShardingStrategy"), ("py:class", "MixedPrecisionPolicy"), ("py:class", "ShardingState"), ("py:class", "ProcessGroups"), ("py:class", "CommLog"), ("py:class", "Communicator"), ("py:class", "DeviceMesh"), ("py:class", "Handle")]

sphinx_gallery_conf = {
    "examples_dirs": ["recipes"],
    "gallery_dirs": ["docs/recipes"],
    "filename_pattern": r"/plot_",
    "ignore_pattern": r"/_",
    "download_all_examples": False,
    "remove_config_comments": True,
    "matplotlib_animations": False,
    "within_subsection_order": "gallery_order.LearningPath",  # docs/_ext: the learning path
    "abort_on_example_error": False,  # -W turns each failing recipe into an error anyway
    "only_warn_on_example_error": False,
    "show_memory": False,
    "run_stale_examples": True,  # set per build by _recipe_cache below
    "capture_repr": (),
    # before each recipe runs: record when, on what machine and with which versions it ran
    # (docs/_ext/measured.py puts that line under the recipe's title)
    "reset_modules": ("matplotlib", "measured.stamp_recipe"),
    # matplotlib's scraper, after a check of every figure (docs/_ext/recipe_figures.py): an empty
    # axes or a legend over a label is a warning, an error under -W
    "image_scrapers": ("recipe_figures.checked_matplotlib_scraper",),  # show what recipes print, not the repr of a last expression
}

html_theme = "pydata_sphinx_theme"
html_title = "mfsdp user guide"
html_theme_options = {
    "navigation_with_keys": False,
    "header_links_before_dropdown": 4,
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
    # The header keeps the logo, search and theme switch; the left sidebar carries the guide's
    # navigation (docs/_templates/sidebar-guide.html), on every page including the landing page.
    "navbar_center": [],
}
html_sidebars = {"**": ["sidebar-guide"]}
copybutton_prompt_text = r">>> |\.\.\. |\$ "
copybutton_prompt_is_regexp = True
# a console block's command continues on the lines after a trailing backslash: copy them too
# (they carry no prompt); its output lines are left out (tests/test_docs_console.py)
copybutton_line_continuation_character = "\\"


def _redirect_root(app, exception):
    """Write ``index.html`` at the top of the build that forwards to the guide's landing page."""
    if exception is None and app.builder.format == "html":
        Path(app.outdir, "index.html").write_text(
            '<!doctype html><meta charset="utf-8"><title>mfsdp</title>'
            '<meta http-equiv="refresh" content="0; url=docs/index.html">'
            '<a href="docs/index.html">mfsdp user guide</a>\n')


# Recipe cache. Recipes import mfsdp, so sphinx-gallery's own check (a recipe is re-run when its
# file changed) is not enough on its own: a digest of everything a recipe can depend on (the mfsdp
# package, the recipes folder, the Python and torch versions) is kept next to the gallery output.
# Same digest as the last build that executed the recipes: unchanged recipes keep their results
# (sphinx-gallery re-runs only the ones whose file changed). Another digest, or no record: every
# recipe runs. A build that does not execute recipes (plot_gallery=0) removes the record, since it
# overwrites the gallery's pages without outputs.
_RECIPE_DIGEST = ROOT / "docs" / "recipes" / ".inputs-digest"


def _recipe_inputs_digest() -> str:
    import hashlib

    import torch

    h = hashlib.sha256(f"{sys.version}|{torch.__version__}".encode())
    for base in ("mfsdp", "recipes"):
        for path in sorted((ROOT / base).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                h.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _executes_recipes(config) -> bool:
    return str(config.sphinx_gallery_conf.get("plot_gallery", True)).lower() not in (
        "0", "false", "no")


def _recipe_cache(app, config):
    if not _executes_recipes(config):
        _RECIPE_DIGEST.unlink(missing_ok=True)
        return
    digest = _recipe_inputs_digest()
    # when this build began: docs/_ext/recipe_times.py tells the recipes it ran from those reused
    _RECIPE_DIGEST.parent.mkdir(parents=True, exist_ok=True)
    (_RECIPE_DIGEST.parent / ".build-started").touch()
    fresh = _RECIPE_DIGEST.exists() and _RECIPE_DIGEST.read_text().strip() == digest
    config.sphinx_gallery_conf["run_stale_examples"] = not fresh
    app._mfsdp_recipe_digest = digest


def _record_recipe_digest(app, exception):
    digest = getattr(app, "_mfsdp_recipe_digest", None)
    if exception is None and digest and app.statuscode == 0:
        _RECIPE_DIGEST.parent.mkdir(parents=True, exist_ok=True)
        _RECIPE_DIGEST.write_text(digest + "\n")


def _no_type_in_attribute_docstrings(app, what, name, obj, options, lines):
    """Our attribute docstrings never start with a type (the annotation gives it): keep napoleon
    from reading the words before a colon on their first line ("MLA: rank of ...") as one."""
    if what in ("attribute", "data", "property") and lines and ":" in lines[0]:
        lines[0] = ": " + lines[0]  # napoleon reads an empty type before the first colon


def setup(app):
    # before napoleon's own handler (priority 500)
    app.connect("autodoc-process-docstring", _no_type_in_attribute_docstrings, priority=400)
    app.connect("build-finished", _redirect_root)
    app.connect("config-inited", _recipe_cache)
    app.connect("build-finished", _record_recipe_digest)
