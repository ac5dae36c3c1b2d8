"""Which layout for my model: the fewest GPUs on which a preset fits, and the command to check it.

The guide's "Which layout for my model" page prints its table from here. For a preset, a
sequence length and a device size, :func:`choose` runs the search of ``mfsdp plan --smallest``
(:func:`mfsdp.tools.plan.smallest_layout`: whole 8-GPU nodes, TP with sequence parallelism and CP
searched) once without recomputation and once with full recomputation, and for an MoE preset at
each expert-parallel size of ``EPS``. Of every TP, CP, EP and recompute choice that fits on the
fewest GPUs it keeps the one with the shortest predicted step
(:func:`mfsdp.tools.plan.estimate`). Every layout is ZeRO-3 (``optim_grads_params``), with
micro-batches of one sequence; given a global batch (the guide's rows: ``GLOBAL_BATCH``), only
layouts whose data-parallel ranks divide it count, and each rank runs the micro-batches that
make it.

>>> c = choose("llama3-70b", 8192, 80)
>>> c.layout.world_size >= 16 and c.layout.tp > 1, c.fits
(True, True)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from mfsdp.tools.plan import (GiB, PRESETS, Layout, _fits_without_state, estimate, plan,
                              smallest_layout, with_global_batch)
from mfsdp.tools.plan_time import GPUS as PLAN_GPUS
from mfsdp.tools.sbatch.presets import _BRIDGE_DEEPSEEK_V3, _BRIDGE_LLAMA3

__all__ = ["Choice", "choose", "row", "table", "why", "EPS", "GPUS", "GLOBAL_BATCH", "NODE_GPUS",
           "ROWS", "SBATCH"]

EPS = (8, 16, 32, 64)
"""Expert-parallel sizes tried for an MoE preset (EP groups of one node and more)."""

GPUS = {name: (PLAN_GPUS[gpu].memory_gib, gpu)
        for name, gpu in (("H100", "h100"), ("H200", "h200"), ("GB200", "gb200"))}
"""A GPU's name -> (``--device-gib``, the ``--gpu`` whose peak and links price the step): the
memory of :data:`mfsdp.tools.plan_time.GPUS`, ``mfsdp plan --gpu``'s default ``--device-gib``
(H100 80 GiB, H200 140, GB200 186). An H200 computes as fast as an H100. The search counts
every GPU, a GB200's too, in steps of 8."""

NODE_GPUS = {"H100": 8, "H200": 8, "GB200": 4}
"""GPUs per node: a DGX H100 or H200 has 8; a GB200 NVL72 compute tray has 4."""

SBATCH = {"llama3-8b": "llama3-8b", "llama3-70b": "llama3-70b",
          "llama3.1-405b": "llama3.1-405b", "deepseek-v3": "deepseek-v3"}
"""The ``mfsdp sbatch`` preset that trains each planner preset (``mfsdp sbatch list``)."""

GLOBAL_BATCH = {"llama3-8b": _BRIDGE_LLAMA3["global_batch_size"],
                "llama3-70b": _BRIDGE_LLAMA3["global_batch_size"],
                "llama3.1-405b": _BRIDGE_LLAMA3["global_batch_size"],
                "deepseek-v3": _BRIDGE_DEEPSEEK_V3["global_batch_size"]}
"""Sequences per optimizer step the guide's rows assume: the Slurm presets' (Megatron-Bridge's
recipes: 512 for Llama 3, 4096 for DeepSeek-V3)."""


@dataclass(frozen=True)
class Choice:
    """A preset's layout on the fewest GPUs, and what the planner says of it."""

    preset: str
    layout: Layout
    device_gib: float
    total: float  # bytes per GPU at the peak (mfsdp plan's total)
    tokens_per_gpu_s: float  # the predicted speed
    gpu: str = "h100"  # mfsdp plan --gpu
    global_batch: int | None = None  # mfsdp plan --global-batch-size

    @property
    def fits(self) -> bool:
        """Whether the plan fits (``device_gib`` less the 4 GiB ``mfsdp plan`` keeps)."""
        return self.total <= (self.device_gib - 4) * GiB

    @property
    def spare_gib(self) -> float:
        """GiB left below what ``mfsdp plan`` lets a job use."""
        return self.device_gib - 4 - self.total / GiB

    @property
    def tight(self) -> bool:
        """Fits with less than ``mfsdp plan``'s tight margin (``plan_cli.TIGHT_GIB``) to spare."""
        from mfsdp.tools.plan_cli import TIGHT_GIB

        return self.fits and self.spare_gib < TIGHT_GIB

    @property
    def recompute(self) -> str:
        """``full`` or ``none``."""
        return self.layout.recompute_granularity or "none"

    def command(self) -> str:
        """The ``mfsdp plan`` command that prints this plan (one flag group a line)."""
        lay = self.layout
        parts = [f"mfsdp plan {self.preset} --world-size {lay.world_size}"]
        if lay.tp > 1:
            parts.append(f"--tensor-model-parallel-size {lay.tp} --sequence-parallel")
        if lay.cp > 1:
            parts.append(f"--context-parallel-size {lay.cp}")
        if lay.ep > 1:
            parts.append(f"--expert-model-parallel-size {lay.ep}")
        tail = f"--seq-length {lay.seq_length}"
        if lay.recompute_granularity:
            tail += f" --recompute-granularity {lay.recompute_granularity}"
        if self.global_batch is not None:
            tail += f" --global-batch-size {self.global_batch}"
        parts.append(tail)
        flags = [f"--gpu {self.gpu}"] if self.gpu != "h100" else []
        if lay.transformer_impl != "local":
            flags.append(f"--transformer-impl {lay.transformer_impl}")
        if self.device_gib != PLAN_GPUS[self.gpu].memory_gib:  # not the --gpu's default
            flags.append(f"--device-gib {self.device_gib:g}")
        if flags:
            parts.append(" ".join(flags))
        return " \\\n    ".join(parts)


    def sbatch_command(self) -> str:
        """The ``mfsdp sbatch render`` command that renders this layout as a Slurm script from
        the model's preset (``SBATCH``): every ``--set`` the layout needs where the preset's
        value differs, and always its nodes, TP, CP, recompute and global batch; ``-o`` names the
        script after the preset, the GPU and the world size. The preset
        reduces gradients in bf16, which the planner charges extra buffers for; the row plans
        fp32 reduction, so the command sets ``grad_reduce_in_bf16=false`` where the preset has
        it on. A Transformer Engine row renders for ``trainer=megatron-lm``.

        >>> print(row("llama3-70b", 8192, "H100").sbatch_command())
        mfsdp sbatch render llama3-70b --set nodes=4 --set tp=1 \\
            --set cp=2 --set recompute=full --set global_batch_size=512 \\
            --set grad_reduce_in_bf16=false -o llama3-70b-h100-32.sbatch
        """
        from mfsdp.tools.sbatch.presets import PRESETS as SBATCH_PRESETS

        lay, name = self.layout, SBATCH[self.preset]
        p = SBATCH_PRESETS[name]
        own = dict(p.values, **(p.megatron_lm if lay.transformer_impl != "local" else {}))
        per_node = NODE_GPUS[next(k for k, (_, g) in GPUS.items() if g == self.gpu)]
        sets = []
        if lay.transformer_impl != "local":
            sets.append(("trainer", "megatron-lm"))
        if self.gpu != own["gpu"]:
            sets.append(("gpu", self.gpu))
        if per_node != own["gpus_per_node"]:
            sets += [("gpus_per_node", per_node), ("ranks_per_node", per_node)]
        sets += [("nodes", lay.world_size // per_node), ("tp", lay.tp)]
        if lay.tp > 1 and not own["sequence_parallel"]:
            sets.append(("sequence_parallel", "true"))
        sets.append(("cp", lay.cp))
        if lay.ep != own["ep"]:
            sets.append(("ep", lay.ep))
        if lay.seq_length != own["seq_length"]:
            sets.append(("seq_length", lay.seq_length))
        sets += [("recompute", lay.recompute_granularity or "none"),
                 ("global_batch_size", self.global_batch or own["global_batch_size"])]
        if own["grad_reduce_in_bf16"]:
            sets.append(("grad_reduce_in_bf16", "false"))
        seq = f"-seq{lay.seq_length}" if lay.seq_length != own["seq_length"] else ""
        out = f"{name}-{self.gpu}-{lay.world_size}{seq}.sbatch"
        lines, line = [], f"mfsdp sbatch render {name}"
        for word in [f"--set {key}={value}" for key, value in sets] + [f"-o {out}"]:
            if len(line) + 1 + len(word) > 64:
                lines.append(line)
                line = "    " + word
            else:
                line += " " + word
        return " \\\n".join(lines + [line])


@lru_cache(maxsize=None)  # the page's table and its commands ask for the same rows
def choose(preset: str, seq_length: int, device_gib: float = 80.0, gpu: str = "h100",
           spare_gib: float = 0.0, max_nodes: int = 4096, global_batch: int | None = None,
           transformer_impl: str = "local") -> Choice | None:
    """The layout of ``preset`` at ``seq_length`` tokens on the fewest ``device_gib`` GPUs (see
    the module's docstring) that leaves ``spare_gib`` of what ``mfsdp plan`` lets a job use, or
    None when none does on up to ``max_nodes`` nodes. ``global_batch``: sequences per step that
    the data-parallel ranks must divide (None: any world); ``transformer_impl``: the layer the
    activations model (``mfsdp plan --transformer-impl``)."""
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r} is not a planner preset; use one of "
                         f"{sorted(PRESETS)}")
    model = PRESETS[preset]
    eps = [ep for ep in EPS if model.num_experts % ep == 0] if model.num_experts else [1]
    if spare_gib < 0 or spare_gib >= device_gib - 4:
        raise ValueError(f"spare_gib={spare_gib} must be at least 0 and below device_gib - 4 = "
                         f"{device_gib - 4:g}")
    best, nodes = None, max_nodes
    for recompute in ("full", None):  # full first: its fewer nodes bound the other searches
        for ep in eps:
            base = Layout(max(8, ep), ep=ep, seq_length=seq_length,
                          recompute_granularity=recompute, transformer_impl=transformer_impl)
            found = smallest_layout(model, base, device_gib - spare_gib, max_nodes=nodes,
                                    global_batch=global_batch)
            if found is None:
                continue
            speed = estimate(model, found, gpu).tokens_per_gpu_s
            key = (found.world_size, -speed)
            if best is None or key < best[0]:
                best = (key, found)
                nodes = found.world_size // 8
    if best is None:
        return None
    layout, speed = best[1], -best[0][1]
    # the search returns the least TP x CP that fits on each world: every other choice on the
    # fewest nodes may still run faster
    for recompute in ("full", None):
        for ep in eps:
            for tp in (1, 2, 4, 8):
                for cp in (1, 2, 4, 8):
                    try:
                        other = with_global_batch(Layout(
                            layout.world_size, ep=ep, tp=tp, cp=cp, sequence_parallel=tp > 1,
                            seq_length=seq_length, recompute_granularity=recompute,
                            transformer_impl=transformer_impl), global_batch)
                    except ValueError:
                        continue
                    if other is None or not plan(model, other).fits(device_gib - spare_gib):
                        continue
                    rate = estimate(model, other, gpu).tokens_per_gpu_s
                    if rate > speed:
                        layout, speed = other, rate
    return Choice(preset, layout, device_gib, plan(model, layout).total, speed, gpu,
                  global_batch)


ROWS = (("llama3-8b", 8192), ("llama3-70b", 8192), ("llama3.1-405b", 8192),
        ("deepseek-v3", 4096), ("deepseek-v3", 8192))
"""The guide's rows: each preset at 8192 tokens, and DeepSeek-V3 at its sbatch preset's 4096."""


def row(preset: str, seq_length: int, gpu_name: str, spare_gib: float | None = None,
        max_nodes: int = 4096, transformer_impl: str = "local") -> Choice | None:
    """The guide's row for ``preset`` at ``seq_length`` tokens on ``gpu_name`` (a key of
    ``GPUS``): :func:`choose` at the preset's ``GLOBAL_BATCH``, leaving ``spare_gib`` (default
    ``mfsdp plan``'s tight margin, ``plan_cli.TIGHT_GIB``)."""
    from mfsdp.tools.plan_cli import TIGHT_GIB

    if gpu_name not in GPUS:
        raise ValueError(f"gpu_name={gpu_name!r} is not one of {list(GPUS)}; pick one of them")
    device_gib, gpu = GPUS[gpu_name]
    return choose(preset, seq_length, device_gib, gpu,
                  TIGHT_GIB if spare_gib is None else spare_gib, max_nodes,
                  GLOBAL_BATCH.get(preset), transformer_impl)


def table(rows=ROWS, gpus=tuple(GPUS), transformer_impl: str = "local") -> str:
    """One line per (preset, sequence length) of ``rows`` and GPU of ``GPUS`` (the guide's
    table, at most 88 columns), at the preset's global batch (``GLOBAL_BATCH``, column ``GBS``):
    the layout on the fewest GPUs that leaves ``mfsdp plan``'s tight margin
    (``plan_cli.TIGHT_GIB``) to spare, its GiB per GPU and what is left; then the fewest GPUs on
    which it fits at all, marked ``tight`` when that plan leaves less than the margin.
    ``transformer_impl``: the layer planned (:func:`choose`)."""
    out = [f"{'model':<14}{'seq':>5}{'GBS':>5} {'GPU':<5}{'GPUs':>5}{'TP':>4}{'CP':>4}{'EP':>4}  "
           f"{'recompute':<10}{'GiB/GPU':>8}{'spare':>6}  fewest"]
    for name, seq in rows:
        for gpu_name in gpus:
            c = row(name, seq, gpu_name, transformer_impl=transformer_impl)
            head = f"{name:<14}{seq:>5}{GLOBAL_BATCH[name]:>5} {gpu_name:<5}"
            if c is None:
                out.append(head + " no layout fits with the margin")
                continue
            lay = c.layout
            least = row(name, seq, gpu_name, 0.0, lay.world_size // 8, transformer_impl)
            fewest = "same" if least.layout.world_size == lay.world_size else \
                f"{least.layout.world_size}{' tight' if least.tight else ''}"
            out.append(head + f"{lay.world_size:>5}{lay.tp:>4}{lay.cp:>4}{lay.ep:>4}  "
                       f"{c.recompute:<10}{c.total / GiB:>8.1f}{c.spare_gib:>6.1f}  {fewest}")
    return "\n".join(out)


def _drop(layout: Layout) -> tuple[str, Layout]:
    """The layout without its TP and CP, and its name (``TP 1``, ``CP 1`` or ``TP 1 CP 1``)."""
    name = " ".join(f"{k} 1" for k, v in (("TP", layout.tp), ("CP", layout.cp)) if v > 1)
    return name, replace(layout, tp=1, cp=1, sequence_parallel=False)


def why(preset: str, seq_length: int, gpu_name: str) -> str:
    """Why the guide's row for ``preset`` at ``seq_length`` tokens on ``gpu_name`` (a key of
    ``GPUS``) is what it is, from what its search tried: the same layout without TP and CP
    (tight on as many GPUs, beyond the GPU whatever the world, or on how many GPUs it fits),
    without recomputation (how many GPUs, or slower on as many), experts per GPU, and the
    fewest GPUs when they leave less than the margin. Empty when nothing needs saying.

    >>> why("llama3-8b", 8192, "H200")
    ''
    """
    from mfsdp.tools.plan_cli import TIGHT_GIB

    c = row(preset, seq_length, gpu_name)
    device_gib, batch = GPUS[gpu_name][0], GLOBAL_BATCH.get(preset)
    if c is None:
        return f"nothing fits with {TIGHT_GIB:g} GiB to spare"
    model, lay, usable = PRESETS[preset], c.layout, device_gib - TIGHT_GIB
    out = []
    if lay.tp * lay.cp > 1:
        name, flat = _drop(lay)
        p = plan(model, flat)
        if p.fits(device_gib):
            out.append(f"{name} leaves {device_gib - 4 - p.total / GiB:.1f} GiB: tight")
        elif p.memory["activations"] > (device_gib - 4) * GiB:
            out.append(f"{name}: the activations alone exceed the GPU")
        elif not _fits_without_state(p, device_gib):
            out.append(f"{name}: activations and gathered layers exceed the GPU")
        else:  # it fits on more GPUs: how many (up to twice the row's)
            more = smallest_layout(model, flat, usable, tps=(1,), cps=(1,),
                                   max_nodes=2 * lay.world_size // 8, global_batch=batch)
            out.append(f"{name} needs {more.world_size} GPUs" if more else
                       f"{name} needs over {2 * lay.world_size} GPUs")
    if lay.recompute_granularity:
        nodes, best = 2 * lay.world_size // 8, None
        for ep in sorted({lay.ep} | ({*EPS} if model.num_experts else set()), reverse=True):
            if model.num_experts % ep:
                continue
            base = Layout(max(8, ep), ep=ep, seq_length=seq_length)
            found = smallest_layout(model, base, usable, max_nodes=nodes, global_batch=batch)
            if found is not None and (best is None or found.world_size < best.world_size):
                best, nodes = found, found.world_size // 8
        if best is None:
            out.append(f"no recompute needs over {2 * lay.world_size} GPUs")
        elif best.world_size > lay.world_size:
            out.append(f"no recompute needs {best.world_size} GPUs")
        else:
            out.append(f"no recompute needs TP {best.tp} CP {best.cp}: slower")
    if model.num_experts:
        out.append(f"{model.num_experts // lay.ep} experts per GPU")
    least = row(preset, seq_length, gpu_name, 0.0, lay.world_size // 8)
    if least.layout.world_size < lay.world_size:
        out.append(f"{least.layout.world_size} GPUs leave {least.spare_gib:.1f} GiB: tight")
    return "; ".join(out)
