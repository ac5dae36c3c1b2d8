"""The wrapper module: FSDP units, their buckets, and the hooks that move them.

``FullyShardedModule(module, ...)`` (built by :func:`mfsdp.fully_shard_model`) takes over the
parameters of ``module``: they become views into flat bucket buffers (see :mod:`mfsdp.buffers`),
and forward/backward hooks gather, release and reduce those buffers as the sharding strategy says.
The mechanism, step by step, is described in ``docs/concepts.md``; the notes below say why.

Gradient reduction lives in :mod:`mfsdp.reduce` (notes on ordering and bounds there).

[Note: version counters] Parameters are views of ``Bucket.full`` and share its version counter,
which autograd checks for the weights it saved in forward. Re-gathering weights for backward writes
the same values again, but an async collective bumps its output's counter when it completes (on
gloo in a background thread, at a time we do not control), which autograd would report as an
in-place modification. So collectives write through ``Bucket.full_comm``: a second tensor over the
same storage with a version counter of its own.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from mfsdp.buffers import Bucket, DoubleBuffer, plan_bucket
from mfsdp.collectives import CommLog, Communicator, Handle
from mfsdp.config import MixedPrecisionPolicy, ShardingStrategy
from mfsdp.reduce import GradReduction

__all__ = ["FullyShardedModule", "FSDPUnit"]


@dataclass
class Groups:
    """The process groups a sharded model communicates over (``None``: the default group)."""

    dp_shard: dist.ProcessGroup | None = None  # dense parameters are sharded over it
    dp_shard_ag: dist.ProcessGroup | None = None  # same ranks, for all-gathers only
    dp_outer: dist.ProcessGroup | None = None  # HSDP/HFSDP outer (replica) dimension
    outer_strategy: ShardingStrategy = ShardingStrategy.NO_SHARD
    expt_dp_shard: dist.ProcessGroup | None = None  # expert parameters are sharded over it
    expt_dp_shard_ag: dist.ProcessGroup | None = None
    ep: dist.ProcessGroup | None = None  # ranks holding different experts


@dataclass
class FSDPUnit:
    """A module whose parameters are gathered together and released together."""

    name: str  # module path ("" for the root)
    module: nn.Module
    buckets: list[Bucket] = field(default_factory=list)
    pending: list[Handle] = field(default_factory=list)  # in-flight all-gathers into its buckets

    @property
    def is_root(self) -> bool:
        return self.name == ""

    @property
    def gathered_bytes(self) -> int:
        return sum(b.plan.padded_numel * b.full.element_size() for b in self.buckets)


def _tensors(obj) -> list[torch.Tensor]:
    """Tensors requiring grad in a (nested) forward output."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.requires_grad else []
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    if hasattr(obj, "__dataclass_fields__"):
        return [t for f in obj.__dataclass_fields__ for t in _tensors(getattr(obj, f))]
    return []


class FullyShardedModule(GradReduction, nn.Module):
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
        init_model_with_meta_device: bool = False,
        overlap_grad_reduce: bool = True,
        overlap_param_gather: bool = True,
        sync_model_each_microbatch: bool = True,
        average_in_collective: bool = False,
        calculate_per_token_loss: bool = False,
        disable_bucketing: bool = False,
        max_inflight_reduce: int = 2,
        fsdp_double_buffer: bool = False,
        prefetch_depth: int = 1,
    ):
        super().__init__()
        self.module = module
        self.strategy = strategy
        self.device = device
        self.mp_policy = mixed_precision_policy
        self.overlap_grad_reduce = overlap_grad_reduce
        self.overlap_param_gather = overlap_param_gather
        self.calculate_per_token_loss = calculate_per_token_loss
        self.average_in_collective = average_in_collective
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
        # Outer reductions wait for a synchronising backward; their input accumulates meanwhile.
        self._outer_inflight: deque = deque()
        self.max_inflight_reduce = max(1, max_inflight_reduce)
        # How many units ahead all-gathers are launched (ZeRO-3, with overlap_param_gather).
        self.prefetch_depth = prefetch_depth
        # Whether this backward reduces gradients that can wait (no_shard/optim, see no_sync()).
        self._auto_sync = sync_model_each_microbatch
        self._sync_override: bool | None = None
        self._unreduced = False  # a deferred backward left gradients unreduced
        # Per-backward state: see [Note: reduction order] in reduce.py.
        self._launch_cursor = 0
        self._inflight: deque[tuple[Bucket, Handle]] = deque()
        self._backward_started = False
        # Forward order of units, recorded on the first forward; drives prefetching.
        self._order: list[FSDPUnit] = []
        self._order_recorded = False
        # Weights all-gathered after an optimizer step (ZeRO-1/2), waited for before next use.
        self._param_sync: list[Handle] = []
        # Measured memory: bytes of gathered unit weights and of full gradient buffers.
        self.memory = {"gathered_bytes": 0, "peak_gathered_bytes": 0,
                       "grad_full_bytes": 0, "peak_grad_full_bytes": 0, "init_peak_bytes": 0}
        # Gathered weights of non-root units in a fixed two-slot pool (ZeRO-3 only).
        self.pool: DoubleBuffer | None = None
        self._double_buffer = fsdp_double_buffer and self.strategy.shards_params
        self._build(unit_classes, disable_bucketing, init_model_with_meta_device)

    # ------------------------------------------------------------------------------------------
    # construction
    # ------------------------------------------------------------------------------------------
    def _build(self, unit_classes, disable_bucketing: bool, meta_init: bool) -> None:
        root = self.module
        unit_paths = [""]
        if unit_classes and not disable_bucketing:
            unit_paths += [n for n, m in root.named_modules() if n and isinstance(m, unit_classes)]
            if len(unit_paths) == 1 and not isinstance(root, unit_classes):
                names = ", ".join(c.__name__ for c in unit_classes)
                raise ValueError(f"fsdp_unit_modules=({names}) matches no module of "
                                 f"{type(root).__name__}; name the block classes the model uses")
        mods = dict(root.named_modules())

        def owner(path: str) -> str:  # the innermost unit containing module `path`
            best = ""
            for u in unit_paths:
                if u and (path == u or path.startswith(u + ".")) and len(u) > len(best):
                    best = u
            return best

        def common(a: str, b: str) -> str:  # innermost unit containing both
            while not (b == a or b.startswith(a + ".") or a == ""):
                a = owner(a.rpartition(".")[0]) if "." in a else ""
            return a

        # Every distinct parameter, the places it is registered, and the unit that owns it.
        params: dict[int, dict] = {}
        for path, m in root.named_modules(remove_duplicate=False):
            for attr, p in m._parameters.items():
                if p is None:
                    continue
                entry = params.setdefault(id(p), {"param": p, "uses": [], "name":
                                                  f"{path}.{attr}" if path else attr})
                entry["uses"].append((m, attr))
                u = owner(path)
                entry["unit"] = common(entry["unit"], u) if "unit" in entry else u
        if not meta_init:
            for e in params.values():
                p = e["param"]
                if p.device.type == "meta":
                    raise ValueError(f"parameter {e['name']!r} is on the meta device; pass "
                                     "init_model_with_meta_device=True to materialise it shard by shard")
                if p.device != self.device:
                    raise ValueError(f"parameter {e['name']!r} is on {p.device} but the mesh "
                                     f"device is {self.device}; move the model with "
                                     f"model.to({str(self.device)!r}) first or pass device=")
        replicated = self.strategy is ShardingStrategy.NO_SHARD
        outer_size = self.outer_comm.size if self.outer_comm is not None else 1
        factor = outer_size if self.outer_sharded else 1
        # Gradients are averaged over every data-parallel rank. An expert's local gradient already
        # sums the contributions of its whole EP group's tokens, and the expert data-parallel
        # reduction sums over the rest, so the same factor averages both (see docs/hsdp-ep.md).
        scale = 1.0 if self.calculate_per_token_loss else 1.0 / (self.comm.size * outer_size)
        self.units: list[FSDPUnit] = []
        self._slot: dict[int, tuple[Bucket, int]] = {}  # id(original param) -> (bucket, index)
        for upath in unit_paths:
            unit = FSDPUnit(upath, self if upath == "" else mods[upath])
            groups: dict[tuple, list[dict]] = {}
            for e in params.values():
                if e["unit"] != upath:
                    continue
                p = e["param"]
                key = (p.dtype, ".experts." in f".{e['name']}.", p.requires_grad)
                groups.setdefault(key, []).append(e)
            for key, entries in groups.items():
                dtype, is_expert = key[0], key[1]
                comm = self.expt_comm if is_expert else self.comm
                main, grads, comm_dtype = self.mp_policy.resolve(dtype)
                bucket = Bucket(
                    unit=upath, key=key, names=[e["name"] for e in entries],
                    plan=plan_bucket([tuple(e["param"].shape) for e in entries],
                                     1 if replicated else comm.size * factor),
                    rank=0 if replicated else comm.rank, device=self.device, dtype=dtype,
                    main_dtype=main, grad_dtype=grads, comm_dtype=comm_dtype,
                    sharded_params=self.strategy.shards_params,
                    sharded_grads=self.strategy.shards_grads, replicated=replicated,
                    outer_factor=factor,
                    outer_rank=self.outer_comm.rank if factor > 1 else 0,
                )
                bucket.comm = comm  # the inner (shard) group of this bucket
                bucket.ag_comm = self.expt_ag_comm if is_expert else self.ag_comm
                bucket.grad_scale = scale
                bucket.outer_pending = None  # inner-reduced gradients awaiting the outer reduction
                for i, e in enumerate(entries):
                    self._slot[id(e["param"])] = (bucket, i)
                unit.buckets.append(bucket)
            self.units.append(unit)
        self._unit_by_name = {u.name: u for u in self.units}
        if self._double_buffer and len(self.units) > 1:
            self.pool = DoubleBuffer(self.units[1:], self.device)
        self._load_values(params, meta_init)
        self._original_params = [e["param"] for e in params.values()]  # read once by the API
        # Replace every parameter by a view of its bucket and hook it.
        self._new_params: dict[int, nn.Parameter] = {}
        self._slot_by_new: dict[int, tuple[Bucket, int]] = {}  # id(view parameter) -> slot
        self._param_names: list[tuple[str, nn.Parameter]] = []
        for e in params.values():
            bucket, i = self._slot[id(e["param"])]
            new = nn.Parameter(bucket.param_view(i), requires_grad=e["param"].requires_grad)
            for m, attr in e["uses"]:
                m._parameters[attr] = new
            self._new_params[id(e["param"])] = new
            self._param_names.append((e["name"], new))
            self._slot_by_new[id(new)] = (bucket, i)
            if new.requires_grad:
                new.register_post_accumulate_grad_hook(self._grad_hook(bucket, i))
        for b in self.buckets:
            b.n_grad_params = len(b.names) if b.requires_grad else 0
            b.is_ready = False
            # Which parameters received a gradient (on any rank) since the last zero_grad: the
            # optimizer skips the others, as plain PyTorch skips parameters whose .grad is None.
            b.used = torch.zeros(len(b.names), device=self.device)
            if not b.main_aliases_model():
                b.main_shard.copy_(b.model_sub_shard())
        for m in root.modules():  # buffers follow the device; parameters are done
            for name, buf in m._buffers.items():
                if buf is not None and buf.device != self.device and buf.device.type != "meta":
                    m._buffers[name] = buf.to(self.device)
        # Fixed launch order of gradient buckets: see [Note: reduction order] in reduce.py.
        self._grad_order = [b for b in reversed(self.buckets) if b.requires_grad]
        for unit in self.units:
            unit.module.register_forward_pre_hook(self._pre_forward_hook(unit))
            unit.module.register_forward_hook(self._post_forward_hook(unit))

    @property
    def buckets(self) -> list[Bucket]:
        return [b for u in self.units for b in u.buckets]

    @torch.no_grad()
    def _load_values(self, params: dict[int, dict], meta_init: bool) -> None:
        """Copy initial values into the buckets (the local rows only, under ZeRO-3)."""

        def store(bucket: Bucket, i: int, value: torch.Tensor) -> None:
            if bucket.sharded_params:
                bucket.store_local(i, value)
            else:
                bucket.param_view(i).copy_(value)

        if not meta_init:
            for e in params.values():
                store(*self._slot[id(e["param"])], e["param"].detach())
            return
        # Meta-device initialisation, one module at a time, in construction order.
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for b in self.buckets for t in (b.model_shard, b.main_shard, b.full)}
        held = sum(storages.values())  # what the buckets hold already (shards, under ZeRO-3)
        done: set[int] = set()
        for path, m in self.module.named_modules():
            own = [(a, p) for a, p in m._parameters.items() if p is not None and id(p) not in done]
            if not own:
                continue
            if not hasattr(m, "reset_parameters"):
                raise ValueError(f"module {path or type(m).__name__!r} ({type(m).__name__}) has "
                                 "parameters but no reset_parameters(); meta-device "
                                 "initialisation needs it to create their values")
            originals = {a: p for a, p in own}
            m.to_empty(device=self.device, recurse=False)
            m.reset_parameters()
            temp = sum(p.numel() * p.element_size() for p in m._parameters.values() if p is not None)
            self.memory["init_peak_bytes"] = max(self.memory["init_peak_bytes"], held + temp)
            for a, p in originals.items():
                store(*self._slot[id(p)], m._parameters[a].detach())
                m._parameters[a] = p  # keep the original object until the views replace it
                done.add(id(p))

    # ------------------------------------------------------------------------------------------
    # memory
    # ------------------------------------------------------------------------------------------
    def _gather(self, unit: FSDPUnit, wait: bool = True) -> None:
        """All-gather a unit's sharded weights (ZeRO-3), or just wait for a prefetch."""
        if self.strategy.shards_params and not unit.pending:
            todo = [b for b in unit.buckets if not b.gathered]
            if todo and todo[0].in_pool:
                if not wait and not self.pool.available(unit):
                    self.pool.skipped_prefetches += 1  # its slot is busy: gather on demand
                    return
                self.pool.acquire(unit, unit.name)
            for b in todo:
                self._alloc(b)
                with torch.no_grad():
                    unit.pending.append(b.ag_comm.all_gather(b.full_comm, b.model_shard))
        if wait:
            for h in unit.pending:
                h.wait()
            unit.pending.clear()

    def _alloc(self, b: Bucket) -> None:
        if not b.in_pool:
            b.alloc_full()
        if b.unit:
            self.memory["gathered_bytes"] += b.plan.padded_numel * b.full.element_size()
            self.memory["peak_gathered_bytes"] = max(self.memory["peak_gathered_bytes"],
                                                     self.memory["gathered_bytes"])

    def _release(self, b: Bucket) -> None:
        if not b.gathered:
            return
        if b.unit and b.sharded_params:
            self.memory["gathered_bytes"] -= b.plan.padded_numel * b.full.element_size()
        if not b.in_pool:
            b.release_full()
        else:
            b.pool_held = False

    def _reshard(self, unit: FSDPUnit) -> None:
        if self.strategy.shards_params:
            for h in unit.pending:  # never free a buffer a collective is still writing
                h.wait()
            unit.pending.clear()
            for b in unit.buckets:
                self._release(b)
            if self.pool is not None and not unit.is_root:
                self.pool.release(unit)

    def _prefetch(self, unit: FSDPUnit, direction: int) -> None:
        for d in range(1, self.prefetch_depth + 1):
            nxt = self._next_unit(unit, direction * d)
            if nxt is None:
                return
            self._gather(nxt, wait=False)

    def _next_unit(self, unit: FSDPUnit, step: int) -> FSDPUnit | None:
        if not self._order_recorded or unit not in self._order:
            return None
        i = self._order.index(unit) + step
        return self._order[i] if 0 <= i < len(self._order) else None

    # ------------------------------------------------------------------------------------------
    # hooks
    # ------------------------------------------------------------------------------------------
    def _pre_forward_hook(self, unit: FSDPUnit):
        def hook(module, args):
            if unit.is_root:
                self._begin_forward()
            elif not self._order_recorded and unit not in self._order:
                self._order.append(unit)
            self._gather(unit)
            if self.overlap_param_gather and torch.is_grad_enabled():
                self._prefetch(unit, +1)
            self._poll()
        return hook

    def _post_forward_hook(self, unit: FSDPUnit):
        def hook(module, args, output):
            if unit.is_root:
                self._order_recorded = True
            self._reshard(unit)
            tensors = _tensors(output)
            if tensors and torch.is_grad_enabled():
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda grad: self._pre_backward(unit), mode="any")
            return output
        return hook

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
                self._gather(unit)

        def post(mod, args, output):
            for unit in inner:
                self._reshard(unit)
            tensors = _tensors(output)
            if tensors and torch.is_grad_enabled():
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda grad: [self._pre_backward(u) for u in inner], mode="any")
            return output

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)

    def _pre_backward(self, unit: FSDPUnit) -> None:
        if not self._backward_started:
            self._backward_started = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self._gather(unit)
        if self.overlap_param_gather:
            self._prefetch(unit, -1)
        self._poll()

    def _grad_hook(self, bucket: Bucket, i: int):
        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            param.grad = None
            if grad is None:
                return
            self._grad_full(bucket)
            with torch.no_grad():
                bucket.add_grad(i, grad)
            bucket.used[i] = 1.0
            bucket.ready += 1
            if bucket.ready == bucket.n_grad_params:
                self._bucket_ready(bucket)
            self._poll()
        return hook

    def _grad_full(self, bucket: Bucket) -> torch.Tensor:
        if bucket.grad_full is None:
            bucket.ensure_grad_full()
            if bucket.sharded_grads:
                self.memory["grad_full_bytes"] += bucket.grad_full.untyped_storage().nbytes()
                self.memory["peak_grad_full_bytes"] = max(self.memory["peak_grad_full_bytes"],
                                                          self.memory["grad_full_bytes"])
        return bucket.grad_full

    # ------------------------------------------------------------------------------------------
    # steps
    # ------------------------------------------------------------------------------------------
    def _begin_forward(self) -> None:
        self.wait_param_sync()

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
        if self._backward_started:
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
            b.used.zero_()
            b.outer_pending = None
            if b.grad_shard is not None:
                b.grad_shard.zero_()
            if b.grad_full is not None and not b.replicated:
                b.release_grad_full()
                if b.sharded_grads:
                    self.memory["grad_full_bytes"] = 0
        self._unreduced = False

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
    # inspection
    # ------------------------------------------------------------------------------------------
    def named_main_shards(self) -> list[tuple[str, torch.Tensor, Bucket, int]]:
        """(name, local main-weight rows, bucket, index) for every parameter, in model order."""
        out = []
        for name, p in self._param_names:
            bucket, i = self._slot_by_new[id(p)]
            out.append((name, bucket.local_view(bucket.main_shard, i), bucket, i))
        return out

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
        return {name: full[name] for name, _ in self._param_names}

    def comm_scratch_bytes(self) -> int:
        """Bytes of the communication scratch buffers this rank keeps for reuse (gloo only: the
        all-to-all inputs of all-gathers and receive buffers of reduce-scatters, see [Note: gloo
        all-gather as all-to-all] in ``mfsdp/collectives.py``); not part of :meth:`memory_by_kind`."""
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
