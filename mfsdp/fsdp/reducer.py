"""Gradient reduction of a sharded model: per-bucket launches, outer reductions, end of backward.

:class:`GradReducer` belongs to one sharded model (``state.reducer`` of its
:class:`~mfsdp.fsdp.state.ShardingState`) and owns the state of the reductions in a backward: the
fixed launch order, the launch cursor, the reductions in flight (inner and outer) and whether a
backward is under way. It reads the shared state it is handed (strategy, whether this backward
synchronises, the outer communicator) and, at the end of a synchronising backward, hands every
parameter its reduced gradient rows.

[Note: reduction order] Every rank must launch the same collectives in the same order, or gloo and
NCCL pair the wrong tensors (or hang). Buckets become ready in autograd order, which can differ
between ranks (different routing, unused units). So gradient buckets are launched in a fixed order
(reverse construction order, which is the usual backward order): a bucket that is ready early waits
for its predecessors, and at the end of backward every remaining bucket is launched, with zero
gradients where none arrived.

[Note: no_shard accumulation] Under ``no_shard`` the reduced gradients accumulate in
``grad_shard`` (the whole bucket) over synchronised micro-batches. The first backward after
``zero_grad`` accumulates and all-reduces in place there (one buffer, as DDP). A later backward that
reduces again must not all-reduce what was already reduced, so it accumulates into a separate
buffer that is all-reduced and added (see ``GradReducer.grad_full``); ``zero_grad`` drops that
buffer.

[Note: no blocking in hooks] A gradient hook may only wait for a collective at points that are
the same on every rank (the bounded reduce-scatters below: the launch order is fixed). Outer
reductions are launched when an inner one is found finished, which differs between ranks; a
blocking one there deadlocks once other collectives run in backward too (tensor parallelism's:
rank A waits in the outer all-reduce for rank B, which waits in a TP all-reduce for rank C, ...).
So every outer reduction is asynchronous and waited for at the end of backward.

[Note: gradients cleared by hand] Gradients accumulate in the buckets (``grad_shard``), not in
``.grad``: the parameters' ``.grad`` are views of the bucket's rows. ``optimizer.zero_grad()`` of
:class:`~mfsdp.fsdp.optimizer.ShardedOptimizer` and ``model.zero_grad()`` clear the buckets; a plain
``torch.optim`` optimizer built over the sharded model's parameters (FSDP2's pattern) only sets
their ``.grad`` to ``None`` (or zeroes it in place). So the first backward after reduced gradients
were handed out compares: a parameter whose ``.grad`` was cleared gets its rows zeroed (and counts
as having no gradient), one whose ``.grad`` is a tensor of its own (a dtype cast, or one the user
assigned) has it copied back. What the next backward accumulates into is then what ``.grad``
says, as in plain PyTorch.

[Note: bounded reduce-scatters] At most ``max_inflight_reduce`` reduce-scatters are in flight; the
oldest is finished (its full gradient buffer released) before another is launched, so full gradient
buffers never pile up until the end of backward.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import torch
import torch.distributed as dist

from mfsdp.fsdp.bucket import Bucket
from mfsdp.fsdp.collectives import Handle
from mfsdp.fsdp.state import ShardingState

__all__ = ["GradReducer"]


class GradReducer:
    """Launching, finishing and ordering the gradient reductions of one sharded model."""

    def __init__(self, state: ShardingState, max_inflight: int):
        self.state = state
        # Fixed launch order of gradient buckets: see [Note: reduction order].
        self.order = [b for b in reversed(state.buckets) if b.requires_grad]
        self.max_inflight = max(1, max_inflight)
        self.cursor = 0  # the next bucket of `order` to launch
        self.inflight: deque[tuple[Bucket, Handle, Callable]] = deque()
        # Outer reductions wait for a synchronising backward; their input accumulates meanwhile.
        self.outer_inflight: deque = deque()
        self.backward_started = False

    # -- per-backward state ----------------------------------------------------------------------
    def start_backward(self) -> None:
        """The first unit's backward begins: queue :meth:`finish_backward` for its end."""
        if not self.backward_started:
            self.backward_started = True
            if self.state.sync.installed:
                self.adopt_user_grads()
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    @torch.no_grad()
    def adopt_user_grads(self) -> None:
        """Make the buckets hold what the parameters' ``.grad`` say before a backward adds to
        them: [Note: gradients cleared by hand]."""
        state = self.state
        decoupled = state.options.use_decoupled_grad
        attr = "decoupled_grad" if decoupled else "grad"
        handed = [sp for sp in state.sparams if sp.grad is not None]
        cleared = [sp for sp in handed if getattr(sp.sharded, attr, None) is None
                   or getattr(sp.local, attr, None) is None]
        if handed and len(cleared) == len(handed):  # zero_grad() of a plain optimizer
            state.zero_grads()
            return
        cleared_ids = {id(sp) for sp in cleared}
        for sp in handed:
            rows = sp.bucket.local_view(sp.bucket.grad_shard, sp.index)
            if id(sp) in cleared_ids:
                rows.zero_()
                sp.bucket.used[sp.index] = 0.0
                sp.set_grad(None, decoupled)
                continue
            face = getattr(sp.sharded, attr)
            face = face._local_tensor if hasattr(face, "_local_tensor") else face
            if face.data_ptr() != rows.data_ptr() or face.dtype != rows.dtype:
                rows.copy_(face.reshape(rows.shape))

    def reducing(self) -> bool:
        """Whether this backward reduces gradients (ZeRO-2/3 always: their grads are sharded)."""
        return self.state.sync.synchronising or self.state.strategy.shards_grads

    def reducing_outer(self) -> bool:
        """Outer reductions happen only in synchronising backwards (the last micro-batch)."""
        return self.state.sync.synchronising

    def grad_full(self, bucket: Bucket) -> torch.Tensor:
        """``bucket``'s full gradient buffer (allocated at its first gradient, and counted)."""
        if bucket.replicated and bucket.holds_reduced and bucket.grad_full is bucket.grad_shard:
            # [Note: no_shard accumulation]
            bucket.grad_full = torch.zeros_like(bucket.grad_shard)
        if bucket.grad_full is None:
            bucket.ensure_grad_full(self._pool_place(bucket))
            if bucket.sharded_grads:
                self.state.count_grad_full(bucket.grad_full_bytes())
            self.state.note_memory("grad alloc", bucket.unit)
        return bucket.grad_full

    def _pool_place(self, bucket: Bucket) -> torch.Tensor | None:
        """``bucket``'s place in the gradient double buffer (None: its own storage)."""
        pool = self.state.grad_pool
        if pool is None or bucket.grad_home is None:
            return None
        while not pool.free_for(bucket) and self.inflight:
            self._finish_one()  # the slot's holder is reduced, oldest first
        if pool.free_for(bucket):
            return pool.take(bucket)
        if not pool.fallback:
            raise pool.refuse(bucket)
        pool.fallbacks += 1
        return None

    def release_grad_full(self, b: Bucket) -> None:
        """Drop ``b``'s full gradients after their reduction (ZeRO-2/3: storage or pool place
        freed and uncounted; otherwise zeroed for the next accumulation)."""
        nbytes = b.grad_full_bytes() if b.sharded_grads else 0
        pooled = b.grad_pooled
        b.release_grad_full()
        self.state.count_grad_full(-nbytes)
        if pooled:
            self.state.grad_pool.give(b)
        self.state.note_memory("grad free", b.unit)

    # -- launching -------------------------------------------------------------------------------
    def bucket_ready(self, bucket: Bucket) -> None:
        """Every gradient of ``bucket`` has arrived (or its unit's backward is over)."""
        bucket.is_ready = True
        unit = self.state.unit_by_name[bucket.unit]
        # Release the unit's weights once its backward cannot read them any more.
        if unit.can_release_in_backward():
            unit.reshard()
        if all(b.is_ready for b in unit.buckets if b.requires_grad):
            unit.close_backward_range()
        if self.state.options.overlap_grad_reduce:
            self.launch_ready()

    def launch_ready(self, flush: bool = False) -> None:
        """Launch, in the fixed order, every bucket up to the first that is not ready (all with
        ``flush``)."""
        while self.cursor < len(self.order):
            b = self.order[self.cursor]
            if not (b.is_ready or flush):
                return
            self.cursor += 1
            if self.reducing():
                self._launch(b)

    @torch.no_grad()
    def _launch(self, b: Bucket) -> None:
        outer = self.state.comms.outer
        g = self.grad_full(b)
        b.zero_unwritten()
        src = g if b.comm_dtype == g.dtype else g.to(b.comm_dtype)
        op, scale = self.reduce_op(b)
        if scale != 1.0:
            src.mul_(scale)
        if b.replicated:
            handle = b.comm.all_reduce(src, op=op)

            def finish(value, src=src, g=g, b=b):
                if outer is not None:  # HSDP over no_shard: the same buffer again
                    self._outer_reduce(b, src, then=lambda: self._keep_replicated(b, src, g))
                else:
                    self._keep_replicated(b, src, g)
        else:
            handle = b.comm.reduce_scatter(src, op=op)

            def finish(value, b=b):
                if outer is None:
                    b.grad_shard.add_(value)
                else:
                    if b.outer_pending is None:
                        b.outer_pending = torch.zeros_like(value)
                    b.outer_pending.add_(value)
                self.release_grad_full(b)
                if outer is not None and self.reducing_outer():
                    self._outer_reduce(b, b.outer_pending)

        self.inflight.append((b, handle, finish))
        self.state.note_memory("reduce", b.unit)  # a cast copy in flight counts
        while len(self.inflight) > self.max_inflight:
            self._finish_one()

    @staticmethod
    def _keep_replicated(b: Bucket, src: torch.Tensor, g: torch.Tensor) -> None:
        """Put a no_shard bucket's all-reduced gradients where the optimizer reads them."""
        if g is b.grad_shard:  # nothing reduced since zero_grad: reduced in place
            if src is not g:
                g.copy_(src)
        else:  # [Note: no_shard accumulation]
            b.grad_shard.add_(src)
            g.zero_()
        b.holds_reduced = True

    def reduce_op(self, b: Bucket) -> tuple:
        """(reduce op, pre-scale factor) of a bucket's gradient reductions.

        ``average_in_collective`` averages in the collectives (``ReduceOp.AVG`` over the inner and
        the outer group; on gloo, which has no AVG, the communicator sums and then divides the
        result); what is left of the bucket's factor (1/EP for experts) is applied first, as
        upstream's expert scaling factor. By default the whole factor is applied before a SUM.
        """
        opts, outer_comm = self.state.options, self.state.comms.outer
        outer = outer_comm.size if outer_comm is not None else 1
        if opts.average_in_collective:  # (never with calculate_per_token_loss: config refuses)
            return dist.ReduceOp.AVG, b.grad_scale * b.comm.size * outer
        return dist.ReduceOp.SUM, b.grad_scale

    def _outer_reduce(self, b: Bucket, pending: torch.Tensor, then=None) -> None:
        """Launch the outer (HSDP all-reduce / HFSDP reduce-scatter) reduction of a bucket.

        Never waits: [Note: no blocking in hooks]. ``then`` (no_shard buckets) runs when it is
        done, at the end of backward."""
        comms = self.state.comms
        op = self.reduce_op(b)[0]
        if b.replicated:
            self.outer_inflight.append((comms.outer.all_reduce(pending, op=op),
                                        lambda value: then()))
            return
        if comms.outer_sharded:
            handle = comms.outer.reduce_scatter(pending, op=op)
        else:
            handle = comms.outer.all_reduce(pending, op=op)

        def finish(value, b=b):
            b.grad_shard.add_(value)
            b.outer_pending = None

        self.outer_inflight.append((handle, finish))

    # -- finishing -------------------------------------------------------------------------------
    def _finish_one(self) -> None:
        b, handle, finish = self.inflight.popleft()
        finish(handle.wait())

    def poll(self) -> None:
        """Finish the reductions that have completed, oldest first (never blocks)."""
        while self.inflight and self.inflight[0][1].is_completed():
            self._finish_one()

    def _sync_used_flags(self) -> None:
        """Agree across ranks on which parameters got a gradient (small all-reduces, MAX)."""
        state = self.state
        for expert in (False, True):
            buckets = [b for b in state.buckets if b.requires_grad and b.is_expert == expert]
            if not buckets:
                continue
            hybrid = state.comms.expt_hybrid if expert else state.comms.hybrid
            comms = [c for c in ((hybrid,) if hybrid is not None  # one collective over both
                                 else (buckets[0].comm, state.comms.outer))
                     if c is not None and c.size > 1]
            if not comms:
                continue  # one rank: the local flags are the answer, nothing to read back
            flags = torch.tensor([f for b in buckets for f in b.used], device=state.device)
            for comm in comms:
                comm.all_reduce(flags, async_op=False, op=dist.ReduceOp.MAX, kind="flags")
            values, at = flags.tolist(), 0  # one host read per step
            for b in buckets:
                b.used = values[at:at + len(b.names)]
                at += len(b.names)

    def finish_backward(self) -> None:
        """Root callback at the end of backward: launch what is left, wait for everything,
        release every unit and hand the parameters their reduced gradients."""
        state = self.state
        self.launch_ready(flush=True)
        while self.inflight:  # finishing inner reductions launches the outer ones, in order
            self._finish_one()
        synced = self.reducing() and self.reducing_outer()
        if synced:
            self._sync_used_flags()  # after every outer launch: the same order on all ranks
        while self.outer_inflight:
            handle, finish = self.outer_inflight.popleft()
            finish(handle.wait())
        if not state.user_unsharded:
            for unit in state.units:
                unit.reshard()
        for unit in state.units:
            unit.end_backward()
        for b in state.buckets:
            b.ready = 0
            b.is_ready = False
        self.cursor = 0
        self.backward_started = False
        state.sync.unreduced = not synced  # a no_sync micro-batch: see finish_grad_sync
        if synced:
            self.install_grads()
            state.sync.installed = True

    @torch.no_grad()
    def install_grads(self) -> None:
        """After a synchronising backward: hand every parameter its reduced gradient rows."""
        state, opts = self.state, self.state.options
        nan = []
        # Which parameters got a gradient (host-side flags, agreed over ranks in
        # _sync_used_flags).
        grad_buckets = [b for b in state.buckets if b.requires_grad]
        flags = [f for b in grad_buckets for f in b.used]
        used, at = {}, 0
        for b in grad_buckets:
            used[id(b)] = flags[at:at + len(b.names)]
            at += len(b.names)
        for sp in state.sparams:
            b = sp.bucket
            if not b.requires_grad or not used[id(b)][sp.index]:
                sp.set_grad(None, opts.use_decoupled_grad)
                continue
            g = b.local_view(b.grad_shard, sp.index).view(sp.local.shape)
            g = g if g.dtype == sp.local.dtype else g.to(sp.local.dtype)
            sp.set_grad(g, opts.use_decoupled_grad)
            if opts.report_nan_in_param_grad and torch.isnan(g).any():
                nan.append(sp.name)
        if opts.report_nan_in_param_grad:
            flag = torch.tensor([float(bool(nan))], device=state.device)
            if dist.get_world_size() > 1:  # every rank raises, none hangs in the next collective
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                where = ", ".join(nan[:8]) + (" ..." if len(nan) > 8 else "") if nan else (
                    "on another rank's shards")
                raise RuntimeError(f"report_nan_in_param_grad: NaN in the reduced gradients of "
                                   f"{len(nan)} parameter(s) on rank {dist.get_rank()}: {where}")
