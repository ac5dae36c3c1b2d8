"""Typed configuration of ``mfsdp train``, in torchtitan's shape: one ``kw_only`` dataclass per
flag group, a help text per field, the checks of a group's own values in its
``__post_init__`` (one line naming the flag and the fix). The parser is generated from these
classes (:func:`mfsdp.trainer.arguments.build_parser`, Megatron-LM's flag names), and
:meth:`TrainConfig.from_args` turns the parsed arguments into the :class:`TrainConfig` that the
:class:`~mfsdp.trainer.trainer.Trainer` and its components are given: the argparse
``Namespace`` stops there.

>>> from mfsdp.trainer.config import TrainConfig, TrainingConfig
>>> config = TrainConfig(training=TrainingConfig(train_iters=3, lr=1e-3))
>>> config.training.train_iters, config.parallel.data_parallel_sharding_strategy
(3, 'optim_grads_params')
>>> TrainingConfig(lr_decay_style="WSD")
Traceback (most recent call last):
ValueError: --lr-decay-style WSD needs --lr-wsd-decay-iters (the annealing tail)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from mfsdp.trainer.config.flags import add_flags, flag, flag_fields, from_namespace
from mfsdp.trainer.config.job import (CheckpointConfig, JobConfig, LoggingConfig, ProfilingConfig,
                                     check_wandb_args)
from mfsdp.trainer.config.model import ModelConfig, MoEConfig
from mfsdp.trainer.config.parallel import DTYPES, STRATEGIES, ParallelConfig, PrecisionConfig
from mfsdp.trainer.config.training import DataConfig, TrainingConfig

__all__ = ["CheckpointConfig", "DTYPES", "DataConfig", "GROUPS", "JobConfig", "LoggingConfig",
           "ModelConfig", "MoEConfig", "ParallelConfig", "PrecisionConfig", "ProfilingConfig",
           "STRATEGIES", "TrainConfig", "TrainingConfig", "add_flags", "flag", "flag_fields",
           "from_namespace"]


@dataclass(kw_only=True)
class TrainConfig:
    """Everything a training run is configured with, one typed group per flag group."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model's sizes, norms, positions, attention and recomputation; a field left at None
    takes the preset's value."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Experts, router, capacity, dispatcher."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The engine (mfsdp or DDP), ZeRO level, HSDP, EP, TP, SP, CP, overlap."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """bf16 compute and the dtypes of main weights, main gradients and their reduction."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Batch sizes, iterations, the learning-rate schedule, the optimizer."""
    data: DataConfig = field(default_factory=DataConfig)
    """Mock data or datasets, split, cache, tokenizer, evaluation."""
    job: JobConfig = field(default_factory=JobConfig)
    """The collectives' timeout and the error form."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving, loading, stopping, and the checkpoint's schedule and format."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Log lines, JSON log, TensorBoard, W&B, throughput."""
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    """Profiler traces and CUDA memory history."""

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, logging: bool = True) -> TrainConfig:
        """The typed groups of parsed ``mfsdp train`` arguments; a group's check that fails is
        a ``SystemExit`` with its one line (the command line's error form).

        ``--train-samples`` sets ``--train-iters`` here (samples / global batch), as in
        Megatron-LM. The W&B flags are checked first, for their flag-named messages;
        ``logging=False`` leaves them and the logging group (its defaults) out."""
        if logging:
            check_wandb_args(args)
        train_iters = (max(1, args.train_samples // args.global_batch_size)
                       if args.train_samples else args.train_iters)
        try:
            groups = {name: from_namespace(kind, args) for name, kind in _PLAIN.items()
                      if kind is not TrainingConfig}
            groups["training"] = from_namespace(TrainingConfig, args, train_iters=train_iters)
            return cls(**groups, **({"logging": LoggingConfig.from_args(args)} if logging else {}))
        except ValueError as exc:
            raise SystemExit(str(exc)) from None


# the groups TrainConfig.from_args reads field by field (logging has its own from_args)
_PLAIN = {"model": ModelConfig, "moe": MoEConfig, "parallel": ParallelConfig,
          "precision": PrecisionConfig, "training": TrainingConfig, "data": DataConfig,
          "job": JobConfig, "checkpoint": CheckpointConfig, "profiling": ProfilingConfig}

# the parser's groups, in --help order: a title and the config classes whose flags it lists
# (Megatron-LM lists the data flags with the training flags)
GROUPS: tuple[tuple[str, tuple[type, ...]], ...] = (
    ("model", (ModelConfig,)),
    ("mixture of experts", (MoEConfig,)),
    ("parallelism and sharding", (ParallelConfig,)),
    ("precision", (PrecisionConfig,)),
    ("training", (TrainingConfig, DataConfig)),
    ("job", (JobConfig,)),
    ("checkpoints", (CheckpointConfig,)),
    ("logging", (LoggingConfig,)),
    ("profiling (Megatron-LM's flags)", (ProfilingConfig,)),
)
