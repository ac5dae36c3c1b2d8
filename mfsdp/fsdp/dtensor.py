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

Under tensor parallelism (:class:`TPSpec`) a parameter's data-parallel pieces are cut from its
*TP-local* tensor (this rank's column or row block of the global weight, as FSDP2 does with
DTensor TP): the boxes are computed in the TP-local tensor and moved by the block's offset in the
global tensor, and the DTensor is 2-D, over ``(dp, tp)``, with placements ``(Shard(0), <TP's>)``.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["uneven_dtensor", "attach_uneven", "piece_origin", "flat_boxes", "gather_pieces",
           "UnevenDTensor", "TPSpec", "ViewDTensor", "view_dtensor"]


@dataclass(frozen=True)
class TPSpec:
    """Where a parameter's tensor-parallel block sits: the TP mesh, the placements over it, the
    global shape, this rank's block shape and where its rows come from.

    A parameter that is a ``DTensor`` over the TP mesh (``parallelize_module``, a Hugging Face TP
    plan, ``mfsdp.models.tensor_parallel``) has the placements it came with; a plain parameter
    of a model in a TP mesh is replicated over it (``dtensor_param=False``: modules keep computing
    with a plain tensor). The block is made of ``segments`` along dimension ``dim``:
    ``(global start, local start, length)``; one for ``Shard(dim)``, ``split_factor`` of them for
    ``_StridedShard`` (SwiGLU's stacked gate and up, split per rank as Megatron-LM does)."""

    mesh: object  # a 1-D DeviceMesh over the tensor-parallel ranks
    placements: tuple
    global_shape: tuple
    local_shape: tuple
    dim: int | None  # the dimension TP splits (None: replicated)
    segments: tuple  # ((global start, local start, length), ...) along `dim`
    dtensor_param: bool

    @classmethod
    def of(cls, param: torch.Tensor, mesh=None) -> "TPSpec":
        """The spec of ``param``: a DTensor over the TP mesh, or a plain tensor replicated over
        ``mesh``."""
        if not isinstance(param, DTensor):
            shape = tuple(param.shape)
            return cls(mesh, (Replicate(),), shape, shape, None, (), False)
        mesh = param.device_mesh
        placements = tuple(param.placements)
        local_shape = tuple(param._local_tensor.shape)
        (pl,) = placements  # a 1-D mesh
        if isinstance(pl, Replicate):
            return cls(mesh, placements, tuple(param.shape), local_shape, None, (), True)
        dim = pl.dim % param.dim()
        length = local_shape[dim]
        factor = getattr(pl, "split_factor", 1)  # _StridedShard
        if factor > 1:
            if dim != 0:  # a piece's boxes must stay contiguous runs of the local tensor
                raise ValueError(f"{pl}: only a strided split of dim 0 is supported")
            n, r = mesh.size(), mesh.get_local_rank()
            block = param.shape[dim] // factor
            chunk = length // factor
            if block * factor != param.shape[dim] or chunk * n != block:
                raise ValueError(f"a {pl} parameter of shape {tuple(param.shape)} over {n} TP "
                                 "ranks must split evenly")
            segments = tuple((k * block + r * chunk, k * chunk, chunk) for k in range(factor))
        else:
            _, offset = compute_local_shape_and_global_offset(param.shape, mesh, placements)
            segments = ((offset[dim], 0, length),)
        return cls(mesh, placements, tuple(param.shape), local_shape, dim, segments, True)

    @property
    def sharded(self) -> bool:
        """Whether TP ranks hold different blocks (else every TP rank holds the whole tensor)."""
        return self.dim is not None

    @property
    def stride(self) -> tuple:
        return tuple(torch.empty(self.global_shape, device="meta").stride())

    def block_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's TP block of a full (global-shape) tensor."""
        if not self.sharded:
            return full
        parts = [full.narrow(self.dim, g, n) for g, _, n in self.segments]
        return parts[0] if len(parts) == 1 else torch.cat(parts, self.dim)

    def full_of(self, block: torch.Tensor) -> torch.Tensor:
        """The global tensor from every TP rank's block (a collective over the TP group)."""
        if not self.sharded:
            return block
        return self.as_dtensor(block.contiguous()).full_tensor()

    def as_dtensor(self, block: torch.Tensor) -> DTensor:
        """``block`` as a DTensor over the TP mesh, with this parameter's placements."""
        return DTensor.from_local(block, self.mesh, list(self.placements), run_check=False,
                                  shape=torch.Size(self.global_shape), stride=self.stride)

    def boxes(self, start: int, end: int) -> list[tuple[tuple, tuple]]:
        """:func:`~mfsdp.fsdp.dtensor.flat_boxes` of elements ``[start, end)`` of the block, in global coordinates."""
        local = flat_boxes(self.local_shape, start, end)
        if not self.sharded:
            return local
        d, out = self.dim, []
        for offsets, sizes in local:
            lo, hi = offsets[d], offsets[d] + sizes[d]
            for g, l, n in self.segments:
                a, b = max(lo, l), min(hi, l + n)
                if a < b:
                    o, z = list(offsets), list(sizes)
                    o[d], z[d] = g + a - l, b - a
                    out.append((tuple(o), tuple(z)))
        return out


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
                   start: int, group=None, tp: TPSpec | None = None) -> DTensor:
    """Wrap ``local``: elements ``[start, start + local.numel())`` of the flattened global tensor
    (whole rows: ``local`` is shaped ``(rows, *global_shape[1:])``; otherwise flat).

    The result is a DTensor of the global shape, sharded on dim 0 over ``mesh``; writes and reads
    by DCP go straight to ``local``'s memory. With ``group`` (the ranks holding distinct pieces),
    ``full_tensor()`` gathers the uneven pieces correctly (see :func:`~mfsdp.fsdp.dtensor.attach_uneven`).
    With ``tp``, the elements are those of this rank's TP block (``global_shape`` is still the
    whole tensor's); on a 2-D ``(dp, tp)`` mesh the placements are ``(Shard(0), <TP's>)``.
    """
    global_shape = tuple(global_shape)
    stride = torch.empty(global_shape, device="meta").stride()
    placements = [Shard(0)] + (list(tp.placements) if tp is not None and mesh.ndim == 2 else [])
    dt = DTensor.from_local(local, mesh, placements, run_check=False,
                            shape=torch.Size(global_shape), stride=stride)
    return attach_uneven(dt, global_shape, start, group, tp)


def attach_uneven(dt: DTensor, global_shape: tuple[int, ...], start: int,
                  group=None, tp: TPSpec | None = None) -> DTensor:
    """Give ``dt`` (whose local tensor holds elements from ``start`` on) its own chunk metadata.

    DCP then writes and reads exactly those elements. When ``group`` is given (it must be the
    group of ``dt``'s mesh), ``dt`` becomes an :class:`~mfsdp.fsdp.dtensor.UnevenDTensor`, whose ``full_tensor()`` and
    ``redistribute(placements=[Replicate()])`` gather the pieces of every rank of ``group``
    (DTensor's own versions assume ``torch.chunk``'s split, which uneven pieces do not follow).
    Ops on ``dt`` that make new DTensors (``dt + 1``, ``dt.detach()``) lose this: call
    ``full_tensor()`` on the parameter or state-dict entry itself. Reductions are unaffected
    (``dt.pow(2).sum().full_tensor()`` is right). With ``tp``, ``start`` counts in the TP block.
    """
    global_shape = tuple(global_shape)
    inner = dt._local_tensor
    flat = inner.reshape(-1)
    boxes = (tp.boxes(start, start + inner.numel()) if tp is not None
             else flat_boxes(global_shape, start, start + inner.numel()))
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
    _PIECES[inner] = (start, tp.segments if tp is not None else None)
    if group is not None:
        UnevenDTensor.adopt(dt, start, group, tp)
    return dt


# the local tensor of a DTensor made by attach_uneven -> (its first element, the TP segments or
# None): what piece_origin() answers; weak keys, so an entry lives as long as its tensor
_PIECES = WeakIdKeyDictionary()


def piece_origin(piece: torch.Tensor) -> tuple[int, tuple | None] | None:
    """Where ``piece`` (the local tensor of a DTensor made by
    :func:`~mfsdp.fsdp.dtensor.attach_uneven`) starts in its parameter, and the TP segments of its
    block (``None`` without TP); ``None`` for a tensor :func:`~mfsdp.fsdp.dtensor.attach_uneven`
    did not make (a DTensor of ``torch.chunk``'s split, say)."""
    return _PIECES.get(piece)


class UnevenDTensor(DTensor):
    """A DTensor whose local tensor is this rank's uneven piece (see :func:`~mfsdp.fsdp.dtensor.attach_uneven`).

    Only ``full_tensor()`` and ``redistribute`` to ``Replicate`` differ from DTensor's: they gather
    the pieces where they are (DTensor's own assume ``torch.chunk``'s split). ``clone()`` keeps the
    class and its layout; every other op on it returns a plain DTensor, as with any DTensor
    subclass.
    """

    @staticmethod
    def adopt(dt: DTensor, start: int, group, tp: TPSpec | None) -> None:
        """Make ``dt`` an UnevenDTensor whose local tensor holds its elements from ``start`` on
        (its class changes in place: DTensor builds the object, so this is its initialiser)."""
        dt.__class__ = UnevenDTensor
        # Plain attributes in __dict__, read from there (a DTensor's attribute lookup is torch's):
        dt.__dict__["_uneven_start"] = start  # the first element of the local piece (in the block)
        dt.__dict__["_uneven_group"] = group  # the data-parallel group the pieces are spread over
        dt.__dict__["_uneven_tp"] = tp  # the TP block the pieces are cut from, or None

    def full_tensor(self, *, grad_placements=None) -> torch.Tensor:
        """The whole tensor on every rank of the mesh (a collective call): the pieces gathered
        over the data-parallel group, then the TP blocks over the TP group."""
        tp = self.__dict__["_uneven_tp"]
        block = gather_pieces(self._local_tensor.detach(), self.__dict__["_uneven_start"],
                              tp.local_shape if tp is not None else tuple(self.shape),
                              self.__dict__["_uneven_group"])
        return tp.full_of(block) if tp is not None else block

    def __reduce_ex__(self, protocol):
        # torch.save of a DTensor whose local tensor is a view at a non-zero offset fails in
        # DTensor's own path ("invalid python storage"); rebuild from the local piece instead.
        return (_rebuild_uneven, (self._local_tensor.detach(), self.device_mesh, tuple(self.shape),
                                  self.__dict__["_uneven_start"], self.requires_grad,
                                  self.__dict__["_uneven_tp"]))

    def clone(self, *, memory_format=torch.preserve_format) -> UnevenDTensor:
        """A copy that keeps the uneven layout (a plain DTensor copy would read its rows as
        ``torch.chunk``'s split in ``full_tensor()``, and its class would differ)."""
        out = DTensor.clone(self, memory_format=memory_format)
        UnevenDTensor.adopt(out, self.__dict__["_uneven_start"], self.__dict__["_uneven_group"],
                            self.__dict__["_uneven_tp"])
        return out

    def redistribute(self, device_mesh=None, placements=None, **kwargs):
        """As DTensor's; to ``[Replicate()]`` it gathers the uneven pieces first."""
        if placements is not None and all(isinstance(p, Replicate) for p in placements):
            return DTensor.from_local(self.full_tensor(), device_mesh or self.device_mesh,
                                      list(placements), run_check=False)
        return DTensor.redistribute(self, device_mesh, placements, **kwargs)


class ViewDTensor(DTensor):
    """A DTensor (of any placements) whose local tensor views a bucket's flat buffer; only
    pickling differs from DTensor's, which fails on such views (see :class:`~mfsdp.fsdp.dtensor.UnevenDTensor`)."""

    def __reduce_ex__(self, protocol):
        return (_rebuild_view, (self._local_tensor.detach(), self.device_mesh,
                                tuple(self.placements), tuple(self.shape), tuple(self.stride()),
                                self.requires_grad))


def view_dtensor(local: torch.Tensor, mesh, placements, global_shape: tuple,
                 requires_grad: bool = False) -> DTensor:
    """``local`` as a :class:`~mfsdp.fsdp.dtensor.ViewDTensor` of ``global_shape`` over ``mesh`` (no copy, no check)."""
    stride = torch.empty(tuple(global_shape), device="meta").stride()
    dt = DTensor.from_local(local, mesh, list(placements), run_check=False,
                            shape=torch.Size(tuple(global_shape)), stride=stride)
    if requires_grad:
        dt = torch.nn.Parameter(dt, requires_grad=True)
    dt.__class__ = ViewDTensor
    return dt


def _rebuild_view(local, mesh, placements, shape, stride, requires_grad):
    dt = DTensor.from_local(local, mesh, list(placements), run_check=False,
                            shape=torch.Size(shape), stride=stride)
    return dt.requires_grad_(requires_grad) if requires_grad else dt


def _rebuild_uneven(local, mesh, global_shape, start, requires_grad, tp=None):
    group = mesh.get_group(0) if mesh.ndim > 1 else mesh.get_group()
    dt = uneven_dtensor(local, mesh, global_shape, start, group, tp)
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
