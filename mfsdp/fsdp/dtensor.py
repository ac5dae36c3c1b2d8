"""The engine's DTensor helpers: DTensors whose shards are uneven pieces (any split, whole rows or
not), readable by DCP, and the collective that gathers such pieces.

``torch.distributed.checkpoint`` asks a DTensor where its local piece sits in the global tensor; a
DTensor assumes ``torch.chunk``'s split, which is not ours (see :mod:`mfsdp.fsdp.bucket`: shards follow
bucket boundaries). DTensor defers that question to its local tensor when the local tensor has
``__create_chunk_list__`` / ``__create_write_items__`` / ``__get_tensor_shard__``, so we attach
them: each uneven DTensor carries its own chunk metadata. A rank's piece is a contiguous range of
the flattened tensor, ``[start, start + numel)``: whole rows give one chunk (a row range); a piece
cut inside rows gives a few boxes (the partial first row, the whole rows, the partial last row,
recursively for more dimensions). A rank with an empty piece contributes no chunk.

>>> flat_boxes((4, 3), 2, 10)  # elements 2..9 of a 4 x 3 tensor
[((0, 2), (1, 1)), ((1, 0), (2, 3)), ((3, 0), (1, 1))]
"""

from __future__ import annotations

import math
import types

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["uneven_dtensor", "attach_uneven", "flat_boxes", "gather_pieces", "UnevenDTensor"]


def flat_boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[tuple, tuple]]:
    """``(offsets, sizes)`` boxes covering elements ``[start, end)`` of a row-major ``shape``, in
    order; each box is a contiguous range of the flattened tensor."""
    shape = tuple(shape)
    if end <= start:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))]
    inner = math.prod(shape[1:])
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(end, inner)
    if r0 == r1:  # inside one row
        return [((r0, *o), (1, *z)) for o, z in flat_boxes(shape[1:], c0, c1)]
    out = []
    if c0:
        out += [((r0, *o), (1, *z)) for o, z in flat_boxes(shape[1:], c0, inner)]
        r0 += 1
    if r1 > r0:
        out.append(((r0, *[0] * (len(shape) - 1)), (r1 - r0, *shape[1:])))
    if c1:
        out += [((r1, *o), (1, *z)) for o, z in flat_boxes(shape[1:], 0, c1)]
    return out


def uneven_dtensor(local: torch.Tensor, mesh, global_shape: tuple[int, ...],
                   start: int, group=None) -> DTensor:
    """Wrap ``local``: elements ``[start, start + local.numel())`` of the flattened global tensor
    (whole rows: ``local`` is shaped ``(rows, *global_shape[1:])``; otherwise flat).

    The result is a DTensor of the global shape, sharded on dim 0 over ``mesh``; writes and reads
    by DCP go straight to ``local``'s memory. With ``group`` (the ranks holding distinct pieces),
    ``full_tensor()`` gathers the uneven pieces correctly (see :func:`attach_uneven`).
    """
    global_shape = tuple(global_shape)
    stride = torch.empty(global_shape, device="meta").stride()
    dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(global_shape),
                            stride=stride)
    return attach_uneven(dt, global_shape, start, group)


def attach_uneven(dt: DTensor, global_shape: tuple[int, ...], start: int,
                  group=None) -> DTensor:
    """Give ``dt`` (whose local tensor holds elements from ``start`` on) its own chunk metadata.

    DCP then writes and reads exactly those elements. When ``group`` is given (it must be the
    group of ``dt``'s mesh), ``dt`` becomes an :class:`UnevenDTensor`, whose ``full_tensor()`` and
    ``redistribute(placements=[Replicate()])`` gather the pieces of every rank of ``group``
    (DTensor's own versions assume ``torch.chunk``'s split, which uneven pieces do not follow).
    Ops on ``dt`` that make new DTensors (``dt + 1``, ``dt.detach()``) lose this: call
    ``full_tensor()`` on the parameter or state-dict entry itself. Reductions are unaffected
    (``dt.pow(2).sum().full_tensor()`` is right).
    """
    global_shape = tuple(global_shape)
    inner = dt._local_tensor
    flat = inner.reshape(-1)
    boxes = flat_boxes(global_shape, start, start + inner.numel())
    chunks, views, at = [], {}, 0
    for offsets, sizes in boxes:
        n = math.prod(sizes)
        chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        chunks.append(chunk)
        views[tuple(offsets)] = flat[at:at + n].view(sizes)
        at += n
    whole = len(boxes) == 1 and tuple(boxes[0][1]) == tuple(inner.shape)

    def chunk_list(self):
        return list(chunks)

    def write_items(self, fqn, obj):
        props = TensorProperties.create_from_tensor(inner)
        return [WriteItem(index=MetadataIndex(fqn, c.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=c, properties=props,
                                                      size=torch.Size(global_shape)))
                for c in chunks]

    def tensor_shard(self, index):
        if whole:
            return inner
        return views[tuple(index.offset)]

    inner.__create_chunk_list__ = types.MethodType(chunk_list, inner)
    inner.__create_write_items__ = types.MethodType(write_items, inner)
    inner.__get_tensor_shard__ = types.MethodType(tensor_shard, inner)
    inner._mfsdp_start = start
    if group is not None:
        dt._mfsdp_start = start
        dt.__class__ = UnevenDTensor
    return dt


class UnevenDTensor(DTensor):
    """A DTensor whose local tensor is this rank's uneven piece (see :func:`attach_uneven`).

    Only ``full_tensor()`` and ``redistribute`` to ``Replicate`` differ from DTensor's: they gather
    the pieces where they are (DTensor's own assume ``torch.chunk``'s split). Every op on it returns
    a plain DTensor, as with any DTensor subclass.
    """

    def full_tensor(self, *, grad_placements=None) -> torch.Tensor:
        """The whole tensor on every rank of the mesh (a collective call)."""
        return gather_pieces(self._local_tensor.detach(), self.__dict__["_mfsdp_start"],
                             tuple(self.shape), self.device_mesh.get_group())

    def __reduce_ex__(self, protocol):
        # torch.save of a DTensor whose local tensor is a view at a non-zero offset fails in
        # DTensor's own path ("invalid python storage"); rebuild from the local piece instead.
        return (_rebuild_uneven, (self._local_tensor.detach(), self.device_mesh, tuple(self.shape),
                                  self.__dict__["_mfsdp_start"], self.requires_grad))

    def redistribute(self, device_mesh=None, placements=None, **kwargs):
        """As DTensor's; to ``[Replicate()]`` it gathers the uneven pieces first."""
        if placements is not None and all(isinstance(p, Replicate) for p in placements):
            return DTensor.from_local(self.full_tensor(), device_mesh or self.device_mesh,
                                      list(placements), run_check=False)
        return DTensor.redistribute(self, device_mesh, placements, **kwargs)


def _rebuild_uneven(local, mesh, global_shape, start, requires_grad):
    dt = uneven_dtensor(local, mesh, global_shape, start, mesh.get_group())
    return dt.requires_grad_(requires_grad) if requires_grad else dt


def gather_pieces(local: torch.Tensor, start: int, global_shape: tuple[int, ...],
                  group: dist.ProcessGroup | None) -> torch.Tensor:
    """The full tensor of ``global_shape`` from every rank's piece (a collective over ``group``).

    Each rank passes its elements ``[start, start + local.numel())`` of the flattened tensor;
    ranks may hold any number of elements (none included), in any order. Two all-gathers: the
    ranges, then the padded pieces.
    """
    global_shape = tuple(global_shape)
    n = dist.get_world_size(group)
    count = local.numel()
    meta = torch.tensor([start, count], dtype=torch.int64, device=local.device)
    metas = [torch.empty_like(meta) for _ in range(n)]
    dist.all_gather(metas, meta, group=group)
    most = max(int(m[1]) for m in metas)
    padded = torch.zeros(most, dtype=local.dtype, device=local.device)
    padded[:count].copy_(local.reshape(-1))
    parts = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(parts, padded, group=group)
    out = torch.zeros(math.prod(global_shape), dtype=local.dtype, device=local.device)
    for m, part in zip(metas, parts):
        lo, k = int(m[0]), int(m[1])
        out[lo:lo + k].copy_(part[:k])
    return out.reshape(global_shape)
