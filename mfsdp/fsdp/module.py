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

The model itself holds what units share (communicators, the forward order that drives prefetching,
memory counters, the double buffer, whether a backward synchronises) and the API: ``no_sync``,
``unshard``/``reshard``, state-dict hooks, ``zero_grad_buffer``... The mechanism, step by step, is
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

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mfsdp.fsdp.bucket import Bucket
from mfsdp.fsdp.collectives import CommLog, Communicator, Handle, backend_of
from mfsdp.config import EngineOptions, MixedPrecisionPolicy, ShardingStrategy
from mfsdp.fsdp.construct import build_units
from mfsdp.fsdp.reducer import GradReducer
from mfsdp.fsdp.unit import FSDPUnit, Groups, in_backward

__all__ = ["FullyShardedModule", "FSDPUnit", "Groups"]


class FullyShardedModule(nn.Module):
    """A module whose parameters are sharded over a data-parallel group (see :func:`mfsdp.fully_shard`).

    ``forward`` calls the wrapped ``module``; ``module`` keeps its structure and names, its
    parameters are views of flat bucket buffers.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        groups: Groups,
        strategy: ShardingStrategy,
        unit_classes: tuple[type, ...],
        device: torch.device,
        mixed_precision_policy: MixedPrecisionPolicy,
        options: EngineOptions | None = None,
    ):
        super().__init__()
        opts = options or EngineOptions()
        self.module = module
        self.strategy = strategy
        self.device = device
        self.mp_policy = mixed_precision_policy
        self.overlap_grad_reduce = opts.overlap_grad_reduce
        self.overlap_param_gather = opts.overlap_param_gather
        self.calculate_per_token_loss = opts.calculate_per_token_loss
        self.average_in_collective = opts.average_in_collective
        # The log every collective of this model is recorded in (tests and benchmarks read it).
        self.comm_log = CommLog()
        self.groups = groups
        self.comm = Communicator(groups.dp_shard, "dp_shard", self.comm_log)
        # A second communicator over the same ranks, so that gathers do not queue behind reductions.
        self.ag_comm = (Communicator(groups.dp_shard_ag, "dp_shard_ag", self.comm_log)
                        if groups.dp_shard_ag is not None else self.comm)
        self.outer_comm = (Communicator(groups.dp_outer, "dp_outer", self.comm_log)
                           if groups.dp_outer is not None and dist.get_world_size(groups.dp_outer) > 1
                           else None)
        self.outer_sharded = (self.outer_comm is not None
                              and groups.outer_strategy is ShardingStrategy.OPTIM)
        self.expt_comm = (Communicator(groups.expt_dp_shard, "expt_dp_shard", self.comm_log)
                          if groups.expt_dp_shard is not None else self.comm)
        self.expt_ag_comm = (Communicator(groups.expt_dp_shard_ag, "expt_dp_shard_ag", self.comm_log)
                             if groups.expt_dp_shard_ag is not None else self.expt_comm)
        self.ep_comm = (Communicator(groups.ep, "ep", self.comm_log)
                        if groups.ep is not None and dist.get_world_size(groups.ep) > 1 else None)
        # Tensor parallelism: parameters are sharded over the data-parallel group on their TP
        # block; the TP mesh is the caller's, or one made over the TP group.
        self.tp_group = (groups.tp if groups.tp is not None and dist.get_world_size(groups.tp) > 1
                         else None)
        self.tp_mesh = groups.tp_mesh
        if self.tp_group is not None and self.tp_mesh is None:
            self.tp_mesh = DeviceMesh.from_group(self.tp_group, device.type)
        # How many units ahead all-gathers are launched (ZeRO-3, with overlap_param_gather).
        self.prefetch_depth = opts.prefetch_depth
        # Whether this backward reduces gradients that can wait (no_shard/optim, see no_sync()).
        self._auto_sync = opts.sync_model_each_microbatch
        self._sync_override: bool | None = None
        self._unreduced = False  # a deferred backward left gradients unreduced
        # Forward order of non-root units, recorded on the first forward; drives prefetching.
        self._order: list[FSDPUnit] = []
        self._order_recorded = False
        # Weights all-gathered after an optimizer step (ZeRO-1/2), waited for before next use.
        self._param_sync: list[Handle] = []
        # Measured memory: bytes of gathered unit weights and of full gradient buffers.
        self.memory = {"gathered_bytes": 0, "peak_gathered_bytes": 0,
                       "grad_full_bytes": 0, "peak_grad_full_bytes": 0, "init_peak_bytes": 0}
        # Gathered weights of non-root units in a fixed two-slot pool (ZeRO-3 only).
        self.double_buffer = opts.fsdp_double_buffer and self.strategy.shards_params
        # Whether unshard() holds every unit gathered, with the full views in the modules.
        self.user_unsharded = False
        for c in (self.comm, self.ag_comm, self.outer_comm, self.expt_comm, self.expt_ag_comm,
                  self.ep_comm):
            if c is not None:
                c.backend = backend_of(c.group, device)
        self.report_nan_in_param_grad = opts.report_nan_in_param_grad
        self.use_decoupled_grad = opts.use_decoupled_grad
        self.param_init_fn = opts.param_init_fn
        built = build_units(self, unit_classes, opts.disable_bucketing,
                            opts.init_model_with_meta_device)
        self.units: list[FSDPUnit] = built.units
        self.unit_by_name = {u.name: u for u in self.units}
        self.pool = built.pool
        self._sparams = built.sparams
        self._sparam_by_id = built.by_id
        self._original_params = built.originals  # read once by the API, then dropped
        self.reducer = GradReducer(self, opts.max_inflight_reduce)
        for unit in self.units:
            unit.register_hooks()
        # shard_experts() recorded the global names of the experts this rank kept
        if getattr(self.module, "_mfsdp_expert_names", None):
            self.set_global_names(self.module._mfsdp_expert_names)
        if opts.preproc_state_dict_for_dcp_ckpt:
            self._register_state_dict_hook(FullyShardedModule._state_dict_hook)
        self._register_load_state_dict_pre_hook(self._load_pre_hook)
        self.register_load_state_dict_post_hook(FullyShardedModule._load_post_hook)

    # ------------------------------------------------------------------------------------------
    # what units share
    # ------------------------------------------------------------------------------------------
    @property
    def buckets(self) -> list[Bucket]:
        """Every bucket of every unit, in unit order."""
        return [b for u in self.units for b in u.buckets]

    @property
    def synchronising(self) -> bool:
        """Whether the backward under way reduces gradients that could wait (see :meth:`no_sync`)."""
        return self._auto_sync if self._sync_override is None else self._sync_override

    def record_forward(self, unit: FSDPUnit) -> None:
        """Note ``unit``'s place in the forward order (the first forward only)."""
        if not self._order_recorded and unit not in self._order:
            self._order.append(unit)

    def end_forward(self) -> None:
        """The root's forward is over: the forward order is known."""
        self._order_recorded = True

    def next_unit(self, unit: FSDPUnit, step: int) -> FSDPUnit | None:
        """The unit ``step`` places after ``unit`` in forward order (negative: before it). The
        root comes before the first unit in forward and before the last one in backward (its
        forward starts first and its backward, the loss and output layer, runs first)."""
        if not self._order_recorded:
            return None
        if unit.is_root:
            i = step - 1 if step > 0 else len(self._order) + step
        elif unit in self._order:
            i = self._order.index(unit) + step
        else:
            return None
        return self._order[i] if 0 <= i < len(self._order) else None

    def end_backward(self, reduced: bool) -> None:
        """Called by the reducer at the end of backward: install the reduced gradients, or note
        that they were left unreduced (a ``no_sync`` micro-batch)."""
        self._unreduced = not reduced
        if reduced:
            self._install_grads()

    def gather_recursively(self, module: nn.Module) -> None:
        """Gather every unit inside ``module`` before its forward and release them after it.

        For modules whose forward bypasses their children's ``forward`` (fused kernels reading
        child weights directly): the children's own hooks never fire, so ``module`` takes their
        place, in forward and, through a hook on its outputs, in backward.
        """
        path = next((n for n, m in self.module.named_modules() if m is module), None)
        if path is None:
            raise ValueError(f"{type(module).__name__} is not a submodule of the sharded model")
        inner = [u for u in self.units if not u.is_root
                 and (path == "" or u.name == path or u.name.startswith(path + "."))]
        if not inner:
            raise ValueError(f"{path or 'the root'} ({type(module).__name__}) contains no FSDP "
                             "unit; list its children's classes in fsdp_unit_modules")

        def pre(mod, args):
            for unit in inner:
                unit.gather()
                unit.unshard_views()

        def post(mod, args, output):
            if self.user_unsharded:
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
    def begin_forward(self) -> None:
        """Before the root's forward: wait for the weights of the last optimizer step (ZeRO-1/2)
        and check that no parameter was frozen or unfrozen since wrapping."""
        self.wait_param_sync()
        if torch.is_grad_enabled():
            for sp in self._sparams:
                sp.check_requires_grad()

    def wait_param_sync(self) -> None:
        """Wait for the weight all-gathers launched after the last optimizer step (ZeRO-1/2,
        HFSDP). The next forward waits for them anyway; benchmarks call this to time a whole
        step."""
        for h in self._param_sync:
            h.wait()
        self._param_sync.clear()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_grad_sync(self) -> None:
        """Make sure every gradient reduction has finished (the optimizer calls this)."""
        if self.reducer.backward_started:
            raise RuntimeError("finish_grad_sync() during backward")
        if self._unreduced:
            raise RuntimeError(
                "the last backward ran under no_sync() (or with sync_model_each_microbatch=False "
                "outside sync()), so its gradients were never reduced across ranks; run the last "
                "micro-batch of each step outside no_sync() (or inside sync()) before "
                "optimizer.step()")

    @torch.no_grad()
    def install_main_weights(self) -> None:
        """Copy main weights into the model weights after an optimizer step, then re-replicate."""
        for b in self.buckets:
            mine = b.model_sub_shard()
            if not b.main_aliases_model():
                mine.copy_(b.main_shard)
            if b.outer_factor > 1:  # HFSDP: collect the inner shard from the outer ranks
                self._param_sync.append(self.outer_comm.all_gather(b.model_shard, mine.clone()))
            if not b.sharded_params and not b.replicated:  # (HFSDP is ZeRO-3 only)
                self._param_sync.append(b.ag_comm.all_gather(b.full_comm, b.model_shard.clone()))

    @torch.no_grad()
    def zero_grad_buffers(self) -> None:
        """Zero the reduced gradients (and any accumulated full gradients)."""
        for b in self.buckets:
            b.used = [0.0] * len(b.names)
            b.outer_pending = None
            if b.grad_shard is not None:
                b.grad_shard.zero_()
            if b.replicated:
                b.grad_full = b.grad_shard  # drop the second buffer, if any
                b.holds_reduced = False
            elif b.grad_full is not None:
                b.release_grad_full()
                if b.sharded_grads:
                    self.memory["grad_full_bytes"] = 0
        for sp in self._sparams:
            sp.set_grad(None, self.use_decoupled_grad)
        self._unreduced = False

    zero_grad_buffer = zero_grad_buffers  # upstream Megatron-FSDP's name

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients: the reduced ones and the accumulation buffers (see
        :meth:`zero_grad_buffers`); ``nn.Module.zero_grad`` alone would leave the buffers."""
        self.zero_grad_buffers()

    @torch.no_grad()
    def _install_grads(self) -> None:
        """After a synchronising backward: hand every parameter its reduced gradient rows."""
        nan = []
        # Which parameters got a gradient (host-side flags, agreed over ranks in
        # _sync_used_flags).
        grad_buckets = [b for b in self.buckets if b.requires_grad]
        flags = [f for b in grad_buckets for f in b.used]
        used, at = {}, 0
        for b in grad_buckets:
            used[id(b)] = flags[at:at + len(b.names)]
            at += len(b.names)
        for sp in self._sparams:
            b = sp.bucket
            if not b.requires_grad or not used[id(b)][sp.index]:
                sp.set_grad(None, self.use_decoupled_grad)
                continue
            g = b.local_view(b.grad_shard, sp.index).view(sp.local.shape)
            g = g if g.dtype == sp.local.dtype else g.to(sp.local.dtype)
            sp.set_grad(g, self.use_decoupled_grad)
            if self.report_nan_in_param_grad and torch.isnan(g).any():
                nan.append(sp.name)
        if self.report_nan_in_param_grad:
            flag = torch.tensor([float(bool(nan))], device=self.device)
            if dist.get_world_size() > 1:  # every rank raises, none hangs in the next collective
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                where = ", ".join(nan[:8]) + (" ..." if len(nan) > 8 else "") if nan else (
                    "on another rank's shards")
                raise RuntimeError(f"report_nan_in_param_grad: NaN in the reduced gradients of "
                                   f"{len(nan)} parameter(s) on rank {dist.get_rank()}: {where}")

    # -- upstream Megatron-FSDP's names for the same steps ----------------------------------------
    @property
    def model_auto_sync(self) -> bool:
        """Whether every backward synchronises (``sync_model_each_microbatch``)."""
        return self._auto_sync

    def start_grad_sync(self) -> None:
        """Launch the gradient reductions that have not started (after a backward run with
        ``overlap_grad_reduce=False`` they all start at its end already: nothing to do then)."""
        if self.reducer.backward_started:
            self.reducer.launch_ready(flush=True)

    def start_param_sync(self) -> None:
        """Nothing to start: weights are gathered by the forward hooks (ZeRO-3) or right after
        the optimizer step (ZeRO-1/2, waited for by :meth:`wait_param_sync`)."""

    def install_optimized_model_weights(self) -> None:
        """Upstream's name of :meth:`install_main_weights`."""
        self.install_main_weights()

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
        old, self._sync_override = self._sync_override, value
        try:
            yield
        finally:
            self._sync_override = old

    def set_model_auto_sync(self, sync: bool) -> None:
        """Set whether every backward reduces gradients (``sync_model_each_microbatch``)."""
        self._auto_sync = bool(sync)

    # ------------------------------------------------------------------------------------------
    # full weights on demand, state dicts
    # ------------------------------------------------------------------------------------------
    def unshard(self) -> None:
        """Gather every unit's full weights (compute dtype) and put them in the modules, until
        :meth:`reshard` (a collective call under ``optim_grads_params``).

        For inference, generation and export: forward then neither releases nor swaps weights.
        Prefer the context manager :meth:`unsharded`.
        """
        if self.pool is not None:
            raise RuntimeError("unshard() needs every unit gathered at once, which the two-slot "
                               "fsdp_double_buffer cannot hold; use fsdp_double_buffer=False")
        if self.user_unsharded:
            return
        self.wait_param_sync()
        for unit in self.units:
            unit.gather()
            unit.unshard_views()
        self.user_unsharded = True

    def reshard(self) -> None:
        """Undo :meth:`unshard`: modules hold the sharded parameters again, gathered weights are
        released (ZeRO-3)."""
        if not self.user_unsharded:
            return
        self.user_unsharded = False
        for unit in self.units:
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
        # Every entry of a parameter is a fresh DTensor over its main-weight rows that carries
        # its own chunk metadata (a detached parameter would not), so DCP saves it as it is.
        self.wait_param_sync()  # (ZeRO-1/2: the post-step all-gather writes the same memory)
        for sp in self._sparams:
            for key in self._state_keys(sp, prefix):
                if key in state_dict:
                    state_dict[key] = sp.wrap(sp.local.detach())
        return state_dict

    def _load_pre_hook(self, state_dict, prefix, local_metadata, strict, missing_keys,
                       unexpected_keys, error_msgs):
        # Loaded values go straight into the main weights (a later install copies them into the
        # model weights), so a bf16 model with fp32 main weights keeps what it loaded.
        self.wait_param_sync()  # an all-gather still in flight would overwrite what we load
        loaded = set()
        for sp in self._sparams:
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

    @property
    def _loaded_keys(self) -> set:
        return self.__dict__.setdefault("_loaded_key_set", set())

    @torch.no_grad()
    def _after_load(self) -> None:
        """Make the model weights agree with freshly loaded main weights."""
        again = self.user_unsharded
        if again:
            self.reshard()
        self.install_main_weights()
        self.wait_param_sync()
        if again:
            self.unshard()

    # ------------------------------------------------------------------------------------------
    # inspection
    # ------------------------------------------------------------------------------------------
    def named_main_shards(self) -> list[tuple[str, torch.Tensor, Bucket, int]]:
        """(name, local main-weight rows, bucket, index) for every parameter, in model order."""
        return [(sp.name, sp.bucket.local_view(sp.bucket.main_shard, sp.index), sp.bucket, sp.index)
                for sp in self._sparams]

    def set_global_names(self, mapping: dict[str, str]) -> None:
        """Name parameters differently in checkpoints (local expert index -> global index)."""
        self._global_names = dict(mapping)

    def global_name(self, name: str) -> str:
        """The checkpoint name of parameter ``name`` (its own name unless remapped)."""
        return getattr(self, "_global_names", {}).get(name, name)

    @torch.no_grad()
    def full_parameters(self, main: bool = True) -> dict[str, torch.Tensor]:
        """Every parameter gathered to its full shape on every rank (a collective call).

        ``main=True`` returns the main weights (the optimizer's fp32 copy), otherwise the model
        weights in compute dtype.
        """
        full = {}
        for b in self.buckets:
            src = b.main_shard if main else b.model_shard
            if b.replicated:
                flat = src
            else:
                if main and b.outer_factor > 1:
                    inner = torch.empty(b.outer_factor * b.plan.shard_numel, dtype=src.dtype,
                                        device=src.device)
                    self.outer_comm.all_gather(inner, src.contiguous(), async_op=False)
                    src = inner
                flat = torch.empty(b.plan.padded_numel, dtype=src.dtype, device=src.device)
                b.comm.all_gather(flat, src.contiguous(), async_op=False)
            for i, name in enumerate(b.names):
                slot = b.plan.params[i]
                full[name] = flat[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
        # Under TP each parameter so far is this rank's TP block: gather the blocks.
        return {sp.name: sp.tp.full_of(full[sp.name]) if sp.tp_sharded else full[sp.name]
                for sp in self._sparams}

    @property
    def param_and_grad_buffer(self):
        """The buffers as upstream's code reads them, ``.parameter_groups[i]`` with
        ``model_weight_buffer``, ``main_weight_buffer`` and ``main_grad_buffer`` (see
        :class:`~mfsdp.fsdp.buffers.ParamAndGradBufferView`)."""
        from mfsdp.fsdp.buffers import ParamAndGradBufferView
        return ParamAndGradBufferView(self)

    def comm_scratch_bytes(self) -> int:
        """Bytes of the communication scratch buffers this rank keeps for reuse (gloo only: the
        all-to-all inputs of all-gathers and receive buffers of reduce-scatters, see [Note: gloo
        all-gather as all-to-all] in ``mfsdp/fsdp/collectives.py``); not part of :meth:`memory_by_kind`."""
        comms = {id(c): c for c in (self.comm, self.ag_comm, self.outer_comm, self.expt_comm,
                                    self.expt_ag_comm, self.ep_comm) if c is not None}
        return sum(c.scratch_bytes for c in comms.values())

    def memory_by_kind(self) -> dict[str, int]:
        """Bytes held by this rank's buckets right now, by kind (shared storage counted once)."""
        total: dict[str, int] = {}
        for b in self.buckets:
            for k, v in b.bytes_by_kind().items():
                total[k] = total.get(k, 0) + v
        return total
