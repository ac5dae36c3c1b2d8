"""Bucket collectives: all-gather, reduce-scatter, all-reduce; async handles; byte accounting.

Every collective is recorded in a :class:`CommLog` with its op, group, dtype and two byte counts:

* ``bytes``: the size of the full (unsharded) tensor the collective works on;
* ``sent_bytes``: what one rank sends under a bandwidth-optimal (ring) algorithm:
  ``(N-1)/N * bytes`` for all-gather and reduce-scatter, ``2 (N-1)/N * bytes`` for all-reduce.

On gloo, ``reduce_scatter_tensor`` is an all-reduce followed by a local chunk (twice the bytes a
ring reduce-scatter needs); mfsdp instead sends each peer its chunk with one ``all_to_all_single``
and sums what it received, which moves exactly ``(N-1)/N * bytes``. NCCL keeps its own
reduce-scatter. Each collective is labelled for profilers (``mfsdp::all_gather``, ...).

[Note: gloo all-gather as point-to-point]
gloo's ``all_gather_into_tensor`` is a ring (N-1 dependent hops) into a freshly allocated flat
buffer, then one copy per rank's chunk into the output; on this project's CPU machine it took
3.4 ms for a 5.5 MiB bucket on 2 ranks and 8.4 ms on 4. mfsdp sends its shard straight to every
peer and receives each peer's shard straight into its place in the output (``isend``/``irecv``,
all posted at once; the local shard is copied into its own place meanwhile): the same
``(N-1)/N`` of the bucket on the wire, no staging buffer. For a 6.8 MiB bucket: 2.4 ms on 2 ranks
and 5.5 ms on 4, where the earlier form of this path, one ``all_to_all_single`` whose input held
the shard once per peer (a bucket-sized copy per all-gather), took 4.2 and 9.2 ms. Every rank of a
group launches its all-gathers in the same order, so a counter per process group gives the
messages of one all-gather the same tag on every rank; gloo's collectives use tags of their own.
The receive buffers of reduce-scatters come from a small pool per communicator and are reused
step after step: the pool grows only to the most reductions that were ever in flight at once
(timing decides how many), never per step.
"""

from __future__ import annotations

import time
import weakref
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["backend_of", "CommLog", "Communicator", "Handle"]

# torch 2.13 renamed the tensor collectives (the old names warn); older releases lack the new ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommLog:
    """The record of the collectives a model launched (enable/disable with ``enabled``).

    The most recent ``max_records`` are kept (a long run does not grow without bound); clear the
    log at the start of a step to read that step's records.
    """

    enabled: bool = True
    max_records: int = 100_000
    records: deque = field(default_factory=deque)

    def add(self, **record) -> dict:
        if self.enabled:
            self.records.append(record)
            if len(self.records) > self.max_records:
                self.records.popleft()
        return record

    def clear(self) -> None:
        self.records.clear()

    def summary(self, key: str = "sent_bytes") -> dict[tuple[str, str], int]:
        """Total ``key`` by (op, group name)."""
        out: dict[tuple[str, str], int] = defaultdict(int)
        for r in self.records:
            out[(r["op"], r["group"])] += r[key]
        return dict(out)

    def total(self, key: str = "sent_bytes", op: str | None = None) -> int:
        return sum(r[key] for r in self.records if op is None or r["op"] == op)

    def wait_seconds(self) -> float:
        """Seconds of communication not hidden by compute (the *exposed* communication).

        On CPU (gloo) a wait blocks the host: the host time spent in ``Handle.wait``. On a GPU a
        wait does not block the host (NCCL makes the compute stream wait instead), so a host
        timer would read about 0: there each wait is bracketed by CUDA events on the compute
        stream and the GPU time between them is summed (this synchronises on the last event).
        """
        total = 0.0
        for r in self.records:
            events = r.get("wait_events")
            if events:
                for start, end in events:
                    end.synchronize()
                    total += start.elapsed_time(end) / 1e3
            else:
                total += r.get("wait_s", 0.0)
        return total


# Tags of point-to-point all-gathers, one counter per process group (see the note); weak keys: a
# group made after another was destroyed starts at 0 on every rank, whatever id() it gets.
_TAGS: "weakref.WeakKeyDictionary[dist.ProcessGroup, int]" = weakref.WeakKeyDictionary()


def _next_tag(group: dist.ProcessGroup | None) -> int:
    key = group if group is not None else dist.group.WORLD
    _TAGS[key] = tag = (_TAGS.get(key, 0) + 1) % (1 << 30)
    return tag


class _Works:
    """Several in-flight point-to-point operations seen as one (``wait``, ``is_completed``)."""

    def __init__(self, works: list):
        self._works = works
        self._done = False

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        self._done = True

    def is_completed(self) -> bool:
        # gloo's send/recv works report completion only once waited for
        return self._done


_WAITING: list[dict] = []  # the records of the collectives this process is waiting for now


def current_wait() -> str | None:
    """The collective this process is blocked in right now, as ``all_gather over dp_shard (8
    ranks)``, or None: what a watchdog (the trainer's hang report) says about a waiting rank."""
    try:
        r = _WAITING[-1]
    except IndexError:  # (read from another thread: the wait may just have ended)
        return None
    return f"{r.get('op')} over {r.get('group')} ({r.get('size')} ranks)"


class Handle:
    """An in-flight collective. ``wait()`` blocks, runs the finishing step once, returns its value."""

    def __init__(self, work, finish: Callable[[], object] | None, record: dict,
                 cuda: bool = False):
        self._work = work
        self._finish = finish
        self._record = record
        self._done = False
        self._value = None
        self._cuda = cuda

    def is_completed(self) -> bool:
        return self._done or self._work is None or self._work.is_completed()

    def wait(self):
        if not self._done:
            t0 = time.perf_counter()
            events = None
            if self._cuda and self._work is not None:  # GPU time the compute stream waits
                events = (torch.cuda.Event(enable_timing=True),
                          torch.cuda.Event(enable_timing=True))
                events[0].record()
            if self._work is not None:
                _WAITING.append(self._record)
                try:
                    self._work.wait()
                finally:
                    _WAITING.pop()
            if events is not None:
                events[1].record()
                self._record.setdefault("wait_events", []).append(events)
            self._value = self._finish() if self._finish is not None else None
            t1 = time.perf_counter()
            self._record["wait_s"] = self._record.get("wait_s", 0.0) + (t1 - t0)
            self._record["end"] = t1
            self._done = True
        return self._value


def backend_of(group: dist.ProcessGroup | None, device: torch.device) -> str:
    """``"nccl"`` or ``"gloo"``: the backend that carries ``device``'s tensors over ``group``.

    ``dist.get_backend`` answers ``"undefined"`` or ``"cpu:gloo,cuda:nccl"`` for a group made by
    ``init_process_group()`` without a backend argument; what matters is which backend takes
    tensors on the device we use.
    """
    name = str(dist.get_backend(group)).lower()
    if name in ("gloo", "nccl"):
        return name
    if device.type == "cuda" and ("nccl" in name or name == "undefined"):
        return "nccl"
    return "gloo"


class Communicator:
    """Collectives over one process group, with a name used in the accounting."""

    def __init__(self, group: dist.ProcessGroup | None, name: str, log: CommLog | None = None):
        self.group = group
        self.name = name
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.backend = dist.get_backend(group)
        self.log = log if log is not None else CommLog()
        # Reusable receive buffers of gloo reduce-scatters by (numel, dtype, device): see [Note:
        # gloo all-gather as point-to-point]. A buffer is taken when a collective launches and
        # given back when it is waited for, so the pool holds at most as many buffers as were
        # ever in flight at once.
        self._pool: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        self._pool_bytes = 0

    def _take(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        free = self._pool[(numel, like.dtype, like.device)]
        if free:
            return free.pop()
        self._pool_bytes += numel * like.element_size()
        return torch.empty(numel, dtype=like.dtype, device=like.device)

    def _give(self, t: torch.Tensor) -> None:
        self._pool[(t.numel(), t.dtype, t.device)].append(t)

    @property
    def scratch_bytes(self) -> int:
        """Bytes of the scratch buffers this communicator has allocated (and keeps for reuse)."""
        return self._pool_bytes

    def _record(self, op: str, t: torch.Tensor, numel: int, factor: float) -> dict:
        nbytes = numel * t.element_size()
        sent = int(round(nbytes * factor * (self.size - 1) / self.size))
        return self.log.add(op=op, group=self.name, size=self.size, dtype=str(t.dtype),
                            bytes=nbytes, sent_bytes=sent, start=time.perf_counter())

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, async_op: bool = True) -> Handle:
        """Gather every rank's ``shard`` into ``out`` (``out`` is ``size`` shards long)."""
        record = self._record("all_gather", out, out.numel(), 1.0)
        if self.size == 1:
            if out.data_ptr() != shard.data_ptr():
                out.copy_(shard)
            return Handle(None, None, record)
        finish = None
        with torch.profiler.record_function("mfsdp::all_gather"):
            # [Note: gloo all-gather as point-to-point]; gloo's send and receive take CPU
            # tensors only (a CUDA tensor's address fails in the socket write), so CUDA tensors
            # on gloo take its collective, which stages them through the host.
            if self.backend == "gloo" and not out.is_cuda:
                work = self._all_gather_p2p(out, shard)
            else:
                work = _all_gather(out, shard, group=self.group, async_op=True)
        handle = Handle(work, finish, record, cuda=out.is_cuda and self.log.enabled)
        if not async_op:
            handle.wait()
        return handle

    def _all_gather_p2p(self, out: torch.Tensor, shard: torch.Tensor) -> _Works:
        n, r = self.size, self.rank
        flat = shard.reshape(-1)
        chunks = out.view(n, flat.numel())
        tag = _next_tag(self.group)
        works = []
        for k in range(1, n):
            to, frm = (r + k) % n, (r - k) % n
            works.append(dist.isend(flat, group=self.group, group_dst=to, tag=tag))
            works.append(dist.irecv(chunks[frm], group=self.group, group_src=frm, tag=tag))
        if chunks[r].data_ptr() != flat.data_ptr():
            chunks[r].copy_(flat)
        return _Works(works)

    def reduce_scatter(self, full: torch.Tensor, async_op: bool = True,
                       op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Handle:
        """Sum (or ``op``: ``AVG`` on gloo too, as a sum then a division; others NCCL only)
        ``full`` over ranks; ``wait()`` gives this rank's chunk."""
        record = self._record("reduce_scatter", full, full.numel(), 1.0)
        n = self.size
        if n == 1:
            return Handle(None, lambda: full, record)
        chunk = full.numel() // n
        with torch.profiler.record_function("mfsdp::reduce_scatter"):
            if self.backend == "gloo":
                recv = self._take(full.numel(), full)
                work = dist.all_to_all_single(recv, full, group=self.group, async_op=True)

                def finish(recv=recv):
                    value = _sum_chunks(recv, n, chunk)
                    self._give(recv)
                    return value.div_(n) if op == dist.ReduceOp.AVG else value
            else:
                out = torch.empty(chunk, dtype=full.dtype, device=full.device)
                work = _reduce_scatter(out, full, op=op, group=self.group, async_op=True)
                finish = lambda: out  # noqa: E731
        handle = Handle(work, finish, record, cuda=full.is_cuda and self.log.enabled)
        if not async_op:
            handle.wait()
        return handle

    def all_reduce(self, t: torch.Tensor, async_op: bool = True,
                   op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                   kind: str = "all_reduce") -> Handle:
        """Sum (or ``op``) ``t`` in place over ranks; ``kind`` names it in the accounting. gloo
        has no ``AVG``: there it is a sum, then a division by the group size."""
        record = self._record(kind, t, t.numel(), 2.0)
        if self.size == 1:
            return Handle(None, lambda: t, record)
        post = op == dist.ReduceOp.AVG and self.backend == "gloo"
        with torch.profiler.record_function("mfsdp::all_reduce"):
            work = dist.all_reduce(t, op=dist.ReduceOp.SUM if post else op, group=self.group,
                                   async_op=True)
        n = self.size
        finish = (lambda: t.div_(n)) if post else (lambda: t)  # noqa: E731
        handle = Handle(work, finish, record, cuda=t.is_cuda and self.log.enabled)
        if not async_op:
            handle.wait()
        return handle


def _sum_chunks(recv: torch.Tensor, n: int, chunk: int) -> torch.Tensor:
    """Sum the ``n`` contiguous chunks of ``recv`` (elementwise adds: about twice as fast on CPU as
    ``recv.view(n, chunk).sum(0)``, a strided reduction). Low-precision chunks are accumulated in
    fp32 and rounded once, as the reduction would."""
    parts = recv.view(n, chunk)
    if recv.dtype in (torch.float32, torch.float64):
        out = parts[0] + parts[1]
        for i in range(2, n):
            out.add_(parts[i])
        return out
    return parts.sum(0)
