"""What a GPU script will cost, as ``mfsdp sbatch render`` says it on stderr: how long its
schedule takes, its memory per GPU, how often it saves, and how its gradients are reduced.

The schedule is ``train_iters`` optimizer steps of ``global_batch_size`` sequences of
``seq_length`` tokens; the time of a step is the planner's first-order estimate
(:func:`mfsdp.tools.plan.estimate`, ``mfsdp plan``) for the script's model and layout on its
``gpu`` (default an H100 SXM); the wall-clock is their product (queueing and restarts not counted). The memory is
the planner's peak per GPU for the same layout (:func:`mfsdp.tools.plan.plan`), its activations
those of the trainer's layer: mfsdp train's for trainer=mfsdp, Megatron-LM's Transformer Engine
layer for trainer=megatron-lm (:func:`transformer_impl`).

>>> from mfsdp.tools.sbatch import resolve
>>> s = schedule(resolve("llama3-8b")[1])
>>> f"{s.tokens / 1e12:.2f}T tokens, {s.step_s:.2f} s a step, {s.seconds / 86400:.0f} days"
'4.90T tokens, 34.30 s a step, 464 days'
>>> schedule(resolve("cpu-smoke")[1]) is None  # (a CPU job: the planner models GPUs)
True
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

__all__ = ["ACTIVATION_MODELS", "Schedule", "gpu_memory_gib", "over_memory", "schedule",
           "schedule_lines", "over_memory_fixes", "planned", "recompute_phrase", "transformer_impl", "BF16_REDUCE_MAX_RANKS"]

BF16_REDUCE_MAX_RANKS = 64
"""The largest reduction group for which the guide's numerics page accepts bf16 gradient
reduction (``--grad-reduce-in-bf16``); above it the render warns."""


@dataclass(frozen=True)
class Schedule:
    """A train script's schedule and the planner's time for it."""

    iterations: int
    tokens: int  # iterations x global batch x sequence length
    step_s: float  # the planner's predicted step
    gpus: int
    gpu: str  # the GPU the planner priced
    peak_bytes: float = 0.0  # the planner's memory per GPU at its peak
    shard_ranks: int = 1  # ranks of the group the gradients are reduce-scattered over
    transformer_impl: str = "local"  # the layer whose activations the plan counts

    @property
    def seconds(self) -> float:
        """The predicted wall-clock of the whole schedule."""
        return self.iterations * self.step_s


def transformer_impl(v: dict) -> str:
    """The layer the planner models for resolved train values ``v``: ``"local"`` (mfsdp
    train's measured layer) for trainer=mfsdp; for trainer=megatron-lm, Megatron-LM's
    ``--transformer-impl`` as ``model_args`` and ``extra_args`` pass it (the last one given),
    default ``"transformer_engine"``. ``--transformer-impl local`` (Megatron-LM's own local
    layer) is planned as ``"local"``, the nearest layer the planner has;
    ``inference_optimized`` as ``"transformer_engine"``.

    >>> transformer_impl({"trainer": "megatron-lm", "model_args": "--model-preset llama3-8b",
    ...                   "extra_args": "--transformer-impl local"})
    'local'
    """
    if v["trainer"] != "megatron-lm":
        return "local"
    impl = "transformer_engine"
    words = shlex.split(v["model_args"]) + shlex.split(v.get("extra_args", ""))
    for i, word in enumerate(words):
        if word == "--transformer-impl" and i + 1 < len(words):
            impl = words[i + 1]
        elif word.startswith("--transformer-impl="):
            impl = word.split("=", 1)[1]
    return "local" if impl == "local" else "transformer_engine"


ACTIVATION_MODELS = {"local": "mfsdp train's layers",
                     "transformer_engine": "Megatron-LM's Transformer Engine layers"}
"""What the render says the planner's activations model, by :func:`transformer_impl`."""


def _without_impl(words: list[str]) -> list[str]:
    """``words`` without Megatron-LM's ``--transformer-impl`` (mfsdp train has no such flag)."""
    out, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word == "--transformer-impl":
            skip = True
        elif not word.startswith("--transformer-impl="):
            out.append(word)
    return out


def planned(v: dict):
    """The planner's model, layout and model phrase (:func:`mfsdp.tools.plan_model.model_phrase`)
    of resolved train values ``v``: the model ``model_args`` builds (its preset and the flags
    layered on it, as ``mfsdp plan PRESET --model-args`` plans it). ``ValueError`` (one line)
    where the planner does not model it: no ``--model-preset``, GELU MLPs, linear biases. A
    Megatron-LM script is planned with the layer of :func:`transformer_impl` (Transformer
    Engine's unless it passes ``--transformer-impl local``), an mfsdp one with mfsdp train's."""
    from mfsdp.tools.plan import Layout, with_global_batch
    from mfsdp.tools.plan_model import planned_model
    from mfsdp.tools.sbatch.checks import _model_preset

    words = shlex.split(v["model_args"])
    if v["trainer"] == "megatron-lm":
        words = _without_impl(words)
    preset = _model_preset(v["model_args"])
    if preset is None:
        raise ValueError("model_args has no --model-preset NAME, the base its flags change")
    model, name = planned_model(preset, words, seq_length=v["seq_length"])
    from mfsdp.tools.sbatch.checks import recompute_layout

    granularity, method, layers = recompute_layout(v.get("recompute", "none"))
    world = v["nodes"] * v["ranks_per_node"]
    layout = Layout(world, v["strategy"], v["outer"], v["outer_strategy"], v["ep"],
                    micro_batch=v["micro_batch_size"], seq_length=v["seq_length"],
                    recompute_granularity=granularity, recompute_method=method,
                    recompute_num_layers=layers, tp=v["tp"], cp=v["cp"],
                    sequence_parallel=v["tp"] > 1 and v["sequence_parallel"],
                    grad_comm_bytes=2 if v["grad_reduce_in_bf16"] else None,
                    transformer_impl=transformer_impl(v))
    # the render has refused a batch the data-parallel ranks x micro-batch do not divide
    return model, with_global_batch(layout, v["global_batch_size"]), name


def _layout(v: dict):
    """:func:`planned`'s model and layout, or None where the planner does not model the
    script's model."""
    try:
        model, layout, _ = planned(v)
    except ValueError:
        return None
    return model, layout


def recompute_phrase(v: dict, gpu_gib: float | None = None) -> str:
    """How the script of resolved train values ``v`` recomputes activations, as its header says
    it: the layers, and for block recomputation its cost in the planner's step and whether one
    layer fewer would leave under ``TIGHT_GIB`` of ``gpu_gib`` spare in the plan (of the layer
    :func:`transformer_impl` names); for no recomputation, the plan's peak when it leaves that
    much.
    ``gpu_gib``: default, the memory of the script's ``gpu`` (80 GiB for an H100).

    >>> from mfsdp.tools.sbatch import resolve
    >>> print(recompute_phrase(resolve("llama3-8b")[1]))  # doctest: +NORMALIZE_WHITESPACE
    no activation recomputation (without it the plan of mfsdp train's layers peaks at
    47.2 GiB of 80)
    >>> recompute_phrase(resolve("llama3-8b", {"cp": "1", "recompute": "block:3"})[1])[:47]
    'full recomputation of the first 3 of 32 layers '
    """
    from dataclasses import replace

    from mfsdp.tools.plan import GiB, estimate, plan
    from mfsdp.tools.plan_cli import TIGHT_GIB

    if gpu_gib is None:
        gpu_gib = gpu_memory_gib(v)
    planned = _layout(v)
    if planned is None:
        named = {"none": "no activation recomputation", "full": "full recompute",
                 "selective": "selective activation recomputation"}
        if v["recompute"] in named:
            return named[v["recompute"]]
        return f"full recomputation of the first {v['recompute'].split(':')[1]} layers"
    model, layout = planned
    layers = ACTIVATION_MODELS[layout.transformer_impl]
    if layout.recompute_granularity is None:
        without = plan(model, layout)
        if without.fits(gpu_gib - TIGHT_GIB):
            return (f"no activation recomputation (without it the plan of {layers} peaks at "
                    f"{without.total / GiB:.1f} GiB of {gpu_gib:g})")
        return "no activation recomputation"
    if layout.recompute_granularity == "selective":
        return "selective activation recomputation"
    if layout.recompute_method != "block":
        return "full recompute"
    n = layout.recompute_num_layers
    none = replace(layout, recompute_granularity=None, recompute_method="uniform",
                   recompute_num_layers=1)
    cost = estimate(model, layout).step_s / estimate(model, none).step_s - 1
    fewer = (replace(layout, recompute_num_layers=n - 1) if n > 1 else none)
    text = f"full recomputation of the first {n} of {model.num_layers} layers ("
    if not plan(model, fewer).fits(gpu_gib - TIGHT_GIB):
        text += (f"with fewer the plan of {layers} leaves under {TIGHT_GIB:g} GiB of "
                 f"{gpu_gib:g} spare; ")
    return text + f"it costs about {cost:.0%} of the step)"


def gpu_memory_gib(v: dict) -> float:
    """The memory of the script's GPU (its ``gpu`` key; ``mfsdp plan --gpu``'s default
    ``--device-gib``): 80 GiB for an H100."""
    from mfsdp.tools.plan_time import GPUS

    return GPUS[v.get("gpu", "h100")].memory_gib


def schedule(v: dict, gpu: str | None = None) -> Schedule | None:
    """The schedule of resolved train values ``v`` (:func:`mfsdp.tools.sbatch.resolve`) and the
    planner's time for it on ``gpu`` (default: the script's ``gpu`` key); None for a CPU job or
    a model the planner does not model."""
    from mfsdp.tools.plan import estimate
    from mfsdp.tools.plan_time import GPUS

    if not v.get("gpus_per_node"):
        return None
    planned = _layout(v)
    if planned is None:
        return None
    from mfsdp.tools.plan import plan

    model, layout = planned
    gpu = gpu or v.get("gpu", "h100")
    step = estimate(model, layout, gpu).step_s
    return Schedule(v["train_iters"], v["train_iters"] * v["global_batch_size"] * v["seq_length"],
                    step, layout.world_size, GPUS[gpu].name, plan(model, layout).total,
                    layout.shard, layout.transformer_impl)


def _count(n: float) -> str:
    """``n`` tokens, in T, B or M."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if n >= scale:
            return f"{n / scale:,.2f}{unit}"
    return f"{n:,.0f}"


def _duration(seconds: float) -> str:
    """``seconds`` in days (from two days on), hours (from an hour on) or minutes."""
    if seconds >= 2 * 86400:
        return f"about {seconds / 86400:,.0f} days"
    if seconds >= 3600:
        return f"about {seconds / 3600:,.1f} hours"
    return "under a minute" if seconds < 60 else f"about {round(seconds / 60):,} min"


def _span(seconds: float) -> str:
    """``seconds`` in hours, or minutes under an hour."""
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return "under a minute" if seconds < 60 else f"{round(seconds / 60)} min"


def _every(seconds: float) -> str:
    """How often a save comes, ``seconds`` apart: 'about 57 min', 'less than a minute apart'.

    >>> _every(3420), _every(2.3)
    ('about 57 min', 'less than a minute apart')
    """
    return "less than a minute apart" if seconds < 60 else f"about {_span(seconds)}"


def schedule_lines(v: dict) -> list[str]:
    """What ``mfsdp sbatch render`` says of the schedule of resolved train values ``v``: its
    tokens, the planner's step time and the wall-clock, and the key that shortens it (no line
    for a CPU job; for a model the planner does not model, one line saying why)."""
    from mfsdp.tools.sbatch.checks import time_limit_seconds

    s = schedule(v)
    if s is None:
        if not v.get("gpus_per_node"):
            return []
        try:
            planned(v)
        except ValueError as exc:  # say so: no memory check stands behind this script
            return [f"mfsdp sbatch: not planned, so no schedule or memory check: {exc}"]
        return []
    from mfsdp.tools.plan_cli import TIGHT_GIB

    device = gpu_memory_gib(v)
    gib, usable = s.peak_bytes / 2**30, device - 4
    lines = [f"mfsdp sbatch: schedule: {s.iterations:,} iterations x "
             f"{v['global_batch_size']:,} sequences x {v['seq_length']:,} tokens = "
             f"{_count(s.tokens)} tokens; at the planner's {s.step_s:.2f} s a step "
             f"({s.gpus} x {s.gpu}), {_duration(s.seconds)} of chained jobs"]
    if s.seconds > 86400:
        lines.append("mfsdp sbatch: for a trial, shorten it with --set train_iters=N --set "
                     "lr_warmup_iters=M (M < N)")
    lines += [
             f"mfsdp sbatch: memory: the planner's peak is {gib:.1f} GiB per GPU with "
             f"{ACTIVATION_MODELS[s.transformer_impl]}; "
             + (f"fits {device:g} GiB GPUs (at most {usable:g} GiB)" if gib <= usable else
                f"WARNING: over the {usable:g} GiB that a {device:g} GiB GPU leaves (mfsdp plan "
                f"shows the terms)")
             + (f"; tight: within {TIGHT_GIB:g} GiB of that limit, as mfsdp plan says"
                if usable - TIGHT_GIB < gib <= usable else "")]
    if v.get("save") and v.get("save_interval"):
        every = v["save_interval"] * s.step_s
        limit = time_limit_seconds(v["time"])
        line = (f"mfsdp sbatch: saves every {v['save_interval']:,} iterations, "
                f"{_every(every)} at that step, in {_span(limit)} jobs")
        if every > limit:
            line += ("; WARNING: no save inside a job, so a crash without SIGTERM loses the "
                     "whole job (lower save_interval)")
        lines.append(line)
    if v.get("grad_reduce_in_bf16") and s.shard_ranks > BF16_REDUCE_MAX_RANKS:
        lines.append(f"mfsdp sbatch: WARNING: gradients are reduced in bf16 over "
                     f"{s.shard_ranks} ranks; above {BF16_REDUCE_MAX_RANKS} the guide "
                     f"recommends fp32 (--set grad_reduce_in_bf16=false; numerics page)")
    return lines


def over_memory_fixes(v: dict) -> list[str]:
    """The keys that would lower the planned peak of the train script of resolved values ``v``,
    as the over-memory refusal lists them: only settings not applied already. First, when the
    gradients are reduced in bf16, ``grad_reduce_in_bf16=false`` with what its cast copies cost
    (the planner counts a bf16 copy of each gradient buffer in flight beside the fp32 one);
    then TP or CP, full recomputation (unless every layer recomputes already) and more nodes.

    >>> from mfsdp.tools.sbatch import resolve
    >>> v = resolve("llama3-70b", {"nodes": "4", "tp": "1", "cp": "2", "recompute": "full",
    ...                            "global_batch_size": "512", "allow_over_memory": "true"})[1]
    >>> over_memory_fixes(v)  # doctest: +NORMALIZE_WHITESPACE
    ['set grad_reduce_in_bf16=false (its bf16 copies of the gradient buffers in flight add
      7.1 GiB: 69.1 GiB without)', 'raise tp or cp', 'add nodes']
    """
    from dataclasses import replace

    from mfsdp.tools.plan import GiB, plan

    fixes = []
    planned_ = _layout(v)
    if planned_ is not None and planned_[1].grad_comm_bytes is not None:
        model, layout = planned_
        with_bf16 = plan(model, layout).total
        without = plan(model, replace(layout, grad_comm_bytes=None)).total
        fixes.append(f"set grad_reduce_in_bf16=false (its bf16 copies of the gradient buffers in "
                     f"flight add {(with_bf16 - without) / GiB:.1f} GiB: "
                     f"{without / GiB:.1f} GiB without)")
    fixes.append("raise tp or cp")
    if v.get("recompute", "none") != "full":
        fixes.append("set recompute=full")
    return fixes + ["add nodes"]


def over_memory(v: dict) -> str | None:
    """Why the train script of resolved values ``v`` does not fit its GPU, in one line naming
    the keys that would make it fit (:func:`over_memory_fixes`), or None when it fits (or the
    planner does not model it: a CPU job, a model without ``--model-preset``)."""
    s = schedule(v)
    if s is None:
        return None
    device = gpu_memory_gib(v)
    gib = s.peak_bytes / 2**30
    if gib <= device - 4:
        return None
    fixes = over_memory_fixes(v)
    return (f"the planner's peak is {gib:.1f} GiB per GPU with "
            f"{ACTIVATION_MODELS[s.transformer_impl]}, over the {device - 4:g} GiB that "
            f"gpu={v.get('gpu', 'h100')} ({device:g} GiB) leaves: "
            + ", ".join(fixes[:-1]) + f", or {fixes[-1]} (mfsdp plan shows the terms); "
            "--set gpu=... names a larger GPU, --set allow_over_memory=true renders it anyway")
