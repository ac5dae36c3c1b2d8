"""The per-module entry points: :class:`Placements`, :func:`fully_shard`,
:func:`fully_shard_context` and :func:`microbatch` (upstream ``megatron_fsdp.experimental``'s).

Placements name, per data-parallel mesh axis, how parameters, gradients and optimizer state are
laid out; they map onto mfsdp's strategies (``zero_dp_strategy`` on the last axis,
``outer_dp_sharding_strategy`` on the first of two):

=====================================  =====================================  ====================
parameter / gradient / optimizer        on the shard axis                      on an outer axis
=====================================  =====================================  ====================
``Shard(0)`` / ``Shard(0)`` / ``Shard(0)``  ``optim_grads_params`` (ZeRO-3)
``Replicate`` / ``Shard(0)`` / ``Shard(0)``  ``optim_grads`` (ZeRO-2)
``Replicate`` / ``Partial`` / ``Shard(0)``   ``optim`` (ZeRO-1)
``Replicate`` / ``Partial`` / ``Replicate``  ``no_shard``                          HSDP (``no_shard``)
``Replicate`` / ``Partial`` / ``Shard(0)``                                         HFSDP (``optim``)
=====================================  =====================================  ====================
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from contextvars import ContextVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from mfsdp.config import MixedPrecisionPolicy, ShardingStrategy
from mfsdp.experimental.module import FsdpContext, FsdpModule, Registration, make_fsdp_module
from mfsdp.experimental.optimizer import install_unadapted_step_check
from mfsdp.layout import rank_device

__all__ = ["Placements", "fully_shard", "fully_shard_context", "microbatch", "strategies_of"]

_CONTEXT: ContextVar[FsdpContext | None] = ContextVar("mfsdp_experimental_context", default=None)

MeshAxis = int | str


@dataclasses.dataclass(frozen=True)
class Placements:
    """How each data-parallel mesh axis holds parameters, gradients and optimizer state.

    ``dp_axes`` names the axes of the mesh given to :func:`fully_shard` that are data-parallel,
    in mesh order (today: every axis, as upstream requires); each placement sequence has one
    entry per axis. ``Shard(0)`` shards, ``Replicate()`` replicates, ``Partial("avg")`` (for
    gradients) leaves them unreduced until the step reduces them.

    >>> Placements(dp_axes=[0], parameter=[Shard(0)], gradient=[Shard(0)], optimizer=[Shard(0)])
    Placements(dp_axes=[0], parameter=[Shard(dim=0)], gradient=[Shard(dim=0)], optimizer=[Shard(dim=0)])
    """

    dp_axes: Sequence[MeshAxis]
    """The data-parallel axes of the mesh (indices or names), in mesh order."""
    parameter: Sequence[Placement]
    """Placement of the weights between uses, per axis."""
    gradient: Sequence[Placement]
    """Placement of the reduced gradients, per axis."""
    optimizer: Sequence[Placement]
    """Placement of the main weights and optimizer state, per axis."""

    def __post_init__(self) -> None:
        for name in ("parameter", "gradient", "optimizer"):
            if len(getattr(self, name)) != len(self.dp_axes):
                raise ValueError(f"Placements.{name} has {len(getattr(self, name))} entries for "
                                 f"{len(self.dp_axes)} dp_axes; give one placement per axis")


def _kind(p: Placement, what: str) -> str:
    if type(p) is Shard:
        if p.dim != 0:
            raise NotImplementedError(f"Placements.{what}={p!r}: mfsdp shards dim 0 only; use "
                                      "Shard(0)")
        return "shard"
    if isinstance(p, Replicate):
        return "replicate"
    if isinstance(p, Partial):
        if p.reduce_op != "avg":
            raise NotImplementedError(f"Placements.{what}={p!r}: gradients are averaged over "
                                      "data-parallel ranks; use Partial('avg')")
        return "partial"
    raise NotImplementedError(f"Placements.{what}={p!r}: use Shard(0), Replicate() or Partial()")


def strategies_of(placements: Placements) -> tuple[ShardingStrategy, ShardingStrategy | None]:
    """mfsdp's (``zero_dp_strategy``, ``outer_dp_sharding_strategy`` or ``None``) for
    ``placements`` (see the module's table); other combinations are refused by name.

    >>> strategies_of(Placements([0, 1], [Replicate(), Shard(0)], [Partial("avg"), Shard(0)],
    ...                          [Shard(0), Shard(0)]))
    (<ShardingStrategy.OPTIM_GRADS_PARAMS: 'optim_grads_params'>, <ShardingStrategy.OPTIM: 'optim'>)
    """
    if len(placements.dp_axes) not in (1, 2):
        raise NotImplementedError(f"dp_axes={list(placements.dp_axes)!r}: mfsdp takes one axis "
                                  "(FSDP) or two, outer then shard (HSDP/HFSDP)")
    p, g, o = (_kind(x[-1], w) for x, w in ((placements.parameter, "parameter"),
                                             (placements.gradient, "gradient"),
                                             (placements.optimizer, "optimizer")))
    table = {("shard", "shard", "shard"): ShardingStrategy.OPTIM_GRADS_PARAMS,
             ("replicate", "shard", "shard"): ShardingStrategy.OPTIM_GRADS,
             ("replicate", "partial", "shard"): ShardingStrategy.OPTIM,
             ("replicate", "replicate", "shard"): ShardingStrategy.OPTIM,
             ("replicate", "partial", "replicate"): ShardingStrategy.NO_SHARD,
             ("replicate", "replicate", "replicate"): ShardingStrategy.NO_SHARD}
    if (p, g, o) not in table:
        raise NotImplementedError(f"placements {placements!r} on the shard axis: parameter "
                                  f"{p}, gradient {g}, optimizer {o} is no ZeRO stage; see "
                                  "mfsdp.experimental.fully_shard for the combinations")
    inner = table[(p, g, o)]
    if len(placements.dp_axes) == 1:
        return inner, None
    p, g, o = (_kind(x[0], w) for x, w in ((placements.parameter, "parameter"),
                                            (placements.gradient, "gradient"),
                                            (placements.optimizer, "optimizer")))
    if p != "replicate" or g == "shard":
        raise NotImplementedError(f"placements {placements!r} on the outer axis: parameters "
                                  "must be Replicate() and gradients Partial() there (HSDP/HFSDP)")
    outer = ShardingStrategy.OPTIM if o == "shard" else ShardingStrategy.NO_SHARD
    if outer is ShardingStrategy.OPTIM and inner is not ShardingStrategy.OPTIM_GRADS_PARAMS:
        raise NotImplementedError(f"placements {placements!r}: sharding the optimizer over the "
                                  "outer axis (HFSDP) needs Shard(0) everywhere on the shard axis")
    return inner, outer


def _axis_index(mesh: DeviceMesh, axis: MeshAxis) -> int:
    if isinstance(axis, int):
        index = axis + mesh.ndim if axis < 0 else axis
        if not 0 <= index < mesh.ndim:
            raise ValueError(f"mesh axis {axis} is out of range for a {mesh.ndim}-D mesh")
        return index
    names = mesh.mesh_dim_names
    if names is None or axis not in names:
        raise ValueError(f"mesh axis {axis!r} is not one of the mesh's dims {names}")
    return names.index(axis)


def _check_dp_axes(mesh: DeviceMesh, dp_axes: Sequence[MeshAxis]) -> None:
    axes = tuple(_axis_index(mesh, a) for a in dp_axes)
    if axes != tuple(range(mesh.ndim)):
        raise NotImplementedError(f"dp_axes={list(dp_axes)!r}: every mesh axis must be "
                                  f"data-parallel, in mesh order ({list(range(mesh.ndim))}), "
                                  "as upstream requires today")


@contextlib.contextmanager
def fully_shard_context(device: torch.device | str | None = None, *,
                        use_symmetric_memory: bool = False,
                        unify_communication_stream: bool = False) -> Iterator[FsdpContext]:
    """``with fully_shard_context() as context: fully_shard(...)``: modules sharded together.

    On leaving the block the modules are built into mfsdp's engine, one sharded model per root
    (a module given to ``fully_shard`` that no other given module contains). Forward may run
    only after that.

    Args:
        device: where shards live; default the current GPU under NCCL, else the CPU (gloo).
        use_symmetric_memory: upstream's NCCL symmetric-memory staging buffers; refused.
        unify_communication_stream: upstream's one stream for both collectives; refused.
    """
    if use_symmetric_memory:
        raise ValueError("use_symmetric_memory=True: mfsdp does not allocate from NCCL's "
                         "symmetric-memory pool; leave it False")
    if unify_communication_stream:
        raise ValueError("unify_communication_stream=True: mfsdp runs all-gathers and "
                         "reduce-scatters on separate streams (async handles on CPU); leave it False")
    if _CONTEXT.get() is not None:
        raise RuntimeError("fully_shard_context does not support nesting; shard every module "
                           "in one block")
    if not dist.is_initialized():
        raise RuntimeError("fully_shard_context needs an initialised process group: call "
                           "torch.distributed.init_process_group() first (or use torchrun)")
    context = FsdpContext(torch.device(device) if device is not None else rank_device())
    token = _CONTEXT.set(context)
    try:
        yield context
        context.finalize()
        install_unadapted_step_check()  # (upstream's dtype error for an optimizer not adapted)
    finally:
        _CONTEXT.reset(token)


def fully_shard(module: nn.Module, mesh: DeviceMesh, placements: Placements,
                mixed_precision_policy: MixedPrecisionPolicy | None = None,
                grad_divisor: int = 1) -> None:
    """Shard ``module`` in place: it becomes an :class:`~mfsdp.experimental.FsdpModule` (an FSDP
    unit) and keeps its place in its parent. Call it on children before their parent.

    Args:
        module: the module; its parameters not owned by an already sharded child are its unit's.
        mesh: the data-parallel mesh (1-D: FSDP; 2-D ``(outer, shard)``: HSDP/HFSDP).
        placements: the layout, see :class:`Placements`.
        mixed_precision_policy: main-weight, gradient and communication dtypes (default fp32
            main weights, gradients in the parameters' dtype).
        grad_divisor: a further divisor of this module's reduced gradients (expert parallelism:
            the EP size, as an expert's gradient already sums its EP group's tokens).
    """
    if isinstance(module, FsdpModule):
        raise ValueError(f"{type(module).__name__} is already sharded by fully_shard")
    context = _CONTEXT.get()
    if context is None:
        raise RuntimeError("fully_shard must run inside fully_shard_context "
                           "(`with fully_shard_context(): fully_shard(...)`)")
    for sub in module.modules():
        if isinstance(sub, FsdpModule) and sub.context is not context:
            raise ValueError("fully_shard: the module contains a module sharded in another "
                             "fully_shard_context; shard a model in one context")
    if not isinstance(grad_divisor, int) or grad_divisor <= 0:
        raise ValueError(f"grad_divisor={grad_divisor!r} must be a positive integer")
    _check_dp_axes(mesh, placements.dp_axes)
    strategies = strategies_of(placements)
    policy = mixed_precision_policy or MixedPrecisionPolicy()
    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(f"mixed_precision_policy={policy!r} must be an mfsdp.MixedPrecisionPolicy")
    make_fsdp_module(module, context)
    context.register(Registration(module, mesh, placements, strategies, policy, grad_divisor))


@contextlib.contextmanager
def microbatch(context: FsdpContext, is_last: bool) -> Iterator[None]:
    """``with microbatch(context, is_last): loss.backward()``: whether the backwards inside are
    of the last micro-batch of the step.

    As upstream's, it matters for HSDP/HFSDP only: before the last micro-batch, gradients are
    reduce-scattered over the shard axis and accumulate, and the reduction over the outer axis
    waits for the last one. On a one-axis mesh every backward reduces its gradients (and the
    parameters' ``.grad`` holds the sum so far). Outside any ``microbatch`` every backward is the
    last.
    """
    context.ensure_finalized()
    previous = context.is_last_microbatch
    context.is_last_microbatch = bool(is_last)
    with contextlib.ExitStack() as stack:
        for engine in context.engines:
            if engine.fsdp_state().comms.outer is not None:  # (only an outer reduction is deferred)
                stack.enter_context(engine.sync() if is_last else engine.no_sync())
        try:
            yield
        finally:
            context.is_last_microbatch = previous
