"""Sphinx directive ``mfsdp-layout-table``: the "Which layout for my model" table, built when the
guide is built from :mod:`mfsdp.tools.plan_layouts` (the search the page's doctest prints).

Usage in MyST::

    ```{mfsdp-layout-table}
    ```

    ```{mfsdp-layout-table}
    :transformer-impl: transformer_engine
    ```

One row per (model, sequence length) of ``ROWS`` and GPU of ``GPUS``: the layout
:func:`~mfsdp.tools.plan_layouts.choose` finds with ``mfsdp plan``'s tight margin to spare, and
in the last column :func:`~mfsdp.tools.plan_layouts.why`, what the search tried that explains it.
With ``:transformer-impl: transformer_engine``: the same search planning Megatron-LM's
Transformer Engine layer, without the last column.
:func:`rows` and :func:`rst_table` need no Sphinx; ``tests/test_docs_extensions.py`` calls them.
"""

from __future__ import annotations

from pathlib import Path

from docutils import nodes
from cli_reference import rst_nodes  # docs/_ext: the same strict rst parsing
from sphinx.util.docutils import SphinxDirective

HEADER = ("model", "sequence", "global batch", "GPU", "GPUs (nodes)", "TP", "CP", "EP",
          "recompute", "GiB/GPU", "spare", "why")
"""The table's columns (the Transformer Engine table's: all but ``why``)."""

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("plan_layouts.py", "plan.py", "plan_terms.py", "plan_time.py", "plan_cli.py",
           "sbatch/presets.py")
"""The planner's modules (in ``mfsdp/tools``) the table depends on: a change rebuilds the page."""


def rows(table_rows=None, gpus=None, transformer_impl="local") -> list[tuple[str, ...]]:
    """The cells of each row, as text: ``table_rows`` (default ``ROWS``) by ``gpus`` (default
    every key of ``GPUS``), in the order of the page's doctest. ``transformer_impl``: the layer
    planned; ``why`` only for ``local``, the search's own."""
    from mfsdp.tools.plan import GiB
    from mfsdp.tools.plan_layouts import GLOBAL_BATCH, GPUS, NODE_GPUS, ROWS, row, why

    out = []
    for name, seq in table_rows or ROWS:
        for gpu_name in gpus or tuple(GPUS):
            c = row(name, seq, gpu_name, transformer_impl=transformer_impl)
            head = (name, str(seq), str(GLOBAL_BATCH[name]), gpu_name)
            reason = (why(name, seq, gpu_name),) if transformer_impl == "local" else ()
            if c is None:
                out.append((*head, *[""] * 7, *reason))
                continue
            lay = c.layout
            out.append((*head, f"{lay.world_size} ({lay.world_size // NODE_GPUS[gpu_name]})",
                        str(lay.tp), str(lay.cp), str(lay.ep), c.recompute,
                        f"{c.total / GiB:.1f}", f"{c.spare_gib:.1f}", *reason))
    return out


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("*", "\\*").replace("|", "\\|") or " "


def rst_table(cells: list[tuple[str, ...]]) -> str:
    """``cells`` (from :func:`rows`) as a reStructuredText list-table under :data:`HEADER` (less
    ``why`` where the cells have no such column)."""
    lines = [".. list-table::", "   :header-rows: 1", "   :class: mfsdp-layout-table", ""]
    header = HEADER if not cells or len(cells[0]) == len(HEADER) else HEADER[:-1]
    for row in [header, *cells]:
        lines.append(f"   * - {_cell(row[0])}")
        lines += [f"     - {_cell(text)}" for text in row[1:]]
    return "\n".join(lines)


class LayoutTable(SphinxDirective):
    """The table, where the directive stands."""

    has_content = False
    option_spec = {"transformer-impl": lambda v: _impl(v)}

    def run(self) -> list[nodes.Node]:
        self.env.note_dependency(str(Path(__file__)))
        for name in SOURCES:
            self.env.note_dependency(str(ROOT / "mfsdp" / "tools" / name))
        impl = self.options.get("transformer-impl", "local")
        return rst_nodes(rst_table(rows(transformer_impl=impl)))


def _impl(value: str | None) -> str:
    """The directive's ``:transformer-impl:`` option, checked against the planner's names."""
    from mfsdp.tools.plan_terms import TRANSFORMER_IMPLS

    value = (value or "").strip()
    if value not in TRANSFORMER_IMPLS:
        raise ValueError(f":transformer-impl: {value!r} is not one of {TRANSFORMER_IMPLS}; "
                         "pick one")
    return value


def setup(app):
    app.add_directive("mfsdp-layout-table", LayoutTable)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
