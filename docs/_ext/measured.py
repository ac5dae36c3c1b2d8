"""When, where and with what the numbers on a page were measured: one line, generated at build.

Recipes: every recipe runs at build time and shows what it measured. Before sphinx-gallery runs
one, :func:`stamp_recipe` (a ``reset_modules`` callable in ``conf.py``) writes
``docs/recipes/<recipe>.measured.json``: the date, this machine's CPU model and cores, its GPU if
it has one, and the torch and mfsdp versions. A recipe reused from an earlier build keeps the
stamp of the run that made its output. The line goes under the recipe page's title.

Guide pages: the directive marks a page whose numbers were measured, where the line should go::

    ```{mfsdp-measured}
    ```

Without options the numbers are measured by this build (a generated table), and the line gives
this build's date and machine. Numbers measured once and written into the page give what was
recorded when they were measured, every field required::

    ```{mfsdp-measured}
    :date: 2026-11-25
    :machine: one NVIDIA H100 80GB HBM3 (driver 580.159.04)
    :torch: 2.11.0 (CUDA 13.0)
    :mfsdp: 0.1.0
    ```

The line is a ``<p class="mfsdp-measured">`` (``tests/test_browser.py`` looks for it on every page
that shows measured numbers).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.util.docutils import SphinxDirective

ROOT = Path(__file__).resolve().parents[2]
GALLERY = ROOT / "docs" / "recipes"
FIELDS = ("date", "machine", "torch", "mfsdp")


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def this_machine() -> dict[str, str]:
    """The stamp of a measurement made now, here."""
    import torch

    import mfsdp

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    machine = f"{_cpu()}, {cores} CPU cores"
    if torch.cuda.is_available():
        machine += f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    else:
        machine += ", no GPU"
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "machine": machine, "torch": torch.__version__, "mfsdp": mfsdp.__version__}


def line(stamp: dict[str, str], verb: str = "Measured") -> str:
    """The sentence a page shows for ``stamp``."""
    return (f"{verb} {stamp['date']} on {stamp['machine']}; torch {stamp['torch']}, "
            f"mfsdp {stamp['mfsdp']}.")


def paragraph(text: str) -> nodes.paragraph:
    """The measured-on line as a paragraph of class ``mfsdp-measured``."""
    para = nodes.paragraph(text, text)
    para["classes"].append("mfsdp-measured")
    return para


def stamp_recipe(gallery_conf, fname, when) -> None:
    """sphinx-gallery's ``reset_modules`` hook, called before each recipe runs: record the run."""
    if fname is None:
        return
    GALLERY.mkdir(parents=True, exist_ok=True)
    (GALLERY / f"{Path(fname).stem}.measured.json").write_text(json.dumps(this_machine()))


class Measured(SphinxDirective):
    """The measured-on line of a guide page."""

    has_content = False
    option_spec = {name: directives.unchanged_required for name in FIELDS}

    def run(self) -> list[nodes.Node]:
        given = {k: v for k, v in self.options.items() if k in FIELDS}
        if given and set(given) != set(FIELDS):
            missing = ", ".join(f":{f}:" for f in FIELDS if f not in given)
            raise self.error(f"mfsdp-measured: give all of :date:, :machine:, :torch:, :mfsdp: "
                             f"(missing {missing}), or none for numbers this build measures")
        if given:
            try:
                datetime.date.fromisoformat(given["date"])
            except ValueError:
                raise self.error(f"mfsdp-measured: :date: {given['date']!r} is not YYYY-MM-DD")
        return [paragraph(line(given or this_machine()))]


def _recipe_pages(app, doctree) -> None:
    """Put the stamp of a recipe's last run under its page's title."""
    name = Path(app.env.docname).name
    if not (app.env.docname.startswith("docs/recipes/") and name.startswith("plot_")):
        return
    stamp = GALLERY / f"{name}.measured.json"
    if not stamp.exists():
        from sphinx.util import logging

        logging.getLogger(__name__).warning(
            f"{name}: no record of its last run ({stamp.name}): build with the recipes "
            "executed (plot_gallery=1)", location=app.env.docname)
        return
    section = next(iter(doctree.findall(nodes.section)), None)
    if section is None:
        return
    title = next(iter(section.findall(nodes.title)))
    title.parent.insert(title.parent.index(title) + 1,
                        paragraph(line(json.loads(stamp.read_text()), "Ran")))


def setup(app):
    app.add_directive("mfsdp-measured", Measured)
    app.connect("doctree-read", _recipe_pages)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
