"""Upstream Megatron-FSDP's per-module API ("v2", ``megatron_fsdp.experimental``) on mfsdp's engine.

The same names and calls as upstream's, in FSDP2's style: ``fully_shard(module, mesh, placements)``
applied in place to each module (children first, the root last) inside one
``fully_shard_context()``, a plain ``torch.optim`` optimizer over ``model.parameters()``
adapted by ``fully_shard_optimizer(optimizer)``, and ``microbatch(context, is_last)`` around
each micro-batch of gradient accumulation. It runs on gloo/CPU as well as NCCL/GPU.

This is a second front door to the engine of :func:`mfsdp.fully_shard_model`, not a second
engine: when the context closes, each root becomes one :class:`mfsdp.FullyShardedModule` whose
FSDP units are the modules given to ``fully_shard`` (see ``docs/per-module-api.md``).
"""

from __future__ import annotations

from mfsdp.experimental.checkpoint import load_checkpoint, save_checkpoint
from mfsdp.experimental.fully_shard import (Placements, fully_shard, fully_shard_context,
                                            microbatch)
from mfsdp.experimental.module import FsdpContext, FsdpModule
from mfsdp.experimental.optimizer import fully_shard_optimizer

__all__ = [
    "FsdpContext",
    "FsdpModule",
    "Placements",
    "fully_shard",
    "fully_shard_context",
    "fully_shard_optimizer",
    "load_checkpoint",
    "microbatch",
    "save_checkpoint",
]
