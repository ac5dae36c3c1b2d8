"""``fully_shard_optimizer(optimizer)``: a plain ``torch.optim`` optimizer built on a sharded
model's ``parameters()`` steps the main-weight shards (the parameters' DTensors), and the
model weights follow after each step (upstream v2's adapter, on mfsdp's engine)."""

from __future__ import annotations

import torch

from mfsdp.experimental.module import FsdpModule
from mfsdp.fsdp import registry

__all__ = ["engine_modules", "engines_of", "fully_shard_optimizer"]


def engines_of(optimizer: torch.optim.Optimizer) -> list:
    """The mfsdp engines (:class:`mfsdp.FullyShardedModule`) whose parameters ``optimizer``
    steps, in order of first appearance."""
    found: dict[int, object] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            engine = registry.model_of(p)
            if engine is not None:
                found.setdefault(id(engine), engine)
    return list(found.values())


def engine_modules(engine) -> list:
    """The modules given to ``fully_shard`` that ``engine`` (one root's) drives."""
    root = engine.module
    return [m for m in root.modules() if isinstance(m, FsdpModule) and m.engine is engine]


def fully_shard_optimizer(optimizer: torch.optim.Optimizer, *,
                          precision_aware: bool = False) -> None:
    """Adapt ``optimizer`` in place (hooks; its parameter groups stay as they are).

    Before each step: check that the last backward's gradients were reduced (a step after a
    backward under ``microbatch(context, is_last=False)`` is an error). After each step: copy
    the new main weights into the model weights and start re-gathering them where they are
    replicated, as mfsdp's own optimizer does. Parameters not sharded by mfsdp are stepped as
    they are.

    Args:
        optimizer: a ``torch.optim.Optimizer`` over the sharded model's ``parameters()``.
        precision_aware: upstream's switch to skip casting gradients to the main-weight dtype;
            refused, as mfsdp's gradients already arrive in that dtype.
    """
    if precision_aware:
        raise ValueError("precision_aware=True: mfsdp hands the optimizer gradients already in "
                         "the main-weight dtype, so there is no cast to skip; leave it False")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer={optimizer!r} is not a torch.optim.Optimizer")
    engines = engines_of(optimizer)
    if not engines:
        raise ValueError("fully_shard_optimizer: none of the optimizer's parameters is sharded; "
                         "build it from model.parameters() after the fully_shard_context closes")

    def before(opt, args, kwargs):
        if kwargs.get("closure") is not None or len(args) > 1:  # (args[0]: the optimizer)
            raise NotImplementedError("fully_shard_optimizer: optimizer.step(closure) is not "
                                      "supported; run forward and backward before step()")
        for engine in engines:
            engine.finish_grad_sync()

    def after(opt, args, kwargs):
        for engine in engines:
            for module in engine_modules(engine):
                for group in module.parameter_groups:
                    group.sync_model_weight_from_main_weight()

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)
