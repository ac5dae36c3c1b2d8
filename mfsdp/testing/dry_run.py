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
    from mfsdp.tools.memory_timeline import record_memory_timeline
    from mfsdp.tools.plan import Layout
    from mfsdp.trainer.parallel import build_sharded_model

    world = dist.get_world_size()
    layout = Layout(world_size=world, **layout_kwargs)
    config, cfg = _validated_config(train_flags(preset, layout, meta_init=False), world)
    model, _, opt, par = build_sharded_model(config, cfg, world, torch.device("cpu"),
                                             log=lambda *a, **k: None)
    model.fsdp_state().comms.log.clear()
    # the most bytes of gathered weights (every unit, the root included) and of full gradient
    # buffers held at once, read off the buffers' storages at every allocation and release
    timeline = record_memory_timeline(model)
    torch.manual_seed(dist.get_rank())
    tokens = torch.randint(0, cfg.vocab_size, (layout.micro_batch, layout.seq_length // par.cp))
    for i in range(layout.micro_batches):
        last = i == layout.micro_batches - 1
        with contextlib.nullcontext() if last else model.no_sync():
            model(tokens).float().pow(2).mean().backward()
    opt.step()
    timeline.close()
    after_step = opt.local_state_bytes()  # the state a real AdamW step created
    # the engine's own storage accounting
    storage = sum(model.fsdp_state().memory_by_kind().values())
    logged: dict[str, float] = {}
    for (op, group), sent in model.fsdp_state().comms.log.summary().items():
        if op != "flags" and sent:
            logged[f"{op} {group}"] = logged.get(f"{op} {group}", 0.0) + sent
    return {"logged": logged, "implied": implied_traffic(model, layout.micro_batches),
            "held": held_bytes(model, opt), "storage": storage,
            "optimizer_after_step": after_step, "peaks": timeline.peaks()}
