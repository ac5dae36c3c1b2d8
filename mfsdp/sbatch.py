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
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PRESETS", "Preset", "RenderError", "SCHEMA", "build_parser", "main", "render",
           "render_all", "resolve"]

TEMPLATES = Path(__file__).parent / "templates"


class RenderError(ValueError):
    """Bad render input: the message names the preset or key and what to do."""


# key -> (type, help). bool values are written true/false; str values may be empty (= not used).
SCHEMA: dict[str, tuple[type, str]] = {
    "job_name": (str, "Slurm job name"),
    "nodes": (int, "number of nodes"),
    "gpus_per_node": (int, "GPUs per node (0: a CPU job)"),
    "ranks_per_node": (int, "training processes per node (GPUs per node on GPU jobs)"),
    "cpus_per_task": (int, "CPU cores for each node's torchrun"),
    "time": (str, "time limit, HH:MM:SS"),
    "output": (str, "log file pattern (%x: job name, %j: job id)"),
    "partition": (str, "partition (empty: the cluster's default)"),
    "account": (str, "account to charge (empty: your default)"),
    "exclusive": (bool, "whole nodes only"),
    "env_setup": (str, "a line that activates the Python environment with mfsdp, e.g. 'source "
                       "~/venvs/mfsdp/bin/activate' or 'conda activate mfsdp' (empty: a "
                       "commented example)"),
    "container_image": (str, "pyxis/enroot image (empty: no container)"),
    "container_mounts": (str, "more pyxis mounts, src:dst[,src:dst] (data, checkpoints; the "
                              "mfsdp source is mounted from MFSDP_SRC)"),
    "rdzv_port": (int, "TCP port of the c10d rendezvous on the first node"),
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
    "flex_backend": (str, "--moe-flex-dispatcher-backend"),
    "model_args": (str, "model-size flags passed to the trainer as they are"),
    "micro_batch_size": (int, "--micro-batch-size"),
    "global_batch_size": (int, "--global-batch-size"),
    "seq_length": (int, "--seq-length"),
    "train_iters": (int, "--train-iters"),
    "lr": (float, "--lr"),
    "bf16": (bool, "--bf16"),
    "meta_init": (bool, "--init-model-with-meta-device"),
    "all_gather_group": (bool, "--create-all-gather-group"),
    "data_path": (str, "DATA_PATH: Megatron .bin/.idx prefixes, optionally weighted (empty: "
                       "mock data)"),
    "split": (str, "--split of DATA_PATH"),
    "tokenizer_model": (str, "TOKENIZER_MODEL: a Hugging Face tokenizer directory (empty: none)"),
    "save": (str, "--save directory, made absolute (empty: no checkpoints); with an empty "
                  "load, also --load, so a requeued job resumes"),
    "save_interval": (int, "--save-interval"),
    "signal_seconds": (int, "with save: SIGTERM this many seconds before the time limit "
                            "(#SBATCH --signal) and --exit-signal-handler (0: off)"),
    "max_restarts": (int, "torchrun --max-restarts: restarts after a rank dies (0: none)"),
    "ckpt_format": (str, "--ckpt-format"),
    "load": (str, "--load directory (empty: start fresh)"),
    "log_interval": (int, "--log-interval"),
    "log_jsonl": (str, "--log-jsonl file (empty: none)"),
    "extra_args": (str, "more trainer flags, as they are"),
    "src": (str, "conversion input checkpoint"),
    "dst": (str, "conversion output directory"),
    "from_format": (str, "conversion --from"),
    "to_format": (str, "conversion --to"),
    "param_map": (str, "--param-to-param-group-map file (empty: none)"),
    "model_preset": (str, "--model-preset of a Megatron-LM checkpoint's model (empty: none)"),
    "swiglu": (bool, "--swiglu (split/join fused gate and up projections)"),
}

CHOICES = {
    "strategy": ("no_shard", "optim", "optim_grads", "optim_grads_params"),
    "outer_strategy": ("no_shard", "optim"),
    "dispatcher": ("allgather", "alltoall", "flex"),
    "flex_backend": ("torch", "deepep"),
    "ckpt_format": ("fsdp_dtensor", "torch_dist"),
    "from_format": ("torch_dist", "megatron_lm", "mfsdp_full", "fsdp_dtensor", "safetensors", "hf",
                    "megatron_fsdp"),
    "to_format": ("torch_dist", "megatron_lm", "mfsdp_full", "fsdp_dtensor", "safetensors", "hf",
                  "megatron_fsdp"),
}

_SLURM = dict(partition="", account="", exclusive=False, env_setup="", container_image="",
              container_mounts="", rdzv_port=29500)
_TRAIN = dict(_SLURM, strategy="optim_grads_params", outer=1, outer_strategy="no_shard", ep=1,
              tp=1, sequence_parallel=True, cp=1, distributed_timeout_minutes=10,
              num_experts=0, dispatcher="alltoall", flex_backend="torch", meta_init=False,
              all_gather_group=False, save="", save_interval=1000, ckpt_format="fsdp_dtensor",
              load="", signal_seconds=120, max_restarts=0, log_interval=1, log_jsonl="",
              extra_args="", bf16=False, data_path="",
              split="969,30,1", tokenizer_model="")

# Whole 8-GPU nodes, one rank per GPU: what every GPU preset asks of Slurm.
_GPU_NODES = dict(gpus_per_node=8, ranks_per_node=8, cpus_per_task=64, output="%x-%j.log",
                  exclusive=True)

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


PRESETS: dict[str, Preset] = {
    "cpu-smoke": Preset("train", "CPU smoke test: 2 gloo ranks train the small GPT for a few "
                        "iterations; runs anywhere Slurm runs.", dict(
                            _TRAIN, job_name="mfsdp-cpu-smoke", nodes=1, gpus_per_node=0,
                            ranks_per_node=2, cpus_per_task=2, time="00:10:00",
                            output="mfsdp-cpu-smoke-%j.log", model_args="--model-preset gpt-tiny",
                            micro_batch_size=2, global_batch_size=8, seq_length=64, train_iters=10,
                            lr=0.003, rdzv_port=29511)),
    "llama3-8b": Preset("train", "Llama-3-8B-style dense model on 2 nodes x 8 GPUs with ZeRO-3 "
                        "(optim_grads_params), bf16 compute, fp32 main weights.", dict(
                            _TRAIN, **_GPU_NODES, job_name="mfsdp-llama3-8b", nodes=2,
                            time="04:00:00", model_args=_LLAMA3_8B,
                            micro_batch_size=1, global_batch_size=128, seq_length=8192,
                            train_iters=1000, lr=0.0003, bf16=True, meta_init=True,
                            save="checkpoints/llama3-8b", save_interval=500,
                            log_jsonl="llama3-8b.jsonl")),
    "llama3-8b-container": Preset(
        "train", "The llama3-8b job in NGC's PyTorch container (pyxis/enroot): the image's torch, "
        "mfsdp mounted from its source checkout.", dict(
            _TRAIN, **_GPU_NODES, job_name="mfsdp-llama3-8b", nodes=2, time="04:00:00",
            model_args=_LLAMA3_8B, micro_batch_size=1, global_batch_size=128, seq_length=8192,
            train_iters=1000, lr=0.0003, bf16=True, meta_init=True, save="checkpoints/llama3-8b",
            save_interval=500, log_jsonl="llama3-8b.jsonl",
            container_image="nvcr.io#nvidia/pytorch:25.10-py3")),
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
                              log_jsonl="deepseek-v3.jsonl")),
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
                             log_jsonl="llama3-70b.jsonl")),
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
                                log_jsonl="llama3.1-405b.jsonl")),
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
                                 save_interval=250, log_jsonl="llama3-8b-long.jsonl")),
    "convert": Preset("convert", "Checkpoint conversion: a Megatron-LM torch_dist checkpoint to "
                      "mfsdp's fsdp_dtensor, on one CPU node.", dict(
                          _SLURM, job_name="mfsdp-convert", cpus_per_task=16, time="02:00:00",
                          output="%x-%j.log", src="checkpoints/megatron",
                          dst="checkpoints/fsdp_dtensor/iter_0001000", from_format="torch_dist",
                          to_format="fsdp_dtensor", param_map="", model_preset="llama3-8b",
                          swiglu=False)),
}


def _parse(key: str, raw: str) -> object:
    if key not in SCHEMA:
        known = ", ".join(sorted(SCHEMA))
        raise RenderError(f"--set {key}={raw}: unknown key {key!r}; known keys: {known}")
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
        raise RenderError(f"--set {key}={raw}: {key} must be {kind} ({help_})") from None
    if key in CHOICES and value not in CHOICES[key] and not (value == "" and key == "param_map"):
        raise RenderError(f"--set {key}={raw}: choose one of {CHOICES[key]}")
    return value


def resolve(preset: str, overrides: dict[str, str] | None = None) -> tuple[Preset, dict]:
    """The preset and its values with ``overrides`` (strings, as given to ``--set``) applied and
    checked: types, choices, and that the ranks split into the requested parallel sizes."""
    if preset not in PRESETS:
        raise RenderError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    values = dict(p.values)
    for key, raw in (overrides or {}).items():
        if key not in p.values and key in SCHEMA:
            raise RenderError(f"--set {key}={raw}: the {p.template!r} template of preset "
                              f"{preset!r} does not use {key!r}")
        values[key] = _parse(key, raw)
    for key, value in values.items():
        typ = SCHEMA[key][0]
        if typ is float and isinstance(value, int):
            continue
        if not isinstance(value, typ):
            raise RenderError(f"preset {preset!r}: {key}={value!r} is not {typ.__name__}")
    if p.template == "train":
        _check_train(values)
    return p, values


def _check_train(v: dict) -> None:
    from mfsdp.layout import ParallelLayout

    for key in ("nodes", "ranks_per_node", "outer", "ep", "tp", "cp", "micro_batch_size",
                "global_batch_size", "train_iters", "seq_length"):
        if v[key] < 1:
            raise RenderError(f"{key}={v[key]} must be at least 1")
    if v["gpus_per_node"] and v["ranks_per_node"] != v["gpus_per_node"]:
        raise RenderError(f"ranks_per_node={v['ranks_per_node']} but gpus_per_node="
                          f"{v['gpus_per_node']}: a GPU job runs one rank per GPU; set both")
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
    if v["distributed_timeout_minutes"] <= 0:
        raise RenderError("distributed_timeout_minutes must be positive")
    if v["outer_strategy"] == "optim" and v["outer"] < 2:
        raise RenderError("outer_strategy=optim needs outer of at least 2")


def _flag_lines(args: str) -> list[str]:
    """Group ``--flag value`` pairs: one trainer flag (with its values) per line."""
    lines: list[str] = []
    for token in args.split():
        if token.startswith("--") or not lines:
            lines.append(token)
        else:
            lines[-1] += " " + token
    return lines


def render(preset: str, overrides: dict[str, str] | None = None) -> str:
    """The script of ``preset`` with ``overrides`` applied (see :func:`mfsdp.sbatch.resolve`)."""
    import jinja2

    p, values = resolve(preset, overrides)
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)),
                             undefined=jinja2.StrictUndefined, trim_blocks=True,
                             lstrip_blocks=True, keep_trailing_newline=True, autoescape=False)
    world = values.get("nodes", 1) * values.get("ranks_per_node", 1)
    text = env.get_template(f"{p.template}.sbatch.j2").render(
        preset=preset, description=p.description, world=world,
        overrides=[f"{k}={v}" for k, v in (overrides or {}).items()],
        flag_lines=_flag_lines, **values)
    return text if text.endswith("\n") else text + "\n"


def render_all(directory: str | Path) -> list[Path]:
    """Write every preset's script to ``directory/<preset>.sbatch`` (what ``example-scripts`` holds)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for name in PRESETS:
        path = directory / f"{name}.sbatch"
        path.write_text(render(name))
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
