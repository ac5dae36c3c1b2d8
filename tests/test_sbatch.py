"""Rendered sbatch scripts: committed = fresh render, ASCII, newline-terminated, ``bash -n`` and
``shellcheck`` clean; every flag an mfsdp script passes parses with ``mfsdp train``, every flag a
Megatron-LM script passes with the snapshot of Megatron-LM's own parser; values render as
literal strings; bad input fails at render time in one line."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess

import pytest
from conftest import ROOT, skip_or_fail

from mfsdp import train
from mfsdp.tools import sbatch
from mfsdp.checkpoint import convert
from mfsdp.tools import bandwidth
from mfsdp.tools.sbatch.arguments import recompute_flags

SCRIPTS = ROOT / "example-scripts"
ALL = sbatch.scripts()
IDS = [rel for _, _, rel in ALL]
SNAPSHOT = json.loads((ROOT / "tests" / "fixtures" / "megatron_lm_parser.json").read_text())
MEGATRON_DEFAULTS = json.loads((ROOT / "docs" / "megatron_lm_defaults.json").read_text())["defaults"]


@pytest.mark.parametrize("name, overrides, rel", ALL, ids=IDS)
def test_committed_script_equals_fresh_render(name, overrides, rel):
    path = SCRIPTS / rel
    assert path.exists(), f"{path} missing: run `mfsdp sbatch render-all example-scripts`"
    assert path.read_text() == sbatch.render(name, overrides), (
        f"{path} differs from a fresh render: run `mfsdp sbatch render-all example-scripts`")


def test_no_stale_scripts():
    committed = {p.relative_to(SCRIPTS).as_posix() for p in SCRIPTS.rglob("*.sbatch")}
    assert committed == set(IDS)


def test_every_gpu_preset_renders_for_both_trainers():
    # (every GPU preset that trains or converts; bandwidth runs mfsdp's own tool only)
    gpu = [n for n, p in sbatch.PRESETS.items()
           if p.values.get("gpus_per_node") and "trainer" in p.values]
    assert "bandwidth" not in gpu and "megatron-lm/bandwidth.sbatch" not in IDS
    assert gpu and all(f"megatron-lm/{n}.sbatch" in IDS for n in gpu)
    with pytest.raises(sbatch.RenderError, match="Megatron-LM's pretrain_gpt.py does not train"):
        sbatch.render("cpu-smoke", {"trainer": "megatron-lm"})


@pytest.mark.parametrize("rel", IDS)
def test_script_is_ascii_and_ends_with_newline(rel):
    data = (SCRIPTS / rel).read_bytes()
    bad = [(i, b) for i, b in enumerate(data) if b > 127]
    assert not bad, f"non-ASCII byte at offset {bad[0][0]}"
    assert data.startswith(b"#!/bin/bash\n")
    assert data.endswith(b"\n") and not data.endswith(b"\n\n")


def _lint(path) -> None:
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    if shutil.which("shellcheck") is None:
        skip_or_fail("shellcheck is not installed (apt-get install shellcheck; .ci/run does it)")
    proc = subprocess.run(["shellcheck", "-s", "bash", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("rel", IDS)
def test_bash_n_and_shellcheck(rel):
    _lint(SCRIPTS / rel)


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
@pytest.mark.parametrize("trainer", ["mfsdp", "megatron-lm"])
def test_both_launchers_lint(tmp_path, trainer, launcher):
    for name in ("llama3-8b-container", "deepseek-v3"):
        path = tmp_path / f"{name}.sbatch"
        path.write_text(sbatch.render(name, {"trainer": trainer, "launcher": launcher}))
        _lint(path)


def _array(text: str, name: str) -> list[str]:
    body = re.search(rf"^{name}=\(\n(.*?)^\)", text, re.S | re.M).group(1)
    return shlex.split(body)


def _appended(text: str) -> list[str]:
    """What the script adds to TRAIN_ARGS when DATA_PATH, TOKENIZER_MODEL and WANDB_API_KEY are
    set (the variables replaced by sample values)."""
    out = []
    for body in re.findall(r"TRAIN_ARGS\+=\((.*)\)", text):
        body = (body.replace('"${DATA_ARGS[@]}"', "0.5 /data/a 0.5 /data/b")
                .replace('"$TOKENIZER_MODEL"', "/tokenizer").replace("$", ""))
        out += shlex.split(body)
    return out


class SnapshotParser(argparse.ArgumentParser):
    """An argparse parser with the flags, arities, types and choices of the snapshot of
    Megatron-LM's parser; errors raise ValueError."""

    TYPES = {"int": int, "float": float}

    def __init__(self):
        super().__init__(allow_abbrev=False, add_help=False)
        by_dest: dict[tuple, list[str]] = {}
        for option, e in SNAPSHOT["flags"].items():
            key = (e["dest"], e["action"], json.dumps(e["nargs"]), e["type"],
                   json.dumps(e["choices"]))
            by_dest.setdefault(key, []).append(option)
        for (dest, action, nargs, typ, choices), options in by_dest.items():
            nargs, choices = json.loads(nargs), json.loads(choices)
            kw: dict = {"dest": dest}
            if action in ("storetrue", "storefalse", "storeconst", "count", "appendconst",
                          "booleanoptional"):
                kw["action"] = {"storetrue": "store_true", "storefalse": "store_false",
                                "count": "count"}.get(action, "store_true")
            else:
                kw["action"] = "append" if action == "append" else "store"
                if nargs is not None:
                    kw["nargs"] = nargs
                kw["type"] = self.TYPES.get(typ, str)
                if choices is not None and kw["type"] is str and \
                        all(isinstance(c, str) and "." not in c for c in choices):
                    kw["choices"] = choices  # (enum choices are written Class.member)
                elif choices is not None and kw["type"] is int:
                    kw["choices"] = choices
            self.add_argument(*options, **kw)

    def error(self, message):
        raise ValueError(message)


def test_the_snapshot_names_its_commit_and_refuses_what_megatron_lm_refuses():
    assert re.fullmatch(r"[0-9a-f]{40}", SNAPSHOT["commit"])
    p = SnapshotParser()
    assert p.parse_args(["--ckpt-format", "fsdp_dtensor"]).ckpt_format == "fsdp_dtensor"
    for bad, why in ((["--no-such-flag"], "unrecognized"), (["--ckpt-format", "zip"], "invalid choice"),
                     (["--num-layers"], "expected one argument"),
                     (["--num-layers", "2.5"], "invalid int"),
                     (["--use-megatron-fsdp", "yes"], "unrecognized")):
        with pytest.raises(ValueError, match=why):
            p.parse_args(bad)


@pytest.mark.parametrize("name, overrides, rel", ALL, ids=IDS)
def test_every_flag_in_a_script_exists(name, overrides, rel):
    text = (SCRIPTS / rel).read_text()
    template = sbatch.PRESETS[name].template
    if overrides.get("trainer") == "megatron-lm":
        if template == "train":
            args = SnapshotParser().parse_args(_array(text, "TRAIN_ARGS") + _appended(text))
            assert args.use_megatron_fsdp and args.ckpt_format == "fsdp_dtensor"
            assert args.data_path and args.tokenizer_type == "NullTokenizer"
        else:
            cmd = SNAPSHOT["checkpoint_inspector"]["convert-torch-dist-to-fsdp-dtensor"]
            argv = _array(text, "CONVERT_ARGS")
            assert argv[0] == "convert-torch-dist-to-fsdp-dtensor"
            positional = [a for a in argv[1:] if not a.startswith("--")]
            flags = [a for a in argv[1:] if a.startswith("--")]
            assert all(f in cmd["options"] for f in flags), flags
            valued = sum(not cmd["options"][f]["flag"] for f in flags)
            assert len(positional) == len(cmd["arguments"]) + valued
        return
    if template == "train":
        args = train.build_parser().parse_args(_array(text, "TRAIN_ARGS") + _appended(text))
        assert args.use_megatron_fsdp and args.tensorboard_dir
    elif template == "bandwidth":
        args = bandwidth.build_parser().parse_args(_array(text, "BANDWIDTH_ARGS"))
        assert args.json == "$BANDWIDTH_JSON" and args.size_mib
    else:
        convert.build_parser().parse_args(_array(text, "CONVERT_ARGS"))


@pytest.mark.parametrize("name", ["llama3-8b", "deepseek-v3", "llama3-70b", "llama3.1-405b",
                                  "llama3-8b-long"])
def test_megatron_lm_scripts_build_the_same_model_and_layout(name):
    """The Megatron-LM script asks for the mfsdp script's model and layout, with the
    Megatron-FSDP flags of the upstream guide; its recomputation is its own (sized by the plan
    of Megatron-LM's Transformer Engine layer, see
    test_gpu_presets_build_the_real_architecture_and_fit), as its preset's megatron_lm values
    give it."""
    from mfsdp.models.gpt import GPT_PRESETS

    ours = train.build_parser().parse_args(_array((SCRIPTS / f"{name}.sbatch").read_text(),
                                                  "TRAIN_ARGS"))
    theirs = SnapshotParser().parse_args(
        _array((SCRIPTS / "megatron-lm" / f"{name}.sbatch").read_text(), "TRAIN_ARGS"))
    cfg = GPT_PRESETS[ours.model_preset]
    for field in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads"):
        assert getattr(theirs, field) == getattr(cfg, field), field
    assert (theirs.num_query_groups or cfg.num_attention_heads) == (cfg.num_query_groups
                                                                     or cfg.num_attention_heads)
    assert theirs.num_experts == (cfg.num_experts or None)
    for field in ("data_parallel_sharding_strategy", "num_distributed_optimizer_instances",
                  "expert_model_parallel_size", "tensor_model_parallel_size",
                  "sequence_parallel", "micro_batch_size",
                  "global_batch_size", "seq_length", "train_iters", "lr", "bf16",
                  "init_model_with_meta_device", "grad_reduce_in_bf16",
                  "exit_signal_handler"):
        flag = "--" + field.replace("_", "-")
        value = getattr(theirs, field)
        if value is None:  # not on the command line: Megatron-LM's default
            value = MEGATRON_DEFAULTS.get(flag)
        assert value == getattr(ours, field), field
    assert theirs.fsdp_double_buffer and theirs.nccl_ub
    mine = sbatch.resolve(name, {"trainer": "megatron-lm"})[1]  # recompute: its own key
    own = train.build_parser().parse_args(
        shlex.split(mine["model_args"]) + recompute_flags(mine["recompute"]))
    for field in ("recompute_granularity", "recompute_method", "recompute_num_layers"):
        value = getattr(theirs, field)
        if value is None:
            value = MEGATRON_DEFAULTS.get("--" + field.replace("_", "-"))
        assert value == getattr(own, field), field
    # context parallelism too is the variant's own (llama3-8b: CP 2 with mfsdp train, none
    # with Megatron-LM, test_llama3_8b_takes_the_faster_context_parallel_size_that_fits)
    assert (theirs.context_parallel_size or 1) == sbatch.resolve(
        name, {"trainer": "megatron-lm"})[1]["cp"]
    assert ours.context_parallel_size == sbatch.resolve(name)[1]["cp"]
    assert theirs.transformer_impl in (None, "transformer_engine")  # what the plan models
    if name == "deepseek-v3":
        assert (theirs.moe_token_dispatcher_type, theirs.moe_flex_dispatcher_backend) == (
            "flex", "hybridep")
        assert theirs.create_all_gather_group and theirs.num_distributed_optimizer_instances == 1


def test_the_70b_script_asks_for_tensor_and_sequence_parallelism():
    args = train.build_parser().parse_args(
        _array((SCRIPTS / "llama3-70b.sbatch").read_text(), "TRAIN_ARGS"))
    assert (args.tensor_model_parallel_size, args.sequence_parallel,
            args.context_parallel_size) == (4, True, 1)
    assert args.distributed_timeout_minutes == 10
    # (TP 1 alone does not fit an H100: rendered anyway, to see its flags)
    text = sbatch.render("llama3-70b", {"tp": "1", "allow_over_memory": "true"})
    assert "--tensor-model-parallel-size" not in text and "--sequence-parallel" not in text
    assert "  --context-parallel-size 2\n" in sbatch.render("llama3-70b", {"cp": "2"})


def test_deepseek_script_builds_the_intended_model():
    args = train.build_parser().parse_args(
        _array((SCRIPTS / "deepseek-v3.sbatch").read_text(), "TRAIN_ARGS"))
    cfg = train.model_config(args)
    assert (cfg.num_layers, cfg.num_experts, cfg.moe_router_topk, cfg.moe_first_dense_layers) == (
        61, 256, 8, 3)
    assert args.expert_model_parallel_size == 32 and args.num_distributed_optimizer_instances == 1


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-70b", "deepseek-v3", "llama3.1-405b",
                                  "llama3-8b-long", "llama3-8b-container"])
def test_gpu_presets_build_the_real_architecture_and_fit(name):
    """The script's flags build the published architecture, and the planner, on the script's
    own layout, says it fits on 80 GiB GPUs (the 405B preset on 256 of them, with FSDP x TP 2;
    the long-context 8B with 64K-token sequences split over CP 4; the 8B with 8K-token
    sequences over CP 2, without recomputation)."""
    from mfsdp.models.gpt import GPT_PRESETS
    from mfsdp.tools.plan import Layout, ModelConfig, plan

    args = train.build_parser().parse_args(_array((SCRIPTS / f"{name}.sbatch").read_text(),
                                                  "TRAIN_ARGS"))
    cfg = train.model_config(args)
    assert cfg.normalization == "RMSNorm" and cfg.position_embedding_type == "rope"
    assert cfg.swiglu and not cfg.add_bias_linear
    assert cfg.multi_latent_attention == (name == "deepseek-v3")
    for field in ("hidden_size", "num_layers", "num_query_groups", "num_experts", "vocab_size"):
        assert getattr(cfg, field) == getattr(GPT_PRESETS[args.model_preset], field), field
    assert args.model_preset == name.removesuffix("-long").removesuffix("-container")
    world = int(sbatch.PRESETS[name].values["nodes"]) * int(sbatch.PRESETS[name].values["gpus_per_node"])
    layout = Layout(world, args.data_parallel_sharding_strategy,
                    args.num_distributed_optimizer_instances, args.outer_dp_sharding_strategy,
                    args.expert_model_parallel_size, micro_batch=args.micro_batch_size,
                    tp=args.tensor_model_parallel_size, cp=args.context_parallel_size,
                    sequence_parallel=args.sequence_parallel,
                    seq_length=args.seq_length, recompute_granularity=args.recompute_granularity,
                    recompute_method=args.recompute_method or "uniform",
                    recompute_num_layers=args.recompute_num_layers or 1,
                    grad_comm_bytes=2 if args.grad_reduce_in_bf16 else None)
    p = plan(ModelConfig.from_gpt(cfg), layout)
    assert p.fits(80), p.table()
    # and not tightly: the planner's margin (`mfsdp plan` calls a plan with less spare "tight")
    from mfsdp.tools.plan_cli import TIGHT_GIB

    assert p.fits(80 - TIGHT_GIB), f"{name} leaves under {TIGHT_GIB} GiB spare:\n{p.table()}"
    # what the render says of the script's memory is this plan of its own flags
    from mfsdp.tools.sbatch.schedule import schedule

    assert schedule(sbatch.resolve(name)[1]).peak_bytes == pytest.approx(p.total, rel=1e-12)


@pytest.mark.parametrize("trainer", ["mfsdp", "megatron-lm"])
def test_llama3_8b_takes_the_faster_context_parallel_size_that_fits(trainer):
    """On the preset's 16 H100s, each trainer's llama3-8b variant uses the context-parallel
    size (1, 2 or 4, each with the fewest block-recomputed layers that leave TIGHT_GIB of 80
    spare in the plan of that trainer's layer) whose planner step is the shortest: CP 2 without
    recomputation for mfsdp train (its measured layer needs 3 recomputed layers without CP),
    CP 1 without recomputation for Megatron-LM's Transformer Engine layer. The global batch
    divides over the data-parallel ranks (the render refuses otherwise)."""
    from mfsdp.tools.plan import PRESETS, Layout, estimate, plan
    from mfsdp.tools.plan_cli import TIGHT_GIB

    impl = "local" if trainer == "mfsdp" else "transformer_engine"
    v = sbatch.resolve("llama3-8b", {"trainer": trainer})[1]
    model = PRESETS["llama3-8b"]

    def cheapest(cp):  # the layout of cp with the fewest recomputed layers that fit
        for n in range(model.num_layers + 1):
            recompute = (dict(recompute_granularity="full", recompute_method="block",
                              recompute_num_layers=n) if n else {})
            layout = Layout(16, seq_length=8192, micro_batch=1, cp=cp, grad_comm_bytes=2,
                            micro_batches=512 // (16 // cp), transformer_impl=impl,
                            **recompute)
            if plan(model, layout).fits(80 - TIGHT_GIB):
                return n, estimate(model, layout, "h100").step_s
        raise AssertionError(f"cp={cp}: no recomputation fits")

    options = {cp: cheapest(cp) for cp in (1, 2, 4)}
    best = min(options, key=lambda cp: options[cp][1])
    assert v["cp"] == best, options
    words = shlex.split(v["model_args"])
    n = (int(words[words.index("--recompute-num-layers") + 1])
         if "--recompute-granularity" in words else 0)
    assert n == options[best][0], options
    assert (v["cp"], n) == ((2, 0) if trainer == "mfsdp" else (1, 0))
    if trainer == "mfsdp":  # what the Slurm page says CP 1 would cost: 3 of 32 layers
        assert options[1][0] == 3 and options[1][1] > options[2][1], options
    assert 512 % (16 // v["cp"]) == 0


_MEGATRON_LM_GPU_PRESETS = [name for name, p in sbatch.PRESETS.items()
                            if p.megatron_lm and p.template == "train"]


@pytest.mark.parametrize("name", _MEGATRON_LM_GPU_PRESETS)
def test_megatron_lm_variants_recompute_the_least_that_keeps_5_gib_spare(name):
    """Each GPU preset's Megatron-LM script, planned with Megatron-LM's Transformer Engine
    layer (its default --transformer-impl) on the layout written out from the script's own
    flags, leaves TIGHT_GIB of 80 GiB spare, and recomputes as little as that allows: one
    block-recomputed layer fewer (or none instead of one) would leave under TIGHT_GIB spare;
    the render's memory figure is this plan."""
    from dataclasses import replace

    from mfsdp.tools.plan import GiB, Layout, ModelConfig, plan
    from mfsdp.tools.plan_cli import TIGHT_GIB
    from mfsdp.tools.sbatch.schedule import schedule

    text = (SCRIPTS / "megatron-lm" / f"{name}.sbatch").read_text()
    theirs = SnapshotParser().parse_args(_array(text, "TRAIN_ARGS"))
    assert theirs.transformer_impl is None  # Megatron-LM's default: transformer_engine
    assert MEGATRON_DEFAULTS["--transformer-impl"] == "transformer_engine"
    # the model: the mfsdp script's (the same, test_megatron_lm_scripts_build_the_same_model...)
    ours = train.build_parser().parse_args(_array((SCRIPTS / f"{name}.sbatch").read_text(),
                                                  "TRAIN_ARGS"))
    model = ModelConfig.from_gpt(train.model_config(ours))
    v = sbatch.PRESETS[name].values
    world = v["nodes"] * v["gpus_per_node"]
    dp = world // (theirs.tensor_model_parallel_size or 1) // (theirs.context_parallel_size or 1)
    layout = Layout(world, theirs.data_parallel_sharding_strategy,
                    theirs.num_distributed_optimizer_instances or 1,
                    theirs.outer_dp_sharding_strategy or "no_shard",
                    theirs.expert_model_parallel_size or 1, micro_batch=theirs.micro_batch_size,
                    micro_batches=theirs.global_batch_size // (theirs.micro_batch_size * dp),
                    tp=theirs.tensor_model_parallel_size or 1,
                    cp=theirs.context_parallel_size or 1,
                    sequence_parallel=bool(theirs.sequence_parallel),
                    seq_length=theirs.seq_length,
                    recompute_granularity=theirs.recompute_granularity,
                    recompute_method=theirs.recompute_method or "uniform",
                    recompute_num_layers=theirs.recompute_num_layers or 1,
                    grad_comm_bytes=2 if theirs.grad_reduce_in_bf16 else None,
                    transformer_impl="transformer_engine")
    p = plan(model, layout)
    assert p.fits(80 - TIGHT_GIB), f"{name} leaves under {TIGHT_GIB} GiB spare:\n{p.table()}"
    if theirs.recompute_granularity is not None:  # and no less recomputation would
        assert (theirs.recompute_granularity, theirs.recompute_method) == ("full", "block")
        n = theirs.recompute_num_layers
        fewer = (replace(layout, recompute_num_layers=n - 1) if n > 1 else
                 replace(layout, recompute_granularity=None, recompute_method="uniform",
                         recompute_num_layers=1))
        less = plan(model, fewer)
        assert not less.fits(80 - TIGHT_GIB), (
            f"{name}: {n - 1} recomputed layers would leave {76 - less.total / GiB:.2f} GiB "
            "spare; recompute fewer")
    s = schedule(sbatch.resolve(name, {"trainer": "megatron-lm"})[1])
    assert s.peak_bytes == pytest.approx(p.total, rel=1e-12)
    assert s.transformer_impl == "transformer_engine"


def test_megatron_lm_render_names_the_transformer_engine_plan(capsys):
    """A Megatron-LM render says, on stderr and in its header, that its plan is of Megatron-LM's
    Transformer Engine layers, and its peak is that plan's, not the mfsdp render's (the same
    model and layout with mfsdp train's layer); --transformer-impl local in its extra_args
    plans it with the local layer."""
    from mfsdp.cli import main
    from mfsdp.tools.plan import PRESETS, Layout, plan

    peaks = {}
    for trainer in ("mfsdp", "megatron-lm"):
        assert main(["sbatch", "render", "llama3-70b", "--set", f"trainer={trainer}"]) == 0
        out, err = capsys.readouterr()
        memory = [line for line in err.splitlines() if "memory:" in line]
        assert len(memory) == 1, err
        peaks[trainer] = float(re.search(r"peak is ([\d.]+) GiB", memory[0]).group(1))
        header = " ".join(line[2:] for line in out.splitlines()[2:8])
        layers = ("Megatron-LM's Transformer Engine layers" if trainer == "megatron-lm" else
                  "mfsdp train's layers")
        assert f"GiB per GPU with {layers};" in memory[0], memory[0]
        assert f"the plan of {layers}" in header, header
    # the hand-written layout of the 70B script (64 H100s, TP 4 with SP, 512 x 8,192 tokens)
    layout = dict(world_size=64, tp=4, sequence_parallel=True, seq_length=8192,
                  micro_batch=1, micro_batches=512 // 16, grad_comm_bytes=2)
    local = plan(PRESETS["llama3-70b"], Layout(
        recompute_granularity="full", recompute_method="block", recompute_num_layers=26,
        **layout)).total / 2**30
    engine = plan(PRESETS["llama3-70b"], Layout(transformer_impl="transformer_engine",
                                                **layout)).total / 2**30
    assert peaks == {"mfsdp": pytest.approx(local, abs=0.051),
                     "megatron-lm": pytest.approx(engine, abs=0.051)}  # (printed to 0.1)
    assert peaks["megatron-lm"] != peaks["mfsdp"]
    # (mfsdp train's layer without recomputation needs more than an H100: allowed, to see it)
    assert main(["sbatch", "render", "llama3-70b", "--set", "trainer=megatron-lm", "--set",
                 "extra_args=--transformer-impl local", "--set",
                 "allow_over_memory=true"]) == 0
    err = capsys.readouterr().err
    assert "GiB per GPU with mfsdp train's layers;" in err, err
    assert f"peak is {plan(PRESETS['llama3-70b'], Layout(**layout)).total / 2**30:.1f} " in err


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-70b", "deepseek-v3", "llama3.1-405b",
                                  "llama3-8b-long", "gpu-smoke"])
def test_gpu_presets_save_inside_a_job_and_reduce_as_the_numerics_page_says(name):
    """Every GPU preset saves at least three times per job at the planner's step time (a
    crash without SIGTERM then loses at most a third of a job), and reduces gradients in bf16
    only over groups of at most 64 ranks (``docs/numerics.md``); the render's own lines say
    so, and warn when a user's values do not."""
    from mfsdp.tools.sbatch.checks import time_limit_seconds
    from mfsdp.tools.sbatch.schedule import BF16_REDUCE_MAX_RANKS, schedule, schedule_lines

    v = sbatch.resolve(name)[1]
    s = schedule(v)
    assert 3 * v["save_interval"] * s.step_s <= time_limit_seconds(v["time"]), name
    assert not v["grad_reduce_in_bf16"] or s.shard_ranks <= BF16_REDUCE_MAX_RANKS, name
    assert not any("WARNING" in line for line in schedule_lines(v)), schedule_lines(v)
    worse = sbatch.resolve(name, {"save_interval": "100000", "grad_reduce_in_bf16": "true"})[1]
    warned = [line for line in schedule_lines(worse) if "WARNING" in line]
    assert any("no save inside a job" in line for line in warned), warned
    assert any("bf16" in line for line in warned) == (s.shard_ranks > BF16_REDUCE_MAX_RANKS)


def test_container_flags_only_with_an_image(tmp_path):
    assert "--container-image" not in sbatch.render("llama3-8b")
    assert "MFSDP_SRC" not in sbatch.render("llama3-8b")
    text = sbatch.render("llama3-8b", {"container_image": "nvcr.io#nvidia/pytorch:25.01-py3",
                                       "container_mounts": "/lustre:/lustre"})
    assert "  --container-image='nvcr.io#nvidia/pytorch:25.01-py3'\n" in text
    # (inside the quotes: container_mounts holds no character the shell reads there)
    assert '--container-mounts="$CODE_MOUNT,$PWD:$PWD,$LOG_DIR:$LOG_DIR,/lustre:/lustre"\n' in text
    path = tmp_path / "mounts.sbatch"
    path.write_text(text)
    _lint(path)
    assert 'srun --kill-on-bad-exit=1 "${CONTAINER_ARGS[@]}" \\\n' in text
    assert 'export PYTHONPATH="/opt/mfsdp' in text
    assert "transformers when TOKENIZER_MODEL is set" in text  # what the image must hold
    assert "submit from the mfsdp checkout" in text
    conv = sbatch.render("convert", {"container_image": "img"})
    assert 'srun --kill-on-bad-exit=1 "${CONTAINER_ARGS[@]}" \\\n' in conv and "--container-image=img" in conv
    mlm = sbatch.render("llama3-8b-container", {"trainer": "megatron-lm"})
    assert 'CODE_MOUNT="$MEGATRON_LM_DIR:$MEGATRON_LM_DIR"' in mlm and "MFSDP_SRC" not in mlm


def test_signal_requeue_and_singleton_follow_the_keys():
    text = sbatch.render("llama3-8b")
    assert "#SBATCH --signal=B:TERM@120\n" in text and "  --exit-signal-handler\n" in text
    assert "#SBATCH --requeue\n" in text and "#SBATCH --dependency=singleton\n" in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text and "trap on_sigterm TERM" in text
    assert "pkill -TERM -P" in text  # torchrun's children, the ranks, not torchrun
    assert "--max-restarts" not in text
    off = sbatch.render("llama3-8b", {"signal_seconds": "0", "max_restarts": "2",
                                      "requeue": "false"})
    assert "--signal" not in off and "--exit-signal-handler" not in off
    assert "trap on_sigterm" not in off
    assert "--requeue" not in off and "scontrol requeue" not in off
    assert "  --max-restarts 2\n" in off
    srun = sbatch.render("llama3-8b", {"launcher": "srun"})
    assert "#SBATCH --ntasks-per-node=8\n" in srun and "#SBATCH --cpus-per-task=8\n" in srun
    assert 'scancel --signal=TERM "$SLURM_JOB_ID"' in srun and "torch.distributed.run" not in srun
    assert '--output="$JOB_DIR/ranks/rank-%t.log"' in srun
    assert "--signal" not in sbatch.render("cpu-smoke")  # no checkpoints: nothing to save


def test_rendezvous_port_from_the_job_id():
    assert "RDZV_PORT=$((15000 + SLURM_JOB_ID % 15000))" in sbatch.render("llama3-8b")
    assert "RDZV_PORT=29400\n" in sbatch.render("llama3-8b", {"rdzv_port": "29400"})


def test_empty_data_path_fails_at_once_unless_mock_data():
    text = sbatch.render("llama3-8b")
    check = text.index('if [[ -z "$DATA_PATH" ]]; then')
    assert check < text.index("PYTHON=") and "exit 2" in text[check:check + 400]
    assert "MOCK DATA" not in text
    mock = sbatch.render("llama3-8b", {"mock_data": "true"})
    assert "MOCK DATA" in mock and "DATA_PATH is empty: submit" not in mock


# ---- values are literal strings -----------------------------------------------------------

NASTY = {
    "save": "ckpt/run 1/$(touch INJECTED)",
    "load": "/ckpt/with space/`touch INJECTED2`",
    "data_path": '/data/a"b_text_document',
    "tokenizer_model": "/tok/it's ${HOME}",
    "log_jsonl": "/logs/a;touch INJECTED3.jsonl",
    "extra_args": "--exit-interval 7 --tensorboard-queue-size '1'",
    "env_setup": "true",
}


def _values_in_bash(text: str, tmp_path) -> dict:
    """Run the script's assignments and TRAIN_ARGS under bash in ``tmp_path`` and return what
    bash made of them (nothing else of the script runs)."""
    keep = [line for line in text.splitlines()
            if re.match(r"^(DATA_PATH|TOKENIZER_MODEL|CHECKPOINT_DIR|LOAD_FROM|LOG_DIR|JOB_DIR|"
                        r"TENSORBOARD_DIR|METRICS_JSONL|DATA_CACHE_DIR)=", line)]
    body = re.search(r"^TRAIN_ARGS=\(\n.*?^\)\n", text, re.S | re.M).group(0)
    prog = "\n".join(["set -eu", "SLURM_JOB_NAME=j SLURM_JOB_ID=1", *keep, body,
                      'printf "%s\\n" "$DATA_PATH" "$TOKENIZER_MODEL" "${CHECKPOINT_DIR-}"',
                      'printf "%s\\0" "${TRAIN_ARGS[@]}" > args.bin'])
    env = {"PATH": "/usr/bin:/bin", "HOME": "/home/u"}
    proc = subprocess.run(["bash", "-c", prog], cwd=tmp_path, env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    data, tok, ckpt = proc.stdout.splitlines()
    args = (tmp_path / "args.bin").read_text().split("\0")[:-1]
    return {"data": data, "tok": tok, "ckpt": ckpt, "args": args}


@pytest.mark.parametrize("trainer", ["mfsdp", "megatron-lm"])
def test_values_render_as_literal_strings(tmp_path, trainer):
    values = dict(NASTY)
    preset = "llama3-8b"
    if trainer == "megatron-lm":
        values.pop("log_jsonl")
    text = sbatch.render(preset, dict(values, trainer=trainer))
    got = _values_in_bash(text, tmp_path)
    assert not list(tmp_path.glob("INJECTED*"))
    assert got["data"] == NASTY["data_path"] and got["tok"] == NASTY["tokenizer_model"]
    assert got["ckpt"] == f"{tmp_path}/{NASTY['save']}"
    args = got["args"]
    assert args[args.index("--save") + 1] == f"{tmp_path}/{NASTY['save']}"
    assert args[args.index("--load") + 1] == NASTY["load"]
    assert args[args.index("--exit-interval") + 1] == "7"
    if trainer == "mfsdp":
        assert args[args.index("--log-jsonl") + 1] == NASTY["log_jsonl"]
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    _lint(path)


@pytest.mark.parametrize("overrides, message", [
    ({"time": "two hours"}, "time='two hours' is not a Slurm time limit"),
    ({"time": "0"}, "under one minute"),
    ({"cpus_per_task": "0"}, "cpus_per_task=0: Slurm needs at least 1 CPU"),
    ({"rdzv_port": "70000"}, "rdzv_port=70000: a TCP port from 1024 to 65535"),
    ({"rdzv_port": "80"}, "rdzv_port=80"),
    ({"job_name": "my\njob"}, "a newline or control character cannot be part of job_name"),
    ({"job_name": "my job"}, "job_name='my job': Slurm reads it from an #SBATCH line"),
    ({"partition": "gpu;rm"}, "partition='gpu;rm'"),
    ({"output": "log dir/%j.log"}, "output='log dir/%j.log'"),
    ({"save": "ckpt\nrm -rf /"}, "a newline or control character cannot be part of save"),
    ({"data_path": "/data/x\n"}, "cannot be part of data_path"),
    ({"save": "~/ckpt"}, "a leading ~ is not expanded"),
    ({"extra_args": "--foo 'unbalanced"}, "No closing quotation"),
    ({"container_mounts": "/a:/b $(id)"}, "pyxis takes src:dst"),
    ({"signal_seconds": "14400"}, "signal_seconds=14400 is not less than the time limit"),
    ({"signal_seconds": "70000"}, "signal_seconds=70000: Slurm's --signal takes 0 to 65535"),
    ({"lr": "nan"}, "lr=nan must be a finite number"),
    ({"lr": "-1"}, "lr=-1.0 must be positive"),
    ({"split": "90,x,10"}, "split='90,x,10'"),
    ({"launcher": "mpirun"}, "choose one of torchrun, srun"),
    ({"launcher": "srun", "max_restarts": "1"}, "max_restarts is torchrun's"),
    ({"trainer": "megatron-lm", "megatron_lm_dir": "Megatron-LM"}, "must be an absolute path"),
    ({"trainer": "megatron-lm", "model_args": "--model-preset gpt-9 --num-layers 2"},
     "needs --model-preset NAME"),
    ({"flex_backend": "hybridep", "num_experts": "8", "ep": "8", "dispatcher": "flex",
      "model_args": "--model-preset deepseek-proxy"}, "flex_backend='hybridep' is not one of"),
    ({"save_interval": "0"}, "save_interval=0 must be at least 1"),
    ({"nccl_ub": "true"}, "nccl_ub=true: mfsdp train refuses --use-nccl-ub"),
    ({"trainer": "megatron-lm", "compile": "true"}, "compile=true is mfsdp train's --compile: "),
    ({"trainer": "megatron-lm", "fused_adam": "true"},
     "fused_adam=true is mfsdp train's --fused-adam: "),
])
def test_values_slurm_or_the_trainer_would_refuse_fail_at_render_time(overrides, message):
    with pytest.raises(sbatch.RenderError, match=re.escape(message)) as err:
        sbatch.render("llama3-8b", overrides)
    assert "\n" not in str(err.value).replace(repr("\n")[1:-1], "")  # one line


@pytest.mark.parametrize("preset, overrides, message", [
    ("nope", {}, "unknown preset 'nope'"),
    ("cpu-smoke", {"colour": "red"}, "unknown key 'colour'"),
    ("cpu-smoke", {"nodes": "2.5"}, "nodes must be an integer"),
    ("cpu-smoke", {"bf16": "maybe"}, "bf16 must be true or false"),
    ("cpu-smoke", {"strategy": "zero3"}, "choose one of"),
    ("convert", {"ep": "2"}, "does not use 'ep'"),
    ("convert", {"trainer": "megatron-lm", "to_format": "hf"}, "torch_dist to fsdp_dtensor only"),
    ("convert", {"trainer": "megatron-lm", "gpus_per_node": "0"}, "converts on GPUs"),
    ("deepseek-v3", {"nodes": "3"}, "3 x 8 = 24 ranks cannot be split"),
    ("llama3-8b", {"nodes": "3"}, "not divisible by micro_batch_size x data-parallel ranks = 1 x 12"),
    ("cpu-smoke", {"ep": "2"}, "needs an MoE model"),
    ("llama3-70b", {"tp": "16"}, "tp=16 exceeds ranks_per_node=8"),
    ("llama3-70b", {"tp": "8", "cp": "3"}, "cannot be split with tp=8 x cp=3"),
    ("llama3-70b", {"global_batch_size": "120"}, "micro_batch_size x data-parallel ranks = 1 x 16"),
    ("cpu-smoke", {"distributed_timeout_minutes": "0"}, "distributed_timeout_minutes must be positive"),
])
def test_render_errors(preset, overrides, message):
    with pytest.raises(sbatch.RenderError, match=re.escape(message)):
        sbatch.render(preset, overrides)


def test_cli_render_to_file_and_one_line_errors(tmp_path, capsys):
    from mfsdp.cli import main

    out = tmp_path / "job.sbatch"
    assert main(["sbatch", "render", "cpu-smoke", "--set", "train_iters=3", "--set",
                 "save=a b", "-o", str(out)]) == 0
    assert "--train-iters 3" in out.read_text()
    assert "--set train_iters=3 --set 'save=a b'" in out.read_text()  # how it was rendered
    capsys.readouterr()
    assert main(["sbatch", "render", "cpu-smoke", "--set", "time=two hours"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "time='two hours'" in err, err


@pytest.mark.parametrize("rel", IDS)
def test_srun_gets_the_cpu_count_and_stops_on_a_failed_rank(rel):
    # Since Slurm 22.05 srun does not inherit --cpus-per-task: SRUN_CPUS_PER_TASK carries it.
    text = (SCRIPTS / rel).read_text()
    export = text.index("export SRUN_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-")
    srun = text.index("\nsrun --kill-on-bad-exit=1")
    assert export < srun


def test_env_setup_is_rendered_before_python_is_used_and_its_absence_is_caught():
    text = sbatch.render("cpu-smoke", {"env_setup": "source /opt/venvs/mfsdp/bin/activate"})
    assert text.index("source /opt/venvs/mfsdp/bin/activate") < text.index("PYTHON=")
    plain = (SCRIPTS / "cpu-smoke.sbatch").read_text()
    assert "finds no mfsdp (or no torch): render with --set env_setup=" in plain
    mlm = (SCRIPTS / "megatron-lm" / "llama3-8b.sbatch").read_text()
    assert "holds no pretrain_gpt.py" in mlm and "finds no torch and megatron.core" in mlm


def test_provenance_and_per_rank_logs_are_in_every_training_script():
    for name, overrides, rel in ALL:
        text = (SCRIPTS / rel).read_text()
        for what in ('cp "$0" "$PROVENANCE/job.sbatch"', "pip freeze", "nvidia-smi",
                     'git -C "$CODE_DIR" rev-parse HEAD', "NCCL|UCX|CUDA"):
            assert what in text, (rel, what)
        if sbatch.PRESETS[name].template == "train":
            assert '--log-dir "$1/ranks/node-$SLURM_NODEID"' in text and "--tee 3" in text
            assert '--tensorboard-dir\n' not in text and '--tensorboard-dir "$TENSORBOARD_DIR"' in text


GUIDE_FLAGS = json.loads((ROOT / "tests" / "fixtures" / "megatron_fsdp_guide_flags.json")
                         .read_text())


@pytest.mark.parametrize("name", [n for n, p in sbatch.PRESETS.items()
                                  if p.template == "train" and p.values["gpus_per_node"]])
def test_megatron_lm_renders_carry_the_flags_of_upstreams_guide_scripts(name):
    """Every flag that all of upstream's Megatron-FSDP example scripts pass
    (tools/upstream_fsdp_flags.py wrote them from Megatron-LM's examples/megatron_fsdp/) is on
    the Megatron-LM render's command line, and parses with Megatron-LM's parser."""
    shared = set.intersection(*(set(f) for f in GUIDE_FLAGS["scripts"].values()))
    assert {"--use-distributed-optimizer", "--no-gradient-accumulation-fusion"} <= shared
    argv = _array(sbatch.render(name, {"trainer": "megatron-lm"}), "TRAIN_ARGS")
    assert not shared - set(argv), f"{name}: missing {sorted(shared - set(argv))}"
    args = SnapshotParser().parse_args(argv + ["--mock-data"])
    assert args.use_distributed_optimizer and not args.gradient_accumulation_fusion
    assert args.overlap_grad_reduce and args.overlap_param_gather
    assert args.calculate_per_token_loss


@pytest.mark.parametrize("trainer", ["mfsdp", "megatron-lm"])
@pytest.mark.parametrize("name", [n for n, p in sbatch.PRESETS.items() if p.template == "train"
                                  and (p.values["gpus_per_node"] or n == "cpu-smoke")])
def test_every_preset_warms_up_and_decays(name, trainer):
    """The learning rate starts low, reaches --lr after the warm-up and decays to --min-lr: the
    render's flags read by each trainer's own parser (Megatron-LM's snapshot, mfsdp train's)."""
    if trainer == "megatron-lm" and name == "cpu-smoke":
        pytest.skip("Megatron-LM renders are GPU jobs")
    argv = _array(sbatch.render(name, {"trainer": trainer}), "TRAIN_ARGS") + ["--mock-data"]
    parser = SnapshotParser() if trainer == "megatron-lm" else train.build_parser()
    args = parser.parse_args(argv)
    assert args.lr_warmup_iters > 0 and args.lr_decay_style == "cosine"
    assert 0 < args.min_lr < args.lr and args.lr_warmup_iters < args.train_iters


@pytest.mark.parametrize("overrides, message", [
    ({"min_lr": "1"}, "min_lr=1.0 must be from 0 to lr"),
    ({"lr_warmup_iters": "20"}, "lr_warmup_iters=20 must be less than train_iters=10"),
    ({"lr_decay_style": "WSD"}, "lr_decay_style"),
])
def test_a_schedule_the_trainers_would_refuse_fails_at_render_time(overrides, message):
    with pytest.raises(sbatch.RenderError, match=re.escape(message)):
        sbatch.render("cpu-smoke", overrides)


def test_list_aligns_every_name_with_its_description(capsys):
    """``mfsdp sbatch list``: each preset's description, and each key's type, starts in one
    column, with at least one space after the longest name (``llama3-8b-container``,
    ``distributed_timeout_minutes``)."""
    assert sbatch.main(["list"]) == 0
    presets, keys = capsys.readouterr().out.rstrip("\n").split("\n\n")
    for block, names in ((presets, sbatch.PRESETS), (keys, sbatch.SCHEMA)):
        lines = block.splitlines()
        assert [line.split(" ", 1)[0] for line in lines] == list(names)
        starts = {len(line) - len(line[len(name):].lstrip(" ")) for line, name in
                  zip(lines, names)}
        assert starts == {max(map(len, names)) + 1}, starts


# The planner's layout of each GPU preset, written out by hand from the preset's values (16, 64
# or 256 H100s, global batch 512 of 8,192 tokens, one sequence per micro-batch, gradients
# reduced in bf16; llama3-8b: context parallelism 2, so 8 data-parallel ranks, and no
# recomputation), and its Megatron-Bridge schedule: 1,168,251 iterations.
_SCHEDULES = {
    "llama3-8b": ("llama3-8b", dict(world_size=16, cp=2, micro_batches=512 // 8)),
    "llama3-70b": ("llama3-70b", dict(world_size=64, tp=4, sequence_parallel=True,
                                      recompute_granularity="full", recompute_method="block",
                                      recompute_num_layers=26, micro_batches=512 // 16)),
}


@pytest.mark.parametrize("name", list(_SCHEDULES))
def test_render_says_how_long_the_schedule_takes(name, capsys):
    """``mfsdp sbatch render`` says on stderr, not in the script: the schedule's tokens
    (iterations x global batch x sequence length), the planner's step time for the script's
    layout on an H100 and their product, and the key that shortens it."""
    from mfsdp.cli import main
    from mfsdp.tools.plan import PRESETS, Layout, estimate, plan

    model, layout = _SCHEDULES[name]
    step = estimate(PRESETS[model], Layout(seq_length=8192, micro_batch=1, grad_comm_bytes=2,
                                           **layout), "h100").step_s
    for iters, said in ((1_168_251, f"about {1_168_251 * step / 86400:,.0f} days"),
                        (1000, f"about {1000 * step / 3600:,.1f} hours")):
        assert main(["sbatch", "render", name, "--set", f"train_iters={iters}", "--set",
                     "lr_warmup_iters=500"]) == 0
        out, err = capsys.readouterr()
        tokens = iters * 512 * 8192
        long = iters * step > 86400  # the hint to shorten it only for more than a day
        lines = err.splitlines()
        assert lines[:1 + long] == [
            f"mfsdp sbatch: schedule: {iters:,} iterations x 512 sequences x 8,192 tokens = "
            f"{tokens / (1e12 if tokens >= 1e12 else 1e9):,.2f}{'T' if tokens >= 1e12 else 'B'} "
            f"tokens; at the planner's {step:.2f} s a step ({layout['world_size']} x H100 SXM), "
            f"{said} of chained jobs",
            "mfsdp sbatch: for a trial, shorten it with --set train_iters=N --set "
            "lr_warmup_iters=M (M < N)"][:1 + long]
        lines = lines[1 + long:]
        peak = plan(PRESETS[model], Layout(seq_length=8192, micro_batch=1, grad_comm_bytes=2,
                                           **layout)).total / 2**30
        assert lines[0] == (f"mfsdp sbatch: memory: the planner's peak is {peak:.1f} "
                            f"GiB per GPU with mfsdp train's layers; fits 80 GiB GPUs (at "
                            f"most 76 GiB)")
        assert "mfsdp sbatch: schedule:" not in out and out.startswith("#!/bin/bash")
        s = sbatch_schedule(sbatch.resolve(name, {"train_iters": str(iters),
                                                  "lr_warmup_iters": "500"})[1])
        assert s.seconds == pytest.approx(iters * step, rel=1e-12)
    assert main(["sbatch", "render", "cpu-smoke"]) == 0  # a CPU job: no planner figure
    assert capsys.readouterr().err == ""


def sbatch_schedule(values):
    """:func:`mfsdp.tools.sbatch.schedule.schedule` of resolved values."""
    from mfsdp.tools.sbatch.schedule import schedule

    return schedule(values)
