"""The trainer's components that own state a checkpoint keeps, each with ``state_dict`` and
``load_state_dict`` (torchtitan's ``Stateful``): the learning-rate schedule
(:class:`LRScheduler`, Megatron-LM's ``OptimizerParamScheduler``), the Trainer's own progress
(:class:`TrainState`) and the MoE routers' balancing bias (:class:`RouterState`). The
:class:`~mfsdp.trainer.checkpointing.Checkpointer` saves and loads them by name; the names are
the keys that checkpoints have always held (``opt_param_scheduler``, ``expert_bias``), so
checkpoints written before these components existed still load.

>>> import torch
>>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
>>> sched = LRScheduler(opt, max_lr=1e-3, min_lr=0.0, warmup_steps=2, decay_steps=6,
...                     decay_style="linear")
>>> rates = []
>>> for _ in range(7):
...     rates.append(round(sched.apply(), 6))
...     sched.step()
>>> rates, sched.state_dict()["num_steps"]
([0.0, 0.0005, 0.001, 0.00075, 0.0005, 0.00025, 0.0], 7)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["LRScheduler", "RouterState", "SCHEDULER_FIELDS", "TrainState"]

# Megatron-LM's OptimizerParamScheduler state keys, the attribute of LRScheduler, the flag, and
# the names its messages use; steps are iterations here (Megatron-LM counts samples: a
# conversion divides them by the job's global batch size: mfsdp.checkpoint.megatron_schedule).
SCHEDULER_FIELDS = (("max_lr", "max_lr", "--lr", "learning rate"),
                    ("min_lr", "min_lr", "--min-lr", "minimum learning rate"),
                    ("lr_warmup_steps", "warmup_steps", "--lr-warmup-iters", "warmup iterations"),
                    ("lr_decay_steps", "decay_steps", "--lr-decay-iters (default --train-iters)",
                     "total number of iterations"),
                    ("lr_decay_style", "decay_style", "--lr-decay-style",
                     "learning rate decay style"))


class LRScheduler:
    """The learning rate of every step, as Megatron-LM's ``OptimizerParamScheduler`` gives it,
    with the steps taken so far as its state: linear warm-up from ``warmup_init`` over
    ``warmup_steps``, then ``decay_style`` down to ``min_lr`` at ``decay_steps``, ``min_lr``
    after it. :meth:`apply` sets the rate of the next step on the optimizer, :meth:`step` counts
    a step taken.

    ``override`` and ``use_checkpoint`` are Megatron-LM's rule for a schedule loaded from a
    checkpoint (``--override-opt_param-scheduler``, ``--use-checkpoint-opt_param-scheduler``):
    see :meth:`load_state_dict`."""

    def __init__(self, optimizer: torch.optim.Optimizer | None, *, max_lr: float, min_lr: float,
                 warmup_steps: int, decay_steps: int, decay_style: str,
                 warmup_init: float = 0.0, wsd_decay_steps: int | None = None,
                 wsd_decay_style: str = "exponential", override: bool = False,
                 use_checkpoint: bool = False) -> None:
        # the optimizer whose parameter groups apply() sets (None: rates are only computed)
        self.optimizer = optimizer
        # the schedule (Megatron-LM's names); a checkpoint's replace them under use_checkpoint
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_steps, self.decay_steps, self.decay_style = (warmup_steps, decay_steps,
                                                                 decay_style)
        self.warmup_init = warmup_init
        self.wsd_decay_steps, self.wsd_decay_style = wsd_decay_steps, wsd_decay_style
        # which schedule wins when a checkpoint's differs (load_state_dict)
        self.override, self.use_checkpoint = override, use_checkpoint
        # optimizer steps taken: the state a checkpoint keeps, counted by step()
        self.num_steps = 0

    @classmethod
    def from_config(cls, training: Any, checkpoint: Any = None,
                    optimizer: torch.optim.Optimizer | None = None) -> LRScheduler:
        """The schedule of the ``training`` group (a
        :class:`~mfsdp.trainer.config.training.TrainingConfig`, or anything with its fields), with the
        ``checkpoint`` group's rule for a loaded schedule."""
        return cls(optimizer, max_lr=training.lr, min_lr=training.min_lr,
                   warmup_steps=training.lr_warmup_iters,
                   decay_steps=training.lr_decay_iters or training.train_iters,
                   decay_style=training.lr_decay_style, warmup_init=training.lr_warmup_init,
                   wsd_decay_steps=training.lr_wsd_decay_iters,
                   wsd_decay_style=training.lr_wsd_decay_style,
                   override=bool(checkpoint and checkpoint.override_opt_param_scheduler),
                   use_checkpoint=bool(checkpoint
                                       and checkpoint.use_checkpoint_opt_param_scheduler))

    def lr_at(self, steps: int) -> float:
        """The learning rate after ``steps`` optimizer steps (that of step ``steps + 1``)."""
        warmup, decay = self.warmup_steps, self.decay_steps
        max_lr, min_lr = self.max_lr, self.min_lr
        if warmup > 0 and steps <= warmup:
            return self.warmup_init + (max_lr - self.warmup_init) * steps / warmup
        if self.decay_style == "constant":
            return max_lr
        if steps > decay:
            return min_lr
        if self.decay_style == "inverse-square-root":
            return max(min_lr, max_lr * max(warmup, 1) ** 0.5 / max(steps, 1) ** 0.5)
        ratio = (steps - warmup) / (decay - warmup)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD: constant, then the last wsd_decay_steps anneal
            start = decay - self.wsd_decay_steps
            if steps <= start:
                coeff = 1.0
            else:
                r = (steps - start) / self.wsd_decay_steps
                coeff = {"linear": 1.0 - r, "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
                         "exponential": 2.0 * 0.5 ** r - 1.0,
                         "minus_sqrt": 1.0 - math.sqrt(r)}[self.wsd_decay_style]
        return min_lr + coeff * (max_lr - min_lr)

    def get_lr(self) -> float:
        """The learning rate of the next step."""
        return self.lr_at(self.num_steps)

    def apply(self) -> float:
        """Set the next step's learning rate on every parameter group; return it."""
        lr = self.get_lr()
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        return lr

    def step(self) -> None:
        """Count one optimizer step."""
        self.num_steps += 1

    def state_dict(self) -> dict[str, Any]:
        """Megatron-LM's ``opt_param_scheduler`` fields and the steps taken."""
        state = {key: getattr(self, attr) for key, attr, _, _ in SCHEDULER_FIELDS}
        state["num_steps"] = self.num_steps
        return state

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Continue a checkpoint's schedule by Megatron-LM's rule: its steps are taken over, and
        its values must equal this schedule's, unless ``override`` (this schedule wins) or
        ``use_checkpoint`` (the checkpoint's wins); a difference otherwise is a ``SystemExit``
        naming the value and the flags. An empty ``saved`` (no schedule saved) changes nothing."""
        if not saved:
            return
        self.num_steps = int(saved.get("num_steps", self.num_steps))
        if self.override:
            return
        if self.use_checkpoint:
            for key, attr, _, _ in SCHEDULER_FIELDS:
                setattr(self, attr, saved[key])
            return
        mine = self.state_dict()
        for key, _, flag, name in SCHEDULER_FIELDS:
            if mine[key] != saved[key]:
                raise SystemExit(
                    f"--load: the {name} ({flag}) is {mine[key]} here and {saved[key]} in the "
                    "checkpoint; pass the checkpoint's value, --use-checkpoint-opt_param-scheduler "
                    "to continue its schedule, or --override-opt_param-scheduler to use this "
                    "command's")


@dataclass(kw_only=True)
class TrainState:
    """The Trainer's own progress: the last iteration trained and the samples consumed. (Each
    rank's RNG state is saved and restored under a key of its own by
    :func:`mfsdp.checkpoint.save_checkpoint` and its loader.)"""

    iteration: int = 0
    """The last iteration trained (0: none)."""
    consumed_samples: int = 0
    """Sequences trained on so far, over all ranks."""

    def advance(self, samples: int) -> None:
        """One iteration of ``samples`` sequences done."""
        self.iteration += 1
        self.consumed_samples += samples

    def state_dict(self) -> dict[str, Any]:
        """The iteration and the consumed samples."""
        return {"iteration": self.iteration, "consumed_samples": self.consumed_samples}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Take over ``saved``'s values (empty: a checkpoint from before this state was kept;
        the Checkpointer then hands the checkpoint's iteration alone)."""
        self.iteration = int(saved.get("iteration", self.iteration))
        self.consumed_samples = int(saved.get("consumed_samples", self.consumed_samples))


class RouterState:
    """The balancing bias of every MoE router of the model (auxiliary-loss-free balancing),
    by the router's module name."""

    def __init__(self, routers: list[tuple[str, torch.nn.Module]]) -> None:
        # (name, router) of the routers whose expert_bias a checkpoint keeps
        self.routers = routers

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Each router's bias, on the CPU."""
        return {n: m.expert_bias.detach().cpu().clone() for n, m in self.routers}

    def load_state_dict(self, saved: dict[str, torch.Tensor]) -> None:
        """Copy the saved bias into each router that has one saved."""
        with torch.no_grad():
            for name, m in self.routers:
                if name in saved:
                    m.expert_bias.copy_(saved[name])
