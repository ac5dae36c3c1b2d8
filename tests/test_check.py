"""``mfsdp check``, the parity doctor: healthy models pass every layout against a single-process
reference (the toy model, a trainer preset, ``transformers`` Llama and Qwen2-MoE), and each fault
model of :mod:`mfsdp.check.faults` is named by layout, parameter and step. Exit codes 0/1/2 and
the JSON document's fields are checked through the real CLI."""

from __future__ import annotations

import json

import pytest

import mfsdp
from mfsdp.check.layouts import LAYOUTS, TOLERANCES, select_layouts
from mfsdp.check.models import default_unit_classes
from mfsdp.check.report import JSON_SCHEMA
from mfsdp.cli import main

FAULTS = "mfsdp.check.faults"


def _quiet(**kw):
    return dict(progress=None, **kw)


def _matches(value, schema, where="report"):
    """``value`` has every field of ``schema`` with the type it names (lists: each item)."""
    if isinstance(schema, dict):
        assert isinstance(value, dict), where
        for key, sub in schema.items():
            assert key in value, f"{where}.{key} missing"
            _matches(value[key], sub, f"{where}.{key}")
    elif isinstance(schema, list):
        assert isinstance(value, list), where
        for i, item in enumerate(value):
            _matches(item, schema[0], f"{where}[{i}]")
    else:
        expected = schema if isinstance(schema, tuple) else (schema,)
        if float in expected:
            expected = expected + (int,)
        assert isinstance(value, expected), (where, value, schema)


def test_layouts_that_need_more_ranks_are_skipped_by_default_and_refused_by_name():
    run, skipped = select_layouts(None, 2)
    assert [layout.name for layout in run] == [n for n in LAYOUTS if n not in ("hsdp", "hfsdp")]
    assert skipped == ["hsdp", "hfsdp"]
    with pytest.raises(ValueError, match="--layouts hsdp needs --nproc 4"):
        select_layouts(["hsdp"], 2)
    with pytest.raises(ValueError, match="'zero3' is not a layout"):
        select_layouts(["zero3"], 2)
    assert {layout.tolerance for layout in LAYOUTS.values()} <= set(TOLERANCES)


def test_default_units_are_the_layers_the_module_list_with_most_parameters():
    from mfsdp.check import faults
    from mfsdp.check.models import build_model

    assert default_unit_classes(faults.tiny()) == [faults.Block]
    # the blocks hold the experts: the heaviest list wins over the longer one (4 experts > 2 blocks)
    assert default_unit_classes(faults.fused_experts()) == [faults.FusedMoE]
    # a MoE preset: 3 layers, each with a list of 8 experts; the trainer's units are the layers
    assert [c.__name__ for c in default_unit_classes(build_model("deepseek-proxy"))] == [
        "TransformerLayer"]


def test_a_healthy_model_passes_and_the_json_has_every_field(tmp_path):
    path, plot = tmp_path / "check.json", tmp_path / "check.png"
    report = mfsdp.check.check(f"{FAULTS}:tiny", nproc=2, steps=2, layouts=["no_shard"],
                         json_path=str(path), plot_path=str(plot), **_quiet())
    assert report.passed, report.table()
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(path.read_text())
    _matches(data, JSON_SCHEMA)
    assert [r["name"] for r in data["layouts"]] == ["no_shard"]
    for r in data["layouts"]:
        assert len(r["steps"]) == 2 and len(r["max_rss_mib"]) == 2
        for s in r["steps"]:  # fp32: equal to the reference up to the order of sums
            assert abs(s["update_norm_ratio"] - 1) < 1e-5 and s["worst_param_error"] < 1e-4


def test_a_gradient_scaled_on_one_rank_is_named():
    report = mfsdp.check.check(f"{FAULTS}:grad_scaled_on_one_rank", steps=2,
                         layouts=["optim_grads"], **_quiet())
    (r,) = report.layouts
    assert not r.passed and r.name == "optim_grads"
    assert r.reason.startswith("step 1: gradient-norm ratio")
    assert "blocks.1.fc2.weight" in r.reason
    assert all(s.worst_param == "blocks.1.fc2.weight" for s in r.steps)


@pytest.mark.parametrize("optimizer, ratio", [("sgd", 0.5), ("adamw", None)])
def test_an_update_scaled_by_the_data_parallel_size_shows_in_the_update_ratio(optimizer, ratio):
    """With SGD the update is half the reference's at 2 ranks (upstream #5974's class); AdamW
    normalises the scale away on the first step, which is why the doctor defaults to SGD."""
    report = mfsdp.check.check(f"{FAULTS}:loss_averaged_twice", steps=2, optimizer=optimizer,
                         layouts=["optim_grads_params"], **_quiet())
    (r,) = report.layouts
    first = r.steps[0]  # from the same weights: exactly half (later steps start elsewhere)
    assert abs(first.grad_norm_ratio - 0.5) < 1e-4
    assert not r.passed and r.reason.startswith("step 1: gradient-norm ratio 0.5000")
    if ratio is not None:
        assert abs(first.update_norm_ratio - ratio) < 1e-4
        assert all(s.update_norm_ratio < 0.6 for s in r.steps)
    else:
        assert abs(r.steps[0].update_norm_ratio - 1) < 1e-2


@pytest.mark.extended  # `make test`'s budget; CI runs it
def test_a_parameter_left_out_of_the_optimizer_is_named():
    report = mfsdp.check.check(f"{FAULTS}:tiny", steps=2, layouts=["optim"],
                         optimizer_factory=f"{FAULTS}:optimizer_without_final_norm", **_quiet())
    (r,) = report.layouts
    assert not r.passed
    assert r.steps[0].worst_param in ("norm.weight", "norm.bias")
    assert r.steps[0].worst_param_error == pytest.approx(1.0)  # it never moved
    assert "step 1" in r.reason and "norm." in r.reason


@pytest.mark.extended  # `make test`'s budget; CI runs it
def test_a_fused_parent_bypassing_its_units_is_named():
    broken = mfsdp.check.check(f"{FAULTS}:fused_experts", steps=2, layouts=["optim_grads_params"],
                         units=["Expert"], **_quiet())
    (r,) = broken.layouts
    assert not r.passed and r.error is not None and not r.steps
    assert "step 1 (forward/backward)" in r.error
    assert "blocks.0.experts.0" in r.reason and "--recursive-gather FusedMoE" in r.reason
    assert broken.bypassed_units[:1] == ["blocks.0.experts.0"]


@pytest.mark.extended  # `make test`'s budget; CI runs it
def test_recursive_gather_fixes_the_fused_parent():
    fixed = mfsdp.check.check(f"{FAULTS}:fused_experts", steps=2, layouts=["optim_grads_params"],
                        units=["Expert"], recursive_gather=["FusedMoE"], **_quiet())
    assert fixed.passed, fixed.table()


@pytest.mark.extended  # `make test`'s budget; CI runs it
def test_the_resume_layout_passes_when_the_optimizer_state_is_resharded():
    """The resume layout saves after step 2 under optim_grads_params and loads into optim: the
    AdamW moments are resharded, and steps 3 and 4 match the reference."""
    good = mfsdp.check.check(f"{FAULTS}:tiny", steps=4, optimizer="adamw", layouts=["resume"],
                       **_quiet())
    assert good.passed, good.table()


@pytest.mark.extended  # `make test`'s budget; CI runs it
def test_optimizer_state_lost_on_resume_is_named():
    """A resume that loads the weights only restarts AdamW's moments after step 2."""
    bad = mfsdp.check.check(f"{FAULTS}:tiny", steps=4, optimizer="adamw", layouts=["resume"],
                      resume_fn=f"{FAULTS}:load_weights_only", **_quiet())
    (r,) = bad.layouts
    assert not r.passed and r.reason.startswith("step 3: update-norm ratio")
    assert [abs(s.update_norm_ratio - 1) < 1e-4 for s in r.steps] == [True, True, False, False]
    assert r.steps[2].worst_param in r.reason


@pytest.mark.extended  # `make test`'s budget; CI runs it
def test_a_bf16_reduction_that_loses_the_gradient_is_named():
    """Per-rank gradients that cancel: exact in fp32, lost when rounded to bf16 before the sum."""
    report = mfsdp.check.check(f"{FAULTS}:cancelling_gradients", steps=1,
                         layouts=["optim_grads_params", "bf16_comm"], **_quiet())
    fp32, bf16 = report.layouts
    assert fp32.passed and fp32.steps[0].worst_param_error < 1e-4, fp32.reason
    assert not bf16.passed
    assert bf16.reason.startswith("step 1: parameter blocks.0.fc1.weight relative error")
    assert bf16.steps[0].worst_param_error > 0.1
    # the numerics simulator names the same parameter and predicts the measured error
    pred = bf16.prediction
    assert pred["param"] == "blocks.0.fc1.weight" and fp32.prediction is None
    assert pred["measured"] == pytest.approx(bf16.steps[0].worst_param_error)
    assert pred["error"] == pytest.approx(pred["measured"], rel=0.02)
    assert "numerics simulator, step 1: blocks.0.fc1.weight predicted" in report.table()


def test_the_simulated_bf16_reduction_matches_the_engines():
    """``reduction_errors``' replay of the engine's bf16 reduce-scatter equals what the engine
    computes on two gloo ranks (one parameter's gradients, exact mean in fp64 as the reference)."""
    import torch

    from mfsdp.check.predict import reduction_errors
    from mfsdp.launch import launch

    grads = torch.randn(2, 4096, generator=torch.Generator().manual_seed(0))
    grads[:, :2048] += torch.tensor([[3.0], [-3.0]])  # a cancelling term, as the fault model's
    chunks = launch(_engine_mean, 2, args=(grads,))
    engine = torch.cat(chunks).double()
    exact = grads.double().mean(0)
    measured = ((engine - exact).norm() / exact.norm()).item()
    predicted, ring = reduction_errors(grads)
    assert predicted == pytest.approx(measured, rel=1e-6)
    assert measured > 1e-3  # bf16 loses a visible part of this gradient
    assert ring >= predicted * 0.5  # the ring rounds at every hop: never far better


def _engine_mean(grads):
    import torch
    import torch.distributed as dist

    from mfsdp.fsdp.collectives import Communicator

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = (grads[rank].to(torch.bfloat16) * (1.0 / world)).contiguous()
    return Communicator(None, "dp").reduce_scatter(mine).wait().float()


@pytest.mark.extended  # `make test`'s budget; CI runs it
def test_cli_exits_0_when_every_layout_passes(capsys):
    assert main(["check", f"{FAULTS}:tiny", "--layouts", "optim_grads", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "[1/1] optim_grads" in out and "PASS optim_grads" in out


def test_cli_exits_1_when_a_layout_fails(capsys):
    assert main(["check", f"{FAULTS}:loss_averaged_twice", "--layouts", "optim_grads",
                 "--steps", "1"]) == 1
    assert "FAIL optim_grads" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["no_such_module:build"], "cannot import 'no_such_module'"),
    (["not-a-model"], "MODEL='not-a-model' is neither"),
    (["llama-tiny", "--layouts", "hsdp"], "--layouts hsdp needs --nproc 4"),
    ([f"{FAULTS}:tiny", "--units", "Nope"], "--units Nope: TinyLM has no module of class"),
    ([f"{FAULTS}:tiny", "--nproc", "1"], "--nproc=1"),
    ([f"{FAULTS}:tiny", "--layouts", "resume", "--steps", "1"], "needs --steps 2 or more"),
])
def test_cli_bad_input_is_one_line_with_status_2(capsys, args, message):
    assert main(["check", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.extended  # `make test`'s budget; CI runs it
def test_hsdp_and_hfsdp_on_four_ranks_pass():
    report = mfsdp.check.check(f"{FAULTS}:tiny", nproc=4, steps=2, layouts=["hsdp", "hfsdp"], **_quiet())
    assert report.passed, report.table()


@pytest.mark.extended
def test_a_trainer_preset_passes_every_layout_at_two_ranks():
    report = mfsdp.check.check("llama-tiny", nproc=2, steps=2, **_quiet())
    assert report.passed, report.table()
    assert report.units == ["TransformerLayer"] and report.skipped == ["hsdp", "hfsdp", "ep"]
    assert {"tp", "tp_sp", "cp"} <= {r.name for r in report.layouts}


@pytest.mark.extended
def test_a_transformers_llama_passes_every_layout_at_two_ranks(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=64).save_pretrained(tmp_path)
    report = mfsdp.check.check(str(tmp_path), nproc=2, steps=2, **_quiet())
    assert report.passed, report.table()
    assert report.units == ["LlamaDecoderLayer"]


# 4 ranks: the layouts that need them (HSDP, HFSDP), and ZeRO-3 over 4 uneven shards; every
# other layout runs on both models at 2 ranks (here), every layout of the trainer presets at 4
# (test_check_parallel.py)
@pytest.mark.extended
def test_transformers_llama_and_qwen2_moe_pass_at_four_ranks(tmp_path):
    from transformers import LlamaConfig, Qwen2MoeConfig

    LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=64).save_pretrained(tmp_path / "llama")
    Qwen2MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                   moe_intermediate_size=32, shared_expert_intermediate_size=32,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   num_experts=4, num_experts_per_tok=2,
                   max_position_embeddings=64).save_pretrained(tmp_path / "qwen2_moe")
    for name in ("llama", "qwen2_moe"):
        report = mfsdp.check.check(str(tmp_path / name), nproc=4, steps=2,
                                   layouts=["optim_grads_params", "hsdp", "hfsdp"], **_quiet())
        assert report.passed, report.table()
        assert {r.name for r in report.layouts} == {"optim_grads_params", "hsdp", "hfsdp"}


@pytest.mark.extended
def test_a_transformers_qwen2_moe_passes(tmp_path):
    from transformers import Qwen2MoeConfig

    Qwen2MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                   moe_intermediate_size=32, shared_expert_intermediate_size=32,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   num_experts=4, num_experts_per_tok=2,
                   max_position_embeddings=64).save_pretrained(tmp_path)
    report = mfsdp.check.check(str(tmp_path), nproc=2, steps=2, **_quiet())  # every layout
    assert report.passed, report.table()
    assert {r.name for r in report.layouts} == {"no_shard", "optim", "optim_grads",
                                                "optim_grads_params", "bf16", "bf16_comm",
                                                "resume"}
    # mfsdp's expert parallelism splits its own MoE layers: skipped, with the reason (HSDP at 4
    # ranks: the test above; TP and CP: a transformers model has no plan of mfsdp's)
    assert "ep" in report.skipped and "Qwen2MoeForCausalLM has none" in report.skip_reasons["ep"]
