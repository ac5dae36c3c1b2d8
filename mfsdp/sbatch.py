"""Render Slurm batch scripts from jinja2 templates and presets: ``mfsdp sbatch render PRESET``.

Every template variable is declared in :data:`SCHEMA` with its type; a preset gives each a value
and ``--set key=value`` overrides one, checked against that type. Templates use
``StrictUndefined``: a variable missing from the schema is an error, never an empty string.

>>> script = render("cpu-smoke", {"train_iters": "5"})
>>> script.splitlines()[0]
'#!/bin/bash'
>>> "--train-iters 5" in script
True
>>> render("cpu-smoke", {"nodes": "two"})
Traceback (most recent call last):
...
mfsdp.sbatch.RenderError: --set nodes=two: nodes must be an integer (number of nodes)
"""

from __future__ import annotations

import argparse
import math
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["PRESETS", "Preset", "RenderError", "SCHEMA", "build_parser", "convert_args", "main",
           "megatron_lm_model_flags", "render", "render_all", "resolve", "scripts", "time_limit_seconds",
           "train_args"]

TEMPLATES = Path(__file__).parent / "templates"


class RenderError(ValueError):
    """Bad render input: the message names the preset or key and what to do."""


# key -> (type, help). bool values are written true/false; str values may be empty (= not used).
# Every value is written into the script as a literal (shell-quoted) string, except env_setup,
# which is a line of shell code by design.
SCHEMA: dict[str, tuple[type, str]] = {
    "trainer": (str, "what trains: mfsdp (`mfsdp train`) or megatron-lm (Megatron-LM's "
                     "pretrain_gpt.py with --use-megatron-fsdp; conversion: its "
                     "checkpoint_inspector.py)"),
    "launcher": (str, "torchrun: one torchrun per node starts the ranks; srun: one Slurm task per "
                      "rank, no torchrun (either way SIGTERM before the time limit reaches the "
                      "ranks only)"),
    "megatron_lm_dir": (str, "trainer=megatron-lm: the Megatron-LM checkout, absolute (empty: "
                             "MEGATRON_LM_DIR from the environment at submission)"),
    "job_name": (str, "Slurm job name (also the name of the singleton chain)"),
    "nodes": (int, "number of nodes"),
    "gpus_per_node": (int, "GPUs per node (0: a CPU job)"),
    "ranks_per_node": (int, "training processes per node (GPUs per node on GPU jobs)"),
    "cpus_per_task": (int, "CPU cores per node (torchrun) or per node's ranks together (srun)"),
    "time": (str, "time limit: MM, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"),
    "output": (str, "the batch log's file pattern (%x: job name, %j: job id)"),
    "log_dir": (str, "per-rank logs, provenance and TensorBoard: LOG_DIR/JOB_NAME/JOB_ID/ "
                     "(relative: to the submission directory)"),
    "partition": (str, "partition (empty: the cluster's default)"),
    "account": (str, "account to charge (empty: your default)"),
    "exclusive": (bool, "whole nodes only"),
    "requeue": (bool, "with save: #SBATCH --requeue, and a job that saved on the time-limit "
                      "signal requeues itself and resumes from its checkpoint"),
    "env_setup": (str, "one line of shell that activates the Python environment, e.g. 'source "
                       "~/venvs/mfsdp/bin/activate' or 'conda activate mfsdp' (empty: PYTHON "
                       "from the environment, default python3; the job stops at once when it "
                       "cannot import the trainer)"),
    "container_image": (str, "pyxis/enroot image (empty: no container)"),
    "container_mounts": (str, "more pyxis mounts, src:dst[,src:dst] (data, checkpoints; the "
                              "code is mounted from MFSDP_SRC or MEGATRON_LM_DIR)"),
    "rdzv_port": (int, "TCP port of the rendezvous on the first node (0: derived from the job "
                       "id, so that two jobs on one node do not collide)"),
    "strategy": (str, "--data-parallel-sharding-strategy"),
    "outer": (int, "--num-distributed-optimizer-instances (HSDP outer size)"),
    "outer_strategy": (str, "--outer-dp-sharding-strategy"),
    "ep": (int, "--expert-model-parallel-size"),
    "tp": (int, "--tensor-model-parallel-size (inside a node: TP talks every layer)"),
    "sequence_parallel": (bool, "with tp > 1: --sequence-parallel"),
    "cp": (int, "--context-parallel-size"),
    "distributed_timeout_minutes": (float, "--distributed-timeout-minutes: how long a collective "
                                           "waits before the job stops with a hang report"),
    "num_experts": (int, "routed experts per MoE layer (0: dense; must match model_args)"),
    "dispatcher": (str, "--moe-token-dispatcher-type"),
    "flex_backend": (str, "--moe-flex-dispatcher-backend (mfsdp: torch or deepep; Megatron-LM: "
                          "deepep, hybridep or ncclep)"),
    "model_args": (str, "model-size flags passed to the trainer (split like a shell command "
                        "line; for megatron-lm, --model-preset NAME becomes Megatron-LM's "
                        "architecture flags)"),
    "micro_batch_size": (int, "--micro-batch-size"),
    "global_batch_size": (int, "--global-batch-size"),
    "seq_length": (int, "--seq-length"),
    "train_iters": (int, "--train-iters"),
    "lr": (float, "--lr"),
    "bf16": (bool, "--bf16"),
    "meta_init": (bool, "--init-model-with-meta-device"),
    "all_gather_group": (bool, "--create-all-gather-group"),
    "grad_reduce_in_bf16": (bool, "--grad-reduce-in-bf16"),
    "double_buffer": (bool, "--fsdp-double-buffer"),
    "nccl_ub": (bool, "--use-nccl-ub (NCCL user buffers)"),
    "data_path": (str, "DATA_PATH: Megatron .bin/.idx prefixes, optionally weighted, separated "
                       "by spaces (empty: the job stops at once unless mock_data)"),
    "mock_data": (bool, "an empty DATA_PATH trains on synthetic data (with a banner in the "
                        "log) instead of stopping the job"),
    "split": (str, "--split of DATA_PATH, e.g. 969,30,1"),
    "tokenizer_model": (str, "TOKENIZER_MODEL: a Hugging Face tokenizer directory (empty: none)"),
    "save": (str, "--save directory, made absolute (empty: no checkpoints); with an empty "
                  "load, also --load, so a requeued job resumes"),
    "save_interval": (int, "--save-interval"),
    "signal_seconds": (int, "with save: SIGTERM this many seconds before the time limit "
                            "(#SBATCH --signal) and --exit-signal-handler: the time a save may "
                            "take (0: off)"),
    "max_restarts": (int, "launcher=torchrun: torchrun --max-restarts, restarts after a rank "
                          "dies (0: none)"),
    "ckpt_format": (str, "--ckpt-format"),
    "load": (str, "--load directory (empty: start fresh)"),
    "log_interval": (int, "--log-interval"),
    "log_jsonl": (str, "trainer=mfsdp: --log-jsonl file (empty: none)"),
    "wandb_project": (str, "trainer=megatron-lm: the W&B project, used when WANDB_API_KEY is set "
                           "at submission (empty: the job name)"),
    "extra_args": (str, "more trainer flags (split like a shell command line)"),
    "src": (str, "conversion input checkpoint"),
    "dst": (str, "conversion output directory"),
    "from_format": (str, "conversion --from"),
    "to_format": (str, "conversion --to"),
    "param_map": (str, "--param-to-param-group-map file (empty: none)"),
    "model_preset": (str, "--model-preset of a Megatron-LM checkpoint's model (empty: none)"),
    "swiglu": (bool, "--swiglu (split/join fused gate and up projections)"),
}

_FORMATS = ("torch_dist", "megatron_lm", "mfsdp_full", "fsdp_dtensor", "safetensors", "hf",
            "megatron_fsdp")
CHOICES = {
    "trainer": ("mfsdp", "megatron-lm"),
    "launcher": ("torchrun", "srun"),
    "strategy": ("no_shard", "optim", "optim_grads", "optim_grads_params"),
    "outer_strategy": ("no_shard", "optim"),
    "dispatcher": ("allgather", "alltoall", "flex"),
    "flex_backend": ("torch", "deepep", "hybridep", "ncclep"),
    "ckpt_format": ("fsdp_dtensor", "torch_dist"),
    "from_format": _FORMATS,
    "to_format": _FORMATS,
}
FLEX_BACKENDS = {"mfsdp": ("torch", "deepep"), "megatron-lm": ("deepep", "hybridep", "ncclep")}

_SLURM = dict(trainer="mfsdp", megatron_lm_dir="", partition="", account="", exclusive=False,
              env_setup="", container_image="", container_mounts="", log_dir="logs")
_TRAIN = dict(_SLURM, launcher="torchrun", rdzv_port=0, requeue=True, strategy="optim_grads_params",
              outer=1, outer_strategy="no_shard", ep=1, tp=1, sequence_parallel=True, cp=1,
              distributed_timeout_minutes=10, num_experts=0, dispatcher="alltoall",
              flex_backend="torch", meta_init=False, all_gather_group=False,
              grad_reduce_in_bf16=False, double_buffer=False, nccl_ub=False, save="",
              save_interval=1000, ckpt_format="fsdp_dtensor", load="", signal_seconds=120,
              max_restarts=0, log_interval=1, log_jsonl="", wandb_project="", extra_args="",
              bf16=False, data_path="", mock_data=False, split="969,30,1", tokenizer_model="")

# Whole 8-GPU nodes, one rank per GPU: what every GPU preset asks of Slurm.
_GPU_NODES = dict(gpus_per_node=8, ranks_per_node=8, cpus_per_task=64, output="%x-%j.log",
                  exclusive=True, grad_reduce_in_bf16=True)
# What the upstream guide's Megatron-LM scripts add for Megatron-FSDP on GPUs: the persistent
# double buffer and NCCL user buffers (mfsdp accepts --use-nccl-ub and does not register them yet).
_MEGATRON_LM_GPU = dict(double_buffer=True, nccl_ub=True)

# The real architectures (RMSNorm, RoPE, grouped-query or multi-latent attention, SwiGLU) are
# the trainer's presets; the planner reads the same definitions (``mfsdp plan``).
_LLAMA3_8B = "--model-preset llama3-8b"
_FULL_RECOMPUTE = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
_DEEPSEEK_V3 = ("--model-preset deepseek-v3 --moe-aux-loss-coeff 0.0001 --moe-grouped-gemm "
                + _FULL_RECOMPUTE)


@dataclass(frozen=True)
class Preset:
    """A template and the values of every variable it uses."""

    template: str
    description: str
    values: dict
    megatron_lm: dict = field(default_factory=dict)  # values that differ with trainer=megatron-lm


PRESETS: dict[str, Preset] = {
    "cpu-smoke": Preset("train", "CPU smoke test: 2 gloo ranks train the small GPT for a few "
                        "iterations; runs anywhere Slurm runs.", dict(
                            _TRAIN, job_name="mfsdp-cpu-smoke", nodes=1, gpus_per_node=0,
                            ranks_per_node=2, cpus_per_task=2, time="00:10:00",
                            output="mfsdp-cpu-smoke-%j.log", model_args="--model-preset gpt-tiny",
                            micro_batch_size=2, global_batch_size=8, seq_length=64, train_iters=10,
                            lr=0.003, mock_data=True)),
    "llama3-8b": Preset("train", "Llama-3-8B-style dense model on 2 nodes x 8 GPUs with ZeRO-3 "
                        "(optim_grads_params), bf16 compute, fp32 main weights.", dict(
                            _TRAIN, **_GPU_NODES, job_name="mfsdp-llama3-8b", nodes=2,
                            time="04:00:00", model_args=_LLAMA3_8B,
                            micro_batch_size=1, global_batch_size=128, seq_length=8192,
                            train_iters=1000, lr=0.0003, bf16=True, meta_init=True,
                            save="checkpoints/llama3-8b", save_interval=500,
                            log_jsonl="llama3-8b.jsonl"), _MEGATRON_LM_GPU),
    "llama3-8b-container": Preset(
        "train", "The llama3-8b job in NGC's PyTorch container (pyxis/enroot): the image's torch, "
        "mfsdp mounted from its source checkout.", dict(
            _TRAIN, **_GPU_NODES, job_name="mfsdp-llama3-8b", nodes=2, time="04:00:00",
            model_args=_LLAMA3_8B, micro_batch_size=1, global_batch_size=128, seq_length=8192,
            train_iters=1000, lr=0.0003, bf16=True, meta_init=True, save="checkpoints/llama3-8b",
            save_interval=500, log_jsonl="llama3-8b.jsonl",
            container_image="nvcr.io#nvidia/pytorch:25.10-py3"), _MEGATRON_LM_GPU),
    "deepseek-v3": Preset("train", "DeepSeek-V3-style MoE (256 routed experts, top-8, "
                          "group-limited sigmoid routing) on 32 nodes x 8 GPUs: EP 8 inside a "
                          "node, HFSDP over 4 outer groups (optimizer state sharded across them too), flex "
                          "dispatcher with DeepEP.", dict(
                              _TRAIN, **_GPU_NODES, job_name="mfsdp-deepseek-v3", nodes=32,
                              time="24:00:00", model_args=_DEEPSEEK_V3,
                              outer=4, outer_strategy="optim", ep=8, num_experts=256,
                              dispatcher="flex", flex_backend="deepep", micro_batch_size=1,
                              global_batch_size=512, seq_length=4096, train_iters=10000,
                              lr=0.0002, bf16=True, meta_init=True, all_gather_group=True,
                              save="checkpoints/deepseek-v3", save_interval=500,
                              log_jsonl="deepseek-v3.jsonl"),
                          dict(_MEGATRON_LM_GPU, flex_backend="hybridep")),
    "llama3-70b": Preset("train", "Llama-3-70B-style dense model on 8 nodes x 8 GPUs: tensor "
                         "parallelism 4 with sequence parallelism inside a node, ZeRO-3 over the "
                         "16 data-parallel ranks, selective recompute, bf16 compute, meta-device "
                         "initialisation.", dict(
                             _TRAIN, **_GPU_NODES, job_name="mfsdp-llama3-70b", nodes=8,
                             time="24:00:00", model_args="--model-preset llama3-70b --recompute-granularity "
                                        "selective",
                             tp=4, micro_batch_size=1, global_batch_size=128, seq_length=8192,
                             train_iters=1000, lr=0.00015, bf16=True, meta_init=True,
                             save="checkpoints/llama3-70b", save_interval=250,
                             log_jsonl="llama3-70b.jsonl"), _MEGATRON_LM_GPU),
    "llama3.1-405b": Preset("train", "Llama-3.1-405B-shaped dense model on 32 nodes x 8 GPUs: "
                            "FSDP x tensor parallelism 2 with sequence parallelism, the layout of "
                            "Megatron-Bridge's published Megatron-FSDP run (128 GB200s, which "
                            "hold 186 GiB; on 80 GiB GPUs the planner needs 256), ZeRO-3 over "
                            "128 data-parallel ranks, full recompute, bf16 compute, meta-device "
                            "initialisation.", dict(
                                _TRAIN, **_GPU_NODES, job_name="mfsdp-llama3.1-405b", nodes=32,
                                time="48:00:00",
                                model_args="--model-preset llama3.1-405b " + _FULL_RECOMPUTE,
                                tp=2, sequence_parallel=True, micro_batch_size=1,
                                global_batch_size=256, seq_length=8192, train_iters=1000,
                                lr=0.0001, bf16=True, meta_init=True, all_gather_group=True,
                                save="checkpoints/llama3.1-405b", save_interval=100,
                                log_jsonl="llama3.1-405b.jsonl"), _MEGATRON_LM_GPU),
    "llama3-8b-long": Preset("train", "Llama-3-8B-style model on 64K-token sequences, 2 nodes x 8 "
                             "GPUs: context parallelism 2 (each rank holds 32K tokens of a "
                             "sequence, attention exact over all of it), ZeRO-3 over the 16 ranks, "
                             "full recompute, bf16 compute.", dict(
                                 _TRAIN, **_GPU_NODES, job_name="mfsdp-llama3-8b-long", nodes=2,
                                 time="12:00:00",
                                 model_args="--model-preset llama3-8b " + _FULL_RECOMPUTE,
                                 cp=2, micro_batch_size=1, global_batch_size=16,
                                 seq_length=65536, train_iters=1000, lr=0.0003, bf16=True,
                                 meta_init=True, save="checkpoints/llama3-8b-long",
                                 save_interval=250, log_jsonl="llama3-8b-long.jsonl"),
                             _MEGATRON_LM_GPU),
    "convert": Preset("convert", "Checkpoint conversion: a Megatron-LM torch_dist checkpoint to "
                      "fsdp_dtensor, on one node (mfsdp convert: CPU only; Megatron-LM's "
                      "checkpoint_inspector.py: 8 GPUs).", dict(
                          _SLURM, job_name="mfsdp-convert", gpus_per_node=0, cpus_per_task=16,
                          time="02:00:00",
                          output="%x-%j.log", src="checkpoints/megatron",
                          dst="checkpoints/fsdp_dtensor/iter_0001000", from_format="torch_dist",
                          to_format="fsdp_dtensor", param_map="", model_preset="llama3-8b",
                          swiglu=False),
                      # checkpoint_inspector.py converts on GPUs (NCCL), under torchrun
                      dict(gpus_per_node=8, exclusive=True, swiglu=True)),
}


def _parse(key: str, raw: str) -> object:
    if key not in SCHEMA:
        known = ", ".join(sorted(SCHEMA))
        raise RenderError(f"--set {key}={raw!r}: unknown key {key!r}; known keys: {known}")
    typ, help_ = SCHEMA[key]
    try:
        if typ is bool:
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            value: object = raw.lower() in ("true", "1", "yes")
        else:
            value = typ(raw)
    except ValueError:
        kind = {int: "an integer", float: "a number", bool: "true or false"}.get(typ, "text")
        raise RenderError(f"--set {key}={raw!r}: {key} must be {kind} ({help_})") from None
    if key in CHOICES and value not in CHOICES[key]:
        raise RenderError(f"--set {key}={raw!r}: choose one of {', '.join(CHOICES[key])}")
    return value


def resolve(preset: str, overrides: dict[str, str] | None = None) -> tuple[Preset, dict]:
    """The preset and its values with ``overrides`` (strings, as given to ``--set``) applied and
    checked: types, choices, values Slurm or the trainer would refuse, and that the ranks split
    into the requested parallel sizes. Every refusal is one line naming the key."""
    if preset not in PRESETS:
        raise RenderError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    overrides = dict(overrides or {})
    parsed = {}
    for key, raw in overrides.items():
        value = _parse(key, raw)
        if key not in p.values:
            raise RenderError(f"--set {key}={raw!r}: the {p.template!r} template of preset "
                              f"{preset!r} does not use {key!r}")
        parsed[key] = value
    values = dict(p.values)
    if parsed.get("trainer", values["trainer"]) == "megatron-lm":
        values.update(p.megatron_lm)
    values.update(parsed)
    for key, value in values.items():
        typ = SCHEMA[key][0]
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            continue
        if not isinstance(value, typ):
            raise RenderError(f"preset {preset!r}: {key}={value!r} is not {typ.__name__}")
    _check_common(values)
    if p.template == "train":
        _check_train(values)
    else:
        _check_convert(values)
    return p, values


# Slurm's time formats (sbatch --time): MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
_TIME = re.compile(r"^(?:(\d+)-(\d+)(?::(\d+)(?::(\d+))?)?|(\d+)(?::(\d+)(?::(\d+))?)?)$")


def time_limit_seconds(text: str) -> int:
    """Seconds of a Slurm time limit, or RenderError naming the accepted forms.

    >>> time_limit_seconds("04:00:00"), time_limit_seconds("1-12"), time_limit_seconds("90")
    (14400, 129600, 5400)
    """
    m = _TIME.match(text)
    if not m:
        raise RenderError(f"time={text!r} is not a Slurm time limit: use MM, HH:MM:SS, D-HH, "
                          "D-HH:MM or D-HH:MM:SS (e.g. 04:00:00)")
    d, dh, dm, ds, a, b, c = (int(g) if g else None for g in m.groups())
    if d is not None:
        seconds = d * 86400 + dh * 3600 + (dm or 0) * 60 + (ds or 0)
    elif c is not None:
        seconds = a * 3600 + b * 60 + c
    else:
        seconds = a * 60 + (b or 0)
    if seconds < 60:
        raise RenderError(f"time={text!r}: a time limit under one minute (Slurm counts minutes)")
    return seconds


# What a #SBATCH line may hold: sbatch reads these lines itself, without a shell's quoting.
_SLURM_WORD = {
    "job_name": (re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$"),
                 "letters, digits and . _ + - (no spaces)"),
    "partition": (re.compile(r"^[A-Za-z0-9._,-]*$"), "letters, digits and . _ , -"),
    "account": (re.compile(r"^[A-Za-z0-9._-]*$"), "letters, digits and . _ -"),
    "output": (re.compile(r"^[A-Za-z0-9._/%+@=-]+$"),
               "a path of letters, digits, . _ / + @ = - and Slurm's %x %j patterns, no spaces"),
    "container_image": (re.compile(r"^[A-Za-z0-9._/:#@+-]*$"),
                        "an image name or path without spaces or quotes"),
}
# Values that are paths: a leading ~ would be kept literally (the script quotes every value)
_PATHS = ("log_dir", "save", "load", "log_jsonl", "tokenizer_model", "megatron_lm_dir", "src",
          "dst", "param_map")


def _check_common(v: dict) -> None:
    for key, value in v.items():
        if isinstance(value, str) and any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
            raise RenderError(f"{key}={value!r}: a newline or control character cannot be part "
                              f"of {key}")
        if isinstance(value, float) and not math.isfinite(value):
            raise RenderError(f"{key}={value!r} must be a finite number")
    for key, (pattern, what) in _SLURM_WORD.items():
        if key in v and not pattern.match(v[key]):
            raise RenderError(f"{key}={v[key]!r}: Slurm reads it from an #SBATCH line; use {what}")
    for key in _PATHS:
        if v.get(key, "").startswith("~"):
            raise RenderError(f"{key}={v[key]!r}: a leading ~ is not expanded in a quoted value; "
                              "give the absolute path")
    for key in ("model_args", "extra_args"):
        if key in v:
            try:
                shlex.split(v[key])
            except ValueError as exc:
                raise RenderError(f"{key}={v[key]!r}: {exc} (it is split like a shell command "
                                  "line)") from None
    if "container_mounts" in v and not re.match(r"^[A-Za-z0-9._/:,@+=-]*$", v["container_mounts"]):
        raise RenderError(f"container_mounts={v['container_mounts']!r}: pyxis takes "
                          "src:dst[:flags] pairs separated by commas, without spaces or quotes")
    time_limit_seconds(v["time"])
    if v["cpus_per_task"] < 1:
        raise RenderError(f"cpus_per_task={v['cpus_per_task']}: Slurm needs at least 1 CPU per "
                          "task")
    if v.get("gpus_per_node", 0) < 0:
        raise RenderError(f"gpus_per_node={v['gpus_per_node']} must be 0 (a CPU job) or more")
    if v["trainer"] == "megatron-lm" and v["megatron_lm_dir"] and \
            not v["megatron_lm_dir"].startswith("/"):
        raise RenderError(f"megatron_lm_dir={v['megatron_lm_dir']!r} must be an absolute path "
                          "(every node resolves it alike)")


def _check_train(v: dict) -> None:
    from mfsdp.layout import ParallelLayout
    from mfsdp.models.gpt import GPT_PRESETS

    for key in ("nodes", "ranks_per_node", "outer", "ep", "tp", "cp", "micro_batch_size",
                "global_batch_size", "train_iters", "seq_length", "save_interval", "log_interval"):
        if v[key] < 1:
            raise RenderError(f"{key}={v[key]} must be at least 1")
    for key in ("max_restarts", "num_experts"):
        if v[key] < 0:
            raise RenderError(f"{key}={v[key]} must be 0 or more")
    if not (v["rdzv_port"] == 0 or 1024 <= v["rdzv_port"] <= 65535):
        raise RenderError(f"rdzv_port={v['rdzv_port']}: a TCP port from 1024 to 65535, or 0 to "
                          "derive it from the job id")
    limit = time_limit_seconds(v["time"])
    if not 0 <= v["signal_seconds"] <= 65535:
        raise RenderError(f"signal_seconds={v['signal_seconds']}: Slurm's --signal takes 0 to "
                          "65535 seconds")
    if v["save"] and v["signal_seconds"] >= limit:
        raise RenderError(f"signal_seconds={v['signal_seconds']} is not less than the time limit "
                          f"time={v['time']} ({limit} s): the signal would come before the start")
    if v["lr"] <= 0:
        raise RenderError(f"lr={v['lr']} must be positive")
    if v["distributed_timeout_minutes"] <= 0:
        raise RenderError("distributed_timeout_minutes must be positive")
    if v["split"] and not re.match(r"^\d+(\.\d+)?(,\d+(\.\d+)?){0,2}$", v["split"]):
        raise RenderError(f"split={v['split']!r}: up to three comma-separated numbers, e.g. "
                          "969,30,1")
    if v["gpus_per_node"] and v["ranks_per_node"] != v["gpus_per_node"]:
        raise RenderError(f"ranks_per_node={v['ranks_per_node']} but gpus_per_node="
                          f"{v['gpus_per_node']}: a GPU job runs one rank per GPU; set both")
    if v["launcher"] == "srun" and v["cpus_per_task"] < v["ranks_per_node"]:
        raise RenderError(f"launcher=srun runs {v['ranks_per_node']} tasks per node: "
                          f"cpus_per_task={v['cpus_per_task']} (per node) gives them less than "
                          "one core each")
    if v["launcher"] == "srun" and v["max_restarts"]:
        raise RenderError("max_restarts is torchrun's: with launcher=srun a failed rank ends the "
                          "step (resume by resubmitting, or use launcher=torchrun)")
    world = v["nodes"] * v["ranks_per_node"]
    what = f"nodes x ranks_per_node = {v['nodes']} x {v['ranks_per_node']} = {world} ranks"
    if world % (v["tp"] * v["cp"] * v["outer"]):
        raise RenderError(f"{what} cannot be split with tp={v['tp']} x cp={v['cp']} x "
                          f"outer={v['outer']}")
    if v["tp"] > v["ranks_per_node"]:
        raise RenderError(f"tp={v['tp']} exceeds ranks_per_node={v['ranks_per_node']}: keep "
                          "tensor parallelism inside a node (it communicates in every layer)")
    try:
        ParallelLayout(world, v["outer"], v["ep"], v["num_experts"] or None, tp=v["tp"],
                       cp=v["cp"])
    except ValueError as exc:
        raise RenderError(f"{what} cannot be split with outer={v['outer']}, ep={v['ep']}, "
                          f"tp={v['tp']}, cp={v['cp']}, num_experts={v['num_experts']}: "
                          f"{exc}") from None
    if v["ep"] > 1 and not v["num_experts"]:
        raise RenderError(f"ep={v['ep']} needs an MoE model: set num_experts (and the model_args)")
    dp = world // (v["tp"] * v["cp"])
    per = v["micro_batch_size"] * dp
    if v["global_batch_size"] % per:
        raise RenderError(f"global_batch_size={v['global_batch_size']} is not divisible by "
                          f"micro_batch_size x data-parallel ranks = {v['micro_batch_size']} x "
                          f"{dp}")
    if v["outer_strategy"] == "optim" and v["outer"] < 2:
        raise RenderError("outer_strategy=optim needs outer of at least 2")
    backends = FLEX_BACKENDS[v["trainer"]]
    if v["num_experts"] and v["dispatcher"] == "flex" and v["flex_backend"] not in backends:
        raise RenderError(f"flex_backend={v['flex_backend']!r} is not one of trainer="
                          f"{v['trainer']}'s: {', '.join(backends)}")
    if v["trainer"] == "megatron-lm":
        if not v["gpus_per_node"]:
            raise RenderError("trainer=megatron-lm needs GPUs (gpus_per_node > 0): Megatron-LM's "
                              "pretrain_gpt.py does not train on CPU; use trainer=mfsdp")
        preset = _model_preset(v["model_args"])
        if preset is None or preset not in GPT_PRESETS:
            raise RenderError(f"model_args={v['model_args']!r}: trainer=megatron-lm needs "
                              f"--model-preset NAME (one of {', '.join(sorted(GPT_PRESETS))}) to "
                              "write Megatron-LM's architecture flags")


def _check_convert(v: dict) -> None:
    if v["trainer"] == "megatron-lm":
        if (v["from_format"], v["to_format"]) != ("torch_dist", "fsdp_dtensor"):
            raise RenderError(f"trainer=megatron-lm converts torch_dist to fsdp_dtensor only "
                              f"(checkpoint_inspector.py convert-torch-dist-to-fsdp-dtensor), not "
                              f"{v['from_format']} to {v['to_format']}; use trainer=mfsdp")
        if v["gpus_per_node"] < 1:
            raise RenderError("trainer=megatron-lm: checkpoint_inspector.py converts on GPUs "
                              "(NCCL); set gpus_per_node")
    elif v["gpus_per_node"]:
        raise RenderError("trainer=mfsdp: mfsdp convert runs on CPU; leave gpus_per_node=0")


def _model_preset(model_args: str) -> str | None:
    tokens = shlex.split(model_args)
    for i, token in enumerate(tokens):
        if token == "--model-preset" and i + 1 < len(tokens):
            return tokens[i + 1]
        if token.startswith("--model-preset="):
            return token.split("=", 1)[1]
    return None


class Var(str):
    """A shell variable in an argument list: written ``"$NAME"`` (expanded, one word)."""


def _quote(token: str) -> str:
    return f'"${token}"' if isinstance(token, Var) else shlex.quote(str(token))


def _group(tokens: list[str]) -> list[list[str]]:
    """``--flag value ...`` groups: one flag (with its values) per line."""
    lines: list[list[str]] = []
    for token in tokens:
        if (isinstance(token, str) and token.startswith("--")) or not lines:
            lines.append([token])
        else:
            lines[-1].append(token)
    return lines


def megatron_lm_model_flags(name: str, seq_length: int) -> list[str]:
    """Megatron-LM's architecture flags for ``mfsdp``'s model preset ``name`` (the same model:
    layers, sizes, attention, normalisation, rotary embeddings, MoE routing).

    >>> " ".join(megatron_lm_model_flags("llama3-8b", 8192)[:8])
    '--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32'
    """
    from mfsdp.models.gpt import GPT_PRESETS

    c = GPT_PRESETS[name]
    f = ["--num-layers", str(c.num_layers), "--hidden-size", str(c.hidden_size),
         "--ffn-hidden-size", str(c.ffn_hidden_size), "--num-attention-heads",
         str(c.num_attention_heads)]
    if c.num_query_groups and c.num_query_groups != c.num_attention_heads:
        f += ["--group-query-attention", "--num-query-groups", str(c.num_query_groups)]
    if c.kv_channels:
        f += ["--kv-channels", str(c.kv_channels)]
    f += ["--max-position-embeddings", str(max(c.max_position_embeddings, seq_length)),
          "--normalization", c.normalization, "--norm-epsilon", repr(c.norm_epsilon)]
    f += ["--position-embedding-type", c.position_embedding_type]
    if c.position_embedding_type == "rope":
        f += ["--rotary-base", str(int(c.rotary_base))]
        if c.rotary_interleaved:
            f += ["--rotary-interleaved"]
        if c.rope_scaling_factor:
            f += ["--use-rope-scaling", "--rope-scaling-factor", repr(float(c.rope_scaling_factor))]
    if c.swiglu:
        f += ["--swiglu"]
    if not c.add_bias_linear:
        f += ["--disable-bias-linear"]
    if c.add_qkv_bias:
        f += ["--add-qkv-bias"]
    if c.qk_layernorm:
        f += ["--qk-layernorm"]
    if not c.share_embeddings_and_output_weights:
        f += ["--untie-embeddings-and-output-weights"]
    if c.init_method_std:
        f += ["--init-method-std", repr(c.init_method_std)]
    if c.multi_latent_attention:
        f += ["--multi-latent-attention", "--kv-lora-rank", str(c.kv_lora_rank),
              "--qk-head-dim", str(c.qk_head_dim), "--qk-pos-emb-head-dim",
              str(c.qk_pos_emb_head_dim), "--v-head-dim", str(c.v_head_dim)]
        if c.q_lora_rank:
            f += ["--q-lora-rank", str(c.q_lora_rank)]
    if c.num_experts:
        dense = c.moe_first_dense_layers
        f += ["--num-experts", str(c.num_experts),
              "--moe-layer-freq", f"[0]*{dense}+[1]*{c.num_layers - dense}" if dense else "1",
              "--moe-router-topk", str(c.moe_router_topk),
              "--moe-router-score-function", c.moe_router_score_function]
        if c.moe_ffn_hidden_size:
            f += ["--moe-ffn-hidden-size", str(c.moe_ffn_hidden_size)]
        if c.moe_router_pre_softmax:
            f += ["--moe-router-pre-softmax"]
        if c.moe_router_num_groups:
            f += ["--moe-router-num-groups", str(c.moe_router_num_groups),
                  "--moe-router-group-topk", str(c.moe_router_group_topk)]
        if c.moe_router_topk_scaling_factor:
            f += ["--moe-router-topk-scaling-factor", repr(c.moe_router_topk_scaling_factor)]
        if c.moe_router_enable_expert_bias:
            f += ["--moe-router-enable-expert-bias"]
        if c.moe_shared_expert_intermediate_size:
            f += ["--moe-shared-expert-intermediate-size",
                  str(c.moe_shared_expert_intermediate_size)]
    return f


def train_args(v: dict) -> list[str]:
    """The trainer's command line of a resolved train preset (``Var`` tokens are the script's
    variables: CHECKPOINT_DIR, TENSORBOARD_DIR, ...); DATA_PATH and the tokenizer are added by
    the script when it starts, from the environment."""
    megatron = v["trainer"] == "megatron-lm"
    model = shlex.split(v["model_args"])
    if megatron:  # --model-preset NAME -> Megatron-LM's own architecture flags
        name = _model_preset(v["model_args"])
        i = model.index("--model-preset") if "--model-preset" in model else None
        rest = (model[:i] + model[i + 2:]) if i is not None else [
            t for t in model if not t.startswith("--model-preset=")]
        model = megatron_lm_model_flags(name, v["seq_length"]) + rest
    a: list[str] = ["--use-megatron-fsdp",
                    "--data-parallel-sharding-strategy", v["strategy"],
                    "--num-distributed-optimizer-instances", str(v["outer"])]
    if v["outer"] > 1:
        a += ["--outer-dp-sharding-strategy", v["outer_strategy"]]
    if v["ep"] > 1:
        a += ["--expert-model-parallel-size", str(v["ep"])]
    if v["tp"] > 1:
        a += ["--tensor-model-parallel-size", str(v["tp"])]
        if v["sequence_parallel"]:
            a += ["--sequence-parallel"]
    if v["cp"] > 1:
        a += ["--context-parallel-size", str(v["cp"])]
    if v["num_experts"] > 0:
        a += ["--moe-token-dispatcher-type", v["dispatcher"]]
        if v["dispatcher"] == "flex":
            a += ["--moe-flex-dispatcher-backend", v["flex_backend"]]
    a += model
    a += ["--micro-batch-size", str(v["micro_batch_size"]),
          "--global-batch-size", str(v["global_batch_size"]),
          "--seq-length", str(v["seq_length"]), "--train-iters", str(v["train_iters"]),
          "--lr", repr(float(v["lr"]))]
    for key, flag in (("bf16", "--bf16"), ("meta_init", "--init-model-with-meta-device"),
                      ("all_gather_group", "--create-all-gather-group"),
                      ("grad_reduce_in_bf16", "--grad-reduce-in-bf16"),
                      ("double_buffer", "--fsdp-double-buffer"), ("nccl_ub", "--use-nccl-ub")):
        if v[key]:
            a.append(flag)
    if v["save"]:
        a += ["--save", Var("CHECKPOINT_DIR"), "--save-interval", str(v["save_interval"])]
        if v["signal_seconds"] > 0:
            a += ["--exit-signal-handler"]
        a += ["--ckpt-format", v["ckpt_format"]]
    if v["load"]:
        a += ["--load", v["load"]]
    elif v["save"]:
        a += ["--load", Var("CHECKPOINT_DIR")]
    a += ["--distributed-timeout-minutes", _minutes(v["distributed_timeout_minutes"]),
          "--log-interval", str(v["log_interval"]), "--tensorboard-dir", Var("TENSORBOARD_DIR")]
    if megatron:
        a += ["--log-throughput", "--data-cache-path", Var("DATA_CACHE_DIR")]
    elif v["log_jsonl"]:
        a += ["--log-jsonl", v["log_jsonl"]]
    return a + shlex.split(v["extra_args"])


def _minutes(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def convert_args(v: dict) -> list[str]:
    """The conversion command's arguments (``mfsdp convert`` or Megatron-LM's
    ``checkpoint_inspector.py convert-torch-dist-to-fsdp-dtensor``)."""
    if v["trainer"] == "megatron-lm":
        a = ["convert-torch-dist-to-fsdp-dtensor", v["src"], v["dst"]]
        if v["swiglu"]:
            a.append("--swiglu")
        if v["param_map"]:
            a += ["--param-to-param-group-map-json", v["param_map"]]
        return a
    a = ["--from", v["from_format"], "--to", v["to_format"], v["src"], v["dst"]]
    if v["param_map"]:
        a += ["--param-to-param-group-map", v["param_map"]]
    if v["model_preset"]:
        a += ["--model-preset", v["model_preset"]]
    if v["swiglu"]:
        a.append("--swiglu")
    return a


def _abs(path: str) -> str:
    """A path as the script writes it: absolute ones quoted, relative ones under "$PWD"."""
    return shlex.quote(path) if path.startswith("/") else f'"$PWD"/{shlex.quote(path)}'


def render(preset: str, overrides: dict[str, str] | None = None) -> str:
    """The script of ``preset`` with ``overrides`` applied (see :func:`mfsdp.sbatch.resolve`).
    Every value is written as a literal: shell-quoted (``shlex.quote``) where the shell reads it,
    checked to be one word where sbatch reads it (the ``#SBATCH`` lines)."""
    import jinja2

    p, values = resolve(preset, overrides)
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)),
                             undefined=jinja2.StrictUndefined, trim_blocks=True,
                             lstrip_blocks=True, keep_trailing_newline=True, autoescape=False)
    env.filters["q"] = lambda x: shlex.quote(str(x))
    env.filters["abs"] = _abs
    world = values.get("nodes", 1) * values.get("ranks_per_node", 1)
    args = train_args(values) if p.template == "train" else convert_args(values)
    lines = [" ".join(_quote(t) for t in group) for group in _group(args)]
    rendered_by = " ".join(["mfsdp sbatch render", preset]
                           + [f"--set {shlex.quote(f'{k}={v}')}"
                              for k, v in (overrides or {}).items()])
    task_cpus = values["cpus_per_task"]
    if values.get("launcher") == "srun":  # the node's cores shared by its ranks
        task_cpus //= values["ranks_per_node"]
    vocab_size = 0
    if p.template == "train" and values["trainer"] == "megatron-lm":
        from mfsdp.models.gpt import GPT_PRESETS

        vocab_size = GPT_PRESETS[_model_preset(values["model_args"])].vocab_size
    text = env.get_template(f"{p.template}.sbatch.j2").render(
        preset=preset, template=p.template, description=p.description, world=world,
        rendered_by=rendered_by, arg_lines=lines, task_cpus=task_cpus,
        vocab_size=vocab_size, **values)
    return text if text.endswith("\n") else text + "\n"


def scripts() -> list[tuple[str, dict[str, str], str]]:
    """Every committed script: ``(preset, overrides, path relative to example-scripts)``. Each
    preset for mfsdp; each that Megatron-LM runs (GPU presets and conversion) for megatron-lm
    too, under ``megatron-lm/``."""
    out = []
    for name, p in PRESETS.items():
        out.append((name, {}, f"{name}.sbatch"))
        if p.megatron_lm:
            out.append((name, {"trainer": "megatron-lm"}, f"megatron-lm/{name}.sbatch"))
    return out


def render_all(directory: str | Path) -> list[Path]:
    """Write every script of :func:`scripts` under ``directory`` (what ``example-scripts``
    holds)."""
    directory = Path(directory)
    out = []
    for name, overrides, rel in scripts():
        path = directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render(name, overrides))
        out.append(path)
    return out


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The ``mfsdp sbatch`` argument parser."""
    if parser is None:
        parser = argparse.ArgumentParser(prog="mfsdp sbatch", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    r = sub.add_parser("render", help="render a preset's script")
    r.add_argument("preset", metavar="PRESET", help=f"one of: {', '.join(PRESETS)}")
    r.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one value (repeatable); `mfsdp sbatch list` shows the keys")
    r.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    sub.add_parser("list", help="list the presets and every key with its type and meaning")
    a = sub.add_parser("render-all", help="render every preset into a directory")
    a.add_argument("directory", metavar="DIR")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``mfsdp sbatch`` command."""
    if args.action == "list":
        for name, p in PRESETS.items():
            print(f"{name:<12} {p.description}")
        print()
        for key, (typ, help_) in SCHEMA.items():
            print(f"{key:<18} {typ.__name__:<6} {help_}")
        return 0
    if args.action == "render-all":
        for path in render_all(args.directory):
            print(path)
        return 0
    overrides = {}
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise RenderError(f"--set {item}: expected KEY=VALUE")
        overrides[key] = value
    text = render(args.preset, overrides)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m mfsdp.sbatch``."""
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except RenderError as exc:
        print(f"mfsdp sbatch: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
