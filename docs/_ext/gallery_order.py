"""The recipes gallery in the order a reader learns (sphinx-gallery's ``within_subsection_order``).

A recipe not named here comes after the named ones, in file-name order; a test fails when a
recipe file is missing from the list, so a new recipe gets its place on purpose.
"""

from __future__ import annotations

import os

LEARNING_PATH = [
    "plot_hello_ranks.py",             # processes and a process group
    "plot_training_script.py",         # a complete script: accumulate, clip, save, resume
    "plot_memory_per_strategy.py",     # what each sharding strategy keeps
    "plot_step_memory_timeline.py",    # what one step holds, event by event
    "plot_comm_timeline.py",           # what it sends, and when
    "plot_profile_trace.py",           # the same, in a profiler trace of mfsdp train
    "plot_checkpoint_fsdp_to_hsdp.py", # save on one layout, resume on another
    "plot_hsdp_bytes_per_group.py",    # hybrid sharding across nodes
    "plot_tensor_parallel.py",         # composing with tensor parallelism
    "plot_tp_sp_cp.py",                # sequence and context parallelism in the trainer
    "plot_moe_dispatchers.py",         # experts and token dispatchers
    "plot_thd_packing.py",             # packed variable-length sequences
    "plot_bf16_reduction.py",          # numerics of bf16 gradient reduction
    "plot_megatron_data.py",           # Megatron-LM's indexed data
    "plot_hf_finetune.py",             # Hugging Face in, Hugging Face out
    "plot_check_transformers.py",      # check a model on every layout before a cluster run
    "plot_upstream_bug.py",            # check the engine you train with: upstream #5974
    "plot_benchmark.py",               # mfsdp against FSDP2 and DDP
    "plot_dry_run_scaling.py",         # the engine at 4,096 ranks on one CPU
    "plot_per_module_api.py",          # upstream's per-module ("v2") fully_shard
]


class LearningPath:
    """Sort key: a recipe's place in :data:`LEARNING_PATH` (unknown ones last, by name)."""

    def __init__(self, src_dir: str):
        self.src_dir = src_dir

    def __call__(self, filename: str) -> tuple[int, str]:
        """The sort key of ``filename``."""
        name = os.path.basename(filename)
        place = LEARNING_PATH.index(name) if name in LEARNING_PATH else len(LEARNING_PATH)
        return place, name

    def __repr__(self) -> str:  # sphinx-gallery records the key in its configuration digest
        return "LearningPath"
