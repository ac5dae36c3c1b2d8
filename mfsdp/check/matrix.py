"""The compatibility matrix: every sharding strategy x outer dimension (none, HSDP, HFSDP) x
precision, either measured with the parity doctor's machinery or refused by the API, with the
API's own message. The guide page ``docs/compatibility.md`` shows it, measured at docs build time
(``docs/_ext/compat_matrix.py`` caches it by a digest of the package source)::

    python -m mfsdp.check.matrix            # measure and print the table (about a minute)

From Python: ``measure_matrix()`` returns the data, ``render_table(data)`` the Markdown table.
"""

from __future__ import annotations

import gc
import resource
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable

from mfsdp.check.layouts import TOLERANCES, Layout

__all__ = ["STRATEGIES", "OUTERS", "PRECISIONS", "NPROC", "Cell", "combinations", "layout_for",
           "refusal", "measure_matrix", "cell_text", "render_table"]

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
"""The ``zero_dp_strategy`` axis."""

OUTERS: dict[str, tuple[int, str]] = {
    "none": (1, "no_shard"),
    "HSDP": (2, "no_shard"),
    "HFSDP": (2, "optim"),
}
"""The outer-dimension axis: ``(dp_outer, outer_dp_sharding_strategy)``."""

PRECISIONS: dict[str, dict[str, Any]] = {
    "fp32": dict(compute_dtype="fp32", grad_comm_dtype=None, tolerance="fp32"),
    "bf16": dict(compute_dtype="bf16", grad_comm_dtype=None, tolerance="bf16"),
    "bf16_comm": dict(compute_dtype="fp32", grad_comm_dtype="bf16", tolerance="bf16_comm"),
}
"""The precision axis: fp32; bf16 compute with fp32 main weights and gradients; fp32 compute with
bf16 gradient communication. Each names the tolerance of ``TOLERANCES`` it is judged by."""

PRECISION_TITLES = {"fp32": "fp32", "bf16": "bf16 compute, fp32 main weights",
                    "bf16_comm": "bf16 gradient communication"}

NPROC = 4
"""Ranks per run: an outer dimension of 2 over a shard group of 2 (or a shard group of 4)."""

_AXES = ("outer", "precision")  # the coordinates of a cell beside its strategy


@dataclass
class Cell:
    """One combination of a measured table and what happened to it: this matrix's (strategy,
    outer, precision), the parallelism table's (strategy, parallel), the checkpoint table's
    (strategy, route)."""

    strategy: str
    axes: dict[str, str]
    """The combination's other coordinates by name (``{"outer": "HSDP", "precision": "bf16"}``)."""
    status: str
    """``works`` (within tolerance at every step), ``fails`` (outside it, or a rank raised),
    ``refused`` (the API rejects the combination before building anything) or ``lacks`` (not
    one of the engine's strategies: FSDP2 has no ZeRO-1, for example)."""
    message: str = ""
    """``refused``: the API's error; ``fails``: the first step and metric outside the tolerance,
    or the error a rank raised."""
    worst_param_error: float | None = None
    """Largest relative error of one parameter at any step (``mfsdp check``'s worst parameter)."""
    worst_ratio_error: float | None = None
    """Largest ``|ratio - 1|`` of the gradient-norm and update-norm ratios at any step."""
    worst_loss_error: float | None = None
    """Largest ``|loss difference| / max(1, |reference loss|)`` at any step."""

    @classmethod
    def of(cls, combo: tuple[str, ...], names: tuple[str, ...], status: str,
           message: str = "") -> Cell:
        """The cell of ``combo`` (the strategy, then one value per name of ``names``)."""
        return cls(combo[0], dict(zip(names, combo[1:], strict=True)), status, message)

    def as_dict(self) -> dict:
        """The JSON row: the strategy, the other coordinates, then the outcome."""
        row = {"strategy": self.strategy, **self.axes}
        row.update((k, v) for k, v in asdict(self).items() if k not in ("strategy", "axes"))
        return row


def combinations() -> list[tuple[str, str, str]]:
    """Every ``(strategy, outer, precision)`` of the matrix, in table order."""
    return [(s, o, p) for s in STRATEGIES for o in OUTERS for p in PRECISIONS]


def layout_for(strategy: str, outer: str, precision: str) -> Layout:
    """The :class:`~mfsdp.check.layouts.Layout` that runs one combination on :data:`NPROC` ranks."""
    dp_outer, outer_strategy = OUTERS[outer]
    return Layout(f"{strategy}/{outer}/{precision}", strategy, dp_outer=dp_outer,
                  outer_strategy=outer_strategy, min_ranks=NPROC, **PRECISIONS[precision])


def refusal(strategy: str, outer: str, precision: str) -> str | None:
    """The ``ValueError`` message ``mfsdp.fully_shard`` raises for this combination, or ``None``
    when it accepts it (asked of the API's own validation, ``ShardingConfig.from_arguments``).

    >>> print(refusal("optim_grads", "HFSDP", "fp32"))
    outer_dp_sharding_strategy='optim' needs zero_dp_strategy='optim_grads_params', got 'optim_grads'
    >>> refusal("optim_grads", "HSDP", "fp32") is None
    True
    """
    from mfsdp.check.run import mixed_precision_policy
    from mfsdp.config import ShardingConfig

    layout = layout_for(strategy, outer, precision)
    try:
        config = ShardingConfig.from_arguments(
            zero_dp_strategy=strategy, outer_dp_sharding_strategy=layout.outer_strategy,
            mixed_precision_policy=mixed_precision_policy(layout))
        config.for_outer_size(layout.dp_outer)
    except ValueError as exc:
        return str(exc)
    return None


_RUN_MANY = "mfsdp.check.matrix:_run_many"  # by name: also when run as python -m


def _run_many(s: dict, layouts: list[Layout]) -> list[dict[str, Any]]:
    """Inside a launched rank: :func:`~mfsdp.check.run.run_layout` for each layout in turn (one
    process start-up for all of them); an error is recorded and the next layout runs. A
    ``ValueError`` raised while building (``run_layout`` names the step of any later error) is
    the API refusing the layout: it is kept whole as ``refused``."""
    from mfsdp.check.run import run_layout

    out = []
    for layout in layouts:
        try:
            out.append(run_layout(s, layout))
        except ValueError as exc:
            out.append({"error": f"ValueError: {str(exc).splitlines()[0]}",
                        "refused": str(exc)})
        except Exception as exc:  # the cell fails with it; the ranks raised alike or time out
            out.append({"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"})
        gc.collect()
    return out


def run_layouts(s: dict, layouts: list[Layout], timeout: float) -> tuple[list[dict], int]:
    """Rank 0's result of each layout, run one after another in one launch of :data:`NPROC`
    ranks; if that launch raises or times out, each layout is rerun in a launch of its own, so a
    bad one fails alone (its result is then ``{"error": ...}``). Returns the results and the
    number of launches."""
    from mfsdp.launch import LaunchTimeout, RankError, launch

    try:
        return launch(_RUN_MANY, NPROC, args=(s, layouts), timeout=timeout)[0], 1
    except (RankError, LaunchTimeout):
        results = []
        for layout in layouts:
            try:
                results.append(launch(_RUN_MANY, NPROC, args=(s, [layout]),
                                      timeout=min(timeout, 120.0))[0][0])
            except (RankError, LaunchTimeout) as exc:
                results.append({"error": str(exc).strip().splitlines()[0]})
        return results, 1 + len(layouts)


def _judge(cell: Cell, layout: Layout, reference: dict, got: dict) -> None:
    from mfsdp.check.report import compare

    if "error" in got:
        cell.status, cell.message = "fails", f"raised: {got['error']}"
        return
    steps, reason = compare(layout, reference, got)
    cell.status, cell.message = ("fails", reason) if reason else ("works", "")
    cell.worst_param_error = max(s.worst_param_error for s in steps)
    cell.worst_ratio_error = max(max(abs(s.grad_norm_ratio - 1), abs(s.update_norm_ratio - 1))
                                 for s in steps)
    cell.worst_loss_error = max(abs(s.loss_diff) / max(1.0, abs(s.loss - s.loss_diff))
                                for s in steps)


def measure_matrix(model: Any = "mfsdp.check.faults:tiny", *, steps: int = 2, lr: float = 0.1,
                   cells: Iterable[tuple[str, str, str]] | None = None, seed: int = 0,
                   timeout: float = 300.0,
                   progress: Callable[[str], Any] | None = None,
                   engine: str = "mfsdp") -> dict[str, Any]:
    """Measure the matrix (or only ``cells``) for ``model`` with SGD on :data:`NPROC` gloo ranks,
    sharded by ``engine`` (``mfsdp``, ``fsdp2``, ``megatron_fsdp``: :mod:`mfsdp.check.engines`).

    Under mfsdp, refused combinations are asked of the API (:func:`refusal`) and not run; under
    another engine, a combination that is not one of its strategies is ``lacks`` (with the
    adapter's reason), and one its ``fully_shard`` rejects with a ``ValueError`` is ``refused``
    with that message. The others train
    ``steps`` steps each in one launch of :data:`NPROC` processes (``timeout`` seconds; if it
    raises or times out, each of its combinations is rerun in a launch of its own, of at most
    ``min(timeout, 120)`` seconds, so one bad combination fails alone), and are compared with a
    single-process reference as ``mfsdp check`` does.

    Returns JSON-ready data: ``cells`` (one :class:`Cell` as a dict each), the settings, the
    tolerances, ``seconds`` (wall) and ``cpu_seconds`` (this process and its ranks), ``launches``.
    """
    from mfsdp.check.models import build_model, resolve_units
    from mfsdp.check.run import Settings, run_reference

    wall, cpu = time.perf_counter(), _cpu_seconds()
    chosen = list(cells) if cells is not None else combinations()
    unknown = [c for c in chosen if c not in combinations()]
    if unknown:
        raise ValueError(f"cells={unknown[0]!r} is not a combination of the matrix; give "
                         f"(strategy, outer, precision) from {STRATEGIES}, {tuple(OUTERS)}, "
                         f"{tuple(PRECISIONS)}")
    from mfsdp.check.engines import get_engine

    adapter = get_engine(engine)
    if adapter.missing():
        raise ValueError(adapter.missing())
    units = resolve_units(build_model(model, seed), None)
    s = Settings(model=model, optimizer="sgd", lr=lr, steps=steps, global_batch=2 * NPROC,
                 seq_len=16, seed=seed, units=[c.__name__ for c in units], optimizer_factory=None,
                 recursive_gather=None, resume_fn=None, engine=engine)
    results: dict[tuple, Cell] = {}
    runnable = []
    for combo in chosen:
        lacks = adapter.refuses(layout_for(*combo))
        message = refusal(*combo) if engine == "mfsdp" else None
        if lacks is not None:
            results[combo] = Cell.of(combo, _AXES, "lacks", lacks)
        elif message is not None:
            results[combo] = Cell.of(combo, _AXES, "refused", message)
        else:
            runnable.append(combo)
    layouts = [layout_for(*c) for c in runnable]
    ranks0, launches = run_layouts(s, layouts, timeout) if layouts else ([], 0)
    version, replaced = adapter.version(), []
    for got in ranks0:
        version, replaced = got.get("engine_version", version), got.get("replacements", replaced)
    references: dict[str, dict] = {}
    for combo, layout, got in zip(runnable, layouts, ranks0):
        if layout.compute_dtype not in references:
            references[layout.compute_dtype] = run_reference(s, layout.compute_dtype)
        cell = Cell.of(combo, _AXES, "fails")
        if "refused" in got:  # the engine's fully_shard rejected it (its ValueError)
            cell.status, cell.message = "refused", got["refused"]
        else:
            _judge(cell, layout, references[layout.compute_dtype], got)
        results[combo] = cell
        if progress is not None:
            progress(f"{layout.name:<40} {cell.status}  {cell.message}")
    return {
        "model": model if isinstance(model, str) else f"{model.__module__}:{model.__qualname__}",
        "engine": engine, "engine_version": version, "replacements": replaced,
        "nproc": NPROC, "steps": steps, "optimizer": "sgd", "lr": lr, "seed": seed,
        "tolerances": {k: asdict(v) for k, v in TOLERANCES.items()},
        "cells": [results[c].as_dict() for c in chosen],
        "launches": launches,
        "seconds": round(time.perf_counter() - wall, 1),
        "cpu_seconds": round(_cpu_seconds() - cpu, 1),
    }


def _cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the launched ranks)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def cell_text(c: dict) -> str:
    """One cell as the page shows it: ``works (worst parameter error)``, ``refused: <the API's
    message>`` or ``fails: <why>``."""
    if c["status"] == "refused":
        return f"refused: {c['message']}"
    if c["status"] == "works":
        return f"works ({c['worst_param_error']:.0e})"
    if c["status"] == "lacks":
        return f"n/a: {c['message']}"
    return f"**fails**: {c['message']}"


def render_table(data: dict[str, Any]) -> str:
    """The matrix as a Markdown table: one row per strategy and outer dimension, one column per
    precision; a cell reads ``works (worst parameter error)``, ``refused: <the API's message>``
    or ``fails: <why>``.

    >>> data = {"cells": [{"strategy": "optim", "outer": "HFSDP", "precision": "fp32",
    ...                    "status": "refused", "message": "needs ZeRO-3"},
    ...                   {"strategy": "optim", "outer": "HFSDP", "precision": "bf16",
    ...                    "status": "works", "message": "", "worst_param_error": 3.1e-7}]}
    >>> print(render_table(data))
    | strategy | outer | fp32 | bf16 compute, fp32 main weights |
    | --- | --- | --- | --- |
    | `optim` | HFSDP | refused: needs ZeRO-3 | works (3e-07) |
    """
    cells = data["cells"]
    precisions = [p for p in PRECISIONS if any(c["precision"] == p for c in cells)]
    rows: dict[tuple[str, str], dict[str, dict]] = {}
    for c in cells:
        rows.setdefault((c["strategy"], c["outer"]), {})[c["precision"]] = c
    head = "| strategy | outer | " + " | ".join(PRECISION_TITLES[p] for p in precisions) + " |"
    lines = [head, "|" + " --- |" * (2 + len(precisions))]
    for (strategy, outer), by_precision in rows.items():
        texts = [cell_text(by_precision[p]).replace("|", "\\|") if p in by_precision else " "
                 for p in precisions]
        lines.append(f"| `{strategy}` | {outer} | " + " | ".join(texts) + " |")
    return "\n".join(lines)


def render_by_strategy(data: dict[str, Any], key: str, order) -> str:
    """A Markdown table of ``data["cells"]``: one row per strategy, one column per value of the
    cell field ``key`` (the values of ``order`` that occur, in its order)."""
    columns = [p for p in order if any(c[key] == p for c in data["cells"])]
    rows: dict[str, dict[str, dict]] = {}
    for c in data["cells"]:
        rows.setdefault(c["strategy"], {})[c[key]] = c
    lines = ["| strategy | " + " | ".join(columns) + " |", "|" + " --- |" * (1 + len(columns))]
    for strategy, by_column in rows.items():
        texts = [cell_text(by_column[p]).replace("|", "\\|") if p in by_column else " "
                 for p in columns]
        lines.append(f"| `{strategy}` | " + " | ".join(texts) + " |")
    return "\n".join(lines)


def print_measured(measure: Callable[..., dict], render: Callable[[dict], str]) -> int:
    """``python -m`` of a table: measure it (printing each cell), print it and its cost."""
    data = measure(progress=print)
    print(render(data))
    print(f"{data['launches']} launch(es), {data['seconds']} s wall, "
          f"{data['cpu_seconds']} s CPU")
    return 0


def main() -> int:
    """Measure the whole matrix and print it with its cost."""
    return print_measured(measure_matrix, render_table)


if __name__ == "__main__":
    sys.exit(main())
