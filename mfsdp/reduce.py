"""Gradient reduction of a sharded model: per-bucket launches, outer reductions, end of backward.

:class:`GradReduction` is mixed into :class:`mfsdp.FullyShardedModule`; it reads the model's
buckets, communicators and per-backward state, and is split out only to keep one idea per file.

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
buffer that is all-reduced and added (see ``_grad_full``); ``zero_grad`` drops that buffer.

[Note: bounded reduce-scatters] At most ``max_inflight_reduce`` reduce-scatters are in flight; the
oldest is finished (its full gradient buffer released) before another is launched, so full gradient
buffers never pile up until the end of backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mfsdp.buffers import Bucket

__all__ = ["GradReduction"]


class GradReduction:
    """Launching, finishing and ordering the gradient reductions of a sharded model."""

    def _reducing(self) -> bool:
        """Whether this backward reduces gradients (ZeRO-2/3 always: their grads are sharded)."""
        sync = self._auto_sync if self._sync_override is None else self._sync_override
        return sync or self.strategy.shards_grads

    def _bucket_ready(self, bucket: Bucket) -> None:
        bucket.is_ready = True
        unit = self._unit_by_name[bucket.unit]
        # Release the unit's weights once its backward cannot read them any more: when every
        # parameter's gradient has arrived (a node computing a weight's gradient is done with the
        # weight), unless frozen weights remain, which only the post-backward hook can vouch for.
        if (self.strategy.shards_params and not unit.is_root and not self._user_unsharded
                and all(b.is_ready if b.requires_grad else unit.post_backward_done
                        for b in unit.buckets)):
            self._reshard(unit)
        if self.overlap_grad_reduce:
            self._launch_ready()

    def _launch_ready(self, flush: bool = False) -> None:
        while self._launch_cursor < len(self._grad_order):
            b = self._grad_order[self._launch_cursor]
            if not (b.is_ready or flush):
                return
            self._launch_cursor += 1
            if self._reducing():
                self._launch(b)

    @torch.no_grad()
    def _launch(self, b: Bucket) -> None:
        g = self._grad_full(b)
        b.zero_unwritten()
        src = g if b.comm_dtype == g.dtype else g.to(b.comm_dtype)
        op, scale = self._reduce_op(b)
        if scale != 1.0:
            src.mul_(scale)
        if b.replicated:
            handle = b.comm.all_reduce(src, op=op)

            def finish(value, src=src, g=g, b=b):
                if self.outer_comm is not None:  # HSDP over no_shard: the same buffer again
                    self._outer_reduce(b, src)
                if g is b.grad_shard:  # nothing reduced since zero_grad: reduce in place
                    if src is not g:
                        g.copy_(src)
                else:  # [Note: no_shard accumulation]
                    b.grad_shard.add_(src)
                    g.zero_()
                b.holds_reduced = True
        else:
            handle = b.comm.reduce_scatter(src, op=op)

            def finish(value, b=b):
                if self.outer_comm is None:
                    b.grad_shard.add_(value)
                else:
                    if b.outer_pending is None:
                        b.outer_pending = torch.zeros_like(value)
                    b.outer_pending.add_(value)
                nbytes = b.grad_full.untyped_storage().nbytes() if b.sharded_grads else 0
                b.release_grad_full()
                self.memory["grad_full_bytes"] -= nbytes
                if self.outer_comm is not None and self._reducing_outer():
                    self._outer_reduce(b, b.outer_pending)

        self._inflight.append((b, handle, finish))
        while len(self._inflight) > self.max_inflight_reduce:
            self._finish_one()

    def _reduce_op(self, b: Bucket) -> tuple:
        """(reduce op, pre-scale factor) of a bucket's gradient reductions.

        ``average_in_collective`` lets NCCL divide (``ReduceOp.AVG``) over the inner and outer
        groups; what is left of the bucket's factor (1/EP for experts) is applied first. gloo has
        no AVG: there, and by default, the whole factor is applied before a SUM.
        """
        outer = self.outer_comm.size if self.outer_comm is not None else 1
        if (self.average_in_collective and not self.calculate_per_token_loss
                and b.comm.backend == "nccl"):
            return dist.ReduceOp.AVG, b.grad_scale * b.comm.size * outer
        return dist.ReduceOp.SUM, b.grad_scale

    def _reducing_outer(self) -> bool:
        """Outer reductions happen only in synchronising backwards (the last micro-batch)."""
        return self._auto_sync if self._sync_override is None else self._sync_override

    def _outer_reduce(self, b: Bucket, pending: torch.Tensor) -> None:
        """Launch the outer (HSDP all-reduce / HFSDP reduce-scatter) reduction of a bucket."""
        op = self._reduce_op(b)[0]
        if b.replicated:
            self._outer_inflight.append((self.outer_comm.all_reduce(pending, async_op=False, op=op),
                                         lambda value: None))
            return
        if self.outer_sharded:
            handle = self.outer_comm.reduce_scatter(pending, op=op)
        else:
            handle = self.outer_comm.all_reduce(pending, op=op)

        def finish(value, b=b):
            b.grad_shard.add_(value)
            b.outer_pending = None

        self._outer_inflight.append((handle, finish))

    def _finish_one(self) -> None:
        b, handle, finish = self._inflight.popleft()
        finish(handle.wait())

    def _poll(self) -> None:
        while self._inflight and self._inflight[0][1].is_completed():
            self._finish_one()

    def _sync_used_flags(self) -> None:
        """Agree across ranks on which parameters got a gradient (small all-reduces, MAX)."""
        for expert in (False, True):
            buckets = [b for b in self.buckets if b.requires_grad and b.is_expert == expert]
            if not buckets:
                continue
            comms = [c for c in (buckets[0].comm, self.outer_comm) if c is not None and c.size > 1]
            if not comms:
                continue  # one rank: the local flags are the answer, nothing to read back
            flags = torch.tensor([f for b in buckets for f in b.used], device=self.device)
            for comm in comms:
                comm.all_reduce(flags, async_op=False, op=dist.ReduceOp.MAX, kind="flags")
            values, at = flags.tolist(), 0  # one host read per step
            for b in buckets:
                b.used = values[at:at + len(b.names)]
                at += len(b.names)

    def _finish_backward(self) -> None:
        """Root callback at the end of backward: launch what is left, wait for everything."""
        self._launch_ready(flush=True)
        while self._inflight:  # finishing inner reductions launches the outer ones, in order
            self._finish_one()
        if self._reducing() and self._reducing_outer():
            self._sync_used_flags()  # after every outer launch: the same order on all ranks
        while self._outer_inflight:
            handle, finish = self._outer_inflight.popleft()
            finish(handle.wait())
        if not self._user_unsharded:
            for unit in self.units:
                self._reshard(unit)
        for unit in self.units:
            unit.fwd_pending = 0
            unit.post_backward_done = False
        for b in self.buckets:
            b.ready = 0
            b.is_ready = False
        self._launch_cursor = 0
        self._backward_started = False
        self._unreduced = not (self._reducing() and self._reducing_outer())
        if not self._unreduced:
            self._install_grads()
