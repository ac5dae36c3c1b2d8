"""The sharding engine, in the shape of PyTorch FSDP2's ``_fully_shard`` package.

``api`` (``fully_shard`` / ``fully_shard_model`` / ``fully_shard_optimizer``: validate, resolve,
build), ``module`` (:class:`FullyShardedModule`, the model-level API and what its units share),
``unit`` (:class:`FSDPUnit`: one unit's buckets, gathers and hooks), ``reducer``
(:class:`GradReducer`: one backward's reductions), ``param`` (:class:`ShardedParam`: one
parameter's shards and its DTensor), ``bucket`` (flat padded buffers and shard views),
``collectives`` (all-gather / reduce-scatter / all-reduce on buckets), ``optimizer`` (the sharded
optimizer on fp32 main shards), ``construct`` (building units from a module), ``dtensor``
(DTensors of uneven shards). The engine imports nothing from ``checkpoint``, ``models``,
``data``, the trainer, the tools or the harnesses.
"""

from mfsdp.fsdp.api import fully_shard, fully_shard_model, fully_shard_optimizer
from mfsdp.fsdp.module import FullyShardedModule
from mfsdp.fsdp.optimizer import ShardedOptimizer

__all__ = ["fully_shard", "fully_shard_model", "fully_shard_optimizer", "FullyShardedModule",
           "ShardedOptimizer"]
