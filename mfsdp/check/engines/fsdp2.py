"""``--engine fsdp2``: the sharded side run by PyTorch's FSDP2, as its tutorial shards a model:
``torch.distributed.fsdp.fully_shard`` on every FSDP unit, then on the root, over one device mesh,
and the optimizer built on the sharded parameters::

    mesh = init_device_mesh("cpu", (world,))                  # HSDP: (outer, world // outer)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

FSDP2's strategies: ZeRO-3 (``reshard_after_forward=True``), ZeRO-2 (``False``: the unit stays
gathered from forward to backward), HSDP (a 2-D mesh: replicate over the outer dimension, shard
over the inner one) and ``MixedPrecisionPolicy`` (``param_dtype``, ``reduce_dtype``). It has no
ZeRO-0 or ZeRO-1 and does not shard the optimizer state over HSDP's outer dimension: those
layouts are skipped with that reason.
"""

from __future__ import annotations

import torch
from torch import nn

from mfsdp.check.engines import Engine, Sharded, strip_name

__all__ = ["FSDP2Engine", "fsdp2_arguments"]

_STRATEGIES = {"optim_grads_params": True, "optim_grads": False}
"""mfsdp's ``zero_dp_strategy`` -> FSDP2's ``reshard_after_forward``."""


def fsdp2_arguments(layout) -> dict:
    """``fully_shard``'s ``reshard_after_forward`` and ``mp_policy`` for ``layout``: bf16
    compute is ``param_dtype=bfloat16`` with fp32 reduction (fp32 sharded parameters are the main
    weights); bf16 gradient communication is ``reduce_dtype=bfloat16``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if layout.compute_dtype == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif layout.grad_comm_dtype == "bf16":
        policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    else:
        policy = MixedPrecisionPolicy()
    return {"reshard_after_forward": _STRATEGIES[layout.strategy], "mp_policy": policy}


class FSDP2Engine(Engine):
    """PyTorch's ``torch.distributed.fsdp.fully_shard``."""

    name = "fsdp2"
    title = "PyTorch FSDP2"

    def version(self) -> str:
        """FSDP2 ships with torch: ``torch.__version__``."""
        return f"torch {torch.__version__}"

    def refuses(self, layout) -> str | None:
        """TP, CP, EP and the resume layout run under mfsdp only; ZeRO-0/1 and HFSDP are not
        FSDP2 strategies."""
        if layout.parallel:
            return f"{layout.parallel_kind()} is checked under --engine mfsdp only"
        if layout.resume_as:
            return "saves with mfsdp.checkpoint and resumes into ZeRO-1: --engine mfsdp only"
        if layout.strategy not in _STRATEGIES:
            return (f"zero_dp_strategy={layout.strategy!r}: FSDP2 always shards gradients "
                    "(ZeRO-2 or ZeRO-3); it has no ZeRO-0 or ZeRO-1 (use DDP)")
        if layout.outer_strategy != "no_shard":
            return ("HFSDP: FSDP2's HSDP replicates over the outer dimension; it does not shard "
                    "the optimizer state there")
        return None

    def shard(self, s: dict, layout, strategy: str) -> Sharded:
        """``fully_shard`` per unit and on the root over a 1-D mesh (2-D for HSDP), then the
        user's optimizer on the sharded parameters."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from mfsdp.check.models import build_model, resolve_units
        from mfsdp.check.run import _user_optimizer

        world = dist.get_world_size()
        model = build_model(s.model, s.seed)
        units = tuple(resolve_units(model, s.units))
        if layout.compute_dtype == "bf16":  # the reference's start: weights rounded to bf16
            model = model.to(torch.bfloat16).float()
        if layout.dp_outer > 1:
            mesh = init_device_mesh("cpu", (layout.dp_outer, world // layout.dp_outer),
                                    mesh_dim_names=("dp_replicate", "dp_shard"))
        else:
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        kwargs = fsdp2_arguments(layout)
        for module in [m for m in model.modules() if isinstance(m, units)]:
            fully_shard(module, mesh=mesh, **kwargs)
        fully_shard(model, mesh=mesh, **kwargs)
        return Sharded(model, _user_optimizer(s, model))

    def full_gradients(self, sh: Sharded) -> dict[str, torch.Tensor]:
        """Each parameter's ``grad.full_tensor()`` (after FSDP2's reduce-scatter)."""
        return {strip_name(n): _full(p.grad).float() for n, p in sh.model.named_parameters()
                if p.grad is not None}

    def full_parameters(self, sh: Sharded) -> dict[str, torch.Tensor]:
        """Each parameter's ``full_tensor()`` (fp32: FSDP2 keeps the sharded parameters in their
        own dtype and casts a copy for compute)."""
        return {strip_name(n): _full(p.detach()) for n, p in sh.model.named_parameters()}

    def state_bytes(self, sh: Sharded) -> int:
        """Local shards of the parameters and gradients plus the optimizer state."""
        return _local_bytes(sh.model, sh.optimizer)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _local_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    total = 0
    for p in model.parameters():
        total += local(p).numel() * p.element_size()
        if p.grad is not None:
            total += local(p.grad).numel() * p.grad.element_size()
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                total += local(v).numel() * v.element_size()
    return total
