"""DTensors whose dim-0 shards are uneven (whole rows, any split), readable by DCP.

``torch.distributed.checkpoint`` asks a DTensor where its local piece sits in the global tensor; a
DTensor assumes ``torch.chunk``'s split, which is not ours (see :mod:`mfsdp.buffers`: shards follow
bucket boundaries). DTensor defers that question to its local tensor when the local tensor has
``__create_chunk_list__`` / ``__create_write_items__`` / ``__get_tensor_shard__``, so we attach
them: each uneven DTensor carries its own chunk metadata (offset and size on dim 0). A rank with an
empty piece contributes no chunk.
"""

from __future__ import annotations

import types

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.metadata import TensorProperties
from torch.distributed.tensor import DTensor, Shard

__all__ = ["uneven_dtensor", "row_chunk"]


def row_chunk(global_shape: tuple[int, ...], row_start: int, rows: int) -> ChunkStorageMetadata:
    """The chunk of ``rows`` rows starting at ``row_start`` of a tensor of ``global_shape``."""
    offsets = torch.Size([row_start] + [0] * (len(global_shape) - 1))
    sizes = torch.Size([rows, *global_shape[1:]])
    return ChunkStorageMetadata(offsets=offsets, sizes=sizes)


def uneven_dtensor(local: torch.Tensor, mesh, global_shape: tuple[int, ...],
                   row_start: int) -> DTensor:
    """Wrap ``local`` (rows ``[row_start, row_start + len(local))`` of the global tensor).

    The result is a DTensor of the global shape, sharded on dim 0 over ``mesh``; writes and reads
    by DCP go straight to ``local``'s memory.
    """
    global_shape = tuple(global_shape)
    stride = torch.empty(global_shape, device="meta").stride()
    dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(global_shape),
                            stride=stride)
    inner = dt._local_tensor
    rows = local.shape[0] if local.dim() else 1
    chunk = row_chunk(global_shape, row_start, rows)

    def chunk_list(self):
        return [chunk] if rows else []

    def write_items(self, fqn, obj):
        if not rows:
            return []
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=chunk, properties=TensorProperties.create_from_tensor(local),
                              size=torch.Size(global_shape)))]

    def tensor_shard(self, index):
        return inner

    inner.__create_chunk_list__ = types.MethodType(chunk_list, inner)
    inner.__create_write_items__ = types.MethodType(write_items, inner)
    inner.__get_tensor_shard__ = types.MethodType(tensor_shard, inner)
    return dt
