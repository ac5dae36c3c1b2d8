"""The reference a dry run is checked against: one real training step on real ranks.

:func:`real_step` builds a preset with ``mfsdp train``'s flags and model builder on the ranks of
the current (gloo) process group, runs one optimizer step of ``micro_batches`` micro-batches as
the trainer does (``no_sync`` on all but the last), and returns the bytes its collectives sent
(the engine's :class:`~mfsdp.fsdp.collectives.CommLog`) beside what
:func:`mfsdp.tools.dry_run.implied_traffic` reads off the same buckets, and the bytes it holds.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

__all__ = ["real_step"]


def real_step(preset: str, layout_kwargs: dict) -> dict:
    """On every rank: ``{"logged": {"op group": bytes}, "implied": {...}, "held": {...},
    "storage": bytes, "optimizer_after_step": bytes}`` (``storage``: the bytes of the engine's
    buffers after the step, by its own accounting; ``optimizer_after_step``: the state the
    optimizer's real step created)."""
    from mfsdp.tools.dry_run import _validated_config, held_bytes, implied_traffic, train_flags
    from mfsdp.tools.plan import Layout
    from mfsdp.trainer.parallel import build_sharded_model

    world = dist.get_world_size()
    layout = Layout(world_size=world, **layout_kwargs)
    config, cfg = _validated_config(train_flags(preset, layout, meta_init=False), world)
    model, _, opt, par = build_sharded_model(config, cfg, world, torch.device("cpu"),
                                             log=lambda *a, **k: None)
    model.fsdp_state().comms.log.clear()
    peaks = _watch_peaks(model.fsdp_state())
    torch.manual_seed(dist.get_rank())
    tokens = torch.randint(0, cfg.vocab_size, (layout.micro_batch, layout.seq_length // par.cp))
    for i in range(layout.micro_batches):
        last = i == layout.micro_batches - 1
        with contextlib.nullcontext() if last else model.no_sync():
            model(tokens).float().pow(2).mean().backward()
    opt.step()
    after_step = opt.local_state_bytes()  # the state a real AdamW step created
    # the engine's own storage accounting
    storage = sum(model.fsdp_state().memory_by_kind().values())
    logged: dict[str, float] = {}
    for (op, group), sent in model.fsdp_state().comms.log.summary().items():
        if op != "flags" and sent:
            logged[f"{op} {group}"] = logged.get(f"{op} {group}", 0.0) + sent
    return {"logged": logged, "implied": implied_traffic(model, layout.micro_batches),
            "held": held_bytes(model, opt), "storage": storage,
            "optimizer_after_step": after_step, "peaks": dict(peaks)}


def _watch_peaks(state) -> dict[str, int]:
    """The largest bytes of gathered weights (every unit, the root included) and of full gradient
    buffers (sharded-gradient buckets, and the copies their reductions send when gradients travel
    in another dtype) that ``state``'s buckets hold at once, read off the buffers' storages each
    time the engine allocates or frees one of them; the dict fills as the model runs."""
    peaks = {"gathered": 0, "grad_buffers": 0}

    def held(b) -> tuple[int, int]:
        weights = b.full.numel() * b.full.element_size() if b.sharded_params and b.gathered else 0
        grads = 0
        if b.sharded_grads and b.grad_full is not None:
            grads = b.grad_full.numel() * b.grad_full.element_size()
        return weights, grads

    def sample() -> None:
        gathered = grads = 0
        for b in state.buckets:
            w, g = held(b)
            gathered, grads = gathered + w, grads + g
        # a reduction in flight holds its send buffer (a cast copy when the dtype differs)
        for b, handle, _ in state.reducer.inflight:
            if b.comm_dtype != b.grad_dtype:
                grads += b.plan.padded_numel * b.comm_dtype.itemsize
        peaks["gathered"] = max(peaks["gathered"], gathered)
        peaks["grad_buffers"] = max(peaks["grad_buffers"], grads)

    for name in ("count_gathered", "count_grad_full"):
        counted = getattr(state, name)

        def watched(nbytes, counted=counted):
            counted(nbytes)
            sample()
        setattr(state, name, watched)
    unit_gather = type(state.units[0]).gather

    def gather(unit, wait=True):  # the root's gather is not counted by the engine: sample it
        unit_gather(unit, wait)
        sample()
    for unit in state.units:
        unit.gather = gather.__get__(unit)
    return peaks
