"""The compatibility matrix's second table: every sharding strategy x tensor, sequence, context
and expert parallelism (EP with each MoE token dispatcher), measured with ``mfsdp check``'s
parallel layouts (:mod:`mfsdp.check.parallel`) on :data:`NPROC` gloo ranks, or refused with the
API's own message. ``docs/compatibility.md`` shows it, measured at docs build time and cached with
the first table (``docs/_ext/compat_matrix.py``)::

    python -m mfsdp.check.matrix_parallel       # measure and print the table

The dense columns train the ``llama-tiny`` preset, the EP columns the MoE preset
``deepseek-proxy``; a column is one launch of :data:`NPROC` processes per model.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict
from typing import Any, Callable, Iterable

from mfsdp.check.layouts import TOLERANCES, Layout
from mfsdp.check.matrix import (NPROC, STRATEGIES, Cell, _cpu_seconds, _judge, print_measured,
                                render_by_strategy, run_layouts)

__all__ = ["PARALLEL", "MODELS", "parallel_combinations", "parallel_layout",
           "measure_parallel", "render_parallel_table"]

PARALLEL: dict[str, dict[str, Any]] = {
    "TP2": dict(tp=2),
    "TP2+SP": dict(tp=2, sequence_parallel=True),
    "CP2": dict(cp=2),
    "EP2 allgather": dict(ep=2, dispatcher="allgather"),
    "EP2 alltoall": dict(ep=2, dispatcher="alltoall"),
    "EP2 flex": dict(ep=2, dispatcher="flex"),
}
"""The parallelism axis: the :class:`~mfsdp.check.layouts.Layout` fields of each column."""

MODELS = {"dense": "llama-tiny", "moe": "deepseek-proxy"}
"""The model each column trains: the MoE preset for the EP columns, ``llama-tiny`` otherwise."""


def parallel_combinations() -> list[tuple[str, str]]:
    """Every ``(strategy, parallel)`` of the table, in table order."""
    return [(s, p) for s in STRATEGIES for p in PARALLEL]


def model_of(parallel: str) -> str:
    """The model a column trains (:data:`MODELS`)."""
    return MODELS["moe" if PARALLEL[parallel].get("ep", 1) > 1 else "dense"]


def parallel_layout(strategy: str, parallel: str) -> Layout:
    """The layout that runs one combination."""
    return Layout(f"{strategy}/{parallel}", strategy, min_ranks=NPROC, **PARALLEL[parallel])


def measure_parallel(*, steps: int = 2, lr: float = 0.1,
                     cells: Iterable[tuple[str, str]] | None = None, seed: int = 0,
                     timeout: float = 300.0, models: dict[str, str] | None = None,
                     progress: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """Measure the table (or only ``cells``) with SGD on :data:`NPROC` gloo ranks.

    The combinations of one model run one after another in one launch (if it raises or times
    out, each combination is rerun in a launch of its own, as the first table does). A
    ``ValueError`` raised while building (by ``mfsdp.fully_shard``, the TP plan or the expert
    sharding) makes the cell ``refused`` with its message; any other error, or a step outside
    the tolerance, ``fails``.
    ``models`` replaces :data:`MODELS` (``{"dense": ..., "moe": ...}``). Returns JSON-ready data
    as :func:`mfsdp.check.matrix.measure_matrix` does.
    """
    from mfsdp.check.models import build_model, resolve_units
    from mfsdp.check.run import Settings, run_reference

    wall, cpu = time.perf_counter(), _cpu_seconds()
    chosen = list(cells) if cells is not None else parallel_combinations()
    unknown = [c for c in chosen if c not in parallel_combinations()]
    if unknown:
        raise ValueError(f"cells={unknown[0]!r} is not a combination of the table; give "
                         f"(strategy, parallel) from {STRATEGIES}, {tuple(PARALLEL)}")
    models = {**MODELS, **(models or {})}
    results: dict[tuple, Cell] = {}
    launches = 0
    for kind, model in models.items():
        combos = [c for c in chosen if ("moe" if PARALLEL[c[1]].get("ep", 1) > 1 else "dense")
                  == kind]
        if not combos:
            continue
        units = resolve_units(build_model(model, seed), None)
        s = Settings(model=model, optimizer="sgd", lr=lr, steps=steps, global_batch=2 * NPROC,
                     seq_len=16, seed=seed, units=[c.__name__ for c in units],
                     optimizer_factory=None, recursive_gather=None, resume_fn=None)
        layouts = [parallel_layout(*c) for c in combos]
        ranks0, n = run_layouts(s, layouts, timeout)
        launches += n
        reference = run_reference(s)
        for combo, layout, got in zip(combos, layouts, ranks0):
            cell = Cell.of(combo, ("parallel",), "fails")
            if got.get("refused"):
                cell.status, cell.message = "refused", got["refused"]
            else:
                _judge(cell, layout, reference, got)
            results[combo] = cell
            if progress is not None:
                progress(f"{layout.name:<36} {cell.status}  {cell.message}")
    return {
        "models": models, "nproc": NPROC, "steps": steps, "optimizer": "sgd", "lr": lr,
        "seed": seed, "tolerances": {k: asdict(v) for k, v in TOLERANCES.items()},
        "cells": [results[c].as_dict() for c in chosen],
        "launches": launches,
        "seconds": round(time.perf_counter() - wall, 1),
        "cpu_seconds": round(_cpu_seconds() - cpu, 1),
    }


def render_parallel_table(data: dict[str, Any]) -> str:
    """The table as Markdown: one row per strategy, one column per parallelism.

    >>> data = {"cells": [{"strategy": "optim", "parallel": "TP2", "status": "works",
    ...                    "message": "", "worst_param_error": 2e-6}]}
    >>> print(render_parallel_table(data))
    | strategy | TP2 |
    | --- | --- |
    | `optim` | works (2e-06) |
    """
    return render_by_strategy(data, "parallel", PARALLEL)


def main() -> int:
    """Measure the whole table and print it with its cost."""
    return print_measured(measure_parallel, render_parallel_table)


if __name__ == "__main__":
    sys.exit(main())
