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
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["uneven_dtensor", "attach_uneven", "row_chunk", "UnevenDTensor"]


def row_chunk(global_shape: tuple[int, ...], row_start: int, rows: int) -> ChunkStorageMetadata:
    """The chunk of ``rows`` rows starting at ``row_start`` of a tensor of ``global_shape``."""
    offsets = torch.Size([row_start] + [0] * (len(global_shape) - 1))
    sizes = torch.Size([rows, *global_shape[1:]])
    return ChunkStorageMetadata(offsets=offsets, sizes=sizes)


def uneven_dtensor(local: torch.Tensor, mesh, global_shape: tuple[int, ...],
                   row_start: int, group=None) -> DTensor:
    """Wrap ``local`` (rows ``[row_start, row_start + len(local))`` of the global tensor).

    The result is a DTensor of the global shape, sharded on dim 0 over ``mesh``; writes and reads
    by DCP go straight to ``local``'s memory. With ``group`` (the ranks holding distinct rows),
    ``full_tensor()`` gathers the uneven rows correctly (see :func:`attach_uneven`).
    """
    global_shape = tuple(global_shape)
    stride = torch.empty(global_shape, device="meta").stride()
    dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(global_shape),
                            stride=stride)
    return attach_uneven(dt, global_shape, row_start, group)


def attach_uneven(dt: DTensor, global_shape: tuple[int, ...], row_start: int,
                  group=None) -> DTensor:
    """Give ``dt`` (whose local tensor holds rows from ``row_start``) its own chunk metadata.

    DCP then writes and reads exactly those rows. When ``group`` is given (it must be the group of
    ``dt``'s mesh), ``dt`` becomes an :class:`UnevenDTensor`, whose ``full_tensor()`` and
    ``redistribute(placements=[Replicate()])`` gather the rows of every rank of ``group``
    (DTensor's own versions assume ``torch.chunk``'s split, which uneven rows do not follow).
    Ops on ``dt`` that make new DTensors (``dt + 1``, ``dt.detach()``) lose this: call
    ``full_tensor()`` on the parameter or state-dict entry itself. Reductions are unaffected
    (``dt.pow(2).sum().full_tensor()`` is right).
    """
    global_shape = tuple(global_shape)
    inner = dt._local_tensor
    local = inner
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
    inner._mfsdp_row_start = row_start
    if group is not None:
        dt._mfsdp_row_start = row_start
        dt.__class__ = UnevenDTensor
    return dt


class UnevenDTensor(DTensor):
    """A DTensor whose dim-0 shards are this rank's uneven rows (see :func:`attach_uneven`).

    Only ``full_tensor()`` and ``redistribute`` to ``Replicate`` differ from DTensor's: they gather
    the rows where they are (DTensor's own assume ``torch.chunk``'s split). Every op on it returns a
    plain DTensor, as with any DTensor subclass.
    """

    def full_tensor(self, *, grad_placements=None) -> torch.Tensor:
        """The whole tensor on every rank of the mesh (a collective call)."""
        from mfsdp.params import gather_rows

        return gather_rows(self._local_tensor.detach(), self.__dict__["_mfsdp_row_start"],
                           tuple(self.shape), self.device_mesh.get_group())

    def __reduce_ex__(self, protocol):
        # torch.save of a DTensor whose local tensor is a view at a non-zero offset fails in
        # DTensor's own path ("invalid python storage"); rebuild from the local rows instead.
        return (_rebuild_uneven, (self._local_tensor.detach(), self.device_mesh, tuple(self.shape),
                                  self.__dict__["_mfsdp_row_start"], self.requires_grad))

    def redistribute(self, device_mesh=None, placements=None, **kwargs):
        """As DTensor's; to ``[Replicate()]`` it gathers the uneven rows first."""
        if placements is not None and all(isinstance(p, Replicate) for p in placements):
            return DTensor.from_local(self.full_tensor(), device_mesh or self.device_mesh,
                                      list(placements), run_check=False)
        return DTensor.redistribute(self, device_mesh, placements, **kwargs)


def _rebuild_uneven(local, mesh, global_shape, row_start, requires_grad):
    dt = uneven_dtensor(local, mesh, global_shape, row_start, mesh.get_group())
    return dt.requires_grad_(requires_grad) if requires_grad else dt
