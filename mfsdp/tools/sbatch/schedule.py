"""How long a GPU preset's schedule takes: ``mfsdp sbatch render`` says it on stderr.

The schedule is ``train_iters`` optimizer steps of ``global_batch_size`` sequences of
``seq_length`` tokens; the time of a step is the planner's first-order estimate
(:func:`mfsdp.tools.plan.estimate`, ``mfsdp plan``) for the script's model and layout on an
H100 SXM; the wall-clock is their product (queueing and restarts not counted).

>>> from mfsdp.tools.sbatch import resolve
>>> s = schedule(resolve("llama3-8b")[1])
>>> f"{s.tokens / 1e12:.2f}T tokens, {s.step_s:.2f} s a step, {s.seconds / 86400:.0f} days"
'4.90T tokens, 34.11 s a step, 461 days'
>>> schedule(resolve("cpu-smoke")[1]) is None  # (a CPU job: the planner models GPUs)
True
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

__all__ = ["Schedule", "schedule", "schedule_lines"]


@dataclass(frozen=True)
class Schedule:
    """A train script's schedule and the planner's time for it."""

    iterations: int
    tokens: int  # iterations x global batch x sequence length
    step_s: float  # the planner's predicted step
    gpus: int
    gpu: str  # the GPU the planner priced

    @property
    def seconds(self) -> float:
        """The predicted wall-clock of the whole schedule."""
        return self.iterations * self.step_s


def _layout(v: dict):
    """The planner's model and layout of resolved train values ``v``, or None where the planner
    does not model the script's model (no ``--model-preset``, GELU MLPs or linear biases)."""
    from mfsdp.tools.plan import Layout, ModelConfig
    from mfsdp.trainer.arguments import build_parser
    from mfsdp.trainer.build import model_config

    try:  # the model as the trainer builds it from model_args (a preset and its overrides)
        words = shlex.split(v["model_args"])
        if "--model-preset" not in words and not any(w.startswith("--model-preset=")
                                                     for w in words):
            return None
        cfg = model_config(build_parser().parse_args(words + ["--seq-length",
                                                              str(v["seq_length"])]))
        model = ModelConfig.from_gpt(cfg)
    except (SystemExit, ValueError):
        return None
    world = v["nodes"] * v["ranks_per_node"]
    dp = world // (v["tp"] * v["cp"])
    layout = Layout(world, v["strategy"], v["outer"], v["outer_strategy"], v["ep"],
                    micro_batch=v["micro_batch_size"], seq_length=v["seq_length"],
                    micro_batches=v["global_batch_size"] // (v["micro_batch_size"] * dp),
                    recompute_granularity=cfg.recompute_granularity,
                    recompute_method=cfg.recompute_method or "uniform",
                    recompute_num_layers=cfg.recompute_num_layers or 1, tp=v["tp"], cp=v["cp"],
                    sequence_parallel=v["tp"] > 1 and v["sequence_parallel"],
                    grad_comm_bytes=2 if v["grad_reduce_in_bf16"] else None)
    return model, layout


def schedule(v: dict, gpu: str = "h100") -> Schedule | None:
    """The schedule of resolved train values ``v`` (:func:`mfsdp.tools.sbatch.resolve`) and the
    planner's time for it on ``gpu``; None for a CPU job or a model the planner does not
    model."""
    from mfsdp.tools.plan import estimate
    from mfsdp.tools.plan_time import GPUS

    if not v.get("gpus_per_node"):
        return None
    planned = _layout(v)
    if planned is None:
        return None
    model, layout = planned
    step = estimate(model, layout, gpu).step_s
    return Schedule(v["train_iters"], v["train_iters"] * v["global_batch_size"] * v["seq_length"],
                    step, layout.world_size, GPUS[gpu].name)


def _count(n: float) -> str:
    """``n`` tokens, in T, B or M."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if n >= scale:
            return f"{n / scale:,.2f}{unit}"
    return f"{n:,.0f}"


def _duration(seconds: float) -> str:
    """``seconds`` in days (from two days on) or hours."""
    if seconds >= 2 * 86400:
        return f"about {seconds / 86400:,.0f} days"
    return f"about {seconds / 3600:,.1f} hours"


def schedule_lines(v: dict) -> list[str]:
    """What ``mfsdp sbatch render`` says of the schedule of resolved train values ``v``: its
    tokens, the planner's step time and the wall-clock, and the key that shortens it (no line
    for a CPU job or a model the planner does not model)."""
    s = schedule(v)
    if s is None:
        return []
    return [f"mfsdp sbatch: schedule: {s.iterations:,} iterations x {v['global_batch_size']:,} "
            f"sequences x {v['seq_length']:,} tokens = {_count(s.tokens)} tokens; at the "
            f"planner's {s.step_s:.2f} s a step ({s.gpus} x {s.gpu}), "
            f"{_duration(s.seconds)} of chained jobs",
            "mfsdp sbatch: for a trial, shorten it with --set train_iters=N (and "
            "lr_warmup_iters)"]
