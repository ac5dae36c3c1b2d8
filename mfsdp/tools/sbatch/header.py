"""The first comment of a rendered script: the preset's description, with its batch and
learning-rate schedule stated from the values the script was rendered with (a script is copied
as its job's provenance record, so it states what it runs)."""

from __future__ import annotations

from mfsdp.tools.sbatch.checks import time_limit_seconds
from mfsdp.tools.sbatch.presets import PRESETS, Preset

__all__ = ["describe"]


def describe(preset: Preset, values: dict | None = None) -> str:
    """The description of ``preset`` for the script ``values`` render (resolved; None: the
    preset's own values), its schedule stated from those values: a value changed with
    ``--set`` is written as rendered, with the preset's beside it. A ``{recompute}`` in the
    description is the script's recomputation as
    :func:`mfsdp.tools.sbatch.schedule.recompute_phrase` says it (planned with the layer of the
    script's trainer); a ``{context}`` is its context parallelism (empty without).

    >>> text = describe(PRESETS["llama3-8b"], dict(PRESETS["llama3-8b"].values,
    ...                                            train_iters=200))
    >>> text.split("schedule: ")[1].split(" (rendered with --set")[0]
    '512 x 200 iterations, cosine from 3e-4 to 3e-5 after 2,000 warm-up iterations'
    """
    own = preset.values
    values = own if values is None else values
    context = (f", context parallelism {values['cp']} (each rank holds "
               f"{values['seq_length'] // values['cp']:,} tokens of a sequence)"
               if values.get("cp", 1) > 1 else "")
    if "{recompute}" in preset.description:  # the script's own, in the plan of its trainer
        from mfsdp.tools.sbatch.schedule import recompute_phrase

        text = preset.description.format(**values, recompute=recompute_phrase(values),
                                         context=context)
    else:
        text = preset.description.format(**values, context=context)
    if not preset.recipe:
        return text
    hours = _job_length(values["time"])
    jobs = (f"in {hours} jobs that save and requeue until done"
            if values["save"] and values["requeue"] and values["signal_seconds"] > 0
            else f"in {hours} jobs (this script neither saves on the time-limit signal nor "
                 "requeues itself)")
    rendered = _schedule(values)
    if all(values[k] == own[k] for k in _SCHEDULE_KEYS):
        return (f"{text} Batch and learning-rate schedule: Megatron-Bridge's {preset.recipe} "
                f"({rendered}), {jobs}.")
    return (f"{text} Batch and learning-rate schedule: {rendered} (rendered with --set; "
            f"the preset's: Megatron-Bridge's {preset.recipe}, {_schedule(own)}), {jobs}.")


_SCHEDULE_KEYS = ("global_batch_size", "train_iters", "lr", "min_lr", "lr_warmup_iters",
                  "lr_decay_style", "lr_decay_iters")


def _num(x: float) -> str:
    """A learning rate as the recipes write it: 3e-4, 1.5e-5, 0."""
    if not x:
        return "0"
    mantissa, exponent = f"{x:e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def _schedule(v: dict) -> str:
    """'512 x 1,168,251 iterations, cosine from 3e-4 to 3e-5 after 2,000 warm-up iterations'."""
    text = f"{v['global_batch_size']:,} x {v['train_iters']:,} iterations, "
    text += (f"constant at {_num(v['lr'])}" if v["lr_decay_style"] == "constant" else
             f"{v['lr_decay_style']} from {_num(v['lr'])} to {_num(v['min_lr'])}")
    if v["lr_decay_iters"]:
        text += f" over {v['lr_decay_iters']:,} iterations"
    if v["lr_warmup_iters"]:
        text += f" after {v['lr_warmup_iters']:,} warm-up iterations"
    return text


def _job_length(time: str) -> str:
    """'4-hour' for a time limit of 04:00:00, '30-minute' for 00:30:00."""
    seconds = time_limit_seconds(time)
    for unit, length in (("hour", 3600), ("minute", 60)):
        if seconds % length == 0:
            return f"{seconds // length}-{unit}"
    return f"{time} (Slurm's time limit)"
