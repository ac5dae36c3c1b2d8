"""FSDP units and their buckets, built from a module: which parameters go together, in which flat
buffer, and how each parameter becomes a view into it.

:class:`UnitConstruction` is mixed into :class:`mfsdp.FullyShardedModule` (its ``_build`` runs in the
constructor); it is split out only to keep one idea per file. The grouping rules are described in
``docs/concepts.md``.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mfsdp.buffers import Bucket, DoubleBuffer, plan_bucket
from mfsdp.collectives import Handle
from mfsdp.config import ShardingStrategy
from mfsdp.params import ShardedParam

__all__ = ["FSDPUnit", "Groups", "UnitConstruction"]


def _hybrid_group(inner: dist.ProcessGroup, outer: dist.ProcessGroup) -> dist.ProcessGroup:
    """The group of every rank of ``inner`` and of its replicas over ``outer`` (a collective call
    over the world: every rank creates every such group, in the same order)."""
    world = dist.get_world_size()
    mine = (sorted(dist.get_process_group_ranks(inner)), sorted(dist.get_process_group_ranks(outer)))
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    inner_of = {r: ranks for ranks, _ in everyone for r in ranks}
    sets = []
    for inner_ranks, outer_ranks in everyone:
        hybrid = sorted({r for o in outer_ranks for r in inner_of[o]})
        if hybrid not in sets:
            sets.append(hybrid)
    me = dist.get_rank()
    found = None
    for ranks in sorted(sets):
        g = dist.new_group(ranks)
        if me in ranks:
            found = g
    return found


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
    params: list = field(default_factory=list)  # its ShardedParams
    # Forwards of this backward whose inputs carry a post-backward hook that has not fired yet.
    fwd_pending: int = 0
    post_backward_done: bool = False

    @property
    def is_root(self) -> bool:
        return self.name == ""

    @property
    def gathered_bytes(self) -> int:
        return sum(b.plan.padded_numel * b.full.element_size() for b in self.buckets)


class UnitConstruction:
    """Building the units, buckets and parameter views of a sharded model."""

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
        # Replace every parameter by a ShardedParam: a view of its bucket during forward, a
        # DTensor over its main-weight rows outside (see mfsdp/params.py).
        paths = {id(m): path for path, m in root.named_modules(remove_duplicate=False)}
        self._new_params: dict[int, nn.Parameter] = {}
        self._slot_by_new: dict[int, tuple[Bucket, int]] = {}  # id(any face) -> slot
        self._param_names: list[tuple[str, nn.Parameter]] = []
        self._sparams: list[ShardedParam] = []
        self._sparam_by_id: dict[int, ShardedParam] = {}
        for e in params.values():
            bucket, i = self._slot[id(e["param"])]
            new = nn.Parameter(bucket.param_view(i), requires_grad=e["param"].requires_grad)
            mesh, group = self._param_mesh(bucket)
            sp = ShardedParam(e["name"], bucket, i, e["uses"], new, mesh, group,
                              e["param"].requires_grad)
            sp.names = [f"{paths[id(m)]}.{a}" if paths[id(m)] else a for m, a in e["uses"]]
            sp.to_sharded()
            self._unit_by_name[bucket.unit].params.append(sp)
            self._sparams.append(sp)
            self._new_params[id(e["param"])] = sp.sharded
            self._param_names.append((e["name"], new))
            self._sparam_by_id[id(e["param"])] = sp  # the optimizer may hold the original
            for face in (new, sp.sharded, sp.local):
                self._slot_by_new[id(face)] = (bucket, i)
                self._sparam_by_id[id(face)] = sp
            if new.requires_grad:
                new.register_post_accumulate_grad_hook(self._grad_hook(bucket, i))
        for b in self.buckets:
            b.n_grad_params = len(b.names) if b.requires_grad else 0
            b.is_ready = False
            b.holds_reduced = False  # no_shard: grad_shard holds reduced gradients
            # Which parameters received a gradient (on any rank) since the last zero_grad: the
            # optimizer skips the others, as plain PyTorch skips parameters whose .grad is None.
            # Host-side flags: a device write per parameter per backward would be a kernel launch
            # in every gradient hook.
            b.used = [0.0] * len(b.names)
            if not b.main_aliases_model():
                b.main_shard.copy_(b.model_sub_shard())
        for m in root.modules():  # buffers follow the device; parameters are done
            for name, buf in m._buffers.items():
                if buf is not None and buf.device != self.device and buf.device.type != "meta":
                    m._buffers[name] = buf.to(self.device)
        # Fixed launch order of gradient buckets: see [Note: reduction order] in reduce.py.
        self._grad_order = [b for b in reversed(self.buckets) if b.requires_grad]
        for unit in self.units:
            unit.module.register_forward_pre_hook(self._pre_forward_hook(unit), with_kwargs=True)
            unit.module.register_forward_hook(self._post_forward_hook(unit))

    def _param_mesh(self, bucket: Bucket):
        """(device mesh, process group) of the ranks holding distinct rows of ``bucket``'s
        parameters, or ``(None, None)`` when every rank holds them whole (``no_shard``)."""
        if bucket.replicated:
            return None, None
        cache = self.__dict__.setdefault("_meshes", {})
        comm = bucket.comm
        key = (id(comm), bucket.outer_factor)
        if key not in cache:
            group = comm.group if comm.group is not None else dist.group.WORLD
            if bucket.outer_factor > 1:  # HFSDP: main rows differ over inner x outer
                group = _hybrid_group(group, self.outer_comm.group)
            cache[key] = (DeviceMesh.from_group(group, self.device.type), group)
        return cache[key]

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
        init_fn = getattr(self, "_param_init_fn", None)
        for path, m in self.module.named_modules():
            own = [(a, p) for a, p in m._parameters.items() if p is not None and id(p) not in done]
            meta_bufs = [a for a, b in m._buffers.items() if b is not None and b.is_meta]
            if not own and not meta_bufs:
                continue
            where = f"module {path or type(m).__name__!r} ({type(m).__name__})"
            # param_init_fn, else reset_parameters(), or _reset_parameters() as
            # nn.MultiheadAttention and upstream's meta-device initialisation accept
            reset = getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)
            if init_fn is not None:
                reset = functools.partial(init_fn, m)
            if reset is None and own:
                raise ValueError(f"{where} has parameters but no reset_parameters() (or "
                                 "_reset_parameters()); meta-device initialisation needs one, or "
                                 "pass param_init_fn=fn to fully_shard (fn(module) initialises "
                                 "one module, e.g. a Hugging Face model's _init_weights)")
            transient = [a for a in meta_bufs if a in m._non_persistent_buffers_set]
            if reset is None and transient:
                raise ValueError(f"{where} has non-persistent buffers {transient} on the meta "
                                 "device and no way to recompute them; pass param_init_fn=fn to "
                                 "fully_shard (for Hugging Face models: model._init_weights, "
                                 "which recomputes rotary inv_freq)")
            originals = {a: p for a, p in own}
            m.to_empty(device=self.device, recurse=False)
            for a in meta_bufs:  # persistent buffers start at zero (a checkpoint overwrites them)
                m._buffers[a].zero_()
            if reset is not None:
                reset()
            temp = sum(p.numel() * p.element_size() for p in m._parameters.values() if p is not None)
            self.memory["init_peak_bytes"] = max(self.memory["init_peak_bytes"], held + temp)
            for a, p in originals.items():
                store(*self._slot[id(p)], m._parameters[a].detach())
                m._parameters[a] = p  # keep the original object until the views replace it
                done.add(id(p))
