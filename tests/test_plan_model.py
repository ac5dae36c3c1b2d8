"""Planning your own model: ``mfsdp plan PRESET --model-args`` and ``mfsdp sbatch render --set
model_args=...`` plan the model the trainer's flags build (mfsdp.tools.plan_model).

The reference is the real module: :class:`mfsdp.models.gpt.GPT` built on the meta device from
the preset's config with the same fields set directly (not through the flag parser), its
parameters counted with ``numel``."""

from __future__ import annotations

import re
import shlex
from dataclasses import replace

import pytest
import torch

from mfsdp.tools import sbatch
from mfsdp.tools.plan import GiB, plan
from mfsdp.tools.plan_model import planned_model

THIRTEEN_B = ("--num-layers 40 --hidden-size 5120 --ffn-hidden-size 13824 "
              "--num-attention-heads 40")


def _numel(preset: str, **fields) -> tuple[int, int]:
    """(dense, expert) parameters of the GPT module of ``preset`` with ``fields`` replaced,
    built on the meta device."""
    from mfsdp.models.gpt import GPT, GPT_PRESETS

    with torch.device("meta"):
        model = GPT(replace(GPT_PRESETS[preset], **fields))
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return sum(p.numel() for p in model.parameters()) - expert, expert


@pytest.mark.parametrize("preset, flags, fields", [
    ("llama3-8b", THIRTEEN_B, dict(num_layers=40, hidden_size=5120, ffn_hidden_size=13824,
                                   num_attention_heads=40)),
    ("llama3-8b", "--num-layers 3 --hidden-size 1024 --num-attention-heads 16 "
                  "--group-query-attention --num-query-groups 4 --ffn-hidden-size 2816 "
                  "--untie-embeddings-and-output-weights --vocab-size 32000",
     dict(num_layers=3, hidden_size=1024, num_attention_heads=16, num_query_groups=4,
          ffn_hidden_size=2816, vocab_size=32000)),
    ("deepseek-proxy", "--num-layers 4 --num-experts 16 --moe-router-topk 4 "
                       "--moe-ffn-hidden-size 48 --moe-shared-expert-intermediate-size 96",
     dict(num_layers=4, num_experts=16, moe_router_topk=4, moe_ffn_hidden_size=48,
          moe_shared_expert_intermediate_size=96)),
])
def test_the_flags_plan_the_parameters_of_the_module_they_build(preset, flags, fields):
    model, text = planned_model(preset, flags)
    dense, expert = model.param_counts()
    assert (dense, expert) == _numel(preset, **fields)
    assert (expert > 0) == bool(model.num_experts)
    n = sum(w.startswith("--") for w in shlex.split(flags))
    assert text.startswith(f"{preset} with {n} flags: {model.num_layers} layers, "
                           f"hidden {model.hidden}, ")


def test_the_cli_plans_the_flags_and_names_the_model(capsys):
    from mfsdp.tools.plan_cli import build_parser, run

    assert run(build_parser().parse_args(["llama3-8b", "--model-args", THIRTEEN_B])) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == ("llama3-8b with 4 flags: 40 layers, hidden 5120, FFN 13824, 40 heads "
                     "(8 KV), vocab 128,256 = 12.3B parameters; 8 ranks, optim_grads_params")


@pytest.mark.parametrize("flags, message", [
    ("--normalization LayerNorm", "this model has LayerNorm (--normalization RMSNorm): add "
                                  "those flags"),
    ("--seq-length 8192", "--seq-length is not one of mfsdp train's model or MoE flags"),
    ("--num-layers many", "argument --num-layers: 'many' is not an integer"),
])
def test_a_model_the_planner_cannot_plan_is_one_line_naming_the_fix(flags, message):
    from mfsdp.tools.plan_cli import build_parser, run

    with pytest.raises(SystemExit) as err:
        run(build_parser().parse_args(["llama3-8b", "--model-args", flags]))
    text = str(err.value)
    assert text.startswith("mfsdp plan: --model-args: ") and "\n" not in text
    assert message in text, text


def _peak(lines: list[str]) -> float:
    (line,) = [x for x in lines if "memory: the planner's peak is" in x]
    return float(re.search(r"peak is ([\d.]+) GiB", line).group(1))


@pytest.mark.parametrize("model_args", [THIRTEEN_B, "--model-preset llama3-8b " + THIRTEEN_B])
def test_model_args_in_a_render_change_its_memory_line_as_mfsdp_plan_does(model_args, capsys):
    """The preset renders 16 GPUs, CP 2, 8,192 tokens, a global batch of 512 and bf16
    reduction; mfsdp plan with those flags and --model-args prints the render's peak."""
    from mfsdp.tools.plan_cli import build_parser, run
    from mfsdp.tools.sbatch.schedule import schedule_lines

    from mfsdp.tools.sbatch.header import describe

    p, v = sbatch.resolve("llama3-8b", {"model_args": model_args})
    assert v["model_args"] == "--model-preset llama3-8b " + THIRTEEN_B  # layered on the preset
    rendered = _peak(schedule_lines(v))
    assert rendered != _peak(schedule_lines(sbatch.resolve("llama3-8b")[1]))
    run(build_parser().parse_args([
        "llama3-8b", "--model-args", THIRTEEN_B, "--world-size", "16",
        "--context-parallel-size", "2", "--seq-length", "8192", "--global-batch-size", "512",
        "--grad-reduce-in-bf16"]))
    (total,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("total ")]
    assert rendered == round(float(total.split()[1]), 1)
    # the script's first comment names the rendered model, not the preset's text
    header = describe(p, v)
    assert header.startswith("Model of --set model_args, llama3-8b with 4 flags: 40 layers")
    assert "Llama-3-8B" not in header


def test_a_model_args_the_planner_does_not_model_says_so():
    from mfsdp.tools.sbatch.schedule import schedule_lines

    v = sbatch.resolve("llama3-8b", {"model_args": "--normalization LayerNorm"})[1]
    (line,) = schedule_lines(v)
    assert line.startswith("mfsdp sbatch: not planned, so no schedule or memory check: ")
    assert "--normalization RMSNorm" in line


_ROW = {"nodes": "4", "tp": "1", "cp": "2", "global_batch_size": "512"}


@pytest.mark.parametrize("overrides, fixes", [
    # the layouts page's 70B H100 row without its grad_reduce_in_bf16=false
    ({"recompute": "full"}, ["set grad_reduce_in_bf16=false", "raise tp or cp", "add nodes"]),
    ({"recompute": "none", "grad_reduce_in_bf16": "false"},
     ["raise tp or cp", "set recompute=full", "add nodes"]),
    ({"recompute": "block:40"},
     ["set grad_reduce_in_bf16=false", "raise tp or cp", "set recompute=full", "add nodes"]),
])
def test_the_over_memory_refusal_suggests_only_settings_not_applied(overrides, fixes):
    from mfsdp.tools.sbatch.schedule import over_memory_fixes

    v = sbatch.resolve("llama3-70b", dict(_ROW, **overrides))[1]
    got = over_memory_fixes(v)
    assert [f.split(" (")[0] for f in got] == fixes
    with pytest.raises(sbatch.RenderError) as err:
        sbatch.render("llama3-70b", dict(_ROW, **overrides))
    assert ", ".join(got[:-1]) + f", or {got[-1]}" in str(err.value)
    if "grad_reduce_in_bf16=false" in got[0]:  # its cost is the plan's difference
        from mfsdp.tools.sbatch.schedule import _layout

        model, layout = _layout(v)
        extra = (plan(model, layout).total
                 - plan(model, replace(layout, grad_comm_bytes=None)).total) / GiB
        assert f"add {extra:.1f} GiB" in got[0]


def test_a_render_of_model_args_warns_when_it_keeps_the_presets_job_name_and_save(capsys,
                                                                                  tmp_path):
    """Through the CLI: the preset's job name (its singleton chain) and save directory kept
    with another model are named on stderr; setting both silences it; no model_args, no
    warning."""
    from mfsdp.cli import main

    out = str(tmp_path / "a.sbatch")
    assert main(["sbatch", "render", "llama3-8b", "--output", out,
                 "--set", f"model_args={THIRTEEN_B}"]) == 0
    err = capsys.readouterr().err
    assert ("model_args changes the model, but the job keeps the preset's job_name "
            "(mfsdp-llama3-8b, its singleton chain) and save (") in err
    assert main(["sbatch", "render", "llama3-8b", "--output", out,
                 "--set", f"model_args={THIRTEEN_B}", "--set", "job_name=mfsdp-13b",
                 "--set", "save=checkpoints/13b"]) == 0
    assert "model_args changes the model" not in capsys.readouterr().err
    assert main(["sbatch", "render", "llama3-8b", "--output", out]) == 0
    assert "model_args changes the model" not in capsys.readouterr().err
    assert "#SBATCH --job-name=mfsdp-llama3-8b" in open(out).read()


def test_model_args_experts_set_num_experts_and_a_different_key_is_refused():
    """ep > 1 on a dense preset made MoE by model_args renders with the flags' experts (the
    script's --num-experts and the layout's split agree); a num_experts key that disagrees
    with the flags is one line naming both."""
    flags = "--num-experts 16 --moe-ffn-hidden-size 4096 --moe-router-topk 2"
    _, v = sbatch.resolve("llama3-8b", {"model_args": flags, "ep": "8"})
    assert v["num_experts"] == 16
    text = sbatch.render("llama3-8b", {"model_args": flags, "ep": "8"})
    assert "--num-experts 16" in text and "--expert-model-parallel-size 8" in text
    with pytest.raises(sbatch.RenderError, match=r"--set num_experts=8 but model_args has "
                       r"--num-experts 16: drop num_experts"):
        sbatch.resolve("llama3-8b", {"model_args": flags, "num_experts": "8", "ep": "8"})
    # no --num-experts in the flags: the preset's experts stay
    assert sbatch.resolve("deepseek-v3", {"model_args": "--num-layers 8"})[1][
        "num_experts"] == 256


def test_check_builds_a_preset_with_model_args_as_the_preset_config_replaced():
    """``mfsdp check PRESET --model-args FLAGS`` trains the module GPT builds from the preset's
    config with those fields replaced (the reference: dataclasses.replace, not the flags),
    and runs a layout on it; flags without a preset, or that are not model flags, are refused
    in one line."""
    from mfsdp.check.cli import build_parser, run
    from mfsdp.check.models import build_model
    from mfsdp.models.gpt import GPT, GPT_PRESETS

    flags = ("--num-layers 3 --hidden-size 96 --num-attention-heads 6 "
             "--group-query-attention --num-query-groups 2")
    ours = build_model(f"llama-tiny {flags}", seed=0)
    torch.manual_seed(0)
    reference = GPT(replace(GPT_PRESETS["llama-tiny"], num_layers=3, hidden_size=96,
                            num_attention_heads=6, num_query_groups=2))
    assert {n: p.shape for n, p in ours.named_parameters()} == {
        n: p.shape for n, p in reference.named_parameters()}
    args = build_parser().parse_args(["llama-tiny", "--model-args", flags, "--layouts",
                                      "optim_grads_params", "--steps", "2"])
    assert run(args) == 0
    with pytest.raises(SystemExit, match="--model-args layers flags on a preset MODEL"):
        run(build_parser().parse_args(["mfsdp.check.faults:tiny", "--model-args", flags]))
    with pytest.raises(ValueError, match="--lr is not one of mfsdp train's model or MoE flags"):
        build_model("llama-tiny --lr 3")


@pytest.mark.parametrize("flags, changes", [
    # fewer heads than the preset's 8 key-value groups, with the groups that divide them
    ("--num-attention-heads 4 --group-query-attention --num-query-groups 2 --hidden-size 64",
     dict(num_attention_heads=4, num_query_groups=2, hidden_size=64)),
    # a flag given twice takes its last value, as argparse and Megatron-LM do: the guide's
    # "$MODEL $SMALL" miniature of a 40-head multi-head-attention model
    ("--num-attention-heads 40 --group-query-attention --num-query-groups 40 --hidden-size 5120 "
     "--num-attention-heads 4 --num-query-groups 4 --hidden-size 64",
     dict(num_attention_heads=4, num_query_groups=4, hidden_size=64)),
])
def test_heads_and_groups_given_together_replace_the_presets_together(flags, changes):
    """New heads are checked against the new key-value groups, not the preset's (the trainer
    refused ``--num-attention-heads 4 --num-query-groups 2`` on llama3-8b: 4 heads against its
    8 groups); the reference is the preset's config with the fields replaced."""
    from mfsdp.models.gpt import GPT_PRESETS
    from mfsdp.tools.plan_model import gpt_config

    assert gpt_config("llama3-8b", flags)[0] == replace(GPT_PRESETS["llama3-8b"], **changes)
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by "
                                         "num_query_groups=8"):
        gpt_config("llama3-8b", "--num-attention-heads 4 --hidden-size 64")


def test_a_render_warns_of_parts_not_run_and_of_a_tight_plan(capsys, tmp_path):
    """Through the CLI: mfsdp's flex dispatcher with DeepEP, and compile on an MoE model (a
    dense preset made MoE by model_args keeps the preset's compile), are named on stderr;
    the all-to-all dispatcher without compile is not. A render whose plan is within mfsdp
    plan's tight margin of the limit says so, as mfsdp plan does for the same layout."""
    from mfsdp.cli import main
    from mfsdp.tools.plan_cli import TIGHT_GIB
    from mfsdp.tools.sbatch.schedule import schedule

    out = str(tmp_path / "a.sbatch")
    assert main(["sbatch", "render", "deepseek-v3", "--output", out]) == 0
    assert "the flex dispatcher's deepep backend has not run" in capsys.readouterr().err
    moe = "--num-experts 8 --moe-ffn-hidden-size 1792 --moe-router-topk 2"
    assert main(["sbatch", "render", "llama3-8b", "--output", out, "--set",
                 f"model_args={moe}", "--set", "job_name=m", "--set", "save=m"]) == 0
    assert "compile with an MoE model" in capsys.readouterr().err
    assert main(["sbatch", "render", "deepseek-v3", "--output", out, "--set",
                 "dispatcher=alltoall"]) == 0
    assert "has not run" not in capsys.readouterr().err
    # llama3-8b's job with more layers: the first layer count the planner puts within the
    # tight margin (found from the planner itself, not written down)
    for layers in range(32, 80):
        over = {"model_args": f"--num-layers {layers}", "job_name": "t", "save": "t"}
        gib = schedule(sbatch.resolve("llama3-8b", over)[1]).peak_bytes / 2**30
        if 76 - TIGHT_GIB < gib <= 76:
            break
    assert 76 - TIGHT_GIB < gib <= 76
    assert main(["sbatch", "render", "llama3-8b", "--output", out,
                 *[f"--set={k}={v}" for k, v in over.items()]]) == 0
    assert f"tight: within {TIGHT_GIB:g} GiB of that limit" in capsys.readouterr().err
    assert main(["sbatch", "render", "llama3-8b", "--output", out]) == 0
    assert "tight" not in capsys.readouterr().err
