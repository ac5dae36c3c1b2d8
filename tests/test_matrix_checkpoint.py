"""The compatibility matrix's checkpoint table (``mfsdp.check.matrix_checkpoint``,
``docs/compatibility.md``): every strategy's checkpoint reloaded on another strategy and taken to
Megatron-LM's and Hugging Face's formats and back continues the single-process run; a conversion
that breaks turns its cell to ``fails`` with ``mfsdp convert``'s own error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mfsdp.check.matrix_checkpoint import (RELOAD_AS, ROUTES, checkpoint_combinations,
                                           measure_checkpoints, render_checkpoint_table)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
import compat_matrix  # noqa: E402  (docs/_ext: the page's extension)


def test_every_strategy_is_reloaded_as_another():
    assert set(RELOAD_AS) == set(RELOAD_AS.values())
    assert all(a != b for a, b in RELOAD_AS.items())
    assert len(checkpoint_combinations()) == 4 * len(ROUTES)


def test_a_conversion_that_fails_is_a_failed_cell_with_converts_error():
    """The toy model is no trainer preset, so ``mfsdp convert --model-preset`` refuses it: the
    cell fails and says which conversion exited and why."""
    data = measure_checkpoints(cells=[("optim", "HF round trip")],
                               model="mfsdp.check.faults:tiny")
    (cell,) = data["cells"]
    assert cell["status"] == "fails"
    assert "mfsdp convert --from fsdp_dtensor --to hf exited 2" in cell["message"]
    assert "fails" in render_checkpoint_table(data)


@pytest.mark.extended  # three launches of 4 ranks and 16 conversions: about 75 s
def test_every_cell_of_the_page_holds_when_measured_again():
    data = measure_checkpoints()
    assert [c["status"] for c in data["cells"]] == ["works"] * len(checkpoint_combinations()), \
        render_checkpoint_table(data)
    rst = compat_matrix.rst_checkpoint_table(data)
    assert rst.count("works (") == len(checkpoint_combinations())
    if compat_matrix.CACHE_CHECKPOINT.exists():
        cached = json.loads(compat_matrix.CACHE_CHECKPOINT.read_text())
        if cached["digest"] == compat_matrix.inputs_digest():
            assert {(c["strategy"], c["route"]): c["status"] for c in cached["data"]["cells"]} \
                == {(c["strategy"], c["route"]): c["status"] for c in data["cells"]}
