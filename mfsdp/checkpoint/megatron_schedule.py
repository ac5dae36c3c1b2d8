"""Megatron-LM's learning-rate schedule in a checkpoint: its ``opt_param_scheduler`` counts
samples, mfsdp's scheduler iterations; what an export sets on ``args`` so that Megatron-LM (and
mfsdp's import) resumes where the run stopped. Used by :mod:`mfsdp.checkpoint.megatron_common`'s
readers and writers of both Megatron-LM formats.
"""

from __future__ import annotations

import argparse

__all__ = ["PER_STEP", "SCHEDULER_STEPS", "carry_into_args", "samples_per_step",
           "scheduler_in_iterations", "scheduler_in_samples"]

# Megatron-LM's opt_param_scheduler fields that count steps: samples there (every iteration
# steps it by the global batch size, under --train-iters too), iterations in mfsdp
SCHEDULER_STEPS = ("num_steps", "lr_warmup_steps", "lr_decay_steps", "wd_incr_steps",
                   "wsd_decay_steps")
PER_STEP = "megatron_lm_samples_per_step"  # extra's key: the factor an import divided by


def scheduler_in_iterations(saved: dict, args, extra: dict) -> dict:
    """Megatron-LM's ``opt_param_scheduler`` state with its step counts in iterations, as
    mfsdp's scheduler counts: divided by the job's ``global_batch_size`` (``args``) when its
    ``num_steps`` is the consumed samples, as Megatron-LM's training loop leaves it (kept as it
    is otherwise: a schedule stepped once per iteration); the factor is noted in ``extra``.

    >>> args = argparse.Namespace(global_batch_size=2, consumed_train_samples=6)
    >>> scheduler_in_iterations({"num_steps": 6, "lr_warmup_steps": 2}, args, {})
    {'num_steps': 3, 'lr_warmup_steps': 1}
    """
    gbs = getattr(args, "global_batch_size", None) or 1
    if saved.get("num_steps") != getattr(args, "consumed_train_samples", None) or gbs == 1:
        return dict(saved)
    extra[PER_STEP] = gbs
    return _scaled(saved, gbs, divide=True)


def scheduler_in_samples(state: dict, extra: dict) -> dict:
    """mfsdp's scheduler state as Megatron-LM's ``opt_param_scheduler`` counts it: a
    conversion's back by the factor its import divided by; a schedule ``mfsdp train`` saved
    (steps are iterations) times the global batch size of the Megatron-LM job it came from
    (``extra["megatron_lm_args"]``), else of the run (its consumed samples per iteration)."""
    return _scaled(state, samples_per_step(extra), divide=False)


def samples_per_step(extra: dict) -> int:
    """An export's samples per iteration (:func:`scheduler_in_samples`); 1 if nothing tells."""
    trainer = extra.get("trainer") or {}
    if not trainer:
        return extra.get(PER_STEP, 1)
    gbs = (extra.get("megatron_lm_args") or {}).get("global_batch_size")
    if not gbs and trainer.get("iteration") and trainer.get("consumed_samples"):
        per, rest = divmod(int(trainer["consumed_samples"]), int(trainer["iteration"]))
        gbs = per if not rest else None
    return gbs or 1


def carry_into_args(args, extra: dict) -> None:
    """Set on an export's ``args`` what Megatron-LM's loader resumes from or compares, as the
    job had it: ``consumed_train_samples`` (the mfsdp run's count, else the converted job's;
    Megatron-LM resumes its data there), ``global_batch_size`` (the schedule's samples per
    iteration) and ``add_position_embedding`` (the converted job's,
    else Megatron-LM's default, True; ``check_checkpoint_args`` compares it)."""
    trainer = extra.get("trainer") or {}
    found = trainer.get("consumed_samples", extra.get("consumed_train_samples"))
    args.consumed_train_samples = int(found or 0)
    if samples_per_step(extra) > 1:  # what an import divides the schedule by
        args.global_batch_size = samples_per_step(extra)
    carried = extra.get("megatron_lm_args") or {}
    args.add_position_embedding = carried.get("add_position_embedding", True)


def _scaled(state: dict, factor: int, divide: bool) -> dict:
    out = dict(state)
    for key in SCHEDULER_STEPS:
        v = out.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            v = v / factor if divide else v * factor
            out[key] = int(v) if float(v).is_integer() else v
    return out
