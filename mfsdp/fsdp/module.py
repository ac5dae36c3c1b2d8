"""The wrapper module: what the units of one sharded model share, and the model-level API.

``FullyShardedModule(module, ...)`` (built by :func:`mfsdp.fully_shard_model`) takes over the
parameters of ``module``. The work is done by objects that each own their state, in the manner of
FSDP2's ``_fully_shard`` package:

* :class:`mfsdp.fsdp.unit.FSDPUnit` (one per unit, as FSDP2's ``FSDPParamGroup``): its buckets, its
  parameters, the all-gathers in flight into it, its backward progress and its hooks;
* :class:`mfsdp.fsdp.param.ShardedParam` (one per parameter, as ``FSDPParam``): its faces (the full
  view during forward, the ``DTensor`` outside), its rows, its reduced gradient;
* :class:`mfsdp.fsdp.bucket.Bucket`: the flat buffers of one group of parameters on one rank;
* :class:`mfsdp.fsdp.reducer.GradReducer` (one per model): the gradient reductions of a backward;
* :func:`mfsdp.fsdp.construct.build_units` makes the units from the module.

What units share (communicators, the forward order that drives prefetching, memory counters, the
double buffer, whether a backward synchronises) is one :class:`mfsdp.fsdp.state.ShardingState`,
built here and handed to each unit and to the reducer; the module itself holds the API:
``no_sync``, ``unshard``/``reshard``, state-dict hooks, ``zero_grad_buffer``... The mechanism, step by step, is
described in ``docs/concepts.md``; the notes below and in ``mfsdp/fsdp/reducer.py`` say why.

[Note: version counters] Parameters are views of ``Bucket.full`` and share its version counter,
which autograd checks for the weights it saved in forward. Re-gathering weights for backward writes
the same values again, but an async collective bumps its output's counter when it completes (on
gloo in a background thread, at a time we do not control), which autograd would report as an
in-place modification. So collectives write through ``Bucket.full_comm``: a second tensor over the
same storage with a version counter of its own.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn

from mfsdp.config import EngineOptions, MixedPrecisionPolicy, ShardingStrategy
from mfsdp.fsdp import registry
from mfsdp.fsdp.construct import build_units
from mfsdp.fsdp.reducer import GradReducer
from mfsdp.fsdp.state import Comms, GradSync, ShardingState
from mfsdp.fsdp.unit import FSDPUnit, in_backward
from mfsdp.layout import ProcessGroups

__all__ = ["FullyShardedModule", "FSDPUnit"]


class FullyShardedModule(nn.Module):
    """A module whose parameters are sharded over a data-parallel group (see :func:`mfsdp.fully_shard`).

    ``forward`` calls the wrapped ``module``; ``module`` keeps its structure and names, its
    parameters are views of flat bucket buffers.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        groups: ProcessGroups,
        strategy: ShardingStrategy,
        unit_classes: tuple[type, ...],
        device: torch.device,
        mixed_precision_policy: MixedPrecisionPolicy,
        options: EngineOptions | None = None,
        outer_strategy: ShardingStrategy = ShardingStrategy.NO_SHARD,
        hooks_on_module: bool = False,
        hybrid_groups: tuple = (None, None),
    ):
        super().__init__()
        opts = options or EngineOptions()
        self.module = module
        # What the units and the reducer share, handed to each of them (mfsdp/fsdp/state.py).
        state = ShardingState(strategy, device, mixed_precision_policy, opts,
                              Comms.build(groups, outer_strategy, device, hybrid_groups),
                              sync=GradSync(auto=opts.sync_model_each_microbatch))
        self._state = state
        state.root_keeps_weights = not hooks_on_module  # (upstream v2 releases its root too)
        # The root unit's hooks go on this wrapper, whose forward callers use; the per-module
        # front door (mfsdp.experimental) leaves the model in place and calls ``module`` itself.
        built = build_units(state, module, module if hooks_on_module else self, unit_classes)
        state.units = built.units
        state.unit_by_name = {u.name: u for u in built.units}
        state.pool = built.pool
        state.grad_pool = built.grad_pool
        state.sparams = built.sparams
        state.sparam_of = built.by_face
        # fully_shard_optimizer and plain optimizers find this model from its parameters
        registry.register_parameters(self, [sp.sharded for sp in state.sparams])
        state.reducer = GradReducer(state, opts.max_inflight_reduce)
        state.main_versions = state.sharded_versions()
        for unit in state.units:
            unit.register_hooks()
        # a model builder declared checkpoint names for the module (mfsdp.moe.shard_experts does)
        state.set_global_names(registry.checkpoint_names(module))
        # the keys a load_state_dict() filled, from its pre-hook to its post-hook
        self._loaded_keys: set[str] = set()
        # A call of the original module, not of this wrapper, would run the root unit's layers
        # on their shards (the root unit's hooks are the wrapper's): say what to call instead.
        self._calling = False  # inside forward(): the wrapper called the module
        wrapper = weakref.ref(self)

        def direct_call(mod, args):
            owner = wrapper()
            if (owner is not None and not owner._calling and not owner._state.user_unsharded
                    and not in_backward()):  # (a recompute runs the module again)
                raise RuntimeError(
                    f"{type(mod).__name__} was sharded by fully_shard: outside the returned "
                    "model's forward its parameters are this rank's shards (DTensors); call the "
                    "model fully_shard returned (model, optimizer = fully_shard(module, ...); "
                    "model(...)), or run inside `with model.unsharded():`")

        if not hooks_on_module:  # (the per-module front door calls the module itself)
            module.register_forward_pre_hook(direct_call)
        if opts.preproc_state_dict_for_dcp_ckpt:
            self._register_state_dict_hook(FullyShardedModule._state_dict_hook)
        self._register_load_state_dict_pre_hook(self._load_pre_hook)
        self.register_load_state_dict_post_hook(FullyShardedModule._load_post_hook)

    # ------------------------------------------------------------------------------------------
    # introspection: one accessor, as FSDP2 keeps its state behind FSDPModule._get_fsdp_state()
    # ------------------------------------------------------------------------------------------
    def fsdp_state(self) -> ShardingState:
        """What this model's units and reducer share (:class:`~mfsdp.fsdp.state.ShardingState`):
        units, buckets, parameters, communicators and their log, memory counters. For tests,
        tools and inspection; training needs none of it."""
        return self._state

    # upstream Megatron-FSDP's attributes of the same name
    mp_policy = property(lambda self: self._state.mp_policy, doc="The mixed-precision policy.")
    device = property(lambda self: self._state.device, doc="The device of the shards.")

    def gather_recursively(self, module: nn.Module) -> None:
        """Gather every unit inside ``module`` before its forward and release them after it.

        For modules whose forward bypasses their children's ``forward`` (fused kernels reading
        child weights directly): the children's own hooks never fire, so ``module`` takes their
        place, in forward and, through a hook on its outputs, in backward.
        """
        path = next((n for n, m in self.module.named_modules() if m is module), None)
        if path is None:
            raise ValueError(f"{type(module).__name__} is not a submodule of the sharded model")
        inner = [u for u in self._state.units if not u.is_root
                 and (path == "" or u.name == path or u.name.startswith(path + "."))]
        if not inner:
            raise ValueError(f"{path or 'the root'} ({type(module).__name__}) contains no FSDP "
                             "unit; list its children's classes in fsdp_unit_modules")

        def pre(mod, args):
            for unit in inner:
                unit.gather()
                unit.unshard_views()

        def post(mod, args, output):
            if self._state.user_unsharded:
                return output
            for unit in inner:
                unit.shard_views()
                if not in_backward():
                    unit.reshard()
            inner[0].hook_backward_of(output, inner)
            return output

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)

    # ------------------------------------------------------------------------------------------
    # steps
    # ------------------------------------------------------------------------------------------
    def wait_param_sync(self) -> None:
        """Wait for the weight all-gathers launched after the last optimizer step (ZeRO-1/2,
        HFSDP). The next forward waits for them anyway; benchmarks call this to time a whole
        step."""
        self._state.wait_param_sync()

    def forward(self, *args, **kwargs):
        self._calling = True
        try:
            return self.module(*args, **kwargs)
        finally:
            self._calling = False

    def finish_grad_sync(self) -> None:
        """Make sure every gradient reduction has finished (the optimizer calls this)."""
        if self._state.reducer.backward_started:
            raise RuntimeError("finish_grad_sync() during backward")
        if self._state.sync.unreduced:
            raise RuntimeError(
                "the last backward ran under no_sync() (or with sync_model_each_microbatch=False "
                "outside sync()), so its gradients were never reduced across ranks; run the last "
                "micro-batch of each step outside no_sync() (or inside sync()) before "
                "optimizer.step()")

    def zero_grad_buffer(self) -> None:
        """Zero the reduced gradients (and any accumulated full gradients)."""
        self._state.zero_grads()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients: the reduced ones and the accumulation buffers (see
        :meth:`zero_grad_buffer`); ``nn.Module.zero_grad`` alone would leave the buffers.

        ``set_to_none=True`` drops the parameters' ``.grad``; ``False`` zeroes the gradients a
        parameter holds in place and keeps them (``nn.Module.zero_grad``'s meaning)."""
        self._state.zero_grads(set_to_none)

    # -- upstream Megatron-FSDP's names for the same steps ----------------------------------------
    @property
    def model_auto_sync(self) -> bool:
        """Whether every backward synchronises (``sync_model_each_microbatch``)."""
        return self._state.sync.auto

    def start_grad_sync(self) -> None:
        """Launch the gradient reductions that have not started (after a backward run with
        ``overlap_grad_reduce=False`` they all start at its end already: nothing to do then)."""
        if self._state.reducer.backward_started:
            self._state.reducer.launch_ready(flush=True)

    def start_param_sync(self) -> None:
        """Nothing to start: weights are gathered by the forward hooks (ZeRO-3) or right after
        the optimizer step (ZeRO-1/2, waited for by :meth:`wait_param_sync`)."""

    def install_optimized_model_weights(self) -> None:
        """Copy the main weights into the model weights after an optimizer step, then
        re-replicate them (ZeRO-1/2, HFSDP): what a ``ShardedOptimizer`` step does unless told
        not to (``install_optimized_model_weights=False``)."""
        self._state.install_main_weights()

    def no_sync(self):
        """Skip the gradient reduction of backwards run inside (for all but the last micro-batch).

        Under ``no_shard`` and ``optim`` gradients simply accumulate locally. Under
        ``optim_grads`` and ``optim_grads_params`` gradients are sharded, so each micro-batch is
        still reduce-scattered (into the accumulating shard); only deferrable reductions wait.
        """
        return self._sync_as(False)

    def sync(self):
        """Reduce gradients in backwards run inside, whatever ``sync_model_each_microbatch`` says."""
        return self._sync_as(True)

    @contextlib.contextmanager
    def _sync_as(self, value: bool):
        sync = self._state.sync
        old, sync.override = sync.override, value
        try:
            yield
        finally:
            sync.override = old

    def set_model_auto_sync(self, sync: bool) -> None:
        """Set whether every backward reduces gradients (``sync_model_each_microbatch``)."""
        self._state.sync.auto = bool(sync)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """FSDP2's name of :meth:`set_model_auto_sync`: ``False`` lets backwards skip the
        reductions that can wait (accumulate micro-batches), ``True`` reduces in every backward."""
        self.set_model_auto_sync(requires_gradient_sync)

    # -- the mixed-precision policy of a step (upstream Megatron-FSDP 0.6.1's two methods) --------
    def reset_mixed_precision_policy(self, mixed_precision_policy: MixedPrecisionPolicy) -> None:
        """Take ``mixed_precision_policy``'s gradient communication dtype from now on.

        As upstream's method: the main-weight and main-gradient dtypes stay what the model was
        built with (they size buffers that already hold the weights and the accumulated
        gradients), so only ``grad_comm_dtype`` is read from the new policy; ``None`` there means
        "communicate in the main-gradient dtype". It acts on the next gradient reduction.
        Upstream 0.6.1 applies it only with ``nccl_ub`` or ``fsdp_double_buffer`` (its comment
        says the opposite); mfsdp casts into a temporary for every reduction and always applies it.
        """
        if not isinstance(mixed_precision_policy, MixedPrecisionPolicy):
            raise TypeError(f"mixed_precision_policy={mixed_precision_policy!r} must be an "
                            "mfsdp.MixedPrecisionPolicy")
        if self._state.reducer.backward_started:
            raise RuntimeError("reset_mixed_precision_policy() during backward: change the "
                               "policy between steps, where no reduction is in flight")
        old = self._state.mp_policy
        self._state.mp_policy = MixedPrecisionPolicy(
            main_params_dtype=old.main_params_dtype, main_grads_dtype=old.main_grads_dtype,
            grad_comm_dtype=mixed_precision_policy.grad_comm_dtype)
        for b in self._state.buckets:  # each bucket resolved its dtypes when it was built
            b.comm_dtype = self._state.mp_policy.grad_comm_dtype or b.grad_dtype

    @contextlib.contextmanager
    def mixed_precision_context(self, mixed_precision_policy: MixedPrecisionPolicy):
        """``with model.mixed_precision_context(policy): ...``: the gradient communication dtype
        of ``policy`` inside (see :meth:`reset_mixed_precision_policy`), the previous policy
        restored on the way out, also when the block raises."""
        saved = self._state.mp_policy
        self.reset_mixed_precision_policy(mixed_precision_policy)
        try:
            yield self
        finally:
            self.reset_mixed_precision_policy(saved)

    # ------------------------------------------------------------------------------------------
    # full weights on demand, state dicts
    # ------------------------------------------------------------------------------------------
    def unshard(self) -> None:
        """Gather every unit's full weights (compute dtype) and put them in the modules, until
        :meth:`reshard` (a collective call under ``optim_grads_params``).

        For inference, generation and export: forward then neither releases nor swaps weights.
        Prefer the context manager :meth:`unsharded`.
        """
        if self._state.pool is not None:
            raise RuntimeError("unshard() needs every unit gathered at once, which the two-slot "
                               "fsdp_double_buffer cannot hold; use fsdp_double_buffer=False")
        if self._state.user_unsharded:
            return
        self._state.install_stepped_main_weights()
        self.wait_param_sync()
        for unit in self._state.units:
            unit.gather()
            unit.unshard_views()
        self._state.user_unsharded = True

    def reshard(self) -> None:
        """Undo :meth:`unshard`: modules hold the sharded parameters again, gathered weights are
        released (ZeRO-3)."""
        if not self._state.user_unsharded:
            return
        self._state.user_unsharded = False
        for unit in self._state.units:
            unit.shard_views()
            unit.reshard()

    @contextlib.contextmanager
    def unsharded(self):
        """``with model.unsharded(): ...``: full weights in the modules inside (see
        :meth:`unshard`)."""
        self.unshard()
        try:
            yield self
        finally:
            self.reshard()

    def _state_keys(self, sp, prefix: str) -> list[str]:
        return [f"{prefix}module.{name}" for name in sp.names]

    @staticmethod
    def _state_dict_hook(self, state_dict, prefix, local_metadata):
        return self._state.dcp_state_dict(state_dict, f"{prefix}module.")

    def _load_pre_hook(self, state_dict, prefix, local_metadata, strict, missing_keys,
                       unexpected_keys, error_msgs):
        # Loaded values go straight into the main weights (a later install copies them into the
        # model weights), so a bf16 model with fp32 main weights keeps what it loaded.
        self.wait_param_sync()  # an all-gather still in flight would overwrite what we load
        loaded = set()
        for sp in self._state.sparams:
            for key in self._state_keys(sp, prefix):
                if key in state_dict:
                    value = state_dict.pop(key)
                    if sp not in loaded:
                        try:
                            sp.load_(value)
                        except ValueError as e:
                            error_msgs.append(f"{key}: {e}")
                        loaded.add(sp)
                    self._loaded_keys.add(key)
        if loaded:
            self._after_load()

    @staticmethod
    def _load_post_hook(self, incompatible_keys):
        keys = self._loaded_keys
        incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys
                                             if k not in keys]
        keys.clear()

    @torch.no_grad()
    def _after_load(self) -> None:
        """Make the model weights agree with freshly loaded main weights."""
        again = self._state.user_unsharded
        if again:
            self.reshard()
        self._state.install_main_weights()
        self.wait_param_sync()
        if again:
            self.unshard()

    # ------------------------------------------------------------------------------------------
    # full weights, upstream's buffers
    # ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def full_parameters(self, main: bool = True) -> dict[str, torch.Tensor]:
        """Every parameter gathered to its full shape on every rank (a collective call).

        ``main=True`` returns the main weights (the optimizer's fp32 copy), otherwise the model
        weights in compute dtype.
        """
        if not main:
            self._state.install_stepped_main_weights()
            self.wait_param_sync()
        full = {}
        for b in self._state.buckets:
            src = b.main_shard if main else b.model_shard
            if b.replicated:
                flat = src
            else:
                if main and b.outer_factor > 1:
                    inner = torch.empty(b.outer_factor * b.plan.shard_numel, dtype=src.dtype,
                                        device=src.device)
                    self._state.comms.outer.all_gather(inner, src.contiguous(), async_op=False)
                    src = inner
                flat = torch.empty(b.plan.padded_numel, dtype=src.dtype, device=src.device)
                b.comm.all_gather(flat, src.contiguous(), async_op=False)
            for i, name in enumerate(b.names):
                slot = b.plan.params[i]
                full[name] = flat[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
        # Under TP each parameter so far is this rank's TP block: gather the blocks.
        return {sp.name: sp.tp.full_of(full[sp.name]) if sp.tp_sharded else full[sp.name]
                for sp in self._state.sparams}

    @property
    def param_and_grad_buffer(self):
        """The buffers as upstream's code reads them, ``.parameter_groups[i]`` with
        ``model_weight_buffer``, ``main_weight_buffer`` and ``main_grad_buffer`` (see
        :class:`~mfsdp.fsdp.buffers.ParamAndGradBufferView`)."""
        from mfsdp.fsdp.buffers import ParamAndGradBufferView
        return ParamAndGradBufferView(self)
