"""What the units and the gradient reducer of one sharded model share: :class:`ShardingState`.

:class:`mfsdp.FullyShardedModule` builds one :class:`ShardingState` and hands it explicitly to each
:class:`~mfsdp.fsdp.unit.FSDPUnit` and to the :class:`~mfsdp.fsdp.reducer.GradReducer` (as FSDP2
hands its ``FSDPParamGroup`` objects their mesh info, policies and communication context). No
object reaches into the wrapper module for its fields; the wrapper reads the same state for its
API (``no_sync``, ``unshard``, memory figures).

The state is small on purpose, each field with the reason it is shared:

* settings: the sharding strategy, the device, the mixed-precision policy and the engine options;
* :class:`Comms`: one communicator per process group the model uses, built once from the layout's
  :class:`~mfsdp.layout.ProcessGroups`;
* :class:`ForwardOrder`: the forward order of the units (recorded once), which drives prefetching;
* :class:`GradSync`: whether the backward under way reduces gradients that could wait
  (``no_sync``), and whether the last backward left them unreduced;
* memory counters (measured bytes of gathered weights and full gradient buffers);
* what construction made and everyone reads: the units, the double-buffer pool, the parameters;
* the weight all-gathers launched after an optimizer step (ZeRO-1/2), waited for before next use.

Each unit's own progress through a step is a :class:`UnitPhase`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mfsdp.config import EngineOptions, MixedPrecisionPolicy, ShardingStrategy
from mfsdp.fsdp.collectives import CommLog, Communicator, Handle, backend_of

__all__ = ["Comms", "ForwardOrder", "GradSync", "ShardingState", "UnitPhase"]


class UnitPhase(enum.Enum):
    """Where one FSDP unit is in a training step (its hooks move it along)::

        IDLE -> FORWARD -> AWAITING_BACKWARD -> BACKWARD -> BACKWARD_DONE -> IDLE
                      \\-> IDLE (a forward without gradients)

    ``BACKWARD_DONE`` is what lets a unit with frozen weights release them during backward (no
    gradient will say so); the end of backward returns every unit to ``IDLE``.
    """

    IDLE = "idle"  # between steps: the modules hold the sharded parameters
    FORWARD = "forward"  # between its pre- and post-forward hooks: full views in the modules
    AWAITING_BACKWARD = "awaiting_backward"  # forward done under grad; backward not begun
    BACKWARD = "backward"  # its pre-backward ran: gradients are arriving
    BACKWARD_DONE = "backward_done"  # its post-backward fired: every gradient of it is in


@dataclass(eq=False)
class Comms:
    """The communicators of one sharded model: one per process group it uses, all recording into
    one :class:`~mfsdp.fsdp.collectives.CommLog`."""

    log: CommLog
    dp: Communicator  # the dense shard group: reduce-scatters (and all-gathers without dp_ag)
    dp_ag: Communicator  # all-gathers over the same ranks (a second group, or `dp` itself)
    outer: Communicator | None  # HSDP/HFSDP outer dimension (None: no outer replicas)
    outer_sharded: bool  # HFSDP: main weights are sharded over inner x outer
    expt: Communicator  # the expert shard group (or `dp` without expert parallelism)
    expt_ag: Communicator  # expert all-gathers
    ep: Communicator | None  # ranks holding different experts (None: no EP)
    tp_group: dist.ProcessGroup | None  # tensor-parallel ranks (None: no TP)
    tp_mesh: DeviceMesh | None  # the 1-D mesh over `tp_group` that DTensors use
    # The caller's flattened (outer x shard) groups, upstream's hybrid_fsdp_group and
    # hybrid_fsdp_expt_group (None: not given): the used-gradient flags are agreed over them in
    # one collective, and under HFSDP main weights are sharded over them.
    hybrid: Communicator | None = None
    expt_hybrid: Communicator | None = None
    # The layout the groups were made from (ProcessGroups.layout; None: groups made by hand):
    # HFSDP's flattened groups are then derived from it instead of gathered from every rank.
    layout: object = None

    @classmethod
    def build(cls, groups, outer_strategy: ShardingStrategy, device: torch.device,
              hybrid_groups: tuple = (None, None)) -> "Comms":
        """Communicators over ``groups`` (a :class:`~mfsdp.layout.ProcessGroups`; ``None``
        entries: the default group, or no such dimension) and over the caller's hybrid
        ``(dense, expert)`` groups, when given."""
        log = CommLog()
        dp = Communicator(groups.dp_shard, "dp_shard", log)
        dp_ag = (Communicator(groups.dp_shard_ag, "dp_shard_ag", log)
                 if groups.dp_shard_ag is not None else dp)
        outer = (Communicator(groups.dp_outer, "dp_outer", log)
                 if groups.dp_outer is not None and dist.get_world_size(groups.dp_outer) > 1
                 else None)
        expt = (Communicator(groups.expt_dp_shard, "expt_dp_shard", log)
                if groups.expt_dp_shard is not None else dp)
        expt_ag = (Communicator(groups.expt_dp_shard_ag, "expt_dp_shard_ag", log)
                   if groups.expt_dp_shard_ag is not None else expt)
        ep = (Communicator(groups.ep, "ep", log)
              if groups.ep is not None and dist.get_world_size(groups.ep) > 1 else None)
        # Parameters are sharded over the data-parallel group on their TP block; the TP mesh is
        # the caller's, or one made over the TP group.
        tp = groups.tp if groups.tp is not None and dist.get_world_size(groups.tp) > 1 else None
        tp_mesh = groups.tp_mesh
        if tp is not None and tp_mesh is None:
            tp_mesh = DeviceMesh.from_group(tp, device.type)
        comms = cls(log, dp, dp_ag, outer, outer is not None and outer_strategy is
                    ShardingStrategy.OPTIM, expt, expt_ag, ep, tp, tp_mesh)
        comms.layout = groups.layout
        dense_h, expt_h = hybrid_groups
        if dense_h is not None:
            comms.hybrid = Communicator(dense_h, "hybrid", log)
        if expt_h is not None:
            comms.expt_hybrid = (comms.hybrid if expt_h is dense_h
                                 else Communicator(expt_h, "expt_hybrid", log))
        elif groups.expt_dp_shard is None:  # no experts apart: dense and expert groups agree
            comms.expt_hybrid = comms.hybrid
        for c in comms.distinct():
            c.backend = backend_of(c.group, device)
        return comms

    def distinct(self) -> list[Communicator]:
        """Every communicator once (several fields may share one)."""
        found = {id(c): c for c in (self.dp, self.dp_ag, self.outer, self.expt, self.expt_ag,
                                    self.ep, self.hybrid, self.expt_hybrid) if c is not None}
        return list(found.values())


class ForwardOrder:
    """The order in which non-root units ran their first forward; it drives prefetching."""

    def __init__(self):
        self.units: list = []
        self.recorded = False  # the root's first forward is over: the order is known

    def record(self, unit) -> None:
        """Note ``unit``'s place (the first forward only)."""
        if not self.recorded and unit not in self.units:
            self.units.append(unit)

    def end(self) -> None:
        """The root's forward is over."""
        self.recorded = True

    def next(self, unit, step: int):
        """The unit ``step`` places after ``unit`` in forward order (negative: before it). The
        root comes before the first unit in forward and before the last one in backward (its
        forward starts first and its backward, the loss and output layer, runs first)."""
        if not self.recorded:
            return None
        if unit.is_root:
            i = step - 1 if step > 0 else len(self.units) + step
        elif unit in self.units:
            i = self.units.index(unit) + step
        else:
            return None
        return self.units[i] if 0 <= i < len(self.units) else None


@dataclass
class GradSync:
    """Whether backwards reduce the gradients that could wait (see ``FullyShardedModule.no_sync``)."""

    auto: bool = True  # sync_model_each_microbatch: every backward synchronises
    override: bool | None = None  # inside no_sync() (False) or sync() (True)
    unreduced: bool = False  # the last backward was deferred: its gradients are not reduced
    # Reduced gradients were handed to the parameters (install_grads) and no zero_grad of the
    # model or of its sharded optimizer came since: see [Note: gradients cleared by hand].
    installed: bool = False

    @property
    def synchronising(self) -> bool:
        """Whether the backward under way reduces every gradient."""
        return self.auto if self.override is None else self.override


@dataclass(eq=False)
class ShardingState:
    """What the units and the reducer of one sharded model share (see the module notes)."""

    strategy: ShardingStrategy
    device: torch.device
    mp_policy: MixedPrecisionPolicy
    options: EngineOptions
    comms: Comms
    order: ForwardOrder = field(default_factory=ForwardOrder)
    sync: GradSync = field(default_factory=GradSync)
    # Measured memory: bytes of gathered unit weights and of full gradient buffers, and the peak
    # of a meta-device initialisation.
    memory: dict = field(default_factory=lambda: {
        "gathered_bytes": 0, "peak_gathered_bytes": 0, "grad_full_bytes": 0,
        "peak_grad_full_bytes": 0, "init_peak_bytes": 0})
    # Callbacks ``watch(event, unit name)`` run after each allocation or release of gathered
    # weights or full gradient buffers (mfsdp.tools.memory_timeline records a step with them).
    memory_watchers: list = field(default_factory=list)
    # unshard() holds every unit gathered with the full views in the modules: hooks then neither
    # release nor swap weights.
    user_unsharded: bool = False
    # The root unit keeps its gathered weights from forward to its backward, which runs first (as
    # FSDP2 does); the per-module front door releases them, as upstream v2 does.
    root_keeps_weights: bool = True
    # Filled by construction: the units (root first), their pool, every parameter in model order.
    units: list = field(default_factory=list)
    unit_by_name: dict = field(default_factory=dict)
    pool: Any = None  # mfsdp.fsdp.pools.DoubleBuffer under fsdp_double_buffer, else None
    # mfsdp.fsdp.pools.GradDoubleBuffer: full gradients of non-root units under
    # fsdp_double_buffer with ZeRO-2/3, else None.
    grad_pool: Any = None
    sparams: list = field(default_factory=list)
    reducer: Any = None  # the GradReducer
    # Weights all-gathered after an optimizer step (ZeRO-1/2, HFSDP), waited for before next use.
    param_sync: list[Handle] = field(default_factory=list)
    # A ShardedOptimizer steps this model and installs the main weights after its step itself;
    # otherwise (a plain torch.optim optimizer over the model's parameters, FSDP2's pattern) the
    # next forward installs what changed: see [Note: main weights a plain optimizer stepped].
    installed_by_optimizer: bool = False
    # Any face of a parameter (the module's from before sharding, the full view, the DTensor,
    # the main-weight rows) -> its ShardedParam; weak keys (a WeakIdKeyDictionary).
    sparam_of: Any = None
    # The checkpoint name of a parameter where it differs from its own (experts: global index).
    global_names: dict[str, str] = field(default_factory=dict)
    # The 1-D mesh over the world that checkpoint DTensors name their ranks by (built on use).
    _world_mesh: DeviceMesh | None = None
    # The version counter of each parameter's sharded face (the DTensor a plain optimizer steps)
    # when the model weights last agreed with the main weights.
    main_versions: list[int] = field(default_factory=list)

    @property
    def buckets(self) -> list:
        """Every bucket of every unit, in unit order."""
        return [b for u in self.units for b in u.buckets]

    def sharded_param(self, param: torch.Tensor):
        """The :class:`~mfsdp.fsdp.param.ShardedParam` of ``param``, any of its faces (the module's
        parameter from before sharding, the full view, the DTensor, the main-weight rows), or
        ``None`` if ``param`` is not one of this model's."""
        return self.sparam_of.get(param) if self.sparam_of is not None else None

    @property
    def world_mesh(self) -> DeviceMesh:
        """The mesh that checkpoint DTensors name their ranks by, one dimension over every rank on
        this model's device type (each DTensor carries its own chunk metadata, see
        ``mfsdp/fsdp/dtensor.py``)."""
        if self._world_mesh is None:
            self._world_mesh = DeviceMesh.from_group(dist.group.WORLD, self.device.type)
        return self._world_mesh

    def set_global_names(self, mapping: dict[str, str]) -> None:
        """Name parameters differently in checkpoints (local expert index -> global index)."""
        self.global_names = dict(mapping)

    def global_name(self, name: str) -> str:
        """The checkpoint name of parameter ``name`` (its own name unless remapped)."""
        return self.global_names.get(name, name)

    def dcp_state_dict(self, state_dict: dict, prefix: str) -> dict:
        """Make ``state_dict``'s parameter entries (keys ``prefix + name``) fresh DTensors over
        the main-weight rows that carry their own chunk metadata (a detached parameter would
        not), so that DCP saves them as they are; returns ``state_dict``."""
        self.wait_param_sync()  # (ZeRO-1/2: the post-step all-gather writes the same memory)
        for sp in self.sparams:
            for name in sp.names:
                if prefix + name in state_dict:
                    state_dict[prefix + name] = sp.wrap(sp.local.detach())
        return state_dict

    def named_main_shards(self) -> list[tuple[str, torch.Tensor, Any, int]]:
        """(name, local main-weight rows, bucket, index) for every parameter, in model order."""
        return [(sp.name, sp.bucket.local_view(sp.bucket.main_shard, sp.index), sp.bucket,
                 sp.index) for sp in self.sparams]

    def comm_scratch_bytes(self) -> int:
        """Bytes of the communication scratch buffers this rank keeps for reuse (gloo only: the
        receive buffers of reduce-scatters, see [Note: gloo all-gather as point-to-point] in
        ``mfsdp/fsdp/collectives.py``); not part of :meth:`memory_by_kind`."""
        return sum(c.scratch_bytes for c in self.comms.distinct())

    def memory_by_kind(self) -> dict[str, int]:
        """Bytes held by this rank's buckets right now, by kind (shared storage counted once)."""
        total: dict[str, int] = {}
        for b in self.buckets:
            for k, v in b.bytes_by_kind().items():
                total[k] = total.get(k, 0) + v
        return total

    @property
    def double_buffer(self) -> bool:
        """Whether gathered weights of non-root units live in the two-slot pool (ZeRO-3 only)."""
        return self.options.fsdp_double_buffer and self.strategy.shards_params

    @property
    def grad_double_buffer(self) -> bool:
        """Whether full gradients of non-root units live in a two-slot pool (ZeRO-2/3)."""
        return self.options.fsdp_double_buffer and self.strategy.shards_grads

    def count_gathered(self, nbytes: int) -> None:
        """``nbytes`` of unit weights were gathered (negative: released)."""
        m = self.memory
        m["gathered_bytes"] += nbytes
        m["peak_gathered_bytes"] = max(m["peak_gathered_bytes"], m["gathered_bytes"])

    def count_grad_full(self, nbytes: int) -> None:
        """``nbytes`` of full gradient buffers were allocated (negative: released)."""
        m = self.memory
        m["grad_full_bytes"] += nbytes
        m["peak_grad_full_bytes"] = max(m["peak_grad_full_bytes"], m["grad_full_bytes"])

    def note_memory(self, event: str, unit: str) -> None:
        """Tell :attr:`memory_watchers` that ``event`` ("gather", "release", "grad alloc",
        "grad free", "reduce", "zero_grad") just changed what unit ``unit`` holds."""
        for watch in self.memory_watchers:
            watch(event, unit)

    def wait_param_sync(self) -> None:
        """Wait for the weight all-gathers launched after the last optimizer step."""
        for h in self.param_sync:
            h.wait()
        self.param_sync.clear()

    @torch.no_grad()
    def zero_grads(self, set_to_none: bool = True) -> None:
        """Zero the reduced gradients and any accumulated full gradients, and drop the
        parameters' ``.grad`` (``model.zero_grad_buffer()``, the sharded optimizer's
        ``zero_grad()``); ``set_to_none=False`` zeroes a held ``.grad`` in place instead."""
        for b in self.buckets:
            b.used = [0.0] * len(b.names)
            b.outer_pending = None
            if b.grad_shard is not None:
                b.grad_shard.zero_()
            if b.replicated:
                b.grad_full = b.grad_shard  # drop the second buffer, if any
                b.holds_reduced = False
            elif b.grad_full is not None:
                pooled = b.grad_pooled
                b.release_grad_full()
                if pooled:
                    self.grad_pool.give(b)
                if b.sharded_grads:
                    self.memory["grad_full_bytes"] = 0
        for sp in self.sparams:
            if set_to_none or sp.grad is None:
                sp.set_grad(None, self.options.use_decoupled_grad)
            else:  # a view of the zeroed shard, or its own copy in the parameter's dtype
                sp.grad.zero_()
        self.sync.unreduced = False
        self.sync.installed = False
        self.note_memory("zero_grad", "")

    @torch.no_grad()
    def install_main_weights(self, buckets: list | None = None) -> None:
        """Copy main weights into the model weights after an optimizer step, then re-replicate
        (``buckets``: those only; default every bucket)."""
        for b in self.buckets if buckets is None else buckets:
            mine = b.model_sub_shard()
            if not b.main_aliases_model():
                mine.copy_(b.main_shard)
            if b.outer_factor > 1:  # HFSDP: collect the inner shard from the outer ranks
                self.param_sync.append(self.comms.outer.all_gather(b.model_shard, mine.clone()))
            if not b.sharded_params and not b.replicated:  # (HFSDP is ZeRO-3 only)
                self.param_sync.append(b.ag_comm.all_gather(b.full_comm, b.model_shard.clone()))
        self.main_versions = self.sharded_versions()

    def sharded_versions(self) -> list[int]:
        """The version counter of every parameter's sharded face, in model order."""
        return [sp.sharded._version for sp in self.sparams]

    def install_stepped_main_weights(self) -> None:
        """Install the main weights if an optimizer other than a ``ShardedOptimizer`` changed
        them since the model weights last agreed with them.

        [Note: main weights a plain optimizer stepped] ``torch.optim.AdamW(model.parameters())``
        built after ``fully_shard`` (FSDP2's pattern) steps in place on the DTensors the modules
        hold, whose local tensors are views of the buckets' main weights; an in-place step bumps
        the version counter of each DTensor it changed (not of its local tensor: DTensor's
        dispatch runs below autograd's version bump). The model weights (compute dtype; replicated under ZeRO-1/2) are
        brought up to date here, before the next forward or ``unshard()``, as FSDP2 casts and
        gathers its sharded parameters in the next forward: no optimizer hook is needed. Where
        installing is collective (ZeRO-1/2, HFSDP) the ranks agree on it first, so that a rank
        whose rows no step touched still joins the all-gathers."""
        if self.installed_by_optimizer:
            return
        buckets = self.buckets
        changed = self.sharded_versions() != self.main_versions
        if any(b.outer_factor > 1 or (not b.sharded_params and not b.replicated)
               for b in buckets) and dist.is_initialized():
            flag = torch.tensor([float(changed)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            changed = bool(flag.item())
        if changed:
            self.install_main_weights()

    def begin_forward(self) -> None:
        """Before the root's forward: bring the model weights up to date with the main weights,
        wait for the weights of the last optimizer step and check that no parameter was frozen
        or unfrozen since wrapping."""
        self.install_stepped_main_weights()
        self.wait_param_sync()
        if torch.is_grad_enabled():
            for sp in self.sparams:
                sp.check_requires_grad()
