"""The guide's build-time additions, without a build: links to issues and projects
(docs/_ext/external_links.py) and the measured-on line (docs/_ext/measured.py). The built pages
are checked in Chromium by tests/test_browser.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from docutils import nodes
from docutils.core import publish_doctree

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

import external_links  # noqa: E402
import measured  # noqa: E402


def _links(text: str) -> list[tuple[str, str]]:
    tree = publish_doctree(text)
    external_links.add_links(None, tree, "page")
    return [(n.astext(), n["refuri"]) for n in tree.findall(nodes.reference)]


def test_issue_references_become_links_and_code_stays_code():
    got = _links("See NVIDIA/Megatron-LM#5974 and Megatron-Bridge#4246, not ``a/b#1``.\n\n"
                 "::\n\n   NVIDIA/Megatron-LM#7 in a code block\n")
    assert got == [
        ("NVIDIA/Megatron-LM#5974", "https://github.com/NVIDIA/Megatron-LM/issues/5974"),
        ("Megatron-Bridge#4246", "https://github.com/NVIDIA-NeMo/Megatron-Bridge/issues/4246"),
    ]


def test_a_project_is_linked_once_per_page_unless_the_page_links_it():
    got = _links("torchtitan does X; torchtitan does Y. `Slurm <https://slurm.schedmd.com/>`_ "
                 "and Slurm again. A title:\n\nMegatron-LM\n===========\n\ntext\n")
    assert got == [("torchtitan", external_links.PROJECTS["torchtitan"]),
                   ("Slurm", "https://slurm.schedmd.com/")]


def test_an_unknown_short_repository_name_is_not_guessed():
    assert _links("Somewhere#12 stays text.\n") == []


def test_a_recipe_run_is_stamped_with_date_machine_and_versions(tmp_path, monkeypatch):
    import torch

    import mfsdp

    monkeypatch.setattr(measured, "GALLERY", tmp_path)
    measured.stamp_recipe({}, "recipes/plot_x.py", "before")
    measured.stamp_recipe({}, None, "before")  # entering the gallery: nothing to stamp
    stamp = json.loads((tmp_path / "plot_x.measured.json").read_text())
    assert stamp["torch"] == torch.__version__ and stamp["mfsdp"] == mfsdp.__version__
    assert "CPU cores" in stamp["machine"] and len(stamp["date"]) == 10
    assert [p.name for p in tmp_path.iterdir()] == ["plot_x.measured.json"]
    assert measured.line(stamp, "Ran").startswith(f"Ran {stamp['date']} on ")


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_every_measured_on_directive_gives_every_field(page):
    """A page's ``{mfsdp-measured}`` gives all of date, machine, torch and mfsdp, or none."""
    import datetime
    import re

    text = (ROOT / "docs" / page).read_text()
    for block in re.findall(r"```\{mfsdp-measured\}\n(.*?)```", text, re.S):
        fields = dict(re.findall(r"^:(\w+): (.+)$", block, re.M))
        assert set(fields) in (set(), set(measured.FIELDS)), (page, fields)
        if fields:
            datetime.date.fromisoformat(fields["date"])


def test_text_in_an_autosummary_table_is_linked():
    """autosummary's table is a docutils comment subclass that is rendered: its text is prose."""
    from sphinx.ext.autosummary import autosummary_table

    tree = publish_doctree("Title\n=====\n")
    table = autosummary_table("")
    table += nodes.paragraph("", "", nodes.Text("Start the group: NCCL on GPUs."))
    tree += table
    external_links.add_links(None, tree, "api")
    assert [(n.astext(), n["refuri"]) for n in tree.findall(nodes.reference)] == [
        ("NCCL", external_links.PROJECTS["NCCL"])]


def test_the_layout_table_shows_what_the_search_chose():
    """The layouts page's table (docs/_ext/layout_table.py) for two models on every GPU: each
    cell is ``choose``'s (and ``why``'s) for its row, and the table parses to a docutils table
    with a header row and one row per model and GPU."""
    import layout_table
    from cli_reference import rst_nodes

    from mfsdp.tools.plan import GiB
    from mfsdp.tools.plan_cli import TIGHT_GIB
    from mfsdp.tools.plan_layouts import GPUS, NODE_GPUS, choose, why

    models = (("llama3-8b", 8192), ("llama3-70b", 8192))
    cells = layout_table.rows(models)
    assert len(cells) == len(models) * len(GPUS)
    batch = 512  # the Llama presets' global batch (mfsdp/tools/sbatch/presets.py)
    for row, ((name, seq), gpu) in zip(cells, [(m, g) for m in models for g in GPUS]):
        c = choose(name, seq, *GPUS[gpu], spare_gib=TIGHT_GIB, global_batch=batch)
        lay = c.layout
        assert batch % (lay.world_size // (lay.tp * lay.cp)) == 0
        assert dict(zip(layout_table.HEADER, row)) == {
            "model": name, "sequence": str(seq), "global batch": str(batch), "GPU": gpu,
            "GPUs (nodes)": f"{lay.world_size} ({lay.world_size // NODE_GPUS[gpu]})",
            "TP": str(lay.tp), "CP": str(lay.cp), "EP": str(lay.ep),
            "recompute": lay.recompute_granularity or "none",
            "GiB/GPU": f"{c.total / GiB:.1f}",
            "spare": f"{(GPUS[gpu][0] - 4 - c.total / GiB):.1f}",
            "why": why(name, seq, gpu)}
    assert cells[0][-1].startswith("CP 1 ")  # the 8B H100 row: why CP 2 (what CP 1 needs)
    [table] = rst_nodes(layout_table.rst_table(cells))
    assert isinstance(table, nodes.table) and "mfsdp-layout-table" in table["classes"]
    body = [[entry.astext() for entry in row.findall(nodes.entry)]
            for row in table.findall(nodes.row)]
    assert body[0] == list(layout_table.HEADER)
    assert body[1:] == [list(r) for r in cells]
    # the Transformer Engine table: the same search planning Megatron-LM's layer, without "why"
    te = layout_table.rows(models[1:], ("H100",), "transformer_engine")
    c = choose("llama3-70b", 8192, *GPUS["H100"], spare_gib=TIGHT_GIB, global_batch=batch,
               transformer_impl="transformer_engine")
    assert te == [("llama3-70b", "8192", str(batch), "H100",
                   f"{c.layout.world_size} ({c.layout.world_size // 8})", str(c.layout.tp),
                   str(c.layout.cp), str(c.layout.ep), c.recompute, f"{c.total / GiB:.1f}",
                   f"{80 - 4 - c.total / GiB:.1f}")]
    [table] = rst_nodes(layout_table.rst_table(te))
    assert [e.astext() for e in next(table.findall(nodes.row)).findall(nodes.entry)] == \
        list(layout_table.HEADER[:-1])
    with pytest.raises(ValueError, match="transformer-impl"):
        layout_table._impl("te")
