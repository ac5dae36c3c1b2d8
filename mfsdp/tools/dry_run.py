"""Dry run: the real engine at full world size, in one process, checked against the planner.

``mfsdp plan PRESET ... --dry-run`` builds the model exactly as ``mfsdp train`` would (the same
flags, the same validation, :func:`mfsdp.trainer.parallel.build_sharded_model`), for one rank at
a time of the full world, on torch's fake process group and with every tensor on the meta
device: the buckets, shards, main weights, gradient buffers and optimizer state have their real
shapes and dtypes, and none is allocated. It then reports, per rank, the bytes the engine holds
by kind next to :func:`mfsdp.tools.plan.plan`'s estimate, and the bytes each collective of a
step sends as the engine's buckets imply them. A 671B MoE at 4,096 ranks stays under 1 GiB of
resident memory::

    mfsdp plan llama3-70b --world-size 1024 --dry-run --json dry.json

Exit status: 0 when weights, gradients and optimizer state are within 2% of the plan, 1 when
one is not, 2 when the layout cannot be built (one line says why, as ``mfsdp train`` says it).
"""

from __future__ import annotations

import gc
import resource
import threading
import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from mfsdp.tools.plan import PRESETS, Layout, plan, step_time

__all__ = ["DryRun", "DryRunError", "dry_run", "train_flags", "held_bytes", "implied_traffic",
           "ranks_to_build", "TOLERANCE"]

TOLERANCE = 0.02
"""Largest relative difference between measured and planned weights, gradients, optimizer
state and peak buffers that the dry run accepts (``mfsdp plan --dry-run`` exits 1 beyond it)."""

CHECKED = ("params", "grads", "optimizer", "gathered", "grad_buffers")


class DryRunError(ValueError):
    """The layout cannot be built; the message is the trainer's own one line."""


def train_flags(preset: str, layout: Layout, double_buffer: bool = False,
                meta_init: bool = True) -> list[str]:
    """The ``mfsdp train`` flags that build ``preset`` under ``layout`` (bf16 weights, fp32
    main weights and gradients, Adam: the planner's default bytes per parameter), with
    ``--init-model-with-meta-device`` when ``meta_init`` and the strategy shards.

    >>> flags = train_flags("llama3-8b", Layout(world_size=64, tp=2, sequence_parallel=True))
    >>> print(" ".join(flags[5:]))  # doctest: +NORMALIZE_WHITESPACE
    --data-parallel-sharding-strategy optim_grads_params --num-distributed-optimizer-instances 1
    --outer-dp-sharding-strategy no_shard --expert-model-parallel-size 1
    --tensor-model-parallel-size 2 --context-parallel-size 1 --micro-batch-size 1
    --global-batch-size 32 --seq-length 4096 --sequence-parallel
    """
    bytes_per_param = (layout.compute_bytes, layout.main_bytes, layout.grad_bytes,
                       layout.optimizer_bytes)
    if bytes_per_param != (2, 4, 4, 8):
        raise DryRunError(f"the dry run builds the trainer's --bf16 model (2, 4, 4 and 8 bytes of "
                          f"weights, main weights, gradients and Adam state per parameter), not "
                          f"{bytes_per_param}")
    if (layout.prefetch_depth, layout.max_inflight_reduce) != (1, 2):
        raise DryRunError(f"the dry run builds the trainer's engine, which prefetches one unit and "
                          f"keeps two reductions in flight, not prefetch_depth="
                          f"{layout.prefetch_depth} and max_inflight_reduce="
                          f"{layout.max_inflight_reduce}")
    dp = layout.world_size // (layout.tp * layout.cp)
    meta = ["--init-model-with-meta-device"] if meta_init and layout.strategy != "no_shard" else []
    flags = ["--model-preset", preset, "--use-megatron-fsdp", "--bf16", *meta,
             "--data-parallel-sharding-strategy", layout.strategy,
             "--num-distributed-optimizer-instances", str(layout.dp_outer),
             "--outer-dp-sharding-strategy", layout.outer_strategy,
             "--expert-model-parallel-size", str(layout.ep),
             "--tensor-model-parallel-size", str(layout.tp),
             "--context-parallel-size", str(layout.cp),
             "--micro-batch-size", str(layout.micro_batch),
             "--global-batch-size", str(layout.micro_batch * layout.micro_batches * dp),
             "--seq-length", str(layout.seq_length)]
    if layout.sequence_parallel:
        flags.append("--sequence-parallel")
    if PRESETS[preset].num_experts and layout.tp > 1:
        flags += ["--expert-tensor-parallel-size", "1"]  # mfsdp keeps experts whole
    if double_buffer:
        flags.append("--fsdp-double-buffer")
    return flags


def _validated_config(flags: list[str], world: int):
    """(TrainConfig, GPTConfig) of ``flags`` through ``mfsdp train``'s own parser and checks."""
    from mfsdp.trainer.arguments import build_parser, check_args
    from mfsdp.trainer.build import model_config
    from mfsdp.trainer.config import TrainConfig

    args = build_parser().parse_args(flags)
    cfg = model_config(args)
    try:
        check_args(args, world, cfg)
    except SystemExit as exc:  # the trainer's one line: the flags are the fix
        raise DryRunError(str(exc)) from None
    return TrainConfig.from_args(args, logging=False), cfg


def ranks_to_build(layout: Layout, num_experts: int = 0, ep_positions: int = 8) -> list[int]:
    """The ranks whose shards can differ: the first and last rank of the world and of each of
    rank 0's groups, and the positions in rank 0's EP group (each holds other experts; beyond
    ``ep_positions`` of them, the first ``ep_positions - 1`` and the last, since they differ in
    which experts they hold, not in shapes).

    >>> ranks_to_build(Layout(world_size=1024, dp_outer=2, ep=8), num_experts=64)
    [0, 1, 2, 3, 4, 5, 6, 7, 504, 511, 512, 1016, 1023]
    """
    from mfsdp.layout import GROUP_KINDS, ParallelLayout

    pl = ParallelLayout(layout.world_size, layout.dp_outer, layout.ep, num_experts or None,
                        tp=layout.tp, cp=layout.cp)
    ranks = {0, layout.world_size - 1}
    for kind in GROUP_KINDS:
        group = pl.group_of(kind, 0)
        ranks.update((group[0], group[-1]))
    ep_group = pl.group_of("ep", 0)
    ranks.update(ep_group if len(ep_group) <= ep_positions
                 else ep_group[:ep_positions - 1] + ep_group[-1:])
    return sorted(ranks)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def held_bytes(model, optimizer) -> dict[str, int]:
    """Bytes one rank of a sharded ``model`` holds between steps, by kind, read off its buckets
    and its optimizer (meta tensors count their shapes, real ones their storage).

    ``weights``: the compute-dtype weights kept between steps (ZeRO-3: the shard; otherwise the
    replicated buffer); ``main_weights``: fp32 main shards when they are a copy of their own;
    ``grads``: the reduced gradient shard, plus the full gradient buffer ZeRO-0/1 keep (it is
    allocated at the first backward; here now); ``optimizer``: the optimizer's state, created as
    its first step creates it; ``params``: weights + main weights; ``gathered``: the largest
    unit's gathered weights times the units in flight (``prefetch_depth + 1``) plus the root
    unit's, which stays gathered from its forward through its backward, under ZeRO-3;
    ``double_buffer``: the two fixed slots of ``fsdp_double_buffer``, which then hold the
    layers' gathered weights instead (``gathered`` keeps the root's); ``grad_buffers`` (ZeRO-2/3):
    the full gradients alive at once in a backward, at most: the root unit's, from the first
    gradient to the last, and ``max_inflight_reduce + 1`` units' (reductions in flight and the
    one accumulating), each reduction in flight with a cast copy when gradients travel in
    another dtype. Both peak terms are the bounds :func:`mfsdp.tools.plan.peak_buffers` states.
    """
    out = dict.fromkeys(("weights", "main_weights", "grads"), 0)
    units: dict[str, int] = {}
    grad_units: dict[str, list[int]] = {}  # unit -> [full gradient bytes, cast copy bytes]
    for b in model.fsdp_state().buckets:
        out["weights"] += _nbytes(b.model_shard if b.sharded_params else b.full)
        if not b.main_aliases_model():
            out["main_weights"] += _nbytes(b.main_shard)
        if b.requires_grad:
            if not b.sharded_grads and not b.replicated:
                b.ensure_grad_full()  # as the first backward does
            full = b.grad_full if b.grad_full is not None and b.grad_full is not b.grad_shard \
                else None
            out["grads"] += _nbytes(b.grad_shard) + _nbytes(full)
        if b.sharded_params:
            units[b.unit] = units.get(b.unit, 0) + b.plan.padded_numel * b.full.element_size()
        if b.requires_grad and b.sharded_grads:
            g = grad_units.setdefault(b.unit, [0, 0])
            g[0] += b.plan.padded_numel * b.grad_dtype.itemsize
            if b.comm_dtype != b.grad_dtype:
                g[1] += b.plan.padded_numel * b.comm_dtype.itemsize
    for group in optimizer.param_groups:  # one multi-tensor step on meta tensors, not 30,000
        if group.get("foreach") is None and "foreach" in group:
            group["foreach"] = True
    optimizer.state_dict()  # creates every parameter's state, as the first step would
    out["optimizer"] = optimizer.local_state_bytes()
    out["params"] = out["weights"] + out["main_weights"]
    opts = model.fsdp_state().options
    pool = model.fsdp_state().pool
    root = units.pop("", 0)  # the root unit's name is empty
    # With the double buffer the layers' gathered weights live in its two slots instead.
    layers = (opts.prefetch_depth + 1) * max(units.values(), default=0) if pool is None else 0
    out["gathered"] = root + layers if units or root else 0
    root_grad, root_cast = grad_units.pop("", [0, 0])
    inflight = opts.max_inflight_reduce
    largest = max(grad_units.values(), default=[0, 0])
    if model.fsdp_state().grad_pool is not None:  # the layers' full gradients in two slots
        layer_grads = sum(_nbytes(s) for s in model.fsdp_state().grad_pool.slots)
    else:
        layer_grads = (inflight + 1) * largest[0]
    out["grad_buffers"] = root_grad + layer_grads + root_cast + inflight * largest[1]
    out["double_buffer"] = sum(_nbytes(s) for s in pool.slots) if pool is not None else 0
    return out


def implied_traffic(model, micro_batches: int = 1) -> dict[str, float]:
    """Bytes this rank sends per optimizer step of ``micro_batches`` micro-batches, by
    ``"op group"``, as the engine's buckets imply them (a ring: ``(n - 1) / n`` of each
    collective's bytes, the engine's own accounting in :class:`~mfsdp.fsdp.collectives.CommLog`).

    The schedule is the engine's: ZeRO-3 all-gathers each unit for its forward and again for its
    backward (the root unit once: it stays gathered through the backward) and reduce-scatters
    every micro-batch; ZeRO-2 reduce-scatters every micro-batch and all-gathers the new weights
    once after the step; ZeRO-1 reduce-scatters the accumulated gradients once and all-gathers
    once; ``no_shard`` all-reduces once (twice the ring bytes). HSDP all-reduces the reduced
    shard over the outer group once per step (``no_shard``: the whole buffer); HFSDP
    reduce-scatters it there and all-gathers the new main weights back.
    ``tests/test_dry_run.py`` checks this against a real step's log.
    """
    out: dict[str, float] = {}
    m = micro_batches
    stage = model.fsdp_state().strategy.zero_stage
    outer = model.fsdp_state().comms.outer

    def add(op: str, group: str, nbytes: float) -> None:
        out[f"{op} {group}"] = out.get(f"{op} {group}", 0.0) + nbytes

    for b in model.fsdp_state().buckets:
        if not b.requires_grad and stage != 3:
            continue
        n = b.comm.size
        ring = (n - 1) / n
        weights = b.plan.padded_numel * b.full.element_size()
        grads = b.plan.padded_numel * torch.finfo(b.comm_dtype).bits // 8
        if stage == 0:
            add("all_reduce", b.comm.name, 2 * ring * grads)
        elif b.requires_grad or stage == 3:
            gathers = m * (1 if not b.unit else 2) if stage == 3 else 1
            add("all_gather", b.ag_comm.name, gathers * ring * weights)
            if b.requires_grad:
                add("reduce_scatter", b.comm.name, (m if stage >= 2 else 1) * ring * grads)
        if outer is not None and b.requires_grad:
            o = outer.size
            ring_outer = (o - 1) / o
            if stage == 0:  # no_shard: the whole gradient buffer, again over the outer group
                add("all_reduce", outer.name, 2 * ring_outer * grads)
            elif b.outer_factor > 1:  # HFSDP: reduce-scatter the inner shard, gather new weights
                add("reduce_scatter", outer.name, ring_outer * grads / n)
                add("all_gather", outer.name, ring_outer * weights / n)
            else:  # HSDP: all-reduce the inner shard
                add("all_reduce", outer.name, 2 * ring_outer * grads / n)
    return {k: v for k, v in out.items() if v}


@dataclass
class DryRun:
    """What the dry run measured (bytes per rank) beside what the planner estimates."""

    preset: str
    layout: Layout
    ranks: dict[int, dict[str, int]]  # rank -> held_bytes
    traffic: dict[int, dict[str, float]]  # rank -> implied_traffic
    planned: dict[str, float]
    planned_comm: dict[str, float]
    seconds: float
    peak_rss: int  # bytes, of this process (Linux's maximum resident set size)
    gpu: str = "h100"
    extra: dict = field(default_factory=dict)

    @property
    def measured(self) -> dict[str, int]:
        """Per kind, the largest value over the ranks built."""
        kinds = next(iter(self.ranks.values()))
        return {k: max(r[k] for r in self.ranks.values()) for k in kinds}

    @property
    def measured_comm(self) -> dict[str, float]:
        """Per ``"op group"``, the largest bytes per step over the ranks built."""
        keys = {k for t in self.traffic.values() for k in t}
        return {k: max(t.get(k, 0.0) for t in self.traffic.values()) for k in sorted(keys)}

    def deviation(self) -> dict[str, float]:
        """Relative difference measured / planned - 1 of params, grads, optimizer and the peak
        buffers (gathered weights, gradient buffers)."""
        # the double buffer's slots hold the layers' gathered weights
        m = {**self.measured, "gathered": self.measured["gathered"]
             + self.measured["double_buffer"]}
        return {k: (m[k] / self.planned[k] - 1) if self.planned[k] else float(m[k] != 0)
                for k in CHECKED}

    def ok(self, tolerance: float = TOLERANCE) -> bool:
        """Whether params, grads, optimizer and the peak buffers are within ``tolerance`` of the
        plan."""
        return all(abs(d) <= tolerance for d in self.deviation().values())

    def wire(self) -> dict[str, float]:
        """Bytes per rank and step by group as the engine's buckets imply (``dp_shard`` holds
        the dense and expert shard groups' collectives; ``dp_outer`` the outer group's), in the
        planner's keys."""
        out: dict[str, float] = {}
        for key, v in self.measured_comm.items():
            group = key.split(" ", 1)[1]
            name = "dp_outer" if group == "dp_outer" else "dp_shard"
            out[name] = out.get(name, 0.0) + v
        return out

    def step_times(self):
        """(planned, measured) :class:`~mfsdp.tools.plan_time.StepTime`: the time model fed with
        the planner's bytes, then with the bytes the engine's buckets imply."""
        model = PRESETS[self.preset]
        sent = {**self.planned_comm, **self.wire()}
        return (step_time(model, self.layout, self.planned_comm, self.gpu),
                step_time(model, self.layout, sent, self.gpu))

    def table(self) -> str:
        """The report ``mfsdp plan --dry-run`` prints: bytes per rank by kind, then per step."""
        gib = 2**30
        m, dev = self.measured, self.deviation()
        rows = [f"dry run: {len(self.ranks)} of {self.layout.world_size} ranks built in "
                f"{self.seconds:.1f} s (ranks {', '.join(map(str, self.ranks))}); peak RSS "
                f"{self.peak_rss / gib:.2f} GiB",
                f"{'per rank':<14} {'engine GiB':>11} {'plan GiB':>9} {'diff':>7}"]
        planned = {**self.planned, "double_buffer": None}
        for k in ("params", "grads", "optimizer", "weights", "main_weights", "gathered",
                  "grad_buffers", "double_buffer"):
            p = planned.get(k)
            # (the verdict's deviation: gathered counts the double buffer's slots too)
            diff = (f"{dev[k]:+7.2%}" if k in dev else f"{m[k] / p - 1:+7.2%}") if p \
                else "      -"
            rows.append(f"{k:<14} {m[k] / gib:11.3f} {'' if p is None else f'{p / gib:9.3f}'}"
                        f"{'' if p is not None else ' ' * 9} {diff}")
        rows.append(f"{'per step':<14} {'engine GiB':>11} {'plan GiB':>9}")
        wire = self.wire()
        for k in sorted(set(wire) | {g for g in self.planned_comm if g in ("dp_shard",
                                                                          "dp_outer")}):
            rows.append(f"{'sent ' + k:<14} {wire.get(k, 0.0) / gib:11.2f} "
                        f"{self.planned_comm.get(k, 0.0) / gib:9.2f}")
        for k, v in self.measured_comm.items():
            rows.append(f"  {k:<26} {v / gib:9.2f}")
        planned_t, measured_t = self.step_times()
        rows.append(f"step time ({self.gpu}): {measured_t.step_s:.2f} s from the engine's bytes, "
                    f"{planned_t.step_s:.2f} s from the plan's; MFU {100 * measured_t.mfu:.1f}%")
        verdict = "agrees" if self.ok() else "DISAGREES"
        rows.append(f"state and peak buffers: the plan {verdict} with the engine within "
                    f"{TOLERANCE:.0%} (worst {max(dev.values(), key=abs):+.2%})")
        return "\n".join(rows)

    def to_json(self) -> dict:
        """``{"measured": {...}, "planned": {...}, ...}`` in bytes per rank (per step for
        traffic)."""
        planned_t, measured_t = self.step_times()
        return {"preset": self.preset, "world_size": self.layout.world_size,
                "layout": self.layout.__dict__, "ranks_built": list(self.ranks),
                "measured": self.measured, "planned": self.planned,
                "per_rank": {str(r): v for r, v in self.ranks.items()},
                "measured_comm": self.measured_comm, "wire": self.wire(),
                "planned_comm": self.planned_comm, "deviation": self.deviation(),
                "ok": self.ok(), "tolerance": TOLERANCE,
                "step_time_s": {"measured_bytes": measured_t.step_s,
                                "planned_bytes": planned_t.step_s},
                "seconds": self.seconds, "peak_rss_bytes": self.peak_rss}


class _NoInitOnMeta(TorchFunctionMode):
    """Initialisers' in-place draws and fills on meta tensors return at once: a meta tensor has
    no values, and torch's meta kernels for them cost milliseconds each (a 671B model's
    constructors make tens of thousands)."""

    SKIP = frozenset({"normal_", "uniform_", "fill_", "zero_", "copy_", "trunc_normal_",
                      "kaiming_uniform_", "xavier_uniform_", "xavier_normal_", "kaiming_normal_"})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        first = args[0] if args else None
        if (getattr(func, "__name__", "") in self.SKIP and isinstance(first, torch.Tensor)
                and first.is_meta):
            return first
        return func(*args, **(kwargs or {}))


def _build_rank(config, cfg, world: int, rank: int, micro_batches: int):
    """One rank's sharded model on the fake process group and the meta device; its bytes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from mfsdp.trainer.parallel import build_sharded_model

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        try:
            with _NoInitOnMeta():
                model, _, opt, _ = build_sharded_model(config, cfg, world, torch.device("meta"),
                                                       log=lambda *a, **k: None)
        except (ValueError, SystemExit) as exc:  # fully_shard's or the layout's own line
            raise DryRunError(str(exc)) from None
        return held_bytes(model, opt), implied_traffic(model, micro_batches)
    finally:
        dist.destroy_process_group()
        gc.collect()  # the built model and its meshes die here, before the next rank's build


def _in_fresh_thread(fn, *args):
    """``fn(*args)`` in a thread of its own. DTensor caches sharding decisions per thread and
    compares meshes by shape (and creating thread), not by process group: a rank built after
    another, on a rebuilt process group, would otherwise get the destroyed group's mesh back
    from such a cache while that mesh lives (hence also the ``gc.collect()`` after each)."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # handed to the caller's thread
            out["error"] = exc

    thread = threading.Thread(target=target, name="mfsdp-dry-run")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def dry_run(preset: str, layout: Layout, ranks: list[int] | None = None, gpu: str = "h100",
            double_buffer: bool = False, progress: bool = True) -> DryRun:
    """Build ``preset`` under ``layout`` with the real engine for ``ranks`` (default:
    :func:`~mfsdp.tools.dry_run.ranks_to_build`) of the full world, one at a time, in this
    process; return what each holds beside the plan. Raises
    :class:`~mfsdp.tools.dry_run.DryRunError` when the trainer refuses the layout. Needs no
    process group of its own (it must not run inside one)."""
    from tqdm import tqdm

    if dist.is_initialized():
        raise RuntimeError("dry_run builds its own fake process group; call it outside "
                           "torch.distributed (no init_process_group before it)")
    if preset not in PRESETS:
        raise DryRunError(f"unknown preset {preset!r}; the planner's presets are "
                          f"{', '.join(sorted(PRESETS))}")
    world = layout.world_size
    config, cfg = _validated_config(train_flags(preset, layout, double_buffer), world)
    model = PRESETS[preset]
    ranks = ranks if ranks is not None else ranks_to_build(layout, model.num_experts)
    start = time.perf_counter()
    held, traffic = {}, {}
    state = torch.get_rng_state()
    try:
        # a bar on a terminal only (disable=None): none in a log, where its frames would pile up
        for r in tqdm(ranks, desc=f"dry run {preset} at {world} ranks", unit="rank",
                      disable=None if progress else True, leave=False):
            held[r], traffic[r] = _in_fresh_thread(_build_rank, config, cfg, world, r,
                                                   layout.micro_batches)
    finally:
        torch.set_rng_state(state)  # the trainer's build seeds the generator
    p = plan(model, layout)
    planned = {**p.memory, "params": p.memory["weights"] + p.memory["main_weights"]}
    if double_buffer and layout.strategy in ("optim_grads", "optim_grads_params"):
        # the layers' full gradients take two slots: as one reduction in flight, one accumulating
        planned["grad_buffers"] = plan(model, replace(layout, max_inflight_reduce=1)).memory[
            "grad_buffers"]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return DryRun(preset, layout, held, traffic, planned, dict(p.comm),
                  time.perf_counter() - start, rss, gpu)

