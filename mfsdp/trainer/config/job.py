"""The job's flag groups: ``job`` (timeout, error form), ``checkpoints`` (saving, loading,
stopping, the schedule and format of a checkpoint), ``logging`` (log lines, JSON log,
TensorBoard, W&B, throughput) and ``profiling`` (Megatron-LM's profiler flags)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from mfsdp.argtypes import positive_float, positive_int, timeout_minutes
from mfsdp.trainer.config.flags import flag, from_namespace


@dataclass(kw_only=True, frozen=True)
class JobConfig:
    """The job's timeout and error form."""

    distributed_timeout_minutes: float = flag(default=10.0, type=timeout_minutes)
    """how long a collective waits for the other ranks before the job stops, as in Megatron-LM;
    shortly before, the rank that waits names the ranks that are behind and where they are"""
    debug: bool = flag(default=False)
    """errors with their full traceback (by default a user error is one line)"""

    def __post_init__(self) -> None:
        if self.distributed_timeout_minutes <= 0:  # (the parser's type refuses it first)
            raise ValueError("--distributed-timeout-minutes must be positive")


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    """Saving, loading, stopping, and the checkpoint's schedule and format."""

    save: str | None = flag()
    """checkpoint directory to write"""
    load: str | None = flag()
    """checkpoint directory to resume from (latest); a new or empty directory starts from iteration
    0, anything else that is not a checkpoint is refused"""
    exit_on_missing_checkpoint: bool = flag(default=False)
    """--load of a new or empty directory stops instead of starting from iteration 0 (Megatron-LM's
    flag)"""
    exit_signal_handler: bool = flag(default=False)
    """on SIGTERM (Slurm's --signal before the time limit): save and exit 0"""
    exit_duration_in_mins: float | None = flag(type=positive_float)
    """save and exit once the run has lasted this many minutes"""
    exit_interval: int | None = flag(type=positive_int)
    """stop (after saving, with --save) when the iteration is a multiple of N"""
    save_interval: int | None = flag(type=positive_int)
    """save every N iterations (and at the end)"""
    override_opt_param_scheduler: bool = flag("--override-opt_param-scheduler",
                                              "--override-opt-param-scheduler", default=False)
    """--load: use this command's learning-rate schedule, not the checkpoint's"""
    use_checkpoint_opt_param_scheduler: bool = flag("--use-checkpoint-opt_param-scheduler",
                                                    "--use-checkpoint-opt-param-scheduler",
                                                    default=False)
    """--load: continue the checkpoint's learning-rate schedule (--lr, --min-lr, warm-up, decay
    iterations and style)"""
    ckpt_verify: bool = flag("--no-ckpt-verify", default=True, action="store_false")
    """--load: skip checking every file of an mfsdp checkpoint against the SHA-256 sums its manifest
    records (the check reads the checkpoint once more)"""
    ckpt_format: str = flag(default="fsdp_dtensor",
                            choices=("fsdp_dtensor", "torch_dist", "mfsdp_full"))
    """format of --save: mfsdp's sharded fsdp_dtensor, Megatron-LM's torch_dist (a root with
    latest_checkpointed_iteration.txt that Megatron-LM loads), or mfsdp's full-tensor mfsdp_full;
    --load reads each"""
    dump_param_to_param_group_map: str | None = flag(metavar="DIR")
    """write the parameter -> optimizer group map (as upstream: a torch.distributed.checkpoint
    directory, with the JSON that mfsdp convert --param-to-param-group-map-json reads inside; a
    path ending in .json: that file alone) and go on training"""

    def __post_init__(self) -> None:
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ValueError("--override-opt_param-scheduler and "
                             "--use-checkpoint-opt_param-scheduler contradict each other: pass one")
        if not self.save and self.save_interval:
            raise ValueError("--save-interval needs --save DIR")


@dataclass(kw_only=True, frozen=True)
class LoggingConfig:
    """What rank 0 reports, and where (``--log-*``, ``--tensorboard-dir``, ``--wandb-*``):
    :class:`~mfsdp.trainer.metrics.MetricSinks` and the Trainer's reporting take it."""

    log_interval: int = flag(default=100, type=positive_int)
    """print every N iterations and the last"""
    log_jsonl: str | None = flag(metavar="PATH")
    """one JSON object per iteration (rank 0)"""
    tensorboard_dir: str | None = flag(metavar="DIR")
    """TensorBoard event files (needs the tensorboard package)"""
    log_throughput: bool = flag(default=False)
    """add TFLOP/s per rank (model FLOPs estimate) and peak memory to the log"""
    wandb_project: str | None = flag(metavar="NAME")
    """log the same scalars as TensorBoard to this Weights & Biases project (rank 0; needs
    --wandb-exp-name and the wandb package; WANDB_MODE=offline keeps the run local)"""
    wandb_exp_name: str | None = flag(metavar="NAME")
    """the run's name in W&B"""
    wandb_save_dir: str | None = flag(metavar="DIR")
    """W&B's local files (default: --save/wandb)"""
    wandb_entity: str | None = flag(metavar="NAME")
    """the W&B team or user (default: the API key's)"""
    wandb_dir: str = ""
    """The directory for W&B's local files (``--wandb-save-dir``, else ``--save``/wandb), needed
    with :attr:`wandb_project`; set by :meth:`from_args` and by ``TrainConfig`` (which sees
    ``--save``) when left empty."""

    run_config: dict = field(default_factory=dict)
    """Every argument of the run, recorded as the W&B run's config (as Megatron-LM does): a copy
    of the parsed flags (:meth:`from_args`); a config built in code records its own fields."""

    def __post_init__(self) -> None:
        if self.log_interval < 1:
            raise ValueError(f"LoggingConfig: log_interval={self.log_interval!r} must be at least "
                             "1 (print every N iterations); pass 1 to print every iteration")
        if not self.wandb_project:
            for name in ("wandb_exp_name", "wandb_save_dir", "wandb_entity"):
                if getattr(self, name):
                    raise ValueError(f"--{name.replace('_', '-')} has no effect without "
                                     "--wandb-project: add --wandb-project NAME to log to W&B")
            return
        if not self.wandb_exp_name:
            raise ValueError("--wandb-project needs --wandb-exp-name NAME (the run's name in "
                             "W&B), as in Megatron-LM")
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ValueError("--wandb-project needs the wandb package (pip install "
                             "wandb)") from None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LoggingConfig:
        """The logging flags of checked ``mfsdp train`` arguments (W&B's directory defaults to
        ``--save``/wandb, as Megatron-LM's)."""
        wandb_dir = args.wandb_save_dir or (os.path.join(args.save, "wandb")
                                            if args.wandb_project and args.save else "")
        return from_namespace(cls, args, wandb_dir=wandb_dir, run_config=dict(vars(args)))


@dataclass(kw_only=True, frozen=True)
class ProfilingConfig:
    """Profiler traces and CUDA memory history (checked with the device and
    ``--tensorboard-dir`` by the rules of ``mfsdp.trainer.config.rules``)."""

    profile: bool = flag(default=False)
    """profile iterations --profile-step-start to --profile-step-end (an nsys capture range on GPUs;
    a torch.profiler trace with --use-pytorch-profiler)"""
    use_pytorch_profiler: bool = flag(default=False)
    """--profile writes a torch.profiler trace into --tensorboard-dir/profile"""
    profile_step_start: int = flag(default=10, type=int)
    """first profiled iteration"""
    profile_step_end: int = flag(default=12, type=int)
    """profiling stops before this iteration"""
    profile_ranks: list[int] = flag(default_factory=lambda: [0], type=int, nargs='+')
    """the ranks that profile (default: 0)"""
    pytorch_profiler_collect_shapes: bool = flag(default=False)
    """record operator input shapes in the trace"""
    pytorch_profiler_collect_callstack: bool = flag(default=False)
    """record Python call stacks in the trace"""
    record_memory_history: bool = flag(default=False)
    """record the CUDA caching allocator's history and dump it to --memory-snapshot-path after each
    logged iteration (GPU only)"""
    memory_snapshot_path: str = flag(default="snapshot.pickle")
    """where --record-memory-history writes"""

    def __post_init__(self) -> None:
        if self.profile and self.profile_step_end <= self.profile_step_start:
            raise ValueError(f"--profile-step-end {self.profile_step_end} must exceed "
                             f"--profile-step-start {self.profile_step_start}")
        if self.use_pytorch_profiler and not self.profile:
            raise ValueError("--use-pytorch-profiler chooses how --profile profiles: add "
                             "--profile")
