"""``fully_shard_optimizer(optimizer)``: a plain ``torch.optim`` optimizer built on a sharded
model's ``parameters()`` steps the main-weight shards (the parameters' DTensors), and the
model weights follow after each step (upstream v2's adapter, on mfsdp's engine).

As upstream's, an optimizer *not* adapted cannot step parameters whose gradients are kept in
another dtype than the parameters (the policy's ``main_grads_dtype`` differs from its
``main_params_dtype``, e.g. bf16 gradients of fp32 main weights): upstream hands such an
optimizer the gradients as they are and ``torch.optim`` fails on the dtype; mfsdp refuses the
step with the same condition named (:func:`refuse_unadapted_mixed_precision_step`, a global
optimizer step pre-hook installed when a ``fully_shard_context`` closes).
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from mfsdp.experimental.module import FsdpModule
from mfsdp.fsdp import registry

__all__ = ["engine_modules", "engines_of", "fully_shard_optimizer",
           "install_unadapted_step_check", "refuse_unadapted_mixed_precision_step"]

_ADAPTED: weakref.WeakSet = weakref.WeakSet()  # optimizers fully_shard_optimizer adapted
_CHECK = []  # the handle of the global step pre-hook, once installed


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
    _ADAPTED.add(optimizer)


def refuse_unadapted_mixed_precision_step(optimizer: torch.optim.Optimizer, args,
                                          kwargs) -> None:
    """Before any optimizer's step: raise if ``optimizer`` was not adapted by
    :func:`fully_shard_optimizer` (nor wrapped by :func:`mfsdp.fully_shard_optimizer`) and
    steps a parameter sharded by the per-module API whose gradients are kept in another dtype
    than the parameter (upstream's condition for torch.optim's dtype error)."""
    if optimizer in _ADAPTED:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            engine = registry.model_of(p)
            if engine is None or not isinstance(engine.module, FsdpModule):
                continue  # not sharded, or by the model-level API (its optimizer wraps this one)
            state = engine.fsdp_state()
            sp = state.sharded_param(p)
            grads = sp.bucket.grad_shard if sp is not None and sp.bucket.requires_grad else None
            if state.installed_by_optimizer or grads is None or grads.dtype == sp.local.dtype:
                continue
            raise RuntimeError(
                f"{type(optimizer).__name__}.step(): parameter {sp.name!r} has dtype "
                f"{str(sp.local.dtype).removeprefix('torch.')} but its gradients are kept in "
                f"{str(grads.dtype).removeprefix('torch.')} (main_grads_dtype differs from "
                "main_params_dtype), a dtype mismatch a plain torch.optim optimizer cannot "
                "step; adapt it with fully_shard_optimizer(optimizer), or give the "
                "MixedPrecisionPolicy main_grads_dtype=main_params_dtype")


def install_unadapted_step_check() -> None:
    """Install :func:`refuse_unadapted_mixed_precision_step` as a global optimizer step
    pre-hook (once per process; ``fully_shard_context`` calls it when it closes)."""
    if not _CHECK:
        _CHECK.append(register_optimizer_step_pre_hook(
            refuse_unadapted_mixed_precision_step))
