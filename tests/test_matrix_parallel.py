"""The compatibility matrix's table of tensor, sequence, context and expert parallelism
(``mfsdp.check.matrix_parallel``, ``docs/compatibility.md``): its measured cells agree with plain
``mfsdp check`` runs of the same layouts and with the docs build's cached data; a refused cell is
rendered in the API's words and, re-measured, is still refused with that message."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import mfsdp
from mfsdp.check.matrix_parallel import (PARALLEL, measure_parallel, parallel_combinations,
                                         parallel_layout, render_parallel_table)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
import compat_matrix  # noqa: E402  (docs/_ext: the page's extension)


def _cells(data):
    return {(c["strategy"], c["parallel"]): c for c in data["cells"]}


def _cached() -> dict | None:
    """The docs build's cached table, when it was measured for this source."""
    if not compat_matrix.CACHE_PARALLEL.exists():
        return None
    cached = json.loads(compat_matrix.CACHE_PARALLEL.read_text())
    return cached["data"] if cached["digest"] == compat_matrix.inputs_digest() else None


def test_every_column_is_a_layout_of_mfsdp_check():
    from mfsdp.check.layouts import LAYOUTS

    for strategy, parallel in parallel_combinations():
        layout = parallel_layout(strategy, parallel)
        assert layout.strategy == strategy and layout.parallel
        twin = {"TP2": "tp", "TP2+SP": "tp_sp", "CP2": "cp"}.get(parallel, "ep")
        for field in ("tp", "sequence_parallel", "cp", "ep"):
            assert getattr(layout, field) == getattr(LAYOUTS[twin], field), (parallel, field)
    assert [p for p in PARALLEL if p.startswith("EP2")] == [
        "EP2 allgather", "EP2 alltoall", "EP2 flex"]


def test_a_refusal_is_rendered_in_the_apis_words():
    data = {"models": {"dense": "llama-tiny"}, "nproc": 4, "steps": 2, "lr": 0.1, "launches": 1,
            "seconds": 1.0, "cpu_seconds": 1.0,
            "cells": [{"strategy": "optim", "parallel": "TP2", "status": "refused",
                       "message": "tp_dim= needs zero_dp_strategy='x'"},
                      {"strategy": "optim", "parallel": "CP2", "status": "works", "message": "",
                       "worst_param_error": 2e-6}]}
    markdown, rst = render_parallel_table(data), compat_matrix.rst_parallel_table(data)
    assert "refused: tp_dim= needs zero_dp_strategy='x'" in markdown
    assert "refused [1]" in rst and "[1] refused: tp_dim= needs zero_dp_strategy='x'" in rst
    assert "works (2e-06)" in markdown and "works (2e-06)" in rst


def test_a_cell_outside_the_table_is_an_error():
    with pytest.raises(ValueError, match=r"cells=\('optim', 'TP3'\) is not a combination"):
        measure_parallel(cells=[("optim", "TP3")])


def _agree(cells: dict[tuple[str, str], str]) -> dict:
    """Measure ``cells`` and run their layouts with plain ``mfsdp.check`` at 4 ranks: the same
    verdict and worst parameter error; and the same as the page's cache when it is current."""
    data = measure_parallel(cells=list(cells))
    measured = _cells(data)
    for combo, name in cells.items():
        model = "deepseek-proxy" if name == "ep" else "llama-tiny"
        report = mfsdp.check.check(model, nproc=4, steps=2, optimizer="sgd", lr=0.1, layouts=[name],
                             progress=None)
        (result,) = report.layouts
        cell = measured[combo]
        assert cell["status"] == ("works" if result.passed else "fails"), (cell, result.reason)
        assert cell["status"] == "works", cell
        worst = max(s.worst_param_error for s in result.steps)
        assert cell["worst_param_error"] == pytest.approx(worst, rel=1e-3), combo
    page = _cached()
    if page is not None:
        for combo in cells:
            assert _cells(page)[combo]["status"] == measured[combo]["status"], combo
    return data


@pytest.mark.extended  # two launches of 4 ranks: 26 s on a busy 2-core machine
def test_the_tp_cell_agrees_with_plain_mfsdp_check():
    _agree({("optim_grads_params", "TP2"): "tp"})


@pytest.mark.extended  # two launches of 4 ranks and two runs of mfsdp check: about a minute
def test_the_tp_and_ep_cells_agree_with_plain_mfsdp_check():
    _agree({("optim_grads_params", "TP2"): "tp", ("optim_grads_params", "EP2 alltoall"): "ep"})


@pytest.mark.extended  # the whole table: two launches of 4 ranks
def test_every_cell_of_the_page_holds_when_measured_again():
    data = measure_parallel()
    assert len(data["cells"]) == len(parallel_combinations())
    assert all(c["status"] != "fails" for c in data["cells"]), render_parallel_table(data)
    page = _cached()
    if page is not None:  # a refusal the API no longer raises, or a works cell that fails
        measured = _cells(data)
        for combo, cell in _cells(page).items():
            assert measured[combo]["status"] == cell["status"], combo
            assert measured[combo]["message"] == cell["message"], combo
