"""Sphinx directive ``mfsdp-layout-table``: the "Which layout for my model" table, built when the
guide is built from :mod:`mfsdp.tools.plan_layouts` (the search the page's doctest prints).

Usage in MyST::

    ```{mfsdp-layout-table}
    ```

One row per (model, sequence length) of ``ROWS`` and GPU of ``GPUS``: the layout
:func:`~mfsdp.tools.plan_layouts.choose` finds with ``mfsdp plan``'s tight margin to spare, and
in the last column :func:`~mfsdp.tools.plan_layouts.why`, what the search tried that explains it.
:func:`rows` and :func:`rst_table` need no Sphinx; ``tests/test_docs_extensions.py`` calls them.
"""

from __future__ import annotations

from pathlib import Path

from docutils import nodes
from cli_reference import rst_nodes  # docs/_ext: the same strict rst parsing
from sphinx.util.docutils import SphinxDirective

HEADER = ("model", "sequence", "GPU", "GPUs (nodes)", "TP", "CP", "EP", "recompute", "GiB/GPU",
          "spare", "why")
"""The table's columns."""

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("plan_layouts.py", "plan.py", "plan_terms.py", "plan_time.py", "plan_cli.py")
"""The planner's modules (in ``mfsdp/tools``) the table depends on: a change rebuilds the page."""


def rows(table_rows=None, gpus=None) -> list[tuple[str, ...]]:
    """The cells of each row, as text: ``table_rows`` (default ``ROWS``) by ``gpus`` (default
    every key of ``GPUS``), in the order of the page's doctest."""
    from mfsdp.tools.plan import GiB
    from mfsdp.tools.plan_cli import TIGHT_GIB
    from mfsdp.tools.plan_layouts import GPUS, NODE_GPUS, ROWS, choose, why

    out = []
    for name, seq in table_rows or ROWS:
        for gpu_name in gpus or tuple(GPUS):
            device_gib, gpu = GPUS[gpu_name]
            c = choose(name, seq, device_gib, gpu, spare_gib=TIGHT_GIB)
            if c is None:
                out.append((name, str(seq), gpu_name, *[""] * 7, why(name, seq, gpu_name)))
                continue
            lay = c.layout
            out.append((name, str(seq), gpu_name,
                        f"{lay.world_size} ({lay.world_size // NODE_GPUS[gpu_name]})",
                        str(lay.tp), str(lay.cp), str(lay.ep), c.recompute,
                        f"{c.total / GiB:.1f}", f"{c.spare_gib:.1f}", why(name, seq, gpu_name)))
    return out


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("*", "\\*").replace("|", "\\|") or " "


def rst_table(cells: list[tuple[str, ...]]) -> str:
    """``cells`` (from :func:`rows`) as a reStructuredText list-table under :data:`HEADER`."""
    lines = [".. list-table::", "   :header-rows: 1", "   :class: mfsdp-layout-table", ""]
    for row in [HEADER, *cells]:
        lines.append(f"   * - {_cell(row[0])}")
        lines += [f"     - {_cell(text)}" for text in row[1:]]
    return "\n".join(lines)


class LayoutTable(SphinxDirective):
    """The table, where the directive stands."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        self.env.note_dependency(str(Path(__file__)))
        for name in SOURCES:
            self.env.note_dependency(str(ROOT / "mfsdp" / "tools" / name))
        return rst_nodes(rst_table(rows()))


def setup(app):
    app.add_directive("mfsdp-layout-table", LayoutTable)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
