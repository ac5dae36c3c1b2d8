"""Profiling and memory snapshots of ``mfsdp train``, with Megatron-LM's flags.

- ``--profile --use-pytorch-profiler``: a ``torch.profiler`` trace of iterations
  ``--profile-step-start`` to ``--profile-step-end`` (exclusive, as Megatron-LM counts) on the
  ranks ``--profile-ranks``, written into ``--tensorboard-dir`` (TensorBoard's profile plugin
  and Perfetto read it). mfsdp's collectives appear under their labels (``mfsdp::all_gather``,
  ``mfsdp::reduce_scatter``, ...). Works on CPU and GPU.
- ``--profile`` alone: an ``nsys`` capture range (``cudaProfilerStart``/``Stop``) over the same
  iterations, for ``nsys profile --capture-range=cudaProfilerApi``; CUDA only.
- ``--record-memory-history``: the CUDA caching allocator's history, dumped to
  ``--memory-snapshot-path`` after every logged iteration (open it at
  https://pytorch.org/memory_viz); CUDA only (the CPU has no caching allocator to record).

What cannot work here (a CPU run, no ``--tensorboard-dir``) is refused at start by the rules of
:mod:`mfsdp.trainer.config.rules`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from mfsdp.trainer.config import ProfilingConfig

__all__ = ["Profiler"]


class Profiler:
    """Starts and stops the profiler of ``--profile`` around the chosen iterations, and dumps
    ``--record-memory-history`` snapshots; every method is a no-op when the flags are off."""

    def __init__(self, profiling: ProfilingConfig, tensorboard_dir: str | None,
                 device: torch.device) -> None:
        # the profiling group (ProfilingConfig) and --tensorboard-dir, which the trace goes into
        self.profiling = profiling
        self.tensorboard_dir = tensorboard_dir
        self.device = device
        self.on = bool(profiling.profile) and dist.get_rank() in profiling.profile_ranks
        self.torch_profiler = None
        self.trace_dir = None
        if profiling.record_memory_history:
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    def before(self, iteration: int) -> None:
        """Call before iteration ``iteration``: starts the capture at ``--profile-step-start``."""
        if not self.on or iteration != self.profiling.profile_step_start:
            return
        if self.profiling.use_pytorch_profiler:
            from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self.trace_dir = os.path.join(self.tensorboard_dir, "profile")
            self.torch_profiler = profile(
                activities=activities, record_shapes=self.profiling.pytorch_profiler_collect_shapes,
                with_stack=self.profiling.pytorch_profiler_collect_callstack,
                on_trace_ready=tensorboard_trace_handler(self.trace_dir,
                                                         worker_name=f"rank{dist.get_rank()}"))
            self.torch_profiler.start()
        else:
            torch.cuda.cudart().cudaProfilerStart()

    def after(self, iteration: int, logged: bool) -> None:
        """Call after iteration ``iteration``: stops the capture before ``--profile-step-end``;
        after a logged iteration, dumps the memory snapshot."""
        if self.on and iteration == self.profiling.profile_step_end - 1:
            self.stop()
        if logged and self.profiling.record_memory_history:
            torch.cuda.memory._dump_snapshot(self.profiling.memory_snapshot_path)

    def stop(self) -> None:
        """End a capture still running (the run stopped inside the window)."""
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
            self.torch_profiler = None
        elif self.on and not self.profiling.use_pytorch_profiler and torch.cuda.is_available():
            torch.cuda.cudart().cudaProfilerStop()
        self.on = False
