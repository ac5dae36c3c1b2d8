"""Flat, padded, bucketed buffers: where every parameter, main weight and gradient lives.

A *bucket* is one FSDP unit's share of one parameter group (same dtype, expert-ness and
``requires_grad``). Its parameters are laid out back to back in a flat buffer and the buffer is
padded to ``shard_count * shard_numel``; a parameter that a shard boundary cuts is placed so that
the boundary falls between two of its rows. Two consequences (see ``docs/concepts.md``):

* rank ``k`` owns the contiguous slice ``[k * shard_numel, (k + 1) * shard_numel)`` of the buffer,
  so one all-gather or reduce-scatter per bucket moves everything, with no copies in or out;
* shard boundaries fall on whole rows, so a parameter's local piece is a dim-0 slice (possibly
  empty, possibly uneven) that the optimizer can step on as an ordinary tensor.

>>> plan = plan_bucket([(4, 3), (5,)], shard_count=2)
>>> plan.shard_numel, plan.padded_numel
(9, 18)
>>> [(p.offset, p.local_rows(0), p.local_rows(1)) for p in plan.params]
[(0, (0, 3), (3, 4)), (12, (0, 0), (0, 5))]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["ParamSlot", "BucketPlan", "plan_bucket", "Bucket"]


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in its bucket's flat buffer."""

    shape: tuple[int, ...]
    offset: int  # first element in the flat buffer; every shard boundary inside is on a row edge
    shard_numel: int  # of the bucket, repeated here so the slot can answer alone

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row_numel(self) -> int:
        """Elements in one dim-0 row (1 for scalars and vectors)."""
        return math.prod(self.shape[1:]) if len(self.shape) > 1 else 1

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    def local_range(self, rank: int) -> tuple[int, int]:
        """Elements ``[start, end)`` of the flattened parameter owned by ``rank`` (empty: (0, 0))."""
        lo = max(rank * self.shard_numel, self.offset)
        hi = min((rank + 1) * self.shard_numel, self.offset + self.numel)
        if hi <= lo:
            return (0, 0)
        return (lo - self.offset, hi - self.offset)

    def row_aligned(self, rank: int) -> bool:
        """Whether ``rank``'s piece is whole rows (always, unless the bucket was planned on
        element boundaries, see :func:`plan_bucket`)."""
        lo, hi = self.local_range(rank)
        return lo % self.row_numel == 0 and hi % self.row_numel == 0

    def local_rows(self, rank: int) -> tuple[int, int]:
        """Rows ``[start, end)`` of this parameter owned by ``rank`` (empty where it owns none);
        for a piece cut inside rows, the rows it touches."""
        lo, hi = self.local_range(rank)
        if hi <= lo:
            return (0, 0)
        return (lo // self.row_numel, -(-hi // self.row_numel))

    def local_offset(self, rank: int) -> int:
        """Where this parameter's local piece starts inside ``rank``'s shard."""
        return max(rank * self.shard_numel, self.offset) - rank * self.shard_numel

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """The local piece's shape: ``(rows, *shape[1:])`` for whole rows, else flat."""
        lo, hi = self.local_range(rank)
        if not self.row_aligned(rank):
            return (hi - lo,)
        start, end = lo // self.row_numel, hi // self.row_numel
        return (end - start, *self.shape[1:]) if self.shape else ((end - start),)


@dataclass
class BucketPlan:
    """The layout of one bucket: parameter slots, shard size, total padded size."""

    params: list[ParamSlot]
    shard_count: int
    shard_numel: int
    numel: int  # elements that hold parameters (no padding)

    @property
    def padded_numel(self) -> int:
        return self.shard_count * self.shard_numel


def plan_bucket(shapes: list[tuple[int, ...]], shard_count: int,
                max_row_padding: float = 0.01) -> BucketPlan:
    """Lay out parameters of the given shapes so that shards split them on whole rows.

    Parameters go back to back in order. A parameter that a shard boundary cuts starts a few
    elements later when needed, so that the boundary falls between two of its rows; the shard
    size is the smallest (from ``ceil(total / shard_count)`` up) for which such a placement fits.
    Padding is then at most about one row per boundary, unless a parameter spans several
    boundaries: then the shard size must be a multiple of its row size, and of every such row
    size, which at hundreds of ranks can waste most of the bucket (a Llama-2-7B layer at 1,000
    ranks: 74%). When whole rows would pad more than ``max_row_padding`` of the elements, the
    bucket is cut on element boundaries instead (padding under ``shard_count`` elements): a rank's
    piece of a parameter may then start or end inside a row, and is a flat tensor.
    """
    if shard_count < 1:
        raise ValueError(f"shard_count={shard_count} must be at least 1")
    shapes = [tuple(int(d) for d in s) for s in shapes]
    numels = [math.prod(s) for s in shapes]
    total = sum(numels)
    if shard_count == 1 or total == 0:  # nothing is split: no alignment needed
        offsets = [sum(numels[:i]) for i in range(len(numels))]
        shard_numel = total
    else:
        row_sizes = [math.prod(s[1:]) if len(s) > 1 else 1 for s in shapes]
        # a shard size past this pads more than allowed: the search can stop there
        largest = (None if math.isinf(max_row_padding)
                   else math.floor(total * (1 + max_row_padding) / shard_count))
        offsets, shard_numel = _place_search(numels, row_sizes, shard_count, largest)
        if shard_count * shard_numel - total > max_row_padding * total:
            offsets = [sum(numels[:i]) for i in range(len(numels))]
            shard_numel = -(-total // shard_count)
    slots = [ParamSlot(s, o, shard_numel) for s, o in zip(shapes, offsets)]
    return BucketPlan(slots, shard_count, shard_numel, total)


def _place(numels: list[int], row_sizes: list[int], size: int, n: int) -> list[int] | None:
    """Offsets placing every parameter so that boundaries ``k * size`` fall between rows, or
    ``None`` when that does not fit in ``n * size`` elements."""
    offsets, cursor = [], 0
    for numel, r in zip(numels, row_sizes):
        start = cursor
        if r > 1 and numel > 0:
            first = (start // size + 1) * size  # the first boundary after the start
            if first < start + numel:
                start += (first - start) % r  # that boundary now falls between two rows
                first = (start // size + 1) * size
                if first + size < start + numel and size % r:
                    return None  # a second boundary inside would need size % r == 0
                if first < start + numel and (first - start) % r:
                    return None
        offsets.append(start)
        cursor = start + numel
    return offsets if cursor <= n * size else None


def _place_search(numels: list[int], row_sizes: list[int], n: int, largest: int | None = None,
                  max_tries: int = 100_000) -> tuple[list[int], int]:
    """The smallest shard size with a valid placement; a multiple of every row size always has
    one (each parameter starting on a multiple of its row size), which bounds the search.

    Sizes above ``largest`` are not tried: the caller would reject them."""
    lower = -(-sum(numels) // n)
    lcm = 1
    for numel, r in zip(numels, row_sizes):
        if numel and r > 1:
            lcm = math.lcm(lcm, r)
    stop = lower + max_tries if largest is None else min(lower + max_tries, largest + 1)
    for size in range(lower, stop):
        if size % lcm == 0:
            break
        offsets = _place(numels, row_sizes, size, n)
        if offsets is not None:
            return offsets, size
    # Fallback: row-multiple starts and a shard size that every row size divides.
    offsets, cursor = [], 0
    for numel, r in zip(numels, row_sizes):
        cursor = -(-cursor // max(r, 1)) * max(r, 1)
        offsets.append(cursor)
        cursor += numel
    size = -(-(-(-cursor // n)) // lcm) * lcm
    return offsets, size


def _free(t: torch.Tensor | None) -> None:
    if t is not None:
        t.untyped_storage().resize_(0)


def _storage_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.untyped_storage().nbytes()


@dataclass
class Bucket:
    """The buffers of one bucket on one rank, and the views handed to modules and the optimizer.

    Buffers, and why each exists:

    * ``full``: model weights in compute dtype, ``padded_numel`` long; the module parameters are
      views into it. Under ZeRO-3 its storage is resized to 0 between uses (the views stay valid).
    * ``full_comm``: the same memory as ``full`` seen through a tensor with its own version counter;
      collectives write through it (see [Note: version counters] in ``mfsdp/fsdp/module.py``).
    * ``model_shard``: this rank's slice of the model weights, kept between uses under ZeRO-3 only
      (the all-gather source); otherwise a view of ``full``.
    * ``main_shard``: this rank's main weights (``main_params_dtype``); a view of ``model_shard``
      when the dtypes agree, so fp32 training keeps one copy.
    * ``grad_full``: gradients of the whole bucket, accumulated by the post-accumulate-grad hooks;
      allocated at the first gradient, released after the reduce-scatter when gradients are sharded.
    * ``grad_shard``: this rank's reduced gradients (``main_grads_dtype``), what the optimizer reads.
    """

    unit: str
    key: tuple  # (dtype, is_expert, requires_grad)
    names: list[str]
    plan: BucketPlan
    rank: int  # this rank's index in the (inner) shard group
    device: torch.device
    dtype: torch.dtype
    main_dtype: torch.dtype
    grad_dtype: torch.dtype
    comm_dtype: torch.dtype
    sharded_params: bool  # ZeRO-3: full is released between uses
    sharded_grads: bool  # ZeRO-2/3: grad_full is released after its reduce-scatter
    replicated: bool = False  # no_shard: one gradient buffer, all-reduced in place
    # HFSDP (outer_dp_sharding_strategy="optim"): main weights are sharded over inner x outer, so
    # the plan has `shard_count = inner * outer_factor` sub-shards; this rank's inner shard is
    # sub-shards [rank * outer_factor, (rank + 1) * outer_factor) and its main weights are
    # sub-shard `rank * outer_factor + outer_rank`.
    outer_factor: int = 1
    outer_rank: int = 0
    # The communicator of this bucket's shard group (the dense or the expert one): its
    # reduce-scatters and, unless a separate all-gather group exists, its all-gathers.
    comm: Any = None
    # The communicator its all-gathers use: a second group over the same ranks when
    # create_all_gather_group is set, so that gathers never queue behind reductions.
    ag_comm: Any = None
    # The factor its gradients are multiplied by before reduction (1 / data-parallel ranks, or 1
    # with per-token loss or in-collective averaging).
    grad_scale: float = 1.0
    full: torch.Tensor = field(init=False)
    full_comm: torch.Tensor = field(init=False)
    model_shard: torch.Tensor = field(init=False)
    main_shard: torch.Tensor = field(init=False)
    grad_full: torch.Tensor | None = field(init=False, default=None)
    grad_shard: torch.Tensor | None = field(init=False, default=None)
    ready: int = field(init=False, default=0)  # params whose gradient arrived this backward
    # Which slots of an uninitialised grad_full hold a gradient (None: the buffer was zeroed).
    written: list | None = field(init=False, default=None)
    # Double buffer: the gathered weights live in a pool slot instead of their own storage.
    in_pool: bool = field(init=False, default=False)
    pool_held: bool = field(init=False, default=False)  # its slot holds this bucket's weights now
    # Gradient double buffer (ZeRO-2/3 under fsdp_double_buffer): (slot, byte offset) of this
    # bucket's full gradients in the pool, and whether grad_full is that view right now.
    grad_home: tuple[int, int] | None = field(init=False, default=None)
    grad_pooled: bool = field(init=False, default=False)
    # HSDP: inner-reduced gradients whose outer reduction is in flight (the reducer's handle).
    outer_pending: Any = field(init=False, default=None)
    # Parameters that take a gradient: the hooks count `ready` up to it.
    n_grad_params: int = field(init=False, default=0)
    # Every gradient of this backward arrived and the reduction was launched.
    is_ready: bool = field(init=False, default=False)
    # no_shard: grad_shard already holds reduced gradients (a deferred reduction happened).
    holds_reduced: bool = field(init=False, default=False)
    # Which parameters received a gradient (on any rank) since the last zero_grad: the optimizer
    # skips the others, as plain PyTorch skips parameters whose .grad is None. Host-side flags:
    # a device write per parameter per backward would be a kernel launch in every gradient hook.
    used: list = field(init=False, default_factory=list)
    # Its parameters (mfsdp.fsdp.param.ShardedParam), in slot order.
    sparams: list = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        n, s = self.plan.padded_numel, self.plan.shard_numel
        f = self.outer_factor
        self.full = torch.zeros(n, dtype=self.dtype, device=self.device)
        self.full_comm = torch.empty(0, dtype=self.dtype, device=self.device).set_(
            self.full.untyped_storage(), 0, (n,), (1,))
        # Views must be made while the storage is allocated; they stay valid when it is released.
        self._views = [self.full.as_strided(slot.shape, _contiguous_strides(slot.shape), slot.offset)
                       for slot in self.plan.params]
        lo = self.rank * f * s
        if self.sharded_params:
            self.model_shard = torch.zeros(f * s, dtype=self.dtype, device=self.device)
        else:
            self.model_shard = self.full[lo:lo + f * s]
        if self.main_dtype == self.dtype:
            self.main_shard = self.model_shard[self.outer_rank * s:(self.outer_rank + 1) * s]
        else:
            self.main_shard = torch.zeros(s, dtype=self.main_dtype, device=self.device)
        if self.sharded_params:  # ZeRO-3: the full bucket exists only while a unit computes
            _free(self.full)
        if self.requires_grad:
            self.grad_shard = torch.zeros(s, dtype=self.grad_dtype, device=self.device)
            if self.replicated:  # shard == whole bucket: accumulate and all-reduce in place
                self.grad_full = self.grad_shard

    # -- properties -----------------------------------------------------------------------------
    @property
    def requires_grad(self) -> bool:
        return bool(self.key[2])

    @property
    def is_expert(self) -> bool:
        return bool(self.key[1])

    @property
    def main_index(self) -> int:
        """The plan sub-shard holding this rank's main weights and reduced gradients."""
        return self.rank * self.outer_factor + self.outer_rank

    @property
    def gathered(self) -> bool:
        if self.in_pool:
            return self.pool_held
        return _storage_bytes(self.full) > 0

    # -- views ----------------------------------------------------------------------------------
    def param_view(self, i: int) -> torch.Tensor:
        """Parameter ``i`` as a view of ``full`` (valid even while ``full`` is released)."""
        return self._views[i]

    def local_view(self, flat: torch.Tensor, i: int, index: int | None = None) -> torch.Tensor:
        """Parameter ``i``'s rows inside the sub-shard ``index`` (default: this rank's main one).

        ``flat`` is a buffer of one sub-shard: main weights, reduced gradients.
        """
        index = self.main_index if index is None else index
        slot = self.plan.params[i]
        lo, hi = slot.local_range(index)
        off = slot.local_offset(index)
        return flat[off:off + (hi - lo)].view(slot.local_shape(index))

    def model_sub_shard(self) -> torch.Tensor:
        """The part of ``model_shard`` that this rank's main weights update."""
        s = self.plan.shard_numel
        return self.model_shard[self.outer_rank * s:(self.outer_rank + 1) * s]

    def main_aliases_model(self) -> bool:
        """Whether the main weights are the model weights themselves (same dtype, one copy)."""
        mine = self.model_sub_shard()
        return self.main_shard.dtype == mine.dtype and self.main_shard.data_ptr() == mine.data_ptr()

    def store_local(self, i: int, value: torch.Tensor) -> None:
        """Write the piece of parameter ``i`` that this rank's model-weight shard holds."""
        slot, s = self.plan.params[i], self.plan.shard_numel
        flat = value.reshape(-1)
        for j in range(self.outer_factor):
            index = self.rank * self.outer_factor + j
            lo, hi = slot.local_range(index)
            if hi > lo:
                self.local_view(self.model_shard[j * s:(j + 1) * s], i, index).copy_(
                    flat[lo:hi].view(slot.local_shape(index)))

    # -- memory ---------------------------------------------------------------------------------
    def rebase(self, view: torch.Tensor) -> None:
        """Make ``view`` (bytes of a double-buffer slot) this bucket's gathered-weight memory.

        Called once, before the parameters are created: parameters and everything autograd saves
        from them are views of one storage for the whole run, which is why a unit always uses the
        same slot (see :class:`~mfsdp.fsdp.pools.DoubleBuffer`).
        """
        n = self.plan.padded_numel
        _free(self.full)
        self.full = view.view(self.dtype)[:n]
        self.full_comm = torch.empty(0, dtype=self.dtype, device=self.device).set_(
            view.untyped_storage(), view.storage_offset() // self.full.element_size(), (n,), (1,))
        base = self.full.storage_offset()  # as_strided offsets count from the storage start
        self._views = [self.full.as_strided(slot.shape, _contiguous_strides(slot.shape),
                                            base + slot.offset) for slot in self.plan.params]
        self.in_pool = True

    def alloc_full(self) -> None:
        """Give ``full`` its storage back (ZeRO-3, before an all-gather)."""
        if not self.gathered:
            self.full.untyped_storage().resize_(self.plan.padded_numel * self.full.element_size())

    def release_full(self) -> None:
        """Release the gathered weights (ZeRO-3 only; the parameter views stay valid)."""
        if self.sharded_params:
            _free(self.full)

    def ensure_grad_full(self, into: torch.Tensor | None = None) -> torch.Tensor:
        """The bucket's full gradient buffer, allocated when first needed (or ``into``, a
        ``padded_numel`` view of the gradient double buffer, under ZeRO-2/3).

        ZeRO-2/3 allocate it uninitialised and zero only the padding between and after the
        parameters: each parameter's first gradient is copied in (``written`` tracks which), and
        :meth:`zero_unwritten` clears the slots that got none before the buffer is reduced. That
        saves one pass over the whole buffer per backward. Otherwise it is zeroed once and kept.
        """
        if self.grad_full is None:
            n = self.plan.padded_numel
            if self.sharded_grads:
                self.grad_pooled = into is not None
                self.grad_full = into if self.grad_pooled else torch.empty(
                    n, dtype=self.grad_dtype, device=self.device)
                for start, end in self.plan_gaps():
                    self.grad_full[start:end].zero_()
                self.written = [False] * len(self.plan.params)
            else:
                self.grad_full = torch.zeros(n, dtype=self.grad_dtype, device=self.device)
                self.written = None  # accumulate with add_ into the zeroed buffer
        return self.grad_full

    def plan_gaps(self) -> list[tuple[int, int]]:
        """``[start, end)`` ranges of the flat buffer that belong to no parameter (padding)."""
        gaps, pos = [], 0
        for slot in sorted(self.plan.params, key=lambda s: s.offset):
            if slot.offset > pos:
                gaps.append((pos, slot.offset))
            pos = max(pos, slot.offset + slot.numel)
        if pos < self.plan.padded_numel:
            gaps.append((pos, self.plan.padded_numel))
        return gaps

    def add_grad(self, i: int, grad: torch.Tensor) -> None:
        """Accumulate parameter ``i``'s gradient into ``grad_full`` (copy on its first write)."""
        slot = self.plan.params[i]
        target = self.grad_full[slot.offset:slot.offset + slot.numel].view_as(grad)
        if self.written is not None and not self.written[i]:
            target.copy_(grad)
            self.written[i] = True
        else:
            target.add_(grad)

    def zero_unwritten(self) -> None:
        """Zero the slots of parameters that received no gradient (before a reduction)."""
        if self.grad_full is None or self.written is None:
            return
        for i, done in enumerate(self.written):
            if not done:
                slot = self.plan.params[i]
                self.grad_full[slot.offset:slot.offset + slot.numel].zero_()
                self.written[i] = True

    def grad_full_bytes(self) -> int:
        """Bytes of the full gradient buffer held now (its own storage or its pool place)."""
        g = self.grad_full
        return 0 if g is None else g.numel() * g.element_size()

    def release_grad_full(self) -> None:
        """Drop the full gradient buffer (ZeRO-2/3) or zero it for the next accumulation."""
        if self.grad_full is None or self.replicated:
            return
        if self.sharded_grads:
            self.grad_full = None
            self.grad_pooled = False
        else:
            self.grad_full.zero_()

    def bytes_by_kind(self) -> dict[str, int]:
        """Bytes this bucket holds right now, by kind, counting shared storage once."""
        seen: set[int] = set()
        out = {}
        for kind, t in (("model_weights", self.full), ("model_shard", self.model_shard),
                        ("main_weights", self.main_shard), ("grad_full", self.grad_full),
                        ("main_grads", self.grad_shard)):
            if t is None:
                out[kind] = 0
                continue
            key = t.untyped_storage().data_ptr()
            out[kind] = 0 if (key in seen or not t.untyped_storage().nbytes()) else (
                t.untyped_storage().nbytes())
            seen.add(key)
        return out


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))
