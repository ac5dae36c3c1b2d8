"""What a sharded model's two step buffers hold, event by event: a memory timeline.

A ZeRO-3 step allocates and frees two kinds of buffer. *Gathered weights*: a unit's full weights,
all-gathered before its forward (and again before its backward) and released after. *Full
gradient buffers*: a unit's gradients before their reduce-scatter (ZeRO-2/3). The planner bounds
both (``mfsdp.tools.plan.plan(...).memory["gathered"]`` and ``["grad_buffers"]``);
:func:`record_memory_timeline` shows how a real step gets there::

    timeline = record_memory_timeline(model)  # model: from mfsdp.fully_shard
    model(x).pow(2).mean().backward()
    timeline.close()
    for label, gathered, grads, *_ in timeline:
        print(f"{label:<28} {gathered:>10} {grads:>10}")

Each sample is read off the buckets' storages (not the engine's counters) right after the engine
allocated or released one of those buffers, and kept when what they hold changed. The root unit
(embedding, final norm, output layer) counts too, apart in ``root_gathered`` and ``root_grads``:
the engine's own counter (``model.fsdp_state().memory["peak_gathered_bytes"]``) leaves its
weights out, since they stay gathered from its forward until the end of backward.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["MemorySample", "MemoryTimeline", "held_now", "record_memory_timeline"]


class MemorySample(NamedTuple):
    """What the step buffers hold right after one event, in bytes on this rank."""

    label: str  # the event and its unit: "gather layers.3", "grad free (root)", ...
    gathered: int  # gathered weights, every unit's (the root's included)
    grads: int  # full gradient buffers and the cast copies of reductions in flight
    phase: str  # "forward", "backward" or "outside" (before, between, after them)
    root_gathered: int  # the root unit's share of ``gathered``
    root_grads: int  # the root unit's share of ``grads``


def held_now(state) -> tuple[int, int, int, int]:
    """``(gathered, grads, root_gathered, root_grads)``: the bytes of gathered weights and of full
    gradient buffers that ``state``'s buckets hold now (see
    :class:`~mfsdp.tools.memory_timeline.MemorySample`), read off the buffers' storages. A
    reduction in flight in another dtype holds its cast copy: counted in ``grads``."""
    gathered = grads = root_gathered = root_grads = 0
    for b in state.buckets:
        weights = b.full.numel() * b.full.element_size() if b.sharded_params and b.gathered else 0
        grad = 0
        if b.sharded_grads and b.grad_full is not None:
            grad = b.grad_full.numel() * b.grad_full.element_size()
        gathered, grads = gathered + weights, grads + grad
        if not b.unit:
            root_gathered, root_grads = root_gathered + weights, root_grads + grad
    for b, _, _ in state.reducer.inflight:
        if b.comm_dtype != b.grad_dtype:
            copy = b.plan.padded_numel * b.comm_dtype.itemsize
            grads += copy
            root_grads += 0 if b.unit else copy
    return gathered, grads, root_gathered, root_grads


def _bytes(s: MemorySample) -> tuple[int, int, int, int]:
    return s.gathered, s.grads, s.root_gathered, s.root_grads


class MemoryTimeline(list):
    """The samples (:class:`~mfsdp.tools.memory_timeline.MemorySample`) of one model, oldest
    first; it fills as the model runs until
    :meth:`~mfsdp.tools.memory_timeline.MemoryTimeline.close`. The first sample (``"start"``) is
    what was held when recording began."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.append(self._sample("start"))
        state.memory_watchers.append(self._watch)

    def _sample(self, label: str) -> MemorySample:
        from mfsdp.fsdp.state import UnitPhase
        from mfsdp.fsdp.unit import in_backward

        if in_backward():
            phase = "backward"
        elif any(u.phase is UnitPhase.FORWARD for u in self.state.units):
            phase = "forward"
        else:
            phase = "outside"
        gathered, grads, root_gathered, root_grads = held_now(self.state)
        return MemorySample(label, gathered, grads, phase, root_gathered, root_grads)

    def _watch(self, event: str, unit: str) -> None:
        sample = self._sample(f"{event} {unit or '(root)'}")
        if _bytes(sample) != _bytes(self[-1]):
            self.append(sample)

    def close(self) -> "MemoryTimeline":
        """Stop recording (the samples stay); returns the timeline."""
        if self._watch in self.state.memory_watchers:
            self.state.memory_watchers.remove(self._watch)
        return self

    def __enter__(self) -> "MemoryTimeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def peaks(self, root: bool = True) -> dict[str, int]:
        """The most bytes held at once: ``{"gathered": ..., "grad_buffers": ...}`` (the names of
        the planner's terms); ``root=False`` leaves the root unit's share out."""
        return {"gathered": max(s.gathered - (0 if root else s.root_gathered) for s in self),
                "grad_buffers": max(s.grads - (0 if root else s.root_grads) for s in self)}


def record_memory_timeline(model) -> MemoryTimeline:
    """Start recording what ``model``'s gathered weights and full gradient buffers hold after each
    allocation and release (``model``: from :func:`mfsdp.fully_shard`, or its ``fsdp_state()``);
    the returned :class:`~mfsdp.tools.memory_timeline.MemoryTimeline` fills as the model runs.
    Stop with ``close()`` or use it as a context manager."""
    state = model.fsdp_state() if hasattr(model, "fsdp_state") else model
    if not hasattr(state, "memory_watchers"):
        raise TypeError(f"record_memory_timeline needs a model from mfsdp.fully_shard (or its "
                        f"fsdp_state()); got {type(model).__name__}")
    return MemoryTimeline(state)
