"""Rendered sbatch scripts: committed = fresh render, ASCII, newline-terminated, ``bash -n`` and
``shellcheck`` clean, every trainer flag they pass exists, and bad input fails clearly."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess

import pytest
from conftest import ROOT, skip_or_fail

from mfsdp import sbatch, train
from mfsdp.checkpoint import convert

SCRIPTS = ROOT / "example-scripts"
PRESETS = sorted(sbatch.PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_committed_script_equals_fresh_render(name):
    path = SCRIPTS / f"{name}.sbatch"
    assert path.exists(), f"{path} missing: run `mfsdp sbatch render-all example-scripts`"
    assert path.read_text() == sbatch.render(name), (
        f"{path} differs from a fresh render: run `mfsdp sbatch render-all example-scripts`")


@pytest.mark.parametrize("name", PRESETS)
def test_script_is_ascii_and_ends_with_newline(name):
    data = (SCRIPTS / f"{name}.sbatch").read_bytes()
    bad = [(i, b) for i, b in enumerate(data) if b > 127]
    assert not bad, f"non-ASCII byte at offset {bad[0][0]}"
    assert data.startswith(b"#!/bin/bash\n")
    assert data.endswith(b"\n") and not data.endswith(b"\n\n")


@pytest.mark.parametrize("name", PRESETS)
def test_bash_n_and_shellcheck(name):
    path = SCRIPTS / f"{name}.sbatch"
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    if shutil.which("shellcheck") is None:
        skip_or_fail("shellcheck is not installed (apt-get install shellcheck; .ci/run does it)")
    proc = subprocess.run(["shellcheck", "-s", "bash", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def _array(text: str, name: str) -> list[str]:
    body = re.search(rf"^{name}=\(\n(.*?)^\)", text, re.S | re.M).group(1)
    return shlex.split(body)


@pytest.mark.parametrize("name", PRESETS)
def test_every_flag_in_a_script_exists(name):
    text = (SCRIPTS / f"{name}.sbatch").read_text()
    if sbatch.PRESETS[name].template == "train":
        args = train.build_parser().parse_args(_array(text, "TRAIN_ARGS"))
        assert args.use_megatron_fsdp
    else:
        convert.build_parser().parse_args(_array(text, "CONVERT_ARGS"))


def test_the_70b_script_asks_for_tensor_and_sequence_parallelism():
    args = train.build_parser().parse_args(
        _array((SCRIPTS / "llama3-70b.sbatch").read_text(), "TRAIN_ARGS"))
    assert (args.tensor_model_parallel_size, args.sequence_parallel,
            args.context_parallel_size) == (4, True, 1)
    assert args.distributed_timeout_minutes == 10
    text = sbatch.render("llama3-70b", {"tp": "1"})
    assert "--tensor-model-parallel-size" not in text and "--sequence-parallel" not in text
    assert "  --context-parallel-size 2\n" in sbatch.render("llama3-70b", {"cp": "2"})


def test_deepseek_script_builds_the_intended_model():
    args = train.build_parser().parse_args(
        _array((SCRIPTS / "deepseek-v3.sbatch").read_text(), "TRAIN_ARGS"))
    cfg = train.model_config(args)
    assert (cfg.num_layers, cfg.num_experts, cfg.moe_router_topk, cfg.moe_first_dense_layers) == (
        61, 256, 8, 3)
    assert args.expert_model_parallel_size == 8 and args.num_distributed_optimizer_instances == 4


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-70b", "deepseek-v3", "llama3.1-405b",
                                  "llama3-8b-long"])
def test_gpu_presets_build_the_real_architecture_and_fit(name):
    """The script's flags build the published architecture, and the planner, on the script's
    own layout, says it fits on 80 GiB GPUs (the 405B preset on 256 of them, with FSDP x TP 2;
    the long-context 8B with 64K-token sequences split over CP 2)."""
    from mfsdp.models.gpt import GPT_PRESETS
    from mfsdp.plan import Layout, ModelConfig, plan

    args = train.build_parser().parse_args(_array((SCRIPTS / f"{name}.sbatch").read_text(),
                                                  "TRAIN_ARGS"))
    cfg = train.model_config(args)
    assert cfg.normalization == "RMSNorm" and cfg.position_embedding_type == "rope"
    assert cfg.swiglu and not cfg.add_bias_linear
    assert cfg.multi_latent_attention == (name == "deepseek-v3")
    for field in ("hidden_size", "num_layers", "num_query_groups", "num_experts", "vocab_size"):
        assert getattr(cfg, field) == getattr(GPT_PRESETS[args.model_preset], field), field
    assert args.model_preset == name.removesuffix("-long")
    world = int(sbatch.PRESETS[name].values["nodes"]) * int(sbatch.PRESETS[name].values["gpus_per_node"])
    layout = Layout(world, args.data_parallel_sharding_strategy,
                    args.num_distributed_optimizer_instances, args.outer_dp_sharding_strategy,
                    args.expert_model_parallel_size, micro_batch=args.micro_batch_size,
                    tp=args.tensor_model_parallel_size, cp=args.context_parallel_size,
                    sequence_parallel=args.sequence_parallel,
                    seq_length=args.seq_length, recompute_granularity=args.recompute_granularity,
                    recompute_method=args.recompute_method or "uniform",
                    recompute_num_layers=args.recompute_num_layers or 1)
    p = plan(ModelConfig.from_gpt(cfg), layout)
    assert p.fits(80), p.table()


def test_container_flags_only_with_an_image():
    assert "--container-image" not in sbatch.render("llama3-8b")
    assert "MFSDP_SRC" not in sbatch.render("llama3-8b")
    text = sbatch.render("llama3-8b", {"container_image": "nvcr.io#nvidia/pytorch:25.01-py3",
                                       "container_mounts": "/lustre:/lustre"})
    assert "  --container-image=nvcr.io#nvidia/pytorch:25.01-py3\n" in text
    assert '--container-mounts="$MFSDP_SRC:/opt/mfsdp,$PWD:$PWD,/lustre:/lustre"' in text
    assert 'srun --kill-on-bad-exit=1 "${CONTAINER_ARGS[@]}" \\\n' in text
    assert 'export PYTHONPATH="/opt/mfsdp' in text
    # the conversion script runs in the same container the same way
    conv = sbatch.render("convert", {"container_image": "img"})
    assert 'srun --kill-on-bad-exit=1 "${CONTAINER_ARGS[@]}" \\\n' in conv and "--container-image=img" in conv


def test_signal_handler_and_restarts_follow_the_keys():
    text = sbatch.render("llama3-8b")
    assert "#SBATCH --signal=TERM@120\n" in text and "  --exit-signal-handler\n" in text
    assert "--max-restarts" not in text
    off = sbatch.render("llama3-8b", {"signal_seconds": "0", "max_restarts": "2"})
    assert "--signal" not in off and "--exit-signal-handler" not in off
    assert "    --max-restarts 2 \\\n" in off
    assert "--signal" not in sbatch.render("cpu-smoke")  # no checkpoints: nothing to save


@pytest.mark.parametrize("preset, overrides, message", [
    ("nope", {}, "unknown preset 'nope'"),
    ("cpu-smoke", {"colour": "red"}, "unknown key 'colour'"),
    ("cpu-smoke", {"nodes": "2.5"}, "nodes must be an integer"),
    ("cpu-smoke", {"bf16": "maybe"}, "bf16 must be true or false"),
    ("cpu-smoke", {"strategy": "zero3"}, "choose one of"),
    ("convert", {"ep": "2"}, "does not use 'ep'"),
    ("deepseek-v3", {"nodes": "3"}, "3 x 8 = 24 ranks cannot be split"),
    ("llama3-8b", {"nodes": "3"}, "not divisible by micro_batch_size x data-parallel ranks = 1 x 24"),
    ("cpu-smoke", {"ep": "2"}, "needs an MoE model"),
    ("llama3-70b", {"tp": "16"}, "tp=16 exceeds ranks_per_node=8"),
    ("llama3-70b", {"tp": "8", "cp": "3"}, "cannot be split with tp=8 x cp=3"),
    ("llama3-70b", {"global_batch_size": "120"}, "micro_batch_size x data-parallel ranks = 1 x 16"),
    ("cpu-smoke", {"distributed_timeout_minutes": "0"}, "distributed_timeout_minutes must be positive"),
])
def test_render_errors(preset, overrides, message):
    with pytest.raises(sbatch.RenderError, match=re.escape(message)):
        sbatch.render(preset, overrides)


def test_cli_render_to_file(tmp_path):
    from mfsdp.cli import main

    out = tmp_path / "job.sbatch"
    assert main(["sbatch", "render", "cpu-smoke", "--set", "train_iters=3", "-o", str(out)]) == 0
    assert "--train-iters 3" in out.read_text()
    assert "--set train_iters=3" in out.read_text()  # the header records how it was rendered


@pytest.mark.parametrize("name", sorted(sbatch.PRESETS))
def test_srun_gets_the_cpu_count_and_stops_on_a_failed_rank(name):
    # Since Slurm 22.05 srun does not inherit --cpus-per-task: SRUN_CPUS_PER_TASK carries it.
    text = (SCRIPTS / f"{name}.sbatch").read_text()
    export = text.index("export SRUN_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-")
    srun = text.index("\nsrun --kill-on-bad-exit=1")
    assert export < srun


def test_env_setup_is_rendered_before_python_is_used():
    text = sbatch.render("cpu-smoke", {"env_setup": "source /opt/venvs/mfsdp/bin/activate"})
    assert text.index("source /opt/venvs/mfsdp/bin/activate") < text.index("PYTHON=")
    assert "# Activate the environment" in (SCRIPTS / "cpu-smoke.sbatch").read_text()
