"""The planner's numbers as lookup tables, for the guide's interactive calculator.

The calculator on the planner page (``docs/planner.md``) computes no estimate of its own: the
docs build calls :func:`export` and writes its tables as JSON next to the page, and the page's
script (``docs/_static/mfsdp-planner.js``) looks its inputs up. Every number in the tables comes
from :func:`mfsdp.tools.plan.plan` and :func:`mfsdp.tools.plan_time.step_time`, the functions
``mfsdp plan`` prints, so the calculator cannot drift from the command.

The full grid of inputs is too large to tabulate (four presets, eight world sizes, four
strategies and so on make about two million layouts), so the tables follow what each number
depends on:

* ``state``: weights, main weights, gradients, optimizer state, gathered weights and gradient
  buffers at their peak, and the
  seconds the FSDP collectives (``dp_shard``, ``dp_outer``) take, per (world size, strategy,
  outer size, outer strategy, TP, CP, EP): none of them depends on the batch or the sequence;
* ``activations``: the layers' activations, the loss's logits and the logits' gradient, per
  (TP, CP, SP, micro-batch, sequence length, recompute);
* ``time``: the compute seconds, the seconds of the collectives between layers (TP, CP, EP), and
  the tokens and model FLOPs per rank and step, per (TP, CP, EP, micro-batch, sequence length,
  recompute): per rank, none of them depends on the world size or the sharding.

The page takes the larger of the step's two moments (:attr:`mfsdp.tools.plan.Plan.moments`:
the loss's peak, with ``logits``, and the backward, with ``grad_buffers`` and the logits'
gradient) as the total and combines the times as :func:`~mfsdp.tools.plan_time.step_time`
does (the FSDP collectives overlap the compute, the others add to it); :func:`lookup` is that
combination in Python. :func:`check` compares it with direct calls of the planner on random
layouts, and :func:`export` runs it: a change to the planner that breaks the split stops the docs
build instead of showing wrong numbers.

>>> small = {**GRID, "preset": ["llama3-8b"], "world_size": [8, 64], "seq_length": [4096]}
>>> tables = export(small, samples=20)
>>> got = lookup(tables, preset="llama3-8b", world_size=64, strategy="optim_grads_params",
...              dp_outer=1, outer_strategy="no_shard", tp=1, cp=1, ep=1,
...              sequence_parallel=False, micro_batch=1, seq_length=4096, recompute="none")
>>> round(got["total"], 2), round(got["step_s"], 2)   # mfsdp plan llama3-8b --world-size 64
(38.1, 0.5)
"""

from __future__ import annotations

import itertools
import random

from mfsdp.tools.plan import GiB, PRESETS, Layout, plan
from mfsdp.tools.plan_time import step_time

__all__ = ["GRID", "RECOMPUTE", "AXES", "MEMORY", "export", "check", "lookup", "direct"]

GRID: dict[str, list] = {
    "preset": ["llama3-8b", "llama3-70b", "llama3.1-405b", "deepseek-v3"],
    "world_size": [8, 16, 32, 64, 128, 256, 512, 1024],
    "strategy": ["optim_grads_params", "optim_grads", "optim", "no_shard"],
    "dp_outer": [1, 2, 4],
    "outer_strategy": ["no_shard", "optim"],
    "tp": [1, 2, 4, 8],
    "cp": [1, 2, 4],
    "ep": [1, 2, 4, 8, 16, 32, 64],
    "sequence_parallel": [False, True],
    "micro_batch": [1, 2, 4],
    "seq_length": [2048, 4096, 8192, 16384, 32768],
    "recompute": ["none", "selective", "full"],
}
"""The inputs the calculator offers, each a drop-down list of these values (EP for the
mixture-of-experts presets only, the sizes that divide their routed experts). The outer size
is ``mfsdp plan --num-distributed-optimizer-instances``, the outer strategy its
``--outer-dp-sharding-strategy``: ``no_shard`` replicates across the outer groups (HSDP),
``optim`` also shards the optimizer state over them (HFSDP). Times are for the H100 (``mfsdp
plan``'s default ``--gpu``) and one micro-batch per data-parallel rank and step (its default
``--global-batch-size``)."""

RECOMPUTE = {"none": None, "selective": "selective", "full": "full"}
"""The calculator's recompute choices as ``Layout.recompute_granularity`` (``mfsdp plan
--recompute-granularity``; full is uniform, one layer at a time, the command's default)."""

AXES = {
    "state": ("world_size", "strategy", "dp_outer", "outer_strategy", "tp", "cp", "ep"),
    "activations": ("tp", "cp", "sequence_parallel", "micro_batch", "seq_length", "recompute"),
    "time": ("tp", "cp", "ep", "micro_batch", "seq_length", "recompute"),
}
"""Each table's inputs, in the order of its rows (the last one varies fastest)."""

MEMORY = ("weights", "main_weights", "grads", "optimizer", "gathered", "grad_buffers")
"""The memory terms of a ``state`` row; the row's last number is the FSDP seconds."""

GPU = "h100"


def _values(grid: dict, preset: str, axis: str) -> list:
    experts = PRESETS[preset].num_experts
    if axis == "ep" and not experts:
        return [1]  # a dense model has no experts to split
    if axis == "ep":  # each expert rank holds a whole number of experts
        return [ep for ep in grid[axis] if experts % ep == 0]
    return list(grid[axis])


def _row(preset: str, table: str, inputs: dict) -> list[float] | str:
    """One row of ``table``: what the planner gives for ``inputs`` (the table's axes), or the
    planner's error message."""
    model = PRESETS[preset]
    kw = {k: v for k, v in inputs.items() if k != "recompute"}
    kw["recompute_granularity"] = RECOMPUTE[inputs.get("recompute", "none")]
    if table == "activations":  # on the smallest world the TP x CP split allows
        kw["world_size"] = inputs["tp"] * inputs["cp"]
    if table == "time":  # per rank, neither the world size nor the sharding matters
        kw["world_size"] = inputs["tp"] * inputs["cp"] * inputs["ep"]
    try:
        layout = Layout(**kw)
    except ValueError as exc:
        return str(exc)
    p = plan(model, layout)
    if table == "activations":
        return [p.memory["activations"] / GiB, p.memory["logits"] / GiB, p.logits_grad / GiB]
    t = step_time(model, layout, p.comm, GPU)
    if table == "state":
        return [p.memory[m] / GiB for m in MEMORY] + [
            t.comm_s.get("dp_shard", 0.0) + t.comm_s.get("dp_outer", 0.0)]
    exposed = sum(s for g, s in t.comm_s.items() if g not in ("dp_shard", "dp_outer"))
    return [t.compute_s, exposed, t.tokens_per_gpu_s * t.step_s,
            t.model_tflops_per_gpu * t.step_s, t.mfu * t.step_s]


def export(grid: dict | None = None, samples: int = 300, seed: int = 0) -> dict:
    """The calculator's tables over ``grid`` (default :data:`GRID`), checked by :func:`check` on
    ``samples`` random layouts.

    For each table of :data:`AXES` and each preset: one row per combination of the table's
    inputs, in ``itertools.product`` order; memory in GiB, times in seconds. A row that is an
    integer is the index of the planner's error message in ``errors``.
    """
    grid = {k: list(v) for k, v in (GRID if grid is None else grid).items()}
    errors: list[str] = []
    tables: dict = {"grid": grid, "axes": {k: list(v) for k, v in AXES.items()},
                    "memory": list(MEMORY), "errors": errors,
                    "ep": {p: _values(grid, p, "ep") for p in grid["preset"]}}
    for table, axes in AXES.items():
        tables[table] = {}
        for preset in grid["preset"]:
            rows: list = []
            for combo in itertools.product(*(_values(grid, preset, a) for a in axes)):
                row = _row(preset, table, dict(zip(axes, combo)))
                if isinstance(row, str):
                    if row not in errors:
                        errors.append(row)
                    rows.append(errors.index(row))
                else:
                    rows.append(row)  # every digit: the page rounds as mfsdp plan prints
            tables[table][preset] = rows
    check(tables, samples=samples, seed=seed)
    return tables


def _get(tables: dict, table: str, inputs: dict) -> list[float] | str:
    preset, index = inputs["preset"], 0
    for axis in tables["axes"][table]:
        values = tables["ep"][preset] if axis == "ep" else tables["grid"][axis]
        index = index * len(values) + values.index(inputs[axis])
    row = tables[table][preset][index]
    return tables["errors"][row] if isinstance(row, int) else row


def lookup(tables: dict, **inputs) -> dict | str:
    """One layout's numbers from the tables, combined as the page's script combines them (the
    reference the tests hold the script to).

    ``inputs``: one value of each :data:`GRID` input. Returns the memory terms and ``total`` in
    GiB and the step's ``compute_s``, ``step_s``, ``tokens_per_gpu_s``,
    ``model_tflops_per_gpu`` and ``mfu``; or the planner's error message for an invalid layout.
    """
    rows = [_get(tables, t, inputs) for t in ("state", "activations", "time")]
    for row in rows:
        if isinstance(row, str):
            return row
    state, (activations, logits, logits_grad), (compute, exposed, tokens, tflops, mfu) = rows
    step = max(compute, state[len(tables["memory"])]) + exposed
    memory = dict(zip(tables["memory"], state), activations=activations, logits=logits)
    common = sum(v for k, v in memory.items() if k not in ("grad_buffers", "logits"))
    total = common + max(logits, memory["grad_buffers"] + logits_grad)  # Plan.moments
    return {**memory, "logits_grad": logits_grad, "total": total, "compute_s": compute,
            "step_s": step, "tokens_per_gpu_s": tokens / step, "model_tflops_per_gpu": tflops / step,
            "mfu": mfu / step}


def direct(preset: str, world_size: int, strategy: str, dp_outer: int, outer_strategy: str,
           tp: int, cp: int, ep: int, sequence_parallel: bool, micro_batch: int,
           seq_length: int, recompute: str) -> dict | str:
    """The numbers :func:`lookup` gives, from one direct call of the planner."""
    model = PRESETS[preset]
    try:
        layout = Layout(world_size=world_size, strategy=strategy, dp_outer=dp_outer,
                        outer_strategy=outer_strategy, tp=tp, cp=cp, ep=ep,
                        sequence_parallel=sequence_parallel, micro_batch=micro_batch,
                        seq_length=seq_length,
                        recompute_granularity=RECOMPUTE[recompute])
    except ValueError as exc:
        return str(exc)
    p = plan(model, layout)
    t = step_time(model, layout, p.comm, GPU)
    memory = {m: p.memory[m] / GiB for m in (*MEMORY, "activations", "logits")}
    return {**memory, "logits_grad": p.logits_grad / GiB, "total": p.total / GiB,
            "compute_s": t.compute_s, "step_s": t.step_s,
            "tokens_per_gpu_s": t.tokens_per_gpu_s,
            "model_tflops_per_gpu": t.model_tflops_per_gpu, "mfu": t.mfu}


def check(tables: dict, samples: int = 300, seed: int = 0, rel: float = 1e-8) -> None:
    """Raise ``AssertionError`` unless :func:`lookup` equals :func:`direct` (to ``rel``) on
    ``samples`` random layouts of the tables' grid, and both find the same layouts invalid."""
    rng = random.Random(seed)
    for _ in range(samples):
        inputs = {n: rng.choice(values) for n, values in tables["grid"].items()}
        inputs["ep"] = rng.choice(tables["ep"][inputs["preset"]])
        got, want = lookup(tables, **inputs), direct(**inputs)
        if isinstance(want, str) or isinstance(got, str):
            assert isinstance(got, str) and isinstance(want, str), (inputs, got, want)
            continue
        for name, value in want.items():
            assert abs(got[name] - value) <= rel * max(abs(value), 1e-12), \
                (inputs, name, got[name], value)
