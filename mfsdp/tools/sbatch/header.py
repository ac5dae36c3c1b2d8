"""The first comment of a rendered script: the preset's description, with its layout, batch and
learning-rate schedule stated from the values the script was rendered with (a script is copied
as its job's provenance record, so it states what it runs)."""

from __future__ import annotations

from mfsdp.tools.sbatch.checks import time_limit_seconds
from mfsdp.tools.sbatch.presets import PRESETS, Preset

__all__ = ["describe", "layout_phrase", "model_phrase"]

_STRATEGIES = {"no_shard": "no sharding (no_shard)", "optim": "ZeRO-1 (optim)",
               "optim_grads": "ZeRO-2 (optim_grads)",
               "optim_grads_params": "ZeRO-3 (optim_grads_params)"}


def layout_phrase(v: dict) -> str:
    """How the train script of values ``v`` runs, as its header's ``{layout}`` says it, every
    part from the values: nodes x GPUs, TP (with SP), CP, EP, the data-parallel size and
    sharding strategy, recomputation (:func:`mfsdp.tools.sbatch.schedule.recompute_phrase`),
    precision, meta-device initialisation, compile and fused AdamW (``mfsdp train``) and
    mock data.

    >>> from mfsdp.tools.sbatch import resolve
    >>> v = resolve("llama3-70b", {"nodes": "4", "tp": "1", "cp": "2", "recompute": "full"})[1]
    >>> print(layout_phrase(v))  # doctest: +NORMALIZE_WHITESPACE
    on 4 nodes x 8 GPUs: context parallelism 2 (each rank holds 4,096 tokens of a sequence),
    ZeRO-3 (optim_grads_params) over 32 ranks (data-parallel size 16 x CP 2), full recompute,
    bf16 compute, fp32 main weights, meta-device initialisation, torch.compile, fused AdamW
    """
    from mfsdp.tools.sbatch.schedule import recompute_phrase

    per_node = v["gpus_per_node"] or v["ranks_per_node"]
    what = "GPUs" if v["gpus_per_node"] else "ranks"
    nodes = f"{v['nodes']} node{'s' if v['nodes'] != 1 else ''}"
    parts = []
    if v["tp"] > 1:
        parts.append(f"tensor parallelism {v['tp']}"
                     + (" with sequence parallelism" if v["sequence_parallel"] else "")
                     + " inside a node")
    if v["cp"] > 1:
        parts.append(f"context parallelism {v['cp']} (each rank holds "
                     f"{v['seq_length'] // v['cp']:,} tokens of a sequence)")
    if v["ep"] > 1:
        span = (f"over {v['ep'] // per_node} nodes" if v["ep"] > per_node else "inside a node")
        parts.append(f"expert parallelism {v['ep']} {span} "
                     f"({v['num_experts'] // v['ep']} experts per GPU)")
    world = v["nodes"] * v["ranks_per_node"]
    dp = world // (v["tp"] * v["cp"])
    shard = world // (v["outer"] * v["tp"])  # the dense parameters' shard group: dp x cp
    inner = dp // v["outer"]
    if v["cp"] > 1:
        over = f"over {shard} ranks (data-parallel size {inner} x CP {v['cp']})"
    else:
        over = f"over the {shard} data-parallel ranks"
    text = f"{_STRATEGIES[v['strategy']]} {over}"
    if v["outer"] > 1:
        text += (f", {v['outer']} outer replicas (HSDP, "
                 f"{_STRATEGIES[v['outer_strategy']]} across them)")
    parts.append(text)
    if v["num_experts"]:
        parts.append(f"the {v['dispatcher']} token dispatcher"
                     + (f" with {v['flex_backend']}" if v["dispatcher"] == "flex" else ""))
    parts.append(recompute_phrase(v))
    parts.append("bf16 compute, fp32 main weights" if v["bf16"] else "fp32 compute")
    if v["meta_init"]:
        parts.append("meta-device initialisation")
    if v["trainer"] == "mfsdp":  # Megatron-LM's trainer has no such flags (its Adam is fused)
        parts += [name for key, name in (("compile", "torch.compile"),
                                         ("fused_adam", "fused AdamW")) if v[key]]
    if v["mock_data"]:
        parts.append("mock data")
    return f"on {nodes} x {per_node} {what}: " + ", ".join(parts)


def describe(preset: Preset, values: dict | None = None) -> str:
    """The description of ``preset`` for the script ``values`` render (resolved; None: the
    preset's own values), its schedule stated from those values: a value changed with
    ``--set`` is written as rendered, with the preset's beside it. A ``{layout}`` in the
    description is :func:`layout_phrase` of the values: nodes, parallel sizes, sharding,
    recomputation (planned with the layer of the script's trainer) and precision. A
    ``model_args`` other than the preset's replaces the preset's text by :func:`model_phrase`.

    >>> text = describe(PRESETS["llama3-8b"], dict(PRESETS["llama3-8b"].values,
    ...                                            train_iters=200))
    >>> text.split("schedule: ")[1].split(" (rendered with --set")[0]
    '512 x 200 iterations, cosine from 3e-4 to 3e-5 after 2,000 warm-up iterations'
    """
    own = preset.values
    values = own if values is None else values
    layout = layout_phrase(values) if "{layout}" in preset.description else ""
    text = preset.description.format(**values, layout=layout)
    if values.get("model_args", "") != own.get("model_args", ""):  # not the preset's model
        text = f"{model_phrase(values)}; {layout or layout_phrase(values)}."
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


def model_phrase(v: dict) -> str:
    """The model of a train script whose ``model_args`` is not its preset's, as its first
    comment names it: from the rendered flags, as the planner reads them
    (:func:`mfsdp.tools.plan_model.model_phrase`), or the flags themselves where the planner
    does not model them.

    >>> from mfsdp.tools.sbatch import resolve
    >>> print(model_phrase(resolve("llama3-8b", {"model_args": "--num-layers 40"})[1]))
    Model of --set model_args, llama3-8b with 1 flag: 40 layers, hidden 4096, FFN 14336, 32 heads (8 KV), vocab 128,256 = 9.8B parameters
    """
    from mfsdp.tools.sbatch.schedule import planned

    try:
        name = planned(v)[2]
    except ValueError:
        name = f"model_args={v['model_args']!r}"
    return f"Model of --set model_args, {name}"


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
