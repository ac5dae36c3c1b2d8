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
  buffers at their peak, the bytes the FSDP groups (``dp_shard``, ``dp_outer``) send and, for
  each GPU of :data:`~mfsdp.tools.plan_time.GPUS` with figures of its own (an H200 is timed
  as an H100), the seconds they take and the links they cross, per (world size, strategy,
  outer size, outer strategy, TP, CP, EP): none of them depends on the batch or the sequence;
* ``activations``: the layers' activations, the loss's logits and the logits' gradient, per
  (TP, CP, SP, micro-batch, sequence length, recompute, layer: ``mfsdp plan
  --transformer-impl``);
* ``time``: one rank's hardware and model FLOPs and tokens per step, and the bytes, seconds and
  links of the collectives between layers (TP, CP, EP), per (TP, CP, EP, micro-batch, sequence
  length, recompute): per rank, none of them depends on the world size or the sharding.

The page divides the FLOPs by the GPU's peak times the compute efficiency it is given, as
:func:`~mfsdp.tools.plan_time.step_time` does, so any efficiency needs no table of its own. It
takes the larger of the step's two moments (:attr:`mfsdp.tools.plan.Plan.moments`: the loss's
peak, with ``logits``, and the backward, with ``grad_buffers`` and the logits' gradient) as the
total and combines the times as :func:`~mfsdp.tools.plan_time.step_time` does (the FSDP
collectives overlap the compute, the others add to it); :func:`lookup` is that combination in
Python. :func:`check` compares it with direct calls of the planner on random layouts, GPUs and
efficiencies, and :func:`export` runs it: a change to the planner that breaks the split stops
the docs build instead of showing wrong numbers.

>>> small = {**GRID, "preset": ["llama3-8b"], "world_size": [8, 64], "seq_length": [4096]}
>>> tables = export(small, samples=20)
>>> got = lookup(tables, preset="llama3-8b", world_size=64, strategy="optim_grads_params",
...              dp_outer=1, outer_strategy="no_shard", tp=1, cp=1, ep=1,
...              sequence_parallel=False, micro_batch=1, seq_length=4096, recompute="none")
>>> round(got["total"], 2), round(got["step_s"], 2)   # mfsdp plan llama3-8b --world-size 64
(38.1, 0.5)
>>> got = lookup(tables, device="GB200", efficiency=0.5, preset="llama3-8b", world_size=64,
...              strategy="optim_grads_params", dp_outer=1, outer_strategy="no_shard", tp=1,
...              cp=1, ep=1, sequence_parallel=False, micro_batch=1, seq_length=4096,
...              recompute="none")
>>> round(got["compute_s"], 3), round(got["comm_s"]["dp_shard"], 3), got["links"]["dp_shard"]
(0.158, 0.085, 'NVLink')
>>> got = lookup(tables, transformer_impl="transformer_engine", preset="llama3-8b",
...              world_size=64, strategy="optim_grads_params", dp_outer=1,
...              outer_strategy="no_shard", tp=1, cp=1, ep=1, sequence_parallel=False,
...              micro_batch=1, seq_length=4096, recompute="none")
>>> round(got["total"], 2)   # ... --transformer-impl transformer_engine
28.29
"""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

from mfsdp.tools.plan import GiB, PRESETS, Layout, plan
from mfsdp.tools.plan_terms import TRANSFORMER_IMPLS
from mfsdp.tools.plan_time import GPUS, step_time

__all__ = ["GRID", "RECOMPUTE", "AXES", "MEMORY", "DEVICES", "EFFICIENCY", "GROUPS", "LINKS",
           "TIMED", "export", "check", "lookup", "direct"]

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
    "transformer_impl": list(TRANSFORMER_IMPLS),
}
"""The layout inputs the calculator offers, each a drop-down list of these values (EP for the
mixture-of-experts presets only, the sizes that divide their routed experts). The outer size
is ``mfsdp plan --num-distributed-optimizer-instances``, the outer strategy its
``--outer-dp-sharding-strategy``: ``no_shard`` replicates across the outer groups (HSDP),
``optim`` also shards the optimizer state over them (HFSDP). Times are for one micro-batch per
data-parallel rank and step (``mfsdp plan``'s default ``--global-batch-size``), on the GPU of
:data:`DEVICES` and at the compute efficiency of :data:`EFFICIENCY` the reader picks. The
layer is ``mfsdp plan --transformer-impl``: ``local``, mfsdp train's own (its activations
measured), or ``transformer_engine``, Megatron-LM's with Transformer Engine (Megatron-LM's
estimate); it changes the activations and the logits only."""

DEVICES: dict[str, tuple[float, str]] = {gpu.upper(): (g.memory_gib, gpu)
                                          for gpu, g in GPUS.items()}
"""The calculator's GPU choices: name -> (its memory in GiB, ``mfsdp plan --gpu``): every GPU
of :data:`mfsdp.tools.plan_time.GPUS`, with the memory that is ``mfsdp plan``'s default
``--device-gib`` for it (H100 80, H200 140, GB200 186, GB300 279: NVIDIA's GB taken as GiB,
and the 140 GiB an H200's 141 GB report)."""


def _timed() -> dict[str, str]:
    """Each GPU of ``GPUS`` -> the first GPU with the same peak, links and efficiency, whose
    columns time it (an H200 -> ``h100``): the tables hold each set of figures once."""
    out: dict[str, str] = {}
    for gpu, g in GPUS.items():
        same = [k for k in out.values() if replace(GPUS[k], name="", memory_gib=1.0)
                == replace(g, name="", memory_gib=1.0)]
        out[gpu] = same[0] if same else gpu
    return out


TIMED = _timed()
"""``--gpu`` -> the ``--gpu`` whose columns in the tables time it (see :func:`columns`)."""

EFFICIENCY = [0.3, 0.35, 0.4, 0.45, 0.5]
"""The compute efficiencies offered (``mfsdp plan --compute-efficiency``; 0.4 by default): the
fraction of the GPU's dense peak a step's kernels reach (see :mod:`mfsdp.tools.plan_time`)."""

GROUPS = ("dp_shard", "dp_outer", "tp", "cp", "ep")
"""The groups whose traffic the tables hold, in ``plan().comm``'s order (``mfsdp plan``'s)."""

LINKS = ["none", "NVLink", "network", "NVLink + network"]
"""The links a group's traffic crosses, as :func:`~mfsdp.tools.plan_time.step_time` names
them; a table holds the index."""

RECOMPUTE = {"none": None, "selective": "selective", "full": "full"}
"""The calculator's recompute choices as ``Layout.recompute_granularity`` (``mfsdp plan
--recompute-granularity``; full is uniform, one layer at a time, the command's default)."""

AXES = {
    "state": ("world_size", "strategy", "dp_outer", "outer_strategy", "tp", "cp", "ep"),
    "activations": ("tp", "cp", "sequence_parallel", "micro_batch", "seq_length", "recompute",
                    "transformer_impl"),
    "time": ("tp", "cp", "ep", "micro_batch", "seq_length", "recompute"),
}
"""Each table's inputs, in the order of its rows (the last one varies fastest)."""

MEMORY = ("weights", "main_weights", "grads", "optimizer", "gathered", "grad_buffers")
"""The memory terms of a ``state`` row (the rest of the row: :func:`columns`)."""

_TABLE_GROUPS = {"state": GROUPS[:2], "time": GROUPS[2:]}


def columns(table: str) -> list[str]:
    """The names of a row's numbers in ``table``: memory terms in GiB, ``flops_hw``,
    ``flops_model`` and ``tokens`` per rank and step, ``sent:G`` (GiB group ``G`` sends per rank
    and step), ``s:GPU:G`` (its seconds on ``GPU``, each of :data:`TIMED`'s values) and
    ``link:GPU:G`` (an index of :data:`LINKS`); ``null`` where the planner has no such group
    (``mfsdp plan`` prints none)."""
    if table == "activations":
        return ["activations", "logits", "logits_grad"]
    head = list(MEMORY) if table == "state" else ["flops_hw", "flops_model", "tokens"]
    groups = _TABLE_GROUPS[table]
    return head + [f"sent:{g}" for g in groups] + [
        f"{kind}:{gpu}:{g}" for gpu in _timed_keys() for g in groups for kind in ("s", "link")]


def _timed_keys() -> list[str]:
    """The GPUs whose columns the tables hold (:data:`TIMED`'s values, in ``GPUS``' order)."""
    return list(dict.fromkeys(TIMED.values()))


def _values(grid: dict, preset: str, axis: str) -> list:
    experts = PRESETS[preset].num_experts
    if axis == "ep" and not experts:
        return [1]  # a dense model has no experts to split
    if axis == "ep":  # each expert rank holds a whole number of experts
        return [ep for ep in grid[axis] if experts % ep == 0]
    return list(grid[axis])


def _row(preset: str, table: str, inputs: dict) -> list | str:
    """One row of ``table`` (:func:`columns`): what the planner gives for ``inputs`` (the
    table's axes), or the planner's error message."""
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
    groups = _TABLE_GROUPS[table]
    sent = {g: b for g, b in p.comm.items() if g in groups}
    times = {gpu: step_time(model, layout, sent, gpu) for gpu in _timed_keys()}
    if table == "state":
        row = [p.memory[m] / GiB for m in MEMORY]
    else:  # at efficiency 1 the compute takes flops_hw / peak; tokens and model FLOPs per rank
        t = times["h100"]
        row = [t.compute_s * GPUS["h100"].peak_tflops * 1e12 * GPUS["h100"].efficiency,
               t.model_tflops_per_gpu * 1e12 * t.step_s, t.tokens_per_gpu_s * t.step_s]
    row += [sent[g] / GiB if g in sent else None for g in groups]
    for gpu in _timed_keys():
        for g in groups:
            row += ([times[gpu].comm_s[g], LINKS.index(times[gpu].links[g])] if g in sent
                    else [None, None])
    return row


def export(grid: dict | None = None, samples: int = 300, seed: int = 0) -> dict:
    """The calculator's tables over ``grid`` (default :data:`GRID`), checked by :func:`check` on
    ``samples`` random layouts, GPUs and efficiencies.

    For each table of :data:`AXES` and each preset: one row per combination of the table's
    inputs, in ``itertools.product`` order, its numbers named by ``columns``; memory in GiB,
    times in seconds. A row that is an integer is the index of the planner's error message in
    ``errors``. ``devices`` and ``efficiency`` are the GPU and efficiency choices (a device's
    ``timed`` names the GPU whose columns and peak time it), ``peak_tflops`` each timed GPU's
    peak.
    """
    grid = {k: list(v) for k, v in (GRID if grid is None else grid).items()}
    errors: list[str] = []
    tables: dict = {"grid": grid, "axes": {k: list(v) for k, v in AXES.items()},
                    "columns": {t: columns(t) for t in AXES}, "memory": list(MEMORY),
                    "groups": list(GROUPS), "links": LINKS, "errors": errors,
                    "devices": {name: {"device_gib": gib, "gpu": gpu, "timed": TIMED[gpu]}
                                for name, (gib, gpu) in DEVICES.items()},
                    "peak_tflops": {gpu: GPUS[gpu].peak_tflops for gpu in _timed_keys()},
                    "efficiency": {"choices": list(EFFICIENCY),
                                   "default": GPUS["h100"].efficiency},
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


def _get(tables: dict, table: str, inputs: dict) -> dict | str:
    preset, index = inputs["preset"], 0
    for axis in tables["axes"][table]:
        values = tables["ep"][preset] if axis == "ep" else tables["grid"][axis]
        index = index * len(values) + values.index(inputs[axis])
    row = tables[table][preset][index]
    return tables["errors"][row] if isinstance(row, int) else dict(zip(tables["columns"][table],
                                                                       row))


def lookup(tables: dict, device: str = "H100", efficiency: float = 0.4,
           transformer_impl: str = "local", **inputs) -> dict | str:
    """One layout's numbers from the tables, combined as the page's script combines them (the
    reference the tests hold the script to).

    ``inputs``: one value of each other :data:`GRID` input; ``transformer_impl`` the layer
    (``mfsdp plan --transformer-impl``); ``device`` a key of :data:`DEVICES`;
    ``efficiency`` the fraction of the peak the compute reaches (``mfsdp plan
    --compute-efficiency``). Returns the memory terms and ``total`` in GiB, the step's
    ``compute_s``, ``step_s``, ``tokens_per_gpu_s``, ``model_tflops_per_gpu`` and ``mfu``, and
    per group of ``plan().comm`` (in its order) the GiB ``sent`` per rank and step, its seconds
    ``comm_s`` and its ``links``; ``fsdp_s`` (the FSDP groups' seconds, which overlap the
    compute) and ``exposed_s`` (the others', which add to it). Or the planner's error message
    for an invalid layout.
    """
    if device not in tables["devices"]:
        raise ValueError(f"device={device!r} is not one of {sorted(tables['devices'])}: "
                         "pick a GPU the calculator offers")
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency={efficiency} must be in (0, 1]: the fraction of the "
                         "peak a step's kernels reach (0.4 by default)")
    gpu = tables["devices"][device]["timed"]
    inputs["transformer_impl"] = transformer_impl
    rows = [_get(tables, t, inputs) for t in ("state", "activations", "time")]
    for row in rows:
        if isinstance(row, str):
            return row
    state, act, time = rows
    sent, comm, links = {}, {}, {}
    for row in (state, time):
        for g in tables["groups"]:
            if row.get(f"sent:{g}") is not None:
                sent[g], comm[g] = row[f"sent:{g}"], row[f"s:{gpu}:{g}"]
                links[g] = tables["links"][row[f"link:{gpu}:{g}"]]
    peak = tables["peak_tflops"][gpu] * 1e12
    compute = time["flops_hw"] / (peak * efficiency)
    fsdp = sum(s for g, s in comm.items() if g in ("dp_shard", "dp_outer"))
    exposed = sum(s for g, s in comm.items() if g not in ("dp_shard", "dp_outer"))
    step = max(compute, fsdp) + exposed
    memory = {m: state[m] for m in tables["memory"]}
    memory.update(activations=act["activations"], logits=act["logits"])
    common = sum(v for k, v in memory.items() if k not in ("grad_buffers", "logits"))
    total = common + max(act["logits"], memory["grad_buffers"] + act["logits_grad"])  # moments
    return {**memory, "logits_grad": act["logits_grad"], "total": total, "compute_s": compute,
            "step_s": step, "tokens_per_gpu_s": time["tokens"] / step,
            "model_tflops_per_gpu": time["flops_model"] / step / 1e12,
            "mfu": time["flops_model"] / step / peak, "sent": sent, "comm_s": comm,
            "links": links, "fsdp_s": fsdp, "exposed_s": exposed}


def direct(preset: str, world_size: int, strategy: str, dp_outer: int, outer_strategy: str,
           tp: int, cp: int, ep: int, sequence_parallel: bool, micro_batch: int,
           seq_length: int, recompute: str, device: str = "H100",
           efficiency: float = 0.4, transformer_impl: str = "local") -> dict | str:
    """The numbers :func:`lookup` gives, from one direct call of the planner (``mfsdp plan``'s
    ``plan`` and ``step_time``) on ``device``'s GPU at ``efficiency``."""
    model = PRESETS[preset]
    try:
        layout = Layout(world_size=world_size, strategy=strategy, dp_outer=dp_outer,
                        outer_strategy=outer_strategy, tp=tp, cp=cp, ep=ep,
                        sequence_parallel=sequence_parallel, micro_batch=micro_batch,
                        seq_length=seq_length,
                        recompute_granularity=RECOMPUTE[recompute],
                        transformer_impl=transformer_impl)
    except ValueError as exc:
        return str(exc)
    p = plan(model, layout)
    t = step_time(model, layout, p.comm, DEVICES[device][1], efficiency=efficiency)
    memory = {m: p.memory[m] / GiB for m in (*MEMORY, "activations", "logits")}
    fsdp = sum(s for g, s in t.comm_s.items() if g in ("dp_shard", "dp_outer"))
    return {**memory, "logits_grad": p.logits_grad / GiB, "total": p.total / GiB,
            "compute_s": t.compute_s, "step_s": t.step_s,
            "tokens_per_gpu_s": t.tokens_per_gpu_s,
            "model_tflops_per_gpu": t.model_tflops_per_gpu, "mfu": t.mfu,
            "sent": {g: b / GiB for g, b in p.comm.items()}, "comm_s": dict(t.comm_s),
            "links": dict(t.links), "fsdp_s": fsdp,
            "exposed_s": sum(t.comm_s.values()) - fsdp}


def _differences(got, want, rel: float, name: str = "") -> list[str]:
    """Where ``got`` and ``want`` (numbers, strings, or dicts of them) differ beyond ``rel``."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or list(got) != list(want):
            return [f"{name}: {got!r} != {want!r}"]
        return [d for k in want for d in _differences(got[k], want[k], rel, f"{name}.{k}")]
    if isinstance(want, str) or isinstance(got, str):
        return [] if got == want else [f"{name}: {got!r} != {want!r}"]
    return [] if abs(got - want) <= rel * max(abs(want), 1e-12) else [f"{name}: {got} != {want}"]


def check(tables: dict, samples: int = 300, seed: int = 0, rel: float = 1e-8) -> None:
    """Raise ``AssertionError`` unless :func:`lookup` equals :func:`direct` (to ``rel``; the same
    groups in the same order, the same links) on ``samples`` random layouts of the tables' grid,
    on random GPUs of ``devices`` and efficiencies in [0.2, 1], and both find the same layouts
    invalid."""
    rng = random.Random(seed)
    for _ in range(samples):
        inputs = {n: rng.choice(values) for n, values in tables["grid"].items()}
        inputs["ep"] = rng.choice(tables["ep"][inputs["preset"]])
        inputs["device"] = rng.choice(sorted(tables["devices"]))
        inputs["efficiency"] = rng.choice([*tables["efficiency"]["choices"],
                                           rng.uniform(0.2, 1.0)])
        got, want = lookup(tables, **inputs), direct(**inputs)
        if isinstance(want, str) or isinstance(got, str):
            assert isinstance(got, str) and isinstance(want, str), (inputs, got, want)
            continue
        wrong = _differences(got, want, rel)
        assert not wrong, (inputs, wrong)
