"""The double buffer: two fixed slots, each sized for the largest unit, that hold the temporary
buffers of the non-root units (``fsdp_double_buffer=True`` / upstream's ``maxpool_double_buffer``):
gathered weights under ZeRO-3 (:class:`DoubleBuffer`) and full gradients under ZeRO-2/3
(:class:`GradDoubleBuffer`). Allocated once, their addresses never change.
"""

from __future__ import annotations

import torch

from mfsdp.fsdp.bucket import Bucket

__all__ = ["DoubleBuffer", "GradDoubleBuffer"]


class DoubleBuffer:
    """A fixed pool of two slots for gathered unit weights (``fsdp_double_buffer=True``).

    Each slot is sized for the largest unit and allocated once (allocator-friendly, and what NCCL
    user-buffer registration needs). Units take the slots alternately in module order (unit ``i``
    always uses slot ``i % 2``): parameters are views of their slot for the whole run, so the
    tensors autograd saves in forward still point at the right memory when backward re-gathers.
    With units running one after another (transformer blocks), the computing unit and the
    prefetched one are in different slots. A prefetch whose slot is still busy is skipped; a
    unit that must run while its slot is held by another (nested units) is an error that says so.
    The root unit, gathered for the whole forward, keeps its own storage.
    """

    ALIGN = 64  # bytes; each bucket starts aligned inside a slot

    def __init__(self, units: list, device: torch.device):
        self.slot_of = {id(u): i % 2 for i, u in enumerate(units)}
        self.slot_bytes = max(self.unit_bytes(u.buckets) for u in units)
        self.slots = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=device)
                      for _ in range(2)]
        self.owner: list[object | None] = [None, None]
        self.skipped_prefetches = 0
        for u in units:
            offset, slot = 0, self.slots[self.slot_of[id(u)]]
            for b in u.buckets:
                nbytes = b.plan.padded_numel * b.full.element_size()
                b.rebase(slot[offset:offset + nbytes])
                offset += -(-nbytes // self.ALIGN) * self.ALIGN

    @classmethod
    def unit_bytes(cls, buckets: list[Bucket]) -> int:
        """Bytes a unit needs in a slot."""
        return sum(-(-b.plan.padded_numel * b.full.element_size() // cls.ALIGN) * cls.ALIGN
                   for b in buckets)

    def available(self, unit) -> bool:
        """Whether ``unit``'s slot is free or already its own."""
        return self.owner[self.slot_of[id(unit)]] in (None, unit)

    def acquire(self, unit, name: str) -> None:
        """Take ``unit``'s slot; an error when another unit still holds it."""
        j = self.slot_of[id(unit)]
        holder = self.owner[j]
        if holder is not None and holder is not unit:
            raise RuntimeError(
                f"fsdp_double_buffer: unit {name!r} needs slot {j}, still held by unit "
                f"{getattr(holder, 'name', holder)!r}; the double buffer needs units that run one "
                "after another (not nested); use fsdp_double_buffer=False for this model")
        self.owner[j] = unit
        for b in unit.buckets:
            b.pool_held = True

    def release(self, unit) -> None:
        """Give ``unit``'s slot back (its gathered weights are no longer valid)."""
        j = self.slot_of[id(unit)]
        if self.owner[j] is unit:
            self.owner[j] = None
        for b in unit.buckets:
            b.pool_held = False


class GradDoubleBuffer:
    """Two slots for the full gradients of non-root units (``fsdp_double_buffer`` under ZeRO-2/3).

    Under ZeRO-2/3 a unit's full gradients exist from its first gradient in backward until its
    reduce-scatter ends. With the double buffer they live in one of two slots, each sized for the
    largest unit and allocated once, unit ``i`` in slot ``i % 2`` (as the weights' pool does): the
    addresses never change, which is what NCCL user-buffer registration and CUDA-graph replay need.
    When a unit's slot is still held by the unit two places later in backward order, that unit's
    reduction in flight is finished first. If it cannot be (its reduction was not launched yet:
    ``overlap_grad_reduce=False``, nested units), the gradients either get their own storage
    (``fsdp_db_use_persist_buf_on_alloc_fail=True``, counted in ``fallbacks``) or the backward
    stops with an error that names both units.
    """

    ALIGN = 64  # bytes

    def __init__(self, units: list, device: torch.device, fallback: bool):
        self.fallback = fallback  # fsdp_db_use_persist_buf_on_alloc_fail
        self.fallbacks = 0  # gradients that took their own storage instead of a slot
        self.takes = 0  # gradients placed in a slot (a bucket per backward)
        sizes = []
        for i, u in enumerate(units):
            offset = 0
            for b in u.buckets:
                if b.requires_grad and b.sharded_grads:
                    b.grad_home = (i % 2, offset)
                    offset += self._aligned(b)
            sizes.append(offset)
        self.slot_bytes = max(sizes, default=0)
        self.slots = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=device)
                      for _ in range(2)]
        self.owner: list[str | None] = [None, None]  # the unit whose gradients fill the slot
        self.held = [0, 0]  # buckets of that unit whose gradients are in the slot now

    @classmethod
    def _aligned(cls, b: Bucket) -> int:
        nbytes = b.plan.padded_numel * torch.empty(0, dtype=b.grad_dtype).element_size()
        return -(-nbytes // cls.ALIGN) * cls.ALIGN

    def free_for(self, b: Bucket) -> bool:
        """Whether ``b``'s slot is free or already holds gradients of ``b``'s unit."""
        return self.owner[b.grad_home[0]] in (None, b.unit)

    def take(self, b: Bucket) -> torch.Tensor:
        """``b``'s place in its slot, as a flat ``grad_dtype`` tensor (the slot must be free)."""
        j, offset = b.grad_home
        self.owner[j] = b.unit
        self.held[j] += 1
        self.takes += 1
        nbytes = b.plan.padded_numel * torch.empty(0, dtype=b.grad_dtype).element_size()
        return self.slots[j][offset:offset + nbytes].view(b.grad_dtype)

    def give(self, b: Bucket) -> None:
        """``b`` released its gradients; the slot is free once its unit's last bucket did."""
        j = b.grad_home[0]
        self.held[j] -= 1
        if self.held[j] == 0:
            self.owner[j] = None

    def refuse(self, b: Bucket) -> RuntimeError:
        """The error for a unit whose slot is held by gradients not yet reduced."""
        return RuntimeError(
            f"fsdp_double_buffer: the gradients of unit {b.unit!r} need slot {b.grad_home[0]}, "
            f"still held by the unreduced gradients of unit {self.owner[b.grad_home[0]]!r}; the "
            "gradient double buffer needs reductions launched during backward "
            "(overlap_grad_reduce=True) and units that run one after another; or pass "
            "fsdp_db_use_persist_buf_on_alloc_fail=True to give such gradients their own storage")
