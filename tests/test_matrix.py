"""The compatibility matrix (``mfsdp.check.matrix``, ``docs/compatibility.md``): its refused cells
are exactly what the public ``mfsdp.fully_shard`` refuses, with the same message, and what
upstream ``megatron_fsdp.fully_shard_model`` refuses (an independent source); its measured
cells agree with plain ``mfsdp check`` runs of the same layouts and with the docs build's cached
data; a broken model makes it say **fails**."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import mfsdp
from mfsdp.check.matrix import OUTERS, combinations, measure_matrix, refusal, render_table
from mfsdp.launch import launch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
import compat_matrix  # noqa: E402  (docs/_ext: the page's extension)

TINY = "mfsdp.check.faults:tiny"


def _api_refuses(strategy: str, outer: str, precision: str) -> str | None:
    """What the public ``mfsdp.fully_shard`` says, asked without a process group: its
    ``ValueError`` (refused) or ``None`` when validation passed and it asked for the group."""
    module = nn.Linear(4, 4)
    if precision == "bf16":  # a bf16 model with fp32 main weights and gradients
        module = module.to(torch.bfloat16)
        policy = mfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32,
                                            main_grads_dtype=torch.float32)
    elif precision == "bf16_comm":
        policy = mfsdp.MixedPrecisionPolicy(grad_comm_dtype=torch.bfloat16)
    else:
        policy = mfsdp.MixedPrecisionPolicy()
    outer_strategy = "optim" if outer == "HFSDP" else "no_shard"
    try:
        mfsdp.fully_shard(module, zero_dp_strategy=strategy,
                          outer_dp_sharding_strategy=outer_strategy,
                          mixed_precision_policy=policy)
    except ValueError as exc:
        return str(exc)
    except RuntimeError as exc:
        assert "initialised process group" in str(exc), exc
        return None
    raise AssertionError("fully_shard built a model without a process group")


def _upstream_refuses(combos: list[tuple[str, str, str]]) -> list[str | None]:
    """Inside a launched rank (a one-rank gloo group): what upstream ``megatron_fsdp``'s
    ``fully_shard_model`` says of each combination, given a CPU ``DeviceMesh`` with an outer, a
    shard and a TP dimension: its ``ValueError`` (refused) or ``None`` when its validation passed
    (it then builds, or on a machine without CUDA stops at the first CUDA call)."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore")  # (Transformer Engine and Apex are not installed)
    from megatron_fsdp import MixedPrecisionPolicy, fully_shard_model

    mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("outer", "shard", "tp"))
    hybrid = mesh["outer", "shard"]._flatten().get_group()
    said = []
    for strategy, outer, precision in combos:
        dp_outer, outer_strategy = OUTERS[outer]
        hsdp = dict(dp_outer_dim="outer", hybrid_fsdp_group=hybrid) if dp_outer > 1 else {}
        if precision == "bf16":
            policy = MixedPrecisionPolicy(main_params_dtype=torch.float32,
                                          main_grads_dtype=torch.float32)
        else:
            policy = MixedPrecisionPolicy(
                grad_comm_dtype=torch.bfloat16 if precision == "bf16_comm" else None)
        try:
            fully_shard_model(nn.Linear(4, 4), device_mesh=mesh, dp_shard_dim="shard",
                              tp_dim="tp", zero_dp_strategy=strategy,
                              outer_dp_sharding_strategy=outer_strategy,
                              mixed_precision_policy=policy, **hsdp)
            said.append(None)
        except ValueError as exc:
            said.append(str(exc))
        except AssertionError as exc:  # past validation, at the first CUDA call
            assert not torch.cuda.is_available() and "CUDA" in str(exc), exc
            said.append(None)
    return said


def test_refused_cells_are_exactly_what_the_api_refuses():
    assert not torch.distributed.is_initialized()
    said = {combo: _api_refuses(*combo) for combo in combinations()}
    assert {combo: refusal(*combo) for combo in combinations()} == said
    refused = [c for c, message in said.items() if message]
    assert refused and len(refused) < len(said)  # the matrix has both kinds of cell


def test_refused_cells_are_exactly_what_upstream_refuses():
    """The independent check of the table: upstream Megatron-FSDP, asked each combination on a
    real (one-rank gloo) process group, refuses the same cells (with its own words: "...
    requires zero_dp_strategy to use FSDP ('optim_grads_params', 3) ...")."""
    combos = combinations()
    upstream = dict(zip(combos, launch(_upstream_refuses, 1, args=(combos,), timeout=300)[0]))
    assert {c for c, m in upstream.items() if m} == {c for c in combos if refusal(*c)}
    assert all("optim_grads_params" in m for m in upstream.values() if m)


def test_the_page_shows_each_refusal_in_the_apis_words():
    refused = [c for c in combinations() if refusal(*c)]
    data = measure_matrix(TINY, cells=refused)  # refusals only: nothing is launched
    assert data["launches"] == 0
    markdown, rst = render_table(data), compat_matrix.rst_table(data)
    for cell in data["cells"]:
        assert cell["status"] == "refused"
        assert f"refused: {cell['message']}" in markdown
        assert f"refused: {cell['message']}" in rst


def test_a_cell_outside_the_matrix_is_an_error():
    with pytest.raises(ValueError, match=r"cells=\('zero3', 'none', 'fp32'\) is not a combination"):
        measure_matrix(TINY, cells=[("zero3", "none", "fp32")])


def test_the_cache_is_reused_for_the_same_digest_and_remeasured_for_another(tmp_path):
    cache, calls = tmp_path / "matrix.json", []

    def measure():
        calls.append(1)
        return {"n": len(calls)}

    def load(digest):
        data, measured = compat_matrix.load_or_measure(cache, digest, measure)
        stamp = data.pop("measured_on")  # when, where and with what (docs/_ext/measured.py)
        assert set(stamp) == {"date", "machine", "torch", "mfsdp"}, stamp
        return data, measured

    assert load("a") == ({"n": 1}, True)
    assert load("a") == ({"n": 1}, False)
    assert load("b") == ({"n": 2}, True)
    assert json.loads(cache.read_text())["digest"] == "b"


def test_the_digest_follows_the_package_source(tmp_path):
    (tmp_path / "mfsdp").mkdir()
    (tmp_path / "mfsdp" / "a.py").write_text("x = 1\n")
    before = compat_matrix.inputs_digest(tmp_path)
    assert compat_matrix.inputs_digest(tmp_path) == before
    (tmp_path / "mfsdp" / "a.py").write_text("x = 2\n")
    assert compat_matrix.inputs_digest(tmp_path) != before


# HSDP, HFSDP and bf16 gradient communication, each a layout of plain ``mfsdp check`` too
AGREE = {("optim_grads_params", "HSDP", "fp32"): "hsdp",
         ("optim_grads_params", "HFSDP", "fp32"): "hfsdp",
         ("optim_grads_params", "none", "bf16_comm"): "bf16_comm"}


def _cells(data):
    return {(c["strategy"], c["outer"], c["precision"]): c for c in data["cells"]}


def _agree(cells: dict[tuple[str, str, str], str]) -> None:
    """Measure ``cells`` with the matrix and their layouts with plain ``mfsdp.check``: the same
    verdict and worst parameter error; and the same as the page's cached data, when the build
    has measured it for this source."""
    matrix = _cells(measure_matrix(TINY, steps=2, cells=list(cells)))
    report = mfsdp.check.check(TINY, nproc=4, steps=2, optimizer="sgd", lr=0.1,
                         layouts=list(cells.values()), progress=None)
    by_name = {r.name: r for r in report.layouts}
    for combo, name in cells.items():
        cell, result = matrix[combo], by_name[name]
        assert cell["status"] == ("works" if result.passed else "fails"), (cell, result.reason)
        assert cell["status"] == "works", cell
        worst = max(s.worst_param_error for s in result.steps)
        assert cell["worst_param_error"] == pytest.approx(worst, rel=1e-3), combo
    if compat_matrix.CACHE.exists():
        cached = json.loads(compat_matrix.CACHE.read_text())
        if cached["digest"] == compat_matrix.inputs_digest():
            page = _cells(cached["data"])
            for combo in cells:
                assert page[combo]["status"] == matrix[combo]["status"], combo
                assert page[combo]["worst_param_error"] == pytest.approx(
                    matrix[combo]["worst_param_error"], rel=1e-3), combo


@pytest.mark.extended  # three layouts at 4 ranks, twice: about 50 s on a busy 2-core machine
def test_measured_cells_agree_with_plain_mfsdp_check():
    _agree(AGREE)


def test_a_gradient_scaled_on_one_rank_fails_its_cells():
    data = measure_matrix("mfsdp.check.faults:grad_scaled_on_one_rank",
                          cells=[("optim_grads", "HSDP", "fp32"), ("no_shard", "none", "bf16")])
    for cell in data["cells"]:
        assert cell["status"] == "fails", cell
        assert "ratio" in cell["message"] or "parameter" in cell["message"], cell


@pytest.mark.extended  # the whole matrix: about 40 s of CPU
def test_every_works_cell_of_the_page_holds_when_measured_again():
    data = measure_matrix(TINY)
    assert len(data["cells"]) == len(combinations()) and data["launches"] == 1
    measured = _cells(data)
    assert all(c["status"] != "fails" for c in data["cells"]), render_table(data)
    if compat_matrix.CACHE.exists():
        cached = json.loads(compat_matrix.CACHE.read_text())
        if cached["digest"] == compat_matrix.inputs_digest():
            for combo, cell in _cells(cached["data"]).items():
                assert measured[combo]["status"] == cell["status"], combo
                assert measured[combo]["message"] == cell["message"], combo
