"""The layouts ``mfsdp check`` runs and the tolerances each is judged by (the one place they live).

A layout is one way a user shards their model with ``mfsdp.fully_shard``: a ZeRO strategy,
HSDP, HFSDP, bf16 compute with fp32 main weights, bf16 gradient communication, a resume from a
checkpoint into another strategy, or ZeRO-3 combined with tensor (and sequence), context or
expert parallelism (``mfsdp.check.parallel``; mfsdp's GPT only). Each names the
``Tolerance`` it is held to, chosen by the dtypes it computes and communicates in.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Tolerance", "TOLERANCES", "Layout", "LAYOUTS", "DEFAULT_LAYOUTS", "select_layouts",
           "ranks_reason"]


@dataclass(frozen=True)
class Tolerance:
    """How far a sharded run may drift from the single-process reference and still pass."""

    loss: float
    """Largest ``|loss_sharded - loss_reference| / max(1, |loss_reference|)`` at any step."""
    ratio: float
    """Largest ``|ratio - 1|`` of the gradient-norm and update-norm ratios at any step."""
    param: float
    """Largest relative error of one parameter at any step, that is ``||p_sharded -
    p_reference||`` over ``||p_reference - p_initial||`` (how far training moved it)."""


# [Note: tolerances] fp32 layouts differ from the reference only by the order of floating-point
# sums (the reduction adds per-rank gradients, the reference one full-batch backward): about
# 1e-6 relative, so 1e-4 on the norms and 1e-3 on any one parameter leaves two decades of room and
# still catches a 2x, 1.3x or 1% scale error. bf16 compute rounds every activation to 8 bits of
# mantissa and the reference rounds differently (its batch is twice as large): a few parts in a
# hundred. bf16 gradient communication rounds each rank's gradient once before the sum: about
# 2^-8 relative per element, 1e-2 on norms. A fault class this doctor is built to find moves a
# ratio by 0.2 or more (upstream's #5974 showed 0.5-0.77).
TOLERANCES: dict[str, Tolerance] = {
    "fp32": Tolerance(loss=1e-5, ratio=1e-4, param=1e-3),
    "bf16": Tolerance(loss=2e-2, ratio=5e-2, param=1e-1),
    "bf16_comm": Tolerance(loss=1e-3, ratio=1e-2, param=5e-2),
}


@dataclass(frozen=True)
class Layout:
    """One sharded configuration: the ``mfsdp.fully_shard`` arguments it stands for."""

    name: str
    strategy: str
    """``zero_dp_strategy``."""
    dp_outer: int = 1
    """HSDP outer (replica) size; the shard group is ``nproc // dp_outer``."""
    outer_strategy: str = "no_shard"
    """``outer_dp_sharding_strategy`` across the outer dimension: ``no_shard`` (HSDP) or
    ``optim`` (HFSDP: main weights and optimizer state also sharded over the outer ranks)."""
    compute_dtype: str = "fp32"
    """The model's dtype (``bf16``: the model is cast to bfloat16, main weights stay fp32)."""
    grad_comm_dtype: str | None = None
    """``MixedPrecisionPolicy.grad_comm_dtype`` (``None``: the gradients' own dtype)."""
    tolerance: str = "fp32"
    """The key of ``TOLERANCES`` this layout is judged by."""
    min_ranks: int = 2
    resume_as: str | None = None
    """Save a checkpoint halfway, load it into a fresh model sharded with this strategy (the
    optimizer state is resharded) and train on: the steps after the load check the resume."""
    tp: int = 1
    """Tensor-parallel size (Megatron-LM's split, ``mfsdp.models.tensor_parallel``)."""
    sequence_parallel: bool = False
    """With ``tp``: norms on sequence shards (Megatron-LM's sequence parallelism)."""
    cp: int = 1
    """Context-parallel size (each sequence split over ``cp`` ranks)."""
    ep: int = 1
    """Expert-parallel size (``mfsdp.moe.shard_experts``; MoE models only)."""
    dispatcher: str | None = None
    """With ``ep``: the MoE token dispatcher (``allgather``, ``alltoall``, ``flex``; ``None``:
    the model's own)."""

    @property
    def parallel(self) -> bool:
        """Whether the layout splits the model beyond data parallelism (TP, CP or EP)."""
        return self.tp > 1 or self.cp > 1 or self.ep > 1

    def parallel_kind(self) -> str:
        """``tensor parallelism``, ``context parallelism`` or ``expert parallelism``."""
        return ("tensor parallelism" if self.tp > 1 else "context parallelism" if self.cp > 1
                else "expert parallelism")

    def describe(self) -> str:
        """The ``fully_shard`` arguments, as a user would write them."""
        parts = [f"zero_dp_strategy={self.strategy!r}"]
        if self.dp_outer > 1:
            hybrid = "HFSDP" if self.outer_strategy == "optim" else "HSDP"
            parts.append(f"dp_outer={self.dp_outer} ({hybrid})")
            if self.outer_strategy != "no_shard":
                parts.append(f"outer_dp_sharding_strategy={self.outer_strategy!r}")
        if self.compute_dtype == "bf16":
            parts.append("bf16 model, fp32 main weights and grads")
        if self.grad_comm_dtype:
            parts.append(f"grad_comm_dtype={self.grad_comm_dtype}")
        if self.tp > 1:
            parts.append(f"TP {self.tp}" + (" + sequence parallel" if self.sequence_parallel
                                            else ""))
        if self.cp > 1:
            parts.append(f"CP {self.cp}")
        if self.ep > 1:
            parts.append(f"EP {self.ep}" + (f" ({self.dispatcher} dispatcher)"
                                            if self.dispatcher else ""))
        if self.resume_as:
            parts.append(f"saved halfway, loaded into zero_dp_strategy={self.resume_as!r}")
        return ", ".join(parts)


LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in (
    Layout("no_shard", "no_shard"),
    Layout("optim", "optim"),
    Layout("optim_grads", "optim_grads"),
    Layout("optim_grads_params", "optim_grads_params"),
    Layout("hsdp", "optim_grads_params", dp_outer=2, min_ranks=4),
    Layout("hfsdp", "optim_grads_params", dp_outer=2, outer_strategy="optim", min_ranks=4),
    Layout("bf16", "optim_grads_params", compute_dtype="bf16", tolerance="bf16"),
    Layout("bf16_comm", "optim_grads_params", grad_comm_dtype="bf16", tolerance="bf16_comm"),
    Layout("resume", "optim_grads_params", resume_as="optim"),
    Layout("tp", "optim_grads_params", tp=2),
    Layout("tp_sp", "optim_grads_params", tp=2, sequence_parallel=True),
    Layout("cp", "optim_grads_params", cp=2),
    Layout("ep", "optim_grads_params", ep=2),
)}

DEFAULT_LAYOUTS = tuple(LAYOUTS)


def select_layouts(names: list[str] | None, nproc: int,
                   steps: int = 2) -> tuple[list[Layout], list[str]]:
    """The layouts to run for ``names`` (``None``: all) on ``nproc`` ranks for ``steps`` steps,
    and the names of default layouts skipped because they need more ranks (or, ``resume``, two
    steps). A named layout that cannot run is an error."""
    if nproc < 2:
        raise ValueError(f"--nproc={nproc}: a parity check needs at least 2 ranks; use --nproc 2")
    chosen = list(DEFAULT_LAYOUTS) if not names else list(names)
    unknown = [n for n in chosen if n not in LAYOUTS]
    if unknown:
        raise ValueError(f"--layouts {unknown[0]!r} is not a layout; choose from "
                         f"{', '.join(LAYOUTS)}")
    run, skipped = [], []
    for name in chosen:
        layout = LAYOUTS[name]
        if layout.resume_as and steps < 2:
            if names:
                raise ValueError(f"--layouts {name} saves halfway and needs --steps 2 or more, "
                                 f"got --steps {steps}")
            skipped.append(name)
            continue
        split = layout.dp_outer * layout.tp * layout.cp
        if nproc < layout.min_ranks or nproc % split:
            if names:
                raise ValueError(f"--layouts {name} {_nproc_needed(layout)}, "
                                 f"got --nproc {nproc}")
            skipped.append(name)
            continue
        run.append(layout)
    return run, skipped


def ranks_reason(layout: Layout, nproc: int, steps: int) -> str:
    """Why :func:`select_layouts` skipped the default layout ``layout`` (one line)."""
    if layout.resume_as and steps < 2:
        return "saves halfway: needs --steps 2 or more"
    return f"{_nproc_needed(layout)}, got --nproc {nproc}"


def _nproc_needed(layout: Layout) -> str:
    """The rank counts ``layout`` runs on: "needs --nproc 4, 6, 8, ... (a multiple of 2, at
    least 4)", or "needs --nproc 2, 4, 6, ..." where every multiple of the split will do."""
    split = layout.dp_outer * layout.tp * layout.cp
    first = -(-max(layout.min_ranks, split) // split) * split
    counts = ", ".join(str(first + i * split) for i in range(3))
    if first == split:
        return f"needs --nproc {counts}, ... (a multiple of {split})"
    return f"needs --nproc {counts}, ... (a multiple of {split}, at least {first})"
