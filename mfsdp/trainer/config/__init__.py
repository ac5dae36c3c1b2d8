"""Typed configuration of ``mfsdp train``, in torchtitan's shape: one ``kw_only`` dataclass per
flag group, a help text per field, the checks of a group's own values in its
``__post_init__`` (one line naming the flag and the fix). The parser is generated from these
classes (:func:`mfsdp.trainer.arguments.build_parser`, Megatron-LM's flag names), and
:meth:`TrainConfig.from_args` turns the parsed arguments into the :class:`TrainConfig` that the
:class:`~mfsdp.trainer.trainer.Trainer` and its components are given: the argparse
``Namespace`` stops there.

The rules across groups live in ``mfsdp.trainer.config.rules``: ``TrainConfig.__post_init__``
checks those that need nothing else, :meth:`~mfsdp.trainer.config.TrainConfig.validate` those that need the world
size and the model. A config built in code meets the same rules as the command line, with the
same message (a ``ValueError``). The groups are frozen: a run never changes its configuration.

>>> from mfsdp.trainer.config import TrainConfig, TrainingConfig
>>> config = TrainConfig(training=TrainingConfig(train_iters=3, lr=1e-3))
>>> config.training.train_iters, config.parallel.data_parallel_sharding_strategy
(3, 'optim_grads_params')
>>> TrainingConfig(lr_decay_style="WSD")
Traceback (most recent call last):
ValueError: --lr-decay-style WSD needs --lr-wsd-decay-iters (the annealing tail)
>>> TrainConfig(parallel=ParallelConfig(fsdp_double_buffer=True))
Traceback (most recent call last):
ValueError: --fsdp-double-buffer needs --use-megatron-fsdp (the DDP path replicates the model \
with PyTorch DDP and gathers no weights into a buffer)
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mfsdp.trainer.config import rules
from mfsdp.trainer.config.flags import add_flags, flag, flag_fields, from_namespace
from mfsdp.trainer.config.job import CheckpointConfig, JobConfig, LoggingConfig, ProfilingConfig
from mfsdp.trainer.config.model import ModelConfig, MoEConfig
from mfsdp.trainer.config.parallel import DTYPES, STRATEGIES, ParallelConfig, PrecisionConfig
from mfsdp.trainer.config.training import DataConfig, TrainingConfig

__all__ = ["CheckpointConfig", "DTYPES", "DataConfig", "GROUPS", "JobConfig", "LoggingConfig",
           "ModelConfig", "MoEConfig", "ParallelConfig", "PrecisionConfig", "ProfilingConfig",
           "STRATEGIES", "TrainConfig", "TrainingConfig", "add_flags", "flag", "flag_fields",
           "from_namespace", "rules"]


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    """Everything a training run is configured with, one typed group per flag group; the rules
    across groups (``mfsdp.trainer.config.rules.RULES``) are checked when it is built,
    those that need the world size and the model by
    :meth:`~mfsdp.trainer.config.TrainConfig.validate`."""

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

    def __post_init__(self) -> None:
        # --train-samples sets the iterations (samples / global batch), as in Megatron-LM
        t, samples = self.training, self.data.train_samples
        if samples and t.train_iters != max(1, samples // t.global_batch_size):
            object.__setattr__(self, "training", dataclasses.replace(
                t, train_iters=max(1, samples // t.global_batch_size)))
        # W&B's local files default to --save/wandb (Megatron-LM's), which the group cannot see
        log = self.logging
        if log.wandb_project and not log.wandb_dir and (log.wandb_save_dir or self.checkpoint.save):
            import os

            object.__setattr__(self, "logging", dataclasses.replace(
                log, wandb_dir=log.wandb_save_dir or os.path.join(self.checkpoint.save, "wandb")))
        rules.check(self)

    def validate(self, world_size: int, *, model: Any, device: str | None = "cpu") -> None:
        """Check the rules that need the world size, the model's configuration ``model`` (a
        :class:`~mfsdp.models.config.GPTConfig`, as
        ``mfsdp.trainer.build.model_config`` gives it), the file system and the device
        (``"cpu"`` or ``"cuda"``; None leaves its rules out):
        ``mfsdp.trainer.config.rules.LAYOUT_RULES``; a
        ``ValueError`` with the first broken rule's line."""
        rules.check(self, world_size, model, device)

    def micro_batches(self, world_size: int) -> int:
        """Micro-batches per rank and iteration (gradient accumulation) on ``world_size`` ranks."""
        p, t = self.parallel, self.training
        dp = world_size // (p.tensor_model_parallel_size * p.context_parallel_size)
        return t.global_batch_size // (t.micro_batch_size * dp)

    @classmethod
    def from_fields(cls, **values: Any) -> TrainConfig:
        """A config whose fields named in ``values`` (by their flag names, whatever their group)
        take those values: ``TrainConfig.from_fields(use_megatron_fsdp=True, lr=1e-3)``."""
        owner = {f.name: group for group, kind in _GROUP_TYPES.items()
                 for f in dataclasses.fields(kind)}
        unknown = sorted(set(values) - set(owner))
        if unknown:
            raise TypeError(f"TrainConfig.from_fields: no field {', '.join(unknown)}; the "
                            "fields are the flag names with underscores (mfsdp train --help)")
        groups: dict[str, dict[str, Any]] = {}
        for name, value in values.items():
            groups.setdefault(owner[name], {})[name] = value
        return cls(**{g: _GROUP_TYPES[g](**kw) for g, kw in groups.items()})

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, logging: bool = True) -> TrainConfig:
        """The typed groups of parsed ``mfsdp train`` arguments; a rule that fails is a
        ``SystemExit`` with its one line (the command line's error form).

        ``--train-samples`` sets ``--train-iters`` here (samples / global batch), as in
        Megatron-LM. ``logging=False`` leaves the logging group (its defaults) out."""
        train_iters = (max(1, args.train_samples // args.global_batch_size)
                       if args.train_samples else args.train_iters)
        try:
            groups = {name: from_namespace(kind, args) for name, kind in _PLAIN.items()
                      if kind is not TrainingConfig}
            groups["training"] = from_namespace(TrainingConfig, args, train_iters=train_iters)
            return cls(**groups, **({"logging": LoggingConfig.from_args(args)} if logging else {}))
        except ValueError as exc:
            raise SystemExit(str(exc)) from None


# the class of each group of TrainConfig
_GROUP_TYPES = {"model": ModelConfig, "moe": MoEConfig, "parallel": ParallelConfig,
                "precision": PrecisionConfig, "training": TrainingConfig, "data": DataConfig,
                "job": JobConfig, "checkpoint": CheckpointConfig, "logging": LoggingConfig,
                "profiling": ProfilingConfig}

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
