"""The compatibility matrix's third table: every sharding strategy x what a checkpoint goes
through, measured with ``mfsdp check``'s ``resume`` machinery on :data:`NPROC` gloo ranks. Each
cell trains the ``llama-tiny`` preset one step (:data:`OPTIMIZER`), saves an ``fsdp_dtensor`` checkpoint,
sends it through its column, loads the result into a freshly sharded model and trains the second
step; the cell is the worst parameter error against one process that trained both steps::

    python -m mfsdp.check.matrix_checkpoint       # measure and print the table

Columns (:data:`ROUTES`):

* ``reload as ...``: loaded as saved into a model sharded with another strategy
  (:data:`RELOAD_AS`), so every strategy is both written and read;
* ``torch_dist round trip``: ``mfsdp convert --to megatron_lm --weights-only`` (Megatron-LM's
  ``torch_dist``), then ``--from megatron_lm`` back, loaded into the same strategy. Megatron-LM
  keeps its optimizer state in two parameter groups (with and without weight decay) where a plain
  ``torch.optim`` optimizer has one, so the trip carries the weights; the optimizer state's own
  conversion is checked bit for bit against checkpoints megatron-core wrote (the conversion
  reference page);
* ``HF round trip``: ``mfsdp convert --to hf`` (Hugging Face safetensors and ``config.json``),
  then ``--from hf`` back (weights only).

The conversions are the ``mfsdp convert`` command a user runs, in a process of its own on rank 0.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterable

from mfsdp.check.layouts import TOLERANCES, Layout
from mfsdp.check.matrix import (NPROC, STRATEGIES, Cell, _cpu_seconds, _judge, print_measured,
                                render_by_strategy, run_layouts)

__all__ = ["ROUTES", "RELOAD_AS", "MODEL", "OPTIMIZER", "checkpoint_combinations",
           "round_trip", "measure_checkpoints", "render_checkpoint_table"]

MODEL = "llama-tiny"
"""The model every cell trains (a trainer preset, so the converters know its configuration)."""

RELOAD_AS = {"no_shard": "optim_grads_params", "optim": "no_shard", "optim_grads": "optim",
             "optim_grads_params": "optim_grads"}
"""The strategy each strategy's checkpoint is loaded into in the ``reload`` column."""

ROUTES = ("reload as another strategy", "torch_dist round trip", "HF round trip")
"""The columns, in table order."""

_FORMAT = {"torch_dist round trip": "megatron_lm", "HF round trip": "hf"}
OPTIMIZER = {"reload as another strategy": "adamw", "torch_dist round trip": "sgd",
             "HF round trip": "sgd"}
"""The optimizer of each column: AdamW where the optimizer state travels with the checkpoint
(its moments must survive the reload), SGD (stateless) where only the weights make the trip."""


def checkpoint_combinations() -> list[tuple[str, str]]:
    """Every ``(strategy, route)`` of the table, in table order."""
    return [(s, r) for s in STRATEGIES for r in ROUTES]


def round_trip(path, model, optimizer, fmt: str, preset: str = MODEL) -> None:
    """A ``resume_fn`` for :func:`mfsdp.check.run.run_layout` (every rank calls it): rank 0
    converts the ``fsdp_dtensor`` checkpoint at ``path`` to ``fmt`` and back with ``mfsdp
    convert`` (in a process of its own), then every rank loads the weights of the result."""
    from mfsdp.checkpoint import load_checkpoint
    from mfsdp.checkpoint.dcp import on_rank_zero

    path = Path(path)
    there, back = path.parent / f"as-{fmt}", path.parent / f"back-from-{fmt}"

    def convert_there_and_back() -> None:
        env = {k: v for k, v in os.environ.items()  # a single-process conversion
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
        for src, dst, a, b in ((path, there, "fsdp_dtensor", fmt), (there, back, fmt,
                                                                    "fsdp_dtensor")):
            weights_only = ["--weights-only"] if b == "megatron_lm" else []
            done = subprocess.run(
                [sys.executable, "-m", "mfsdp.cli", "convert", "--from", a, "--to", b,
                 "--model-preset", preset, "--no-progress", *weights_only, str(src), str(dst)],
                env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(
                    f"mfsdp convert --from {a} --to {b} exited {done.returncode}: "
                    + (done.stderr.strip().splitlines() or ["(no output)"])[-1])

    failed = on_rank_zero(convert_there_and_back, describe=str)
    if failed:
        raise RuntimeError(failed)
    load_checkpoint(back, model, None)


def _importable_round_trip() -> Callable:
    """:func:`round_trip` as the ranks can unpickle it (also when this file runs as
    ``__main__``)."""
    import importlib

    return importlib.import_module(__spec__.name if __name__ == "__main__" and __spec__
                                   else __name__).round_trip


def _layout(strategy: str, route: str) -> Layout:
    again = RELOAD_AS[strategy] if route == ROUTES[0] else strategy
    return Layout(f"{strategy}/{route}", strategy, resume_as=again, min_ranks=NPROC)


def measure_checkpoints(*, lr: float = 0.1, cells: Iterable[tuple[str, str]] | None = None,
                        seed: int = 0, timeout: float = 300.0, model: str = MODEL,
                        progress: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """Measure the table (or only ``cells``) on :data:`NPROC` gloo ranks, one launch
    per column. Returns JSON-ready data as :func:`mfsdp.check.matrix.measure_matrix` does."""
    from mfsdp.check.models import build_model, resolve_units
    from mfsdp.check.run import Settings, run_reference

    wall, cpu = time.perf_counter(), _cpu_seconds()
    chosen = list(cells) if cells is not None else checkpoint_combinations()
    unknown = [c for c in chosen if c not in checkpoint_combinations()]
    if unknown:
        raise ValueError(f"cells={unknown[0]!r} is not a combination of the table; give "
                         f"(strategy, route) from {STRATEGIES}, {ROUTES}")
    units = [c.__name__ for c in resolve_units(build_model(model, seed), None)]
    base = Settings(model=model, optimizer="sgd", lr=lr, steps=2, global_batch=2 * NPROC,
                    seq_len=16, seed=seed, units=units)
    references = {opt: run_reference(dataclasses.replace(base, optimizer=opt))
                  for opt in sorted({OPTIMIZER[r] for _, r in chosen})}
    results: dict[tuple, Cell] = {}
    launches = 0
    for route in ROUTES:
        combos = [c for c in chosen if c[1] == route]
        if not combos:
            continue
        fmt = _FORMAT.get(route)
        s = dataclasses.replace(base, optimizer=OPTIMIZER[route],
                                resume_fn=functools.partial(_importable_round_trip(), fmt=fmt,
                                                            preset=model) if fmt else None)
        layouts = [_layout(*c) for c in combos]
        ranks0, n = run_layouts(s, layouts, timeout)
        launches += n
        for combo, layout, got in zip(combos, layouts, ranks0):
            cell = Cell.of(combo, ("route",), "fails")
            _judge(cell, layout, references[OPTIMIZER[route]], got)
            results[combo] = cell
            if progress is not None:
                progress(f"{layout.name:<44} {cell.status}  {cell.message}")
    return {
        "model": model, "nproc": NPROC, "steps": 2, "optimizers": OPTIMIZER, "lr": lr,
        "seed": seed,
        "reload_as": RELOAD_AS, "tolerances": {k: asdict(v) for k, v in TOLERANCES.items()},
        "cells": [results[c].as_dict() for c in chosen], "launches": launches,
        "seconds": round(time.perf_counter() - wall, 1),
        "cpu_seconds": round(_cpu_seconds() - cpu, 1),
    }


def render_checkpoint_table(data: dict[str, Any]) -> str:
    """The table as Markdown: one row per strategy, one column per route.

    >>> data = {"cells": [{"strategy": "optim", "route": "HF round trip", "status": "works",
    ...                    "message": "", "worst_param_error": 3e-7}]}
    >>> print(render_checkpoint_table(data))
    | strategy | HF round trip |
    | --- | --- |
    | `optim` | works (3e-07) |
    """
    return render_by_strategy(data, "route", ROUTES)


def main() -> int:
    """Measure the whole table and print it with its cost."""
    return print_measured(measure_checkpoints, render_checkpoint_table)


if __name__ == "__main__":
    sys.exit(main())
