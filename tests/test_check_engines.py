"""``mfsdp check --engine``: the same reference, steps and report with the sharded side run by
PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard`` on gloo) or by upstream Megatron-FSDP
(the ``megatron_fsdp`` 0.6.1 release from PyPI, its CUDA calls replaced on CPU ranks). Each
engine passes the healthy model and fails the fault models of :mod:`mfsdp.check.faults`; the
upstream engine's AdamW under-update (NVIDIA/Megatron-LM#5974) is flagged and its workaround
passes. Also: noise-dominated gradient elements (a reference gradient at rounding level) are
reported apart and a real fault on them still fails, and ``mfsdp check`` imports MODEL from the
current directory."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch

import mfsdp
from mfsdp.check.engines import get_engine
from mfsdp.check.layouts import LAYOUTS
from mfsdp.check.report import NOISE_FLOOR, compare

FAULTS = "mfsdp.check.faults"
RESET = "mfsdp.check.engines.upstream:reset_optimizer_step"


def _quiet(**kw):
    return dict(progress=None, **kw)


def _has_megatron_fsdp() -> bool:
    try:
        import megatron_fsdp  # noqa: F401
    except ImportError:
        return False
    return True


needs_upstream = pytest.mark.skipif(not _has_megatron_fsdp(),
                                    reason="megatron_fsdp is not installed (mfsdp[upstream])")


# -- without ranks -------------------------------------------------------------------------------

def test_each_engine_skips_the_layouts_it_lacks_with_the_reason():
    fsdp2, upstream = get_engine("fsdp2"), get_engine("megatron_fsdp")
    runs = {"optim_grads", "optim_grads_params", "hsdp", "bf16", "bf16_comm"}
    assert {n for n, layout in LAYOUTS.items() if fsdp2.refuses(layout) is None} == runs
    assert "no ZeRO-0 or ZeRO-1" in fsdp2.refuses(LAYOUTS["optim"])
    assert "does not shard the optimizer state" in fsdp2.refuses(LAYOUTS["hfsdp"])
    # upstream has every ZeRO strategy, HSDP and HFSDP; TP, CP, EP and resume are mfsdp's
    assert {n for n, layout in LAYOUTS.items() if upstream.refuses(layout) is None} == (
        runs | {"no_shard", "optim", "hfsdp"})
    assert "tensor parallelism" in upstream.refuses(LAYOUTS["tp"])
    with pytest.raises(ValueError, match="--engine='ddp': choose from mfsdp, fsdp2, "
                                         "megatron_fsdp"):
        get_engine("ddp")


def test_mfsdp_imports_and_refuses_the_upstream_engine_without_megatron_fsdp():
    """``sys.modules["megatron_fsdp"] = None`` makes its import fail, as when not installed."""
    code = textwrap.dedent("""
        import sys
        sys.modules["megatron_fsdp"] = None
        import mfsdp, mfsdp.check, mfsdp.cli
        from mfsdp.check.engines import get_engine
        print(get_engine("megatron_fsdp").missing())
        try:
            mfsdp.check.check("mfsdp.check.faults:tiny", engine="megatron_fsdp", progress=None)
        except ValueError as exc:
            print("refused:", exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.strip().splitlines()
    assert "pip install 'mfsdp[upstream]'" in first
    assert second.startswith("refused: --engine megatron_fsdp needs the megatron_fsdp package")


def _run(params: dict, grads: dict) -> dict:
    """One step's record as run_layout/run_reference return it."""
    initial = {n: torch.zeros_like(p) for n, p in params.items()}
    return {"initial": initial, "params": [params], "grads": [grads], "losses": [1.0],
            "grad_norms": [1.0]}


def test_a_rounding_level_gradient_is_noise_not_a_failure_and_a_real_one_is_judged():
    """``compare`` on hand-made records: a bias whose reference gradient is 1e-9 (the key bias
    of attention) moved by AdamW differently in both runs is left out of the error; the same
    element with a real gradient on the sharded side (a fault) fails."""
    layout = LAYOUTS["optim_grads_params"]
    weight = torch.full((4,), 0.1)
    ref_grads = {"w": torch.full((4,), 0.5), "b": torch.tensor([0.5, 1e-9, -1e-9, 0.5])}
    ref = _run({"w": weight, "b": torch.tensor([1e-3, 1e-3, -1e-3, 1e-3])}, ref_grads)
    # the sharded run: same real updates, the noise elements moved the other way (AdamW)
    healthy = _run({"w": weight, "b": torch.tensor([1e-3, -1e-3, 1e-3, 1e-3])},
                   {"w": ref_grads["w"], "b": torch.tensor([0.5, -2e-9, 3e-9, 0.5])})
    steps, reason = compare(layout, ref, healthy)
    assert reason == "" and steps[0].worst_param_error == 0.0
    from mfsdp.check.report import noise_report

    noise = noise_report(layout, ref, healthy)
    assert noise["b"]["elements"] == 2 and noise["b"]["size"] == 4
    assert noise["b"]["floor"] == pytest.approx(NOISE_FLOOR["fp32"] * 0.5)
    assert noise["b"]["error"] == pytest.approx(2.0)  # moved the other way: reported only
    # a fault: the sharded side's gradient of those elements is real (1e-4), not rounding
    faulty = _run(healthy["params"][0],
                  {"w": ref_grads["w"], "b": torch.tensor([0.5, 1e-4, 1e-4, 0.5])})
    steps, reason = compare(layout, ref, faulty)
    assert "parameter b relative error" in reason and steps[0].worst_param == "b"
    assert noise_report(layout, ref, faulty) == {}
    # without the rule the healthy run fails (the noise elements are half the bias's update)
    no_grads = dict(healthy, grads=[])
    assert "parameter b relative error" in compare(layout, ref, no_grads)[1]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="python -P (no cwd on sys.path) is 3.11+")
def test_the_cli_imports_model_from_the_current_directory(tmp_path):
    """``python -P`` keeps the current directory off ``sys.path``, as the ``mfsdp`` script does:
    the check must put it there itself."""
    (tmp_path / "mymodel.py").write_text(
        "from mfsdp.check.faults import tiny\n\n\ndef build():\n    return tiny()\n")
    # the tp layout is skipped for this model (no TP plan): the model is imported and built,
    # no rank is started
    out = subprocess.run([sys.executable, "-P", "-m", "mfsdp.cli", "check", "mymodel:build",
                          "--layouts", "tp", "--steps", "1"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "skip tp " in out.stdout and "TinyLM has none" in out.stdout
    assert "engine: mfsdp (mfsdp " in out.stdout


# -- FSDP2 on gloo -------------------------------------------------------------------------------

@pytest.mark.extended  # 2 layouts at 2 ranks (every cell: the compatibility page's engines table)
def test_fsdp2_passes_the_healthy_model_on_its_layouts(tmp_path):
    path = tmp_path / "check.json"
    report = mfsdp.check.check(f"{FAULTS}:tiny", steps=2, engine="fsdp2", json_path=str(path),
                         layouts=["no_shard", "optim_grads_params", "bf16"], **_quiet())
    assert report.passed, report.table()
    assert [r.name for r in report.layouts] == ["optim_grads_params", "bf16"]
    assert report.skipped == ["no_shard"]
    for r in report.layouts[:1]:  # fp32: the reference up to the order of sums
        assert all(s.worst_param_error < 1e-4 for s in r.steps), report.table()
    data = json.loads(path.read_text())
    assert data["engine"] == "fsdp2" and data["engine_version"] == f"torch {torch.__version__}"
    assert data["replacements"] == [] and "no ZeRO-0" in data["skip_reasons"]["no_shard"]
    assert "engine: fsdp2 (torch " in report.table()


@pytest.mark.extended
def test_fsdp2_fails_the_loss_averaged_twice_and_a_parameter_left_out():
    twice = mfsdp.check.check(f"{FAULTS}:loss_averaged_twice", steps=2, engine="fsdp2",
                        layouts=["optim_grads_params"], **_quiet())
    (r,) = twice.layouts
    assert not r.passed and r.reason.startswith("step 1: gradient-norm ratio 0.5000")
    assert abs(r.steps[0].update_norm_ratio - 0.5) < 1e-4
    left_out = mfsdp.check.check(f"{FAULTS}:tiny", steps=2, engine="fsdp2", layouts=["optim_grads"],
                           optimizer_factory=f"{FAULTS}:optimizer_without_final_norm",
                           **_quiet())
    (r,) = left_out.layouts
    assert not r.passed and r.steps, r.reason  # a rank that raised has no steps: say why
    assert r.steps[0].worst_param in ("norm.weight", "norm.bias"), r.reason
    assert r.steps[0].worst_param_error == pytest.approx(1.0)


# -- upstream Megatron-FSDP 0.6.1 on CPU ranks ---------------------------------------------------

@needs_upstream
@pytest.mark.extended  # 2 layouts at 2 ranks (every cell: the compatibility page's engines table)
def test_upstream_passes_the_healthy_model_with_sgd_and_names_what_it_replaced():
    report = mfsdp.check.check(f"{FAULTS}:tiny", steps=2, engine="megatron_fsdp",
                         layouts=["optim", "bf16_comm"], **_quiet())
    assert report.passed, report.table()
    for r in report.layouts[:1]:
        assert all(s.worst_param_error < 1e-4 for s in r.steps), report.table()
    assert report.engine_version == "megatron-fsdp 0.6.1"
    assert any(x.startswith("torch.cuda.Stream") for x in report.replacements)
    assert any(x.startswith("gradient_reduce_div_fusion=False") for x in report.replacements)
    assert "replaced so that it runs on CPU ranks:\n     torch.cuda.Stream" in report.table()
    # the replacements lived only inside the ranks' engine scope
    assert torch.cuda.Stream.__module__.startswith("torch")


@needs_upstream
@pytest.mark.extended
def test_upstream_0_6_1_adamw_under_update_is_flagged_and_the_workaround_passes():
    """NVIDIA/Megatron-LM#5974: the synthetic first step of ``fully_shard_optimizer`` leaves
    AdamW's step count at 1. ZeRO-3, 2 ranks, 3 steps of a small attention model."""
    kw = dict(steps=3, engine="megatron_fsdp", layouts=["optim_grads_params"], **_quiet())
    bug = mfsdp.check.check(f"{FAULTS}:attention", optimizer="adamw", **kw)
    (r,) = bug.layouts
    assert not r.passed and r.reason.startswith("step 1: update-norm ratio")
    assert 0.6 < r.steps[0].update_norm_ratio < 0.85  # 1 / 1.34: step 2's bias correction
    assert all(abs(s.grad_norm_ratio - 1) < 1e-3 for s in r.steps)  # the gradients agree
    fixed = mfsdp.check.check(f"{FAULTS}:attention", optimizer="adamw", after_shard=RESET, **kw)
    assert fixed.passed, fixed.table()
    sgd = mfsdp.check.check(f"{FAULTS}:attention", optimizer="sgd", **kw)
    assert sgd.passed, sgd.table()
    assert max(s.worst_param_error for s in sgd.layouts[0].steps) < 1e-4


@needs_upstream
@pytest.mark.extended
def test_upstream_fails_the_loss_averaged_twice_and_a_parameter_left_out():
    twice = mfsdp.check.check(f"{FAULTS}:loss_averaged_twice", steps=2, engine="megatron_fsdp",
                        layouts=["optim_grads_params"], **_quiet())
    (r,) = twice.layouts
    assert not r.passed and r.reason.startswith("step 1: gradient-norm ratio 0.5000")
    left_out = mfsdp.check.check(f"{FAULTS}:tiny", steps=2, engine="megatron_fsdp",
                           layouts=["optim"],
                           optimizer_factory=f"{FAULTS}:optimizer_without_final_norm",
                           **_quiet())
    (r,) = left_out.layouts
    assert not r.passed and r.steps, r.reason  # a rank that raised has no steps: say why
    assert r.steps[0].worst_param in ("norm.weight", "norm.bias"), r.reason
    assert r.steps[0].worst_param_error == pytest.approx(1.0)


# -- AdamW and rounding-level gradients, multi-rank ----------------------------------------------

@pytest.mark.extended
def test_attention_key_bias_is_noise_under_adamw_and_a_real_fault_on_it_fails(tmp_path):
    path = tmp_path / "check.json"
    good = mfsdp.check.check(f"{FAULTS}:attention", steps=3, optimizer="adamw",
                       layouts=["optim_grads_params"], json_path=str(path), **_quiet())
    assert good.passed, good.table()
    (r,) = json.loads(path.read_text())["layouts"]
    assert sorted(r["noise_dominated"]) == ["blocks.0.attn.in_proj_bias",
                                            "blocks.2.attn.in_proj_bias"]
    for nd in r["noise_dominated"].values():  # the key third: 32 of 3 x 32
        assert nd["elements"] == 32 and nd["size"] == 96
        assert nd["max_reference_grad"] <= nd["floor"] and not math.isnan(nd["error"])
    assert "noise-dominated, not judged: blocks.0.attn.in_proj_bias (32 of 96" in good.table()
    bad = mfsdp.check.check(f"{FAULTS}:key_bias_pushed_on_one_rank", steps=3, optimizer="adamw",
                      layouts=["optim_grads_params"], **_quiet())
    (r,) = bad.layouts
    assert not r.passed and "blocks.0.attn.in_proj_bias" in r.reason, bad.table()
    assert "blocks.0.attn.in_proj_bias" not in r.noise_dominated


# -- the compatibility page's engine columns ------------------------------------------------------

def test_the_engines_table_shows_what_each_engine_lacks_and_refuses_without_a_launch():
    """The cells FSDP2 lacks are ``lacks`` with the adapter's reason (nothing launched), and the
    page's table puts them next to mfsdp's refusals; an engine not installed says so."""
    from pathlib import Path

    from mfsdp.check.matrix import measure_matrix

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "_ext"))
    import compat_matrix

    lacking = [("optim", "none", "fp32"), ("optim_grads_params", "HFSDP", "fp32")]
    fsdp2 = measure_matrix(f"{FAULTS}:tiny", cells=lacking, engine="fsdp2")
    assert fsdp2["launches"] == 0 and fsdp2["engine"] == "fsdp2"
    assert [c["status"] for c in fsdp2["cells"]] == ["lacks", "lacks"]
    mine = measure_matrix(f"{FAULTS}:tiny", cells=[("optim", "HFSDP", "fp32")])
    mine["cells"] += [dict(c, status="works", message="", worst_param_error=1e-6)
                      for c in fsdp2["cells"]]  # as if measured: only the text is under test
    # an engine's own message, with reStructuredText markup in it, as upstream's raised one
    fsdp2["cells"][1] = dict(fsdp2["cells"][1], status="fails",
                             message="raised: RuntimeError: aten.add_.Tensor: *in-place*")
    from cli_reference import rst_nodes  # the build's strict parsing

    rst = compat_matrix.rst_engines_table(mine, {"fsdp2": fsdp2,
                                                 "megatron_fsdp": {"missing": "not here"}})
    text = " ".join(n.astext() for n in rst_nodes(rst))
    assert "PyTorch FSDP2 (torch " in text and "Megatron-FSDP (not installed)" in text
    assert "n/a: zero_dp_strategy='optim': FSDP2 always shards gradients" in text
    assert "refused: outer_dp_sharding_strategy='optim' needs" in text
    assert "not measured: not here" in text and "works (1e-06)" in text
    assert "fails: raised: RuntimeError: aten.add_.Tensor: *in-place*" in text


@pytest.mark.extended
def test_the_built_engines_table_agrees_with_the_engines_own_limits():
    """The docs build's cached engines table (when present and current): FSDP2 works on every
    combination it has; upstream's ZeRO-1/2/3 without an outer dimension work, and each HFSDP it
    refuses carries upstream's own message."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "_ext"))
    import compat_matrix

    if not compat_matrix.CACHE_ENGINES.exists():
        pytest.skip("no engines table built (the docs build measures it)")
    cached = json.loads(compat_matrix.CACHE_ENGINES.read_text())
    if cached.get("digest") != compat_matrix.engines_digest():
        pytest.skip("the built engines table is stale")
    fsdp2, upstream = cached["data"]["fsdp2"], cached["data"]["megatron_fsdp"]
    assert {c["status"] for c in fsdp2["cells"]} == {"works", "lacks"}
    assert sum(c["status"] == "works" for c in fsdp2["cells"]) == 12  # ZeRO-2/3 x none/HSDP x 3
    for c in upstream["cells"]:
        if c["outer"] == "none" and c["strategy"] != "no_shard":
            assert c["status"] == "works", c
        if c["status"] == "refused":
            assert c["outer"] == "HFSDP" and "requires zero_dp_strategy" in c["message"]
