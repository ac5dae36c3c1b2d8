"""mfsdp: Megatron-FSDP-style sharded data parallelism on ``torch.distributed``.

The public surface is listed in ``__all__``; everything else is importable but not advertised.
Upstream's per-module API ("v2": ``fully_shard(module, mesh, placements)`` in place) is
``mfsdp.experimental``, a second front door to the same engine.
"""

from __future__ import annotations

# Code written for upstream Megatron-FSDP calls torch.distributed.checkpoint.save(...) after
# importing only torch and megatron_fsdp (whose import loads it); importing mfsdp does the same.
import torch.distributed.checkpoint  # noqa: F401

from mfsdp.fsdp.api import fully_shard, fully_shard_model, fully_shard_optimizer
from mfsdp.config import MixedPrecisionPolicy, ShardingStrategy
from mfsdp.fsdp.module import FullyShardedModule
from mfsdp.layout import ParallelLayout, ProcessGroups
from mfsdp.fsdp.optimizer import ShardedOptimizer
from mfsdp import check  # the parity doctor: mfsdp.check.check(model, ...)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "fully_shard",
    "fully_shard_model",
    "fully_shard_optimizer",
    "MixedPrecisionPolicy",
    "ShardingStrategy",
    "FullyShardedModule",
    "ShardedOptimizer",
    "ParallelLayout",
    "ProcessGroups",
    "check",
]
