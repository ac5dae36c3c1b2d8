"""Typed configuration of the trainer's components, built from the checked flags in one place.

The argparse ``Namespace`` is read here (:meth:`LoggingConfig.from_args`) and the component gets a
``kw_only`` dataclass with a docstring per field, as torchtitan's ``JobConfig`` sections do:
:class:`~mfsdp.trainer.metrics.MetricSinks` and the :class:`~mfsdp.trainer.trainer.Trainer`'s
reporting take a :class:`LoggingConfig`."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field


@dataclass(kw_only=True, frozen=True)
class LoggingConfig:
    """What rank 0 reports, and where (``--log-*``, ``--tensorboard-dir``, ``--wandb-*``)."""

    log_interval: int = 100
    """Print one line every this many iterations, and after the last (``--log-interval``)."""

    log_jsonl: str | None = None
    """File of one JSON record per iteration and validation, written by rank 0 (``--log-jsonl``);
    appended to when a run resumes. None: no file."""

    log_throughput: bool = False
    """Add TFLOP/s per rank (a model FLOPs estimate) and peak CUDA memory to the records and the
    printed line (``--log-throughput``)."""

    tensorboard_dir: str | None = None
    """Directory of TensorBoard event files (``--tensorboard-dir``). None: no TensorBoard."""

    wandb_project: str = ""
    """Weights & Biases project to log the same scalars to (``--wandb-project``). Empty: no W&B."""

    wandb_exp_name: str = ""
    """The W&B run's name (``--wandb-exp-name``); needed with :attr:`wandb_project`."""

    wandb_entity: str = ""
    """The W&B team or user (``--wandb-entity``). Empty: the API key's."""

    wandb_dir: str = ""
    """The directory for W&B's local files (``--wandb-save-dir``, else ``--save``/wandb),
    needed with :attr:`wandb_project`."""

    run_config: dict = field(default_factory=dict)
    """Every argument of the run, recorded as the W&B run's config (as Megatron-LM does)."""

    def __post_init__(self) -> None:
        if self.log_interval < 1:
            raise ValueError(f"LoggingConfig: log_interval={self.log_interval!r} must be at least "
                             "1 (print every N iterations); pass 1 to print every iteration")
        if self.wandb_project and not (self.wandb_exp_name and self.wandb_dir):
            raise ValueError(f"LoggingConfig: wandb_project={self.wandb_project!r} needs "
                             f"wandb_exp_name and wandb_dir, got {self.wandb_exp_name!r} and "
                             f"{self.wandb_dir!r}; set both (--wandb-exp-name, --wandb-save-dir)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LoggingConfig:
        """The logging flags of checked ``mfsdp train`` arguments (``check_args`` has run)."""
        wandb_dir = args.wandb_save_dir or (os.path.join(args.save, "wandb")
                                            if args.wandb_project and args.save else "")
        return cls(log_interval=args.log_interval, log_jsonl=args.log_jsonl or None,
                   log_throughput=args.log_throughput,
                   tensorboard_dir=args.tensorboard_dir or None,
                   wandb_project=args.wandb_project or "",
                   wandb_exp_name=args.wandb_exp_name or "",
                   wandb_entity=args.wandb_entity or "", wandb_dir=wandb_dir,
                   run_config=vars(args))
