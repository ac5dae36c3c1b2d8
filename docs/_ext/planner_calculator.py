"""Sphinx directive ``mfsdp-planner-calculator``: the planner page's interactive calculator.

Usage in MyST::

    ```{mfsdp-planner-calculator}
    ```

The directive writes the form (one drop-down list per input of
:data:`mfsdp.tools.plan_export.GRID`) and an empty result; ``docs/_static/mfsdp-planner.js``
fills the result in the browser from ``_static/planner-tables.json``, which this extension writes
at build time from :func:`mfsdp.tools.plan_export.export`: the planner's own numbers, looked up,
never recomputed by a second implementation.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

TABLES = "planner-tables.json"

LABELS = {
    "preset": "Model",
    "world_size": "GPUs (world size)",
    "strategy": "Sharding strategy",
    "dp_outer": "Outer size (outer data-parallel groups)",
    "outer_strategy": "Outer sharding (no_shard: HSDP, optim: HFSDP)",
    "tp": "Tensor parallel (TP)",
    "cp": "Context parallel (CP)",
    "ep": "Expert parallel (EP)",
    "sequence_parallel": "Sequence parallel (SP)",
    "micro_batch": "Micro-batch (sequences)",
    "seq_length": "Sequence length (tokens)",
    "recompute": "Recompute",
}
DEFAULTS = {"preset": "llama3-8b", "world_size": 64, "seq_length": 4096}  # mfsdp plan's


def _option(value, selected: bool) -> str:
    text = {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value
    data = json.dumps(value)
    return (f'<option value="{html.escape(data)}"{" selected" if selected else ""}>'
            f"{html.escape(str(text))}</option>")


def form_html() -> str:
    """The calculator's form and its (empty) result, as HTML."""
    from mfsdp.tools.plan_export import GRID

    fields = []
    for name, values in GRID.items():
        default = DEFAULTS.get(name, values[0])
        options = "".join(_option(v, v == default) for v in values)
        fields.append(f'<label class="mfsdp-calc-field"><span>{LABELS[name]}</span>'
                      f'<select name="{name}">{options}</select></label>')
    return (f'<div class="mfsdp-calculator" data-tables="{TABLES}">'
            f'<form class="mfsdp-calc-inputs">{"".join(fields)}</form>'
            '<div class="mfsdp-calc-result" aria-live="polite">'
            # the script writes "Loading the planner's tables..." here when it starts, then the
            # result, or the file it could not load; without JavaScript only this shows
            "<noscript><p>The calculator needs JavaScript; without it, run <code>mfsdp plan"
            "</code>.</p></noscript>"
            "</div></div>")


class PlannerCalculator(SphinxDirective):
    """The calculator, where the directive stands."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        self.env.note_dependency(str(Path(__file__)))
        return [nodes.raw("", form_html(), format="html")]


def _write_tables(app, exception) -> None:
    if exception is not None or app.builder.format != "html":
        return
    from mfsdp.tools.plan_export import export

    static = Path(app.outdir) / "_static"
    static.mkdir(parents=True, exist_ok=True)
    (static / TABLES).write_text(json.dumps(export(), separators=(",", ":")))


def setup(app):
    app.add_directive("mfsdp-planner-calculator", PlannerCalculator)
    app.connect("build-finished", _write_tables)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
