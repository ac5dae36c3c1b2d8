"""Render Slurm batch scripts from jinja2 templates and presets: ``mfsdp sbatch render PRESET``.

Every template variable is declared in :data:`SCHEMA` with its type; a preset gives each a value
and ``--set key=value`` overrides one, checked against that type and against what Slurm and the
trainer accept (one line when refused). Every value is written into the script as a literal
(shell-quoted) string. Templates use ``StrictUndefined``: a variable missing from the schema is an
error, never an empty string. One preset renders for two trainers (``trainer=mfsdp``, the default,
or ``trainer=megatron-lm``: Megatron-LM's ``pretrain_gpt.py``) and two launchers
(``launcher=torchrun`` or ``srun``). The ``bandwidth`` preset runs ``mfsdp bandwidth`` under
torchrun on every node instead of a trainer. The guide's page Inside a Slurm script
(docs/slurm-scripts.md) says what the scripts do.

>>> script = render("cpu-smoke", {"train_iters": "5"})
>>> script.splitlines()[0]
'#!/bin/bash'
>>> "--train-iters 5" in script
True
>>> render("cpu-smoke", {"nodes": "two"})
Traceback (most recent call last):
...
mfsdp.tools.sbatch.RenderError: --set nodes='two': nodes must be an integer (number of nodes)
"""

from __future__ import annotations

import argparse
import shlex
import sys
import textwrap
from pathlib import Path

from mfsdp.tools.sbatch.arguments import (Var, _abs, _beside_log, _group, _in_job_dir, _quote,
                                          bandwidth_args, convert_args,
                                          megatron_lm_model_flags, train_args)
from mfsdp.tools.sbatch.checks import _model_preset, resolve, time_limit_seconds
from mfsdp.tools.sbatch.errors import RenderError
from mfsdp.tools.sbatch.extra import check_extra_args
from mfsdp.tools.sbatch.header import describe
from mfsdp.tools.sbatch.presets import CHOICES, PRESETS, SCHEMA, Preset

__all__ = ["CHOICES", "PRESETS", "Preset", "RenderError", "SCHEMA", "Var", "bandwidth_args",
           "build_parser", "convert_args", "main", "megatron_lm_model_flags", "parse_overrides",
           "render", "render_all", "resolve", "scripts", "time_limit_seconds", "train_args"]

RenderError.__module__ = __name__  # its public name: mfsdp.tools.sbatch.RenderError

TEMPLATES = Path(__file__).resolve().parent / "templates"


def render(preset: str, overrides: dict[str, str] | None = None) -> str:
    """The script of ``preset`` with ``overrides`` applied (see :func:`mfsdp.tools.sbatch.resolve`).
    Every value is written as a literal: shell-quoted (``shlex.quote``) where the shell reads it,
    checked to be one word where sbatch reads it (the ``#SBATCH`` lines). A train script whose
    planned peak per GPU is over what its ``gpu`` leaves is refused unless
    ``allow_over_memory`` (``mfsdp.tools.sbatch.schedule.over_memory``)."""
    import jinja2

    p, values = resolve(preset, overrides)
    if p.template == "train":
        check_extra_args(values)
    if p.template == "train" and not values["allow_over_memory"]:
        from mfsdp.tools.sbatch.schedule import over_memory

        why = over_memory(values)
        if why:
            raise RenderError(why)
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)),
                             undefined=jinja2.StrictUndefined, trim_blocks=True,
                             lstrip_blocks=True, keep_trailing_newline=True, autoescape=False)
    env.filters["q"] = lambda x: shlex.quote(str(x))
    env.filters["abs"] = _abs
    env.filters["in_job_dir"] = _in_job_dir
    env.filters["beside_log"] = _beside_log
    world = values.get("nodes", 1) * values.get("ranks_per_node", 1)
    args = {"train": train_args, "bandwidth": bandwidth_args,
            "convert": convert_args}[p.template](values)
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
        preset=preset, template=p.template, world=world,
        description="\n# ".join(textwrap.wrap(describe(p, values), 98, break_on_hyphens=False)),
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


def parse_overrides(items: list[str]) -> dict[str, str]:
    """``--set`` values (``KEY=VALUE`` each, as ``mfsdp sbatch render`` takes them) as the
    overrides :func:`render` takes; an item without ``=`` is refused.

    >>> parse_overrides(["nodes=2", "env_setup=export A=1"])
    {'nodes': '2', 'env_setup': 'export A=1'}
    """
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise RenderError(f"--set {item}: expected KEY=VALUE")
        overrides[key] = value
    return overrides


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``mfsdp sbatch`` command."""
    if args.action == "list":
        width = max(map(len, PRESETS))  # the longest name still leaves a space
        for name, p in PRESETS.items():
            print(f"{name:<{width}} {describe(p)}")
        print()
        width = max(map(len, SCHEMA))
        for key, (typ, help_) in SCHEMA.items():
            print(f"{key:<{width}} {typ.__name__:<6} {help_}")
        return 0
    if args.action == "render-all":
        for path in render_all(args.directory):
            print(path)
        return 0
    overrides = parse_overrides(args.overrides)
    text = render(args.preset, overrides)
    if PRESETS[args.preset].template == "train":  # how long the schedule takes (not a CPU job)
        from mfsdp.tools.sbatch.schedule import schedule_lines

        values = resolve(args.preset, overrides)[1]
        for line in (schedule_lines(values) + shared_with_preset(values, overrides)
                     + not_run_parts(values)):
            print(line, file=sys.stderr)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def not_run_parts(values: dict) -> list[str]:
    """Warnings for parts of an ``mfsdp train`` job that this project has not run: mfsdp's
    flex dispatcher with the DeepEP backend (no multi-GPU machine here), and ``--compile`` on
    an MoE model (the routed experts' token counts change every step, so each step may
    compile the MoE layers again; the deepseek-v3 preset leaves it off). ``[]`` otherwise.

    >>> for line in not_run_parts({"trainer": "mfsdp", "num_experts": 8, "compile": True,
    ...                            "dispatcher": "flex", "flex_backend": "deepep"}):
    ...     print(line)
    ... # doctest: +NORMALIZE_WHITESPACE
    mfsdp sbatch: the flex dispatcher's deepep backend has not run in this project (no
      multi-GPU machine); --set dispatcher=alltoall, checked on CPU ranks, avoids it
    mfsdp sbatch: compile with an MoE model: the experts' token counts change every step and
      may compile the MoE layers again each time (deepseek-v3 leaves it off); --set
      compile=false
    >>> not_run_parts({"trainer": "mfsdp", "num_experts": 8, "compile": False,
    ...                "dispatcher": "alltoall"})
    []
    """
    lines, ours = [], values.get("trainer", "mfsdp") == "mfsdp"
    if ours and values.get("dispatcher") == "flex" and values.get("flex_backend") == "deepep":
        lines.append("mfsdp sbatch: the flex dispatcher's deepep backend has not run in this "
                     "project (no multi-GPU machine); --set dispatcher=alltoall, checked on "
                     "CPU ranks, avoids it")
    if ours and values.get("num_experts") and values.get("compile"):
        lines.append("mfsdp sbatch: compile with an MoE model: the experts' token counts change "
                     "every step and may compile the MoE layers again each time (deepseek-v3 "
                     "leaves it off); --set compile=false")
    return lines


def shared_with_preset(values: dict, overrides: dict) -> list[str]:
    """The warning for a render whose ``model_args`` change the preset's model but that keeps
    the preset's job name (its singleton chain) or checkpoint directory: the job would queue
    behind, and resume from, the preset's own job. ``[]`` otherwise.

    >>> print(*shared_with_preset({"job_name": "mfsdp-llama3-8b", "save": "ckpt/llama3-8b"},
    ...                           {"model_args": "--num-layers 40"}))
    ... # doctest: +NORMALIZE_WHITESPACE
    mfsdp sbatch: model_args changes the model, but the job keeps the preset's job_name
      (mfsdp-llama3-8b, its singleton chain) and save (ckpt/llama3-8b): set --set
      job_name=NAME --set save=DIR, or it queues behind and resumes from the preset's job
    >>> shared_with_preset({"job_name": "j13b", "save": "ckpt/13b"},
    ...                    {"model_args": "--num-layers 40", "job_name": "j13b",
    ...                     "save": "ckpt/13b"})
    []
    """
    if not overrides.get("model_args"):
        return []
    what = {"job_name": ("NAME", ", its singleton chain"), "save": ("DIR", "")}
    kept = [key for key in what if key not in overrides and values.get(key)]
    if not kept:
        return []
    named = " and ".join(f"{key} ({values[key]}{what[key][1]})" for key in kept)
    keys = " ".join(f"--set {key}={what[key][0]}" for key in kept)
    return [f"mfsdp sbatch: model_args changes the model, but the job keeps the preset's "
            f"{named}: set {keys}, or it queues behind and resumes from the preset's job"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m mfsdp.tools.sbatch``."""
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except RenderError as exc:
        print(f"mfsdp sbatch: error: {exc}", file=sys.stderr)
        return 2

