"""Logging sinks of the trainer: TensorBoard event files and Weights & Biases.

Both receive the same scalars under Megatron-LM's names (``lm loss``, ``learning-rate``,
``grad-norm``, ``lm loss validation``, ...) with the iteration as the step, from rank 0, where the
trainer's metrics are already reduced over every rank. (Megatron-LM writes from the last rank; its
values there are the same reduced ones.)
"""

from __future__ import annotations

import os
from typing import Any

from mfsdp.trainer.config import LoggingConfig

# what the trainer's per-iteration record calls each scalar -> the name Megatron-LM logs it under
TRAINING_SCALARS = (("lm loss", "loss"), ("learning-rate", "lr"), ("grad-norm", "grad_norm"),
                    ("throughput/tokens-per-s", "tokens_per_s"),
                    ("throughput/tflops-per-rank", "tflops_per_rank"))


def tensorboard_writer(directory: str | None):
    """A TensorBoard ``SummaryWriter`` for ``--tensorboard-dir`` (None without it)."""
    if not directory:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise SystemExit("--tensorboard-dir needs the tensorboard package "
                         "(pip install tensorboard)") from None
    return SummaryWriter(log_dir=directory)


def wandb_run(config: LoggingConfig):
    """The W&B run of ``--wandb-project`` (None without it), made as Megatron-LM makes it: name
    ``--wandb-exp-name``, entity ``--wandb-entity``, local files in ``--wandb-save-dir`` (else
    ``--save``/wandb), every argument as the run's config. ``WANDB_MODE=offline`` keeps it local."""
    if not config.wandb_project:
        return None
    import wandb

    os.makedirs(config.wandb_dir, exist_ok=True)
    return wandb.init(dir=config.wandb_dir, name=config.wandb_exp_name,
                      project=config.wandb_project, entity=config.wandb_entity or None,
                      config=config.run_config)


class MetricSinks:
    """The run's TensorBoard writer and W&B run (either may be absent), written together."""

    def __init__(self, board: Any, run: Any) -> None:
        self.board = board  # torch SummaryWriter, or None
        self.run = run  # wandb Run, or None

    @classmethod
    def open(cls, config: LoggingConfig, rank: int) -> MetricSinks:
        """The sinks ``config`` asks for on rank 0; none on the other ranks."""
        if rank != 0:
            return cls(None, None)
        return cls(tensorboard_writer(config.tensorboard_dir), wandb_run(config))

    def write(self, scalars: dict[str, float], iteration: int) -> None:
        """Log ``scalars`` (Megatron-LM's names) at step ``iteration``."""
        if self.board is not None:
            for tag, value in scalars.items():
                self.board.add_scalar(tag, value, iteration)
        if self.run is not None and scalars:
            self.run.log(dict(scalars), step=iteration)

    def training(self, record: dict, iteration: int) -> None:
        """Log one iteration's record (the trainer's JSON record) under Megatron-LM's names."""
        self.write({tag: record[key] for tag, key in TRAINING_SCALARS if key in record}, iteration)

    def close(self) -> None:
        """Flush and close both (W&B's ``finish``)."""
        if self.board is not None:
            self.board.close()
        if self.run is not None:
            self.run.finish()
