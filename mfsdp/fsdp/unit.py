"""An FSDP unit: a module whose parameters are gathered together and released together.

:class:`FSDPUnit` plays the part of FSDP2's ``FSDPParamGroup``: it owns its buckets (the flat
buffers, :mod:`mfsdp.fsdp.bucket`), its parameters (:class:`mfsdp.fsdp.param.ShardedParam`), the all-gathers
in flight into its buckets, its phase in the step (:class:`~mfsdp.fsdp.state.UnitPhase`), and the
forward/backward hooks that move all of these. What units share (communicators, the forward order
that drives prefetching, memory counters, the double buffer, whether a backward synchronises) is
the :class:`~mfsdp.fsdp.state.ShardingState` each unit is handed at construction; gradient
reduction is that state's :class:`mfsdp.fsdp.reducer.GradReducer`. Building units from a module is
:mod:`mfsdp.fsdp.construct`.

The sequence of hooks is described in ``docs/concepts.md``; the version-counter and ordering notes
are in ``mfsdp/fsdp/module.py`` and ``mfsdp/fsdp/reducer.py``.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from mfsdp.fsdp.bucket import Bucket
from mfsdp.fsdp.collectives import Handle
from mfsdp.fsdp.state import ShardingState, UnitPhase

__all__ = ["FSDPUnit", "in_backward", "nvtx_enabled", "nvtx_pop", "nvtx_push",
           "tensors_requiring_grad"]

# [Note: NVTX ranges] Each unit marks its forward and its backward with an NVTX range named
# "MFSDP <unit> forward|backward" (<root> for the root), as upstream's per-module API does, for
# Nsight timelines. A CPU build of torch has no NVTX library (its torch.cuda.nvtx functions
# raise): there a range is emitted only if something replaced those functions (a tracer, a test).
_NVTX_PUSH, _NVTX_POP = torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
_BUILD_HAS_NVTX = torch.version.cuda is not None or torch.version.hip is not None
# a forward output -> (ids of the tensors hooked with it, the units their backward hook starts):
# see FSDPUnit.hook_backward_of
_HOOKED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def nvtx_enabled() -> bool:
    """Whether ranges are emitted: a CUDA or ROCm build, or NVTX's functions replaced (see
    [Note: NVTX ranges])."""
    nvtx = torch.cuda.nvtx
    return _BUILD_HAS_NVTX or nvtx.range_push is not _NVTX_PUSH or nvtx.range_pop is not _NVTX_POP


def nvtx_push(label: str) -> None:
    """Open an NVTX range named ``label`` (see [Note: NVTX ranges])."""
    if nvtx_enabled():
        torch.cuda.nvtx.range_push(label)


def nvtx_pop() -> None:
    """Close the innermost NVTX range (see [Note: NVTX ranges])."""
    if nvtx_enabled():
        torch.cuda.nvtx.range_pop()


def tensors_requiring_grad(obj) -> list[torch.Tensor]:
    """Tensors requiring grad in a (nested) forward output."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.requires_grad else []
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in tensors_requiring_grad(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in tensors_requiring_grad(o)]
    if hasattr(obj, "__dataclass_fields__"):
        return [t for f in obj.__dataclass_fields__ for t in tensors_requiring_grad(getattr(obj, f))]
    return []


def in_backward() -> bool:
    """Whether autograd is running a backward now (a forward now is a recompute)."""
    return torch._C._current_graph_task_id() != -1


def _labelled(label: str):
    """Run a unit's hook inside a profiler range named ``mfsdp::<label> (<unit>)``, as FSDP2
    names its hooks, so that a trace shows which unit's hook took the time."""
    def wrap(fn):
        @functools.wraps(fn)
        def labelled(self, *args, **kwargs):
            with torch.profiler.record_function(f"mfsdp::{label} ({self.name or 'root'})"):
                return fn(self, *args, **kwargs)
        return labelled
    return wrap


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward calls back once the unit's backward is done."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


class FSDPUnit:
    """A module whose parameters are gathered together and released together (see the module
    notes): its buckets, parameters, in-flight all-gathers, backward progress and hooks."""

    def __init__(self, name: str, module: nn.Module, state: ShardingState):
        self.name = name  # module path ("" for the root)
        self.module = module  # whose hooks drive it (the wrapper module for the root)
        self.state = state  # what the units of this model share
        self.buckets: list[Bucket] = []
        self.params: list = []  # its ShardedParams
        self.pending: list[Handle] = []  # in-flight all-gathers into its buckets
        self.phase = UnitPhase.IDLE
        # Forwards of this backward whose inputs carry a post-backward hook that has not fired
        # yet (a unit may run several forwards per backward); BACKWARD_DONE when it reaches 0.
        self.fwd_pending = 0
        # Its backward NVTX range in this backward: None (not opened), "open" or "closed".
        self.backward_range: str | None = None

    def __repr__(self) -> str:
        return f"FSDPUnit({self.name or '(root)'!r}, {len(self.buckets)} buckets)"

    @property
    def is_root(self) -> bool:
        return self.name == ""

    @property
    def gathered_bytes(self) -> int:
        return sum(b.plan.padded_numel * b.full.element_size() for b in self.buckets)

    @property
    def requires_grad(self) -> bool:
        return any(b.requires_grad for b in self.buckets)

    # ------------------------------------------------------------------------------------------
    # gathered weights
    # ------------------------------------------------------------------------------------------
    def gather(self, wait: bool = True) -> None:
        """All-gather this unit's sharded weights (ZeRO-3), or just wait for a prefetch."""
        state = self.state
        if state.strategy.shards_params and not self.pending:
            todo = [b for b in self.buckets if not b.gathered]
            if todo and todo[0].in_pool:
                if not wait and not state.pool.available(self):
                    state.pool.skipped_prefetches += 1  # its slot is busy: gather on demand
                    return
                state.pool.acquire(self, self.name)
            for b in todo:
                self._alloc(b)
                with torch.no_grad():
                    self.pending.append(b.ag_comm.all_gather(b.full_comm, b.model_shard))
        if wait:
            for h in self.pending:
                h.wait()
            self.pending.clear()

    def _alloc(self, b: Bucket) -> None:
        if not b.in_pool:
            b.alloc_full()
        if b.unit:
            self.state.count_gathered(b.plan.padded_numel * b.full.element_size())
        self.state.note_memory("gather", self.name)

    def _release(self, b: Bucket) -> None:
        if not b.gathered:
            return
        if b.unit and b.sharded_params:
            self.state.count_gathered(-b.plan.padded_numel * b.full.element_size())
        if not b.in_pool:
            b.release_full()
        else:
            b.pool_held = False
        self.state.note_memory("release", self.name)

    def reshard(self) -> None:
        """Put the sharded parameters back in the modules and release the gathered weights."""
        state = self.state
        if not state.user_unsharded:
            self.shard_views()
        if state.strategy.shards_params:
            for h in self.pending:  # never free a buffer a collective is still writing
                h.wait()
            self.pending.clear()
            for b in self.buckets:
                self._release(b)
            if state.pool is not None and not self.is_root:
                state.pool.release(self)

    def prefetch(self, direction: int) -> None:
        """Launch the all-gathers of the next units in forward (+1) or backward (-1) order."""
        for d in range(1, self.state.options.prefetch_depth + 1):
            nxt = self.state.order.next(self, direction * d)
            if nxt is None:
                return
            nxt.gather(wait=False)

    def unshard_views(self) -> None:
        """The modules hold the full-weight views (during forward and backward)."""
        for sp in self.params:
            sp.to_unsharded()

    def shard_views(self) -> None:
        """The modules hold the sharded parameters (outside forward)."""
        for sp in self.params:
            sp.to_sharded()

    # ------------------------------------------------------------------------------------------
    # hooks
    # ------------------------------------------------------------------------------------------
    def register_hooks(self) -> None:
        """Forward hooks on the unit's module; gradient hooks on its parameters."""
        self.module.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        self.module.register_forward_hook(self._post_forward)
        for sp in self.params:
            if sp.unsharded.requires_grad:
                sp.unsharded.register_post_accumulate_grad_hook(self._grad_hook(sp))

    @_labelled("pre_forward")
    def _pre_forward(self, module, args, kwargs):
        nvtx_push(self.range_label("forward"))  # closed by _post_forward
        state = self.state
        if in_backward():
            # Recompute under activation checkpointing: the weights are (or are being) gathered
            # for this unit's backward; no prefetch, no post-backward hook.
            self.gather()
            self.unshard_views()
            return None
        if self.is_root:
            state.begin_forward()
            # Weights the root kept after a forward that no backward followed may be older than
            # the last optimizer step: gather them afresh.
            if not state.user_unsharded:
                self.reshard()
        else:
            state.order.record(self)
        if self.phase in (UnitPhase.IDLE, UnitPhase.AWAITING_BACKWARD):
            self.phase = UnitPhase.FORWARD
        self.gather()
        self.unshard_views()
        if torch.is_grad_enabled():
            if state.options.overlap_param_gather:
                self.prefetch(+1)
            args, kwargs = self._register_post_backward(args, kwargs)
        state.reducer.poll()
        return args, kwargs

    @_labelled("post_forward")
    def _post_forward(self, module, args, output):
        backward = in_backward()
        if self.is_root and not backward:
            self.state.order.end()
        if self.phase is UnitPhase.FORWARD:
            # (fwd_pending counts this backward's forwards whose post-backward hook is pending)
            self.phase = UnitPhase.AWAITING_BACKWARD if self.fwd_pending else UnitPhase.IDLE
        if not self.state.user_unsharded:
            self.shard_views()
            # A recompute keeps the weights for the backward under way; so does the root when a
            # backward follows, as FSDP2 does: its backward (loss and output layer) runs first.
            keep = backward or (self.is_root and torch.is_grad_enabled()
                                and self.state.root_keeps_weights)
            if not keep:
                self.reshard()
        self.hook_backward_of(output, [self])
        nvtx_pop()
        return output

    def range_label(self, phase: str) -> str:
        """The NVTX range name of this unit's ``phase`` (upstream's)."""
        return f"MFSDP {self.name or '<root>'} {phase}"

    def close_backward_range(self) -> None:
        """The unit's backward is over (its gradients are all in, or its post-backward hook
        fired): close its backward NVTX range if it is open."""
        if self.backward_range == "open":
            self.backward_range = "closed"
            nvtx_pop()

    def hook_backward_of(self, output, units: list[FSDPUnit]) -> None:
        """Run :meth:`pre_backward` of ``units`` when the first gradient of ``output`` arrives.

        An outer unit that returns an inner unit's output as it is (the last layer's) joins the
        inner unit's hook: the units' pre-backward work runs in the order they were hooked, as
        before, and their NVTX ranges open outermost first, nested as upstream's are."""
        tensors = tensors_requiring_grad(output)
        if not tensors or not torch.is_grad_enabled():
            return
        ids = [id(t) for t in tensors]
        hooked = _HOOKED.get(tensors[0])
        if hooked is not None and hooked[0] == ids:
            hooked[1].extend(units)
            return
        chain = list(units)
        _HOOKED[tensors[0]] = (ids, chain)

        def start(grad) -> None:
            for u in reversed(chain):
                u.open_backward_range()
            for u in chain:
                u.pre_backward()

        torch.autograd.graph.register_multi_grad_hook(tensors, start, mode="any")

    def open_backward_range(self) -> None:
        """Open the unit's backward NVTX range (once per backward; :meth:`pre_backward` opens it
        where no hook did)."""
        if self.backward_range is None:  # once per backward (a unit may run several forwards)
            self.backward_range = "open"
            nvtx_push(self.range_label("backward"))

    @_labelled("pre_backward")
    def pre_backward(self) -> None:
        """Before the unit's backward: gather its weights (and prefetch the next unit's)."""
        state = self.state
        state.reducer.start_backward()
        self.open_backward_range()
        if self.phase is not UnitPhase.BACKWARD_DONE:
            self.phase = UnitPhase.BACKWARD
        self.gather()
        # A recompute that bypasses module hooks (checkpoint of a function that reads the
        # module's weights) finds the full weights in place, as in forward.
        self.unshard_views()
        if state.options.overlap_param_gather:
            self.prefetch(-1)
        state.reducer.poll()

    def _register_post_backward(self, args, kwargs):
        """Route the unit's floating-point inputs through :class:`_PostBackward`, whose backward
        runs once autograd has computed the gradients of everything the unit did with them:
        then every gradient of the unit's parameters has arrived (unused ones never will)."""
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx or not (self.requires_grad or nvtx_enabled()):
            return args, kwargs
        if self.requires_grad:
            self.fwd_pending += 1
            callback = self._post_backward
        else:  # a frozen unit: only its backward NVTX range (when ranges are emitted) waits
            callback = self.close_backward_range
        outs = _PostBackward.apply(callback, *[flat[i] for i in idx])
        for i, t in zip(idx, outs):
            flat[i] = t
        return tree_unflatten(flat, spec)

    @_labelled("post_backward")
    def _post_backward(self) -> None:
        self.fwd_pending -= 1
        if self.fwd_pending > 0:
            return
        self.phase = UnitPhase.BACKWARD_DONE
        reducer = self.state.reducer
        for b in self.buckets:
            if b.requires_grad and not b.is_ready:
                reducer.bucket_ready(b)
        if not self.is_root and not self.state.user_unsharded:
            self.reshard()
        self.close_backward_range()
        reducer.poll()

    def _grad_hook(self, sp):
        # [Note: weak hook references] The hook lives on the parameter tensor, which C++ owns:
        # a strong reference from it to the bucket or the reducer would close a cycle (tensor ->
        # hook -> bucket -> state -> tensor) that Python's garbage collector cannot see, and the
        # model, its communicators and so its process groups would never be freed (gloo's threads
        # then outlive destroy_process_group() and abort the process at exit).
        sp_ref, reducer_ref, i = weakref.ref(sp), weakref.ref(self.state.reducer), sp.index
        label = f"mfsdp::post_accumulate_grad ({self.name or 'root'})"

        def hook(param: torch.Tensor) -> None:
            with torch.profiler.record_function(label):
                _accumulate(param)

        def _accumulate(param: torch.Tensor) -> None:
            grad = param.grad
            param.grad = None
            owner, reducer = sp_ref(), reducer_ref()
            if grad is None or owner is None or reducer is None:
                return
            bucket = owner.bucket
            grad = owner.local_grad(grad)
            if bucket.is_ready:
                raise RuntimeError(
                    f"a gradient of {bucket.names[i]!r} arrived after its FSDP unit "
                    f"{bucket.unit or '(root)'!r} finished its backward: the parameter was used "
                    "outside the forward of the module that owns it; make that module (or a "
                    "common parent) the FSDP unit, or call it through its owner's forward")
            reducer.grad_full(bucket)
            with torch.no_grad():
                bucket.add_grad(i, grad)
            bucket.used[i] = 1.0
            bucket.ready += 1
            if bucket.ready == bucket.n_grad_params:
                reducer.bucket_ready(bucket)
            reducer.poll()
        return hook

    def can_release_in_backward(self) -> bool:
        """Whether the unit's weights can go now: every bucket's gradients are complete (a node
        computing a weight's gradient is done with the weight) and, with frozen weights, the
        post-backward hook has vouched that the unit's backward is over."""
        return (self.state.strategy.shards_params and not self.is_root
                and not self.state.user_unsharded
                and all(b.is_ready if b.requires_grad else self.phase is UnitPhase.BACKWARD_DONE
                        for b in self.buckets))

    def end_backward(self) -> None:
        """Forget this backward's progress (the root callback, at the end of backward)."""
        self.fwd_pending = 0
        self.phase = UnitPhase.IDLE
        self.close_backward_range()
        self.backward_range = None
