"""The two sides of a parity check: one process training the whole global batch (the reference),
and one layout's ranks training their slices of it with :func:`mfsdp.fully_shard` (run inside
:func:`mfsdp.launch.launch`). Both record, per step, the loss, the gradient norm and the full fp32
main weights after the optimizer step; :mod:`mfsdp.check.report` compares them.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from mfsdp.check.layouts import Layout
from mfsdp.check.models import (build_model, load_callable, make_batches, next_token_loss,
                                resolve_units, vocab_size)
from mfsdp.config import dtype_named

__all__ = ["Settings", "make_optimizer", "mixed_precision_policy", "run_reference", "run_layout"]


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What the reference and the sharded side must agree on (it pickles to the ranks); a
    changed copy is ``dataclasses.replace(settings, ...)``."""

    model: Any
    """The model: a preset name, a Hugging Face directory, or ``package.module:factory``."""
    optimizer: str
    """``sgd`` or ``adamw`` (the reference's; see :func:`make_optimizer`)."""
    lr: float
    """The learning rate of both sides."""
    steps: int
    """Optimizer steps per layout."""
    global_batch: int
    """Sequences per step, split over the ranks."""
    seq_len: int
    """Tokens per sequence."""
    seed: int
    """The seed of the model's initial weights and of the batches."""
    units: list[str]
    """The FSDP unit classes, by name."""
    optimizer_factory: Any = None
    """``fn(model, lr)`` or its ``package.module:function`` name, instead of ``optimizer``."""
    recursive_gather: Any = None
    """Module classes whose forward bypasses their children's (fused kernels)."""
    resume_fn: Callable | None = None
    """``fn(path, model, optimizer)`` loading a resumed layout's checkpoint (default: mfsdp's)."""
    engine: str = "mfsdp"
    """The engine under check: ``mfsdp``, ``fsdp2`` or ``megatron_fsdp``."""
    after_shard: Any = None
    """A hook run on the sharded model and optimizer right after sharding (a workaround)."""


def make_optimizer(kind: str, params, lr: float) -> torch.optim.Optimizer:
    """The reference's optimizer: ``torch.optim.SGD(params, lr)`` or ``AdamW(params, lr)``
    (PyTorch's other defaults)."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    raise ValueError(f"--optimizer={kind!r}: use sgd or adamw")


def _user_optimizer(s: Settings, model: nn.Module) -> torch.optim.Optimizer:
    factory = s.optimizer_factory
    if factory is None:
        return make_optimizer(s.optimizer, [p for p in model.parameters() if p.requires_grad],
                              s.lr)
    if isinstance(factory, str):
        factory = load_callable(factory, "--optimizer-factory")
    return factory(model, s.lr)


def _batches(s: Settings, model: nn.Module) -> list[torch.Tensor]:
    return make_batches(vocab_size(model), s.steps, s.global_batch, s.seq_len, s.seed)


def _grad_norm(params) -> float:
    sq = sum(p.grad.double().pow(2).sum() for p in params if p.grad is not None)
    return float(sq) ** 0.5


def run_reference(s: Settings, compute_dtype: str = "fp32") -> dict[str, Any]:
    """Train one process on the whole global batch: the model in ``compute_dtype``, fp32 main
    weights the optimizer steps on (as the sharded layouts keep them)."""
    model = build_model(s.model, s.seed)
    batches = _batches(s, model)
    dtype = dtype_named(compute_dtype)
    model = model.to(dtype)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    work = [p for p in model.parameters() if p.requires_grad]
    main = [nn.Parameter(p.detach().float().clone()) for p in work]
    opt = make_optimizer(s.optimizer, main, s.lr)
    initial = {n: p.detach().clone() for n, p in zip(names, main)}
    losses, norms, params, grads = [], [], [], []
    for tokens in batches:
        for p in work:
            p.grad = None
        loss = next_token_loss(model, tokens)
        loss.backward()
        for pm, pw in zip(main, work):
            pm.grad = None if pw.grad is None else pw.grad.float()
        norms.append(_grad_norm(main))
        grads.append({n: pm.grad.clone() for n, pm in zip(names, main) if pm.grad is not None})
        opt.step()
        with torch.no_grad():
            for pm, pw in zip(main, work):
                pw.copy_(pm)
        losses.append(loss.item())
        params.append({n: p.detach().clone() for n, p in zip(names, main)})
    return {"losses": losses, "grad_norms": norms, "params": params, "initial": initial,
            "grads": grads}


def _strip(name: str) -> str:
    return name[len("module."):] if name.startswith("module.") else name


def mixed_precision_policy(layout: Layout):
    """The ``MixedPrecisionPolicy`` ``layout`` shards with: fp32 main weights and gradients under
    bf16 compute, else the layout's gradient communication dtype."""
    from mfsdp.config import MixedPrecisionPolicy

    if layout.compute_dtype == "bf16":
        return MixedPrecisionPolicy(main_params_dtype=torch.float32,
                                    main_grads_dtype=torch.float32)
    return MixedPrecisionPolicy(grad_comm_dtype=dtype_named(layout.grad_comm_dtype))


def _sharded(s: Settings, layout: Layout, strategy: str):
    """The user's model and optimizer, sharded as ``layout`` with ``strategy``, and the
    :class:`~mfsdp.check.parallel.ParallelRun` of a TP, CP or EP layout (else ``None``)."""
    import torch.distributed as dist

    # mfsdp.fully_shard and mfsdp.MixedPrecisionPolicy, imported from where they are defined
    # (mfsdp/__init__.py imports this package: no cycle)
    from mfsdp.fsdp.api import fully_shard
    from mfsdp.layout import ParallelLayout

    model = build_model(s.model, s.seed)
    units = resolve_units(model, s.units)
    recursive = resolve_units(model, s.recursive_gather) if s.recursive_gather else None
    if layout.compute_dtype == "bf16":
        model = model.to(torch.bfloat16)
    policy = mixed_precision_policy(layout)
    par = None
    if layout.parallel:  # the trainer's groups, TP split and expert sharding
        from mfsdp.check.parallel import ParallelRun

        par = ParallelRun(layout, model, dist.get_world_size(), s.global_batch, s.seq_len)
        model = par.split(model)
        groups = par.groups
    else:
        groups = (ParallelLayout(dist.get_world_size(), layout.dp_outer).create_groups()
                  if layout.dp_outer > 1 else None)
    optimizer = _user_optimizer(s, model)  # upstream's order: built on the module, then sharded
    model, optimizer = fully_shard(
        model, optimizer, fsdp_unit_modules=units, zero_dp_strategy=strategy,
        outer_dp_sharding_strategy=layout.outer_strategy, process_groups=groups,
        mixed_precision_policy=policy, recursive_gather_modules=recursive)
    return model, optimizer, par


def _resume(s: Settings, layout: Layout, model, optimizer, step: int):
    """Save ``model`` and ``optimizer`` after ``step``, then load the checkpoint with the user's
    ``resume_fn`` (default :func:`mfsdp.checkpoint.load_checkpoint`) into a fresh model sharded
    with ``layout.resume_as``; return the fresh pair."""
    import shutil
    import tempfile

    import torch.distributed as dist

    from mfsdp.checkpoint import load_checkpoint, save_checkpoint

    where = [tempfile.mkdtemp(prefix="mfsdp-check-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where, src=0)
    try:
        path = save_checkpoint(where[0], model, optimizer, iteration=step)
        model, optimizer, _ = _sharded(s, layout, layout.resume_as)
        load = s.resume_fn or load_checkpoint
        if isinstance(load, str):
            load = load_callable(load, "--resume-fn")
        load(path, model, optimizer)
        dist.barrier()
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(where[0], ignore_errors=True)
    return model, optimizer


def reset_peak_rss() -> bool:
    """Start this process's peak resident memory (``VmHWM``) again from its current size
    (Linux's ``/proc/self/clear_refs``); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> float:
    """Peak resident memory in MiB since :func:`reset_peak_rss` (``VmHWM``), or over the whole
    process (``getrusage``) where ``/proc`` does not give it."""
    from mfsdp.runtime import proc_status_mib

    peak = proc_status_mib("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_layout(s: Settings, layout: Layout) -> dict[str, Any]:
    """Train this rank's slice of every step's global batch under ``layout`` with the engine
    ``s.engine`` names (call inside a launched rank). Rank 0 returns the per-step losses,
    gradient norms, full gradients and full main weights; every rank returns its peak memory."""
    from mfsdp.check.engines import get_engine

    engine = get_engine(s.engine)
    with engine.running():
        return _train(s, layout, engine)


def _train(s: Settings, layout: Layout, engine) -> dict[str, Any]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    reset_peak_rss()  # the ranks may have run another layout before this one
    batches = _batches(s, build_model(s.model, s.seed))
    sh = engine.shard(s, layout, layout.strategy)
    after = s.after_shard
    if after is not None:  # the user's script, right after fully_shard
        (load_callable(after, "--after-shard") if isinstance(after, str) else after)(
            sh.model, sh.optimizer)
    local = s.global_batch // world
    losses, norms, params, grads = [], [], [], []

    initial = engine.full_parameters(sh)
    prediction = None
    if (layout.grad_comm_dtype == "bf16" and layout.compute_dtype != "bf16"
            and sh.par is None and engine.name == "mfsdp"):
        from mfsdp.check.predict import predict_bf16_reduction

        prediction = predict_bf16_reduction(s, batches[0][rank * local:(rank + 1) * local])
    resume_after = (len(batches) + 1) // 2 if layout.resume_as else None
    for step, tokens in enumerate(batches, start=1):
        phase = "forward/backward"
        try:
            if step - 1 == resume_after:
                phase = "save and resume"
                model, optimizer = _resume(s, layout, sh.model, sh.optimizer, step - 1)
                sh.model, sh.optimizer = model, optimizer
                phase = "forward/backward"
            sh.optimizer.zero_grad()
            if sh.par is not None:  # the global mean on every rank (the mean below keeps it)
                loss = sh.par.loss_backward(sh.model, tokens)
            else:
                loss = next_token_loss(sh.model, tokens[rank * local:(rank + 1) * local])
                loss.backward()
            phase = "optimizer step"
            full_grads = engine.full_gradients(sh)
            norms.append(engine.grad_norm(sh, full_grads))
            sh.optimizer.step()
        except Exception as exc:  # say where: the report names the step
            raise RuntimeError(f"step {step} ({phase}): {type(exc).__name__}: {exc}") from exc
        t = loss.detach().float().reshape(1)
        dist.all_reduce(t)
        losses.append(t.item() / world)
        full = engine.full_parameters(sh)
        if rank == 0:
            params.append(full)
            grads.append(full_grads)
    tracked = engine.state_bytes(sh)
    out = {"rank": rank, "max_rss_mib": peak_rss_mib(),
           "tracked_mib": tracked / 2**20}
    if rank == 0:
        out.update(losses=losses, grad_norms=norms, params=params, initial=initial,
                   grads=grads, prediction=prediction, engine=engine.name,
                   engine_version=engine.version(), replacements=engine.replacements())
    return out
