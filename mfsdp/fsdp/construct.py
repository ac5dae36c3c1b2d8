"""Building a sharded model's units from a module: which parameters go together, in which flat
buffer, how each parameter becomes a :class:`~mfsdp.fsdp.param.ShardedParam` viewing it, and the
initial values (meta-device initialisation one module at a time).

:func:`build_units` runs once, in :class:`mfsdp.FullyShardedModule`'s constructor, and returns a
:class:`Construction`: the units (each owning its buckets and parameters) and the index of every
parameter's faces. The grouping rules are described in ``docs/concepts.md``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils.weak import WeakIdKeyDictionary

from mfsdp.fsdp.agreement import agree_on_rng, agree_on_values, check_same_model
from mfsdp.fsdp.bucket import Bucket, plan_bucket
from mfsdp.fsdp.pools import DoubleBuffer, GradDoubleBuffer
from mfsdp.config import ShardingStrategy
from mfsdp.fsdp.dtensor import TPSpec
from mfsdp.fsdp.param import ShardedParam
from mfsdp.fsdp.state import Comms, ShardingState
from mfsdp.fsdp.unit import FSDPUnit

__all__ = ["Construction", "build_units"]


@dataclass
class Construction:
    """What :func:`~mfsdp.fsdp.construct.build_units` made."""

    units: list[FSDPUnit]  # the root unit first, then the others in module order
    pool: DoubleBuffer | None  # gathered weights of non-root units (fsdp_double_buffer)
    grad_pool: GradDoubleBuffer | None  # their full gradients (fsdp_double_buffer, ZeRO-2/3)
    sparams: list[ShardedParam] = field(default_factory=list)  # in model order
    # any face of a parameter (the original, the full view, the DTensor, the local rows) -> its
    # ShardedParam; weak keys: the original may die (and its id be reused) once the model is built
    by_face: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)


def _hybrid_group(inner: dist.ProcessGroup, outer: dist.ProcessGroup, layout=None,
                  expert: bool = False) -> dist.ProcessGroup:
    """The group of every rank of ``inner`` and of its replicas over ``outer`` (a collective call
    over the world: every rank creates every such group, in the same order). Every rank's
    ``(inner, outer)`` ranks come from ``layout`` (a :class:`~mfsdp.layout.ParallelLayout`, the
    one the groups were made from) when given, else from an all-gather."""
    world = dist.get_world_size()
    if layout is not None:
        inner_of_rank = {r: sorted(g) for g in layout.groups(
            "expt_dp_shard" if expert else "dp_shard") for r in g}
        outer_of_rank = {r: sorted(g) for g in layout.groups("dp_outer") for r in g}
        everyone = [(inner_of_rank[r], outer_of_rank[r]) for r in range(world)]
    else:
        mine = (sorted(dist.get_process_group_ranks(inner)),
                sorted(dist.get_process_group_ranks(outer)))
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


def _tp_specs(comms: Comms, params: dict[int, dict]) -> None:
    """Give every parameter entry its :class:`TPSpec` (``entry["tp"]``, ``None`` outside a TP
    mesh), checking that DTensor parameters live on the model's TP mesh."""
    tp_group = comms.tp_group
    tp_ranks = dist.get_process_group_ranks(tp_group) if tp_group is not None else None
    for e in params.values():
        p = e["param"]
        if not isinstance(p, DTensor):
            e["tp"] = TPSpec.of(p, comms.tp_mesh) if tp_group is not None else None
            continue
        where = f"parameter {e['name']!r} is a DTensor over {p.device_mesh}"
        if tp_group is None:
            raise ValueError(f"{where} (tensor parallel) but fully_shard was given no TP "
                             "dimension; pass device_mesh=<the (dp, tp) mesh>, dp_shard_dim=... "
                             "and tp_dim=<the mesh dimension the TP plan used>")
        if p.device_mesh.ndim != 1 or (sorted(dist.get_process_group_ranks(
                p.device_mesh.get_group())) != sorted(tp_ranks)):
            raise ValueError(f"{where}, but tp_dim spans ranks {sorted(tp_ranks)}; parallelize "
                             "the model over device_mesh[tp_dim] (the same TP ranks)")
        for pl in p.placements:
            if not isinstance(pl, (Shard, _StridedShard, Replicate)):
                raise ValueError(f"{where} with placement {pl}; TP parameters must be Shard, "
                                 "_StridedShard or Replicate over the TP mesh")
        e["tp"] = TPSpec.of(p)


def _is_unit(m: nn.Module, units) -> bool:
    """Whether ``m`` is a unit: an instance of one of the classes in ``units``, or one of the
    module instances there (the per-module front door, ``mfsdp.experimental``, names modules)."""
    return any(m is u if isinstance(u, nn.Module) else isinstance(m, u) for u in units)


def _unit_paths(root: nn.Module, unit_classes, disable_bucketing: bool) -> list[str]:
    paths = [""]
    if unit_classes and not disable_bucketing:
        paths += [n for n, m in root.named_modules() if n and _is_unit(m, unit_classes)]
        if len(paths) == 1 and not _is_unit(root, unit_classes):
            names = ", ".join(getattr(c, "__name__", type(c).__name__) for c in unit_classes)
            raise ValueError(f"fsdp_unit_modules=({names}) matches no module of "
                             f"{type(root).__name__}; name the block classes the model uses")
    return paths


def _parameters_by_unit(root: nn.Module, unit_paths: list[str]) -> dict[int, dict]:
    """Every distinct parameter of ``root``: the places it is registered, and its unit (the
    innermost unit containing every module that registers it)."""

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
    return params


def build_units(state: ShardingState, root: nn.Module, wrapper: nn.Module,
                unit_classes) -> Construction:
    """Units, buckets and :class:`~mfsdp.fsdp.param.ShardedParam` objects of ``root``, with the
    settings of ``state`` (strategy, device, communicators, mixed-precision policy, options); the
    root unit's hooks go on ``wrapper`` (the :class:`mfsdp.FullyShardedModule` under
    construction)."""
    opts, comms = state.options, state.comms
    meta_init = opts.init_model_with_meta_device
    unit_paths = _unit_paths(root, unit_classes, opts.disable_bucketing)
    mods = dict(root.named_modules())
    params = _parameters_by_unit(root, unit_paths)
    _tp_specs(comms, params)
    _refuse_post_accumulate_hooks(params)
    check_same_model(params)  # before any collective whose count depends on the model
    if not meta_init:
        for e in params.values():
            p = e["param"]
            if p.device.type == "meta" and state.device.type != "meta":
                raise ValueError(f"parameter {e['name']!r} is on the meta device; pass "
                                 "init_model_with_meta_device=True to materialise it shard by shard")
            if p.device != state.device:
                raise ValueError(f"parameter {e['name']!r} is on {p.device} but the mesh "
                                 f"device is {state.device}; move the model with "
                                 f"model.to({str(state.device)!r}) first or pass device=")
    replicated = state.strategy is ShardingStrategy.NO_SHARD
    outer_size = comms.outer.size if comms.outer is not None else 1
    factor = outer_size if comms.outer_sharded else 1
    # Gradients are averaged over every data-parallel rank. An expert's local gradient already
    # sums the contributions of its whole EP group's tokens, and the expert data-parallel
    # reduction sums over the rest, so the same factor averages both (see docs/hsdp-ep.md).
    scale = 1.0 if opts.calculate_per_token_loss else 1.0 / (comms.dp.size * outer_size)
    units: list[FSDPUnit] = []
    slot: dict[int, tuple[Bucket, int]] = {}  # id(original param) -> (bucket, index)
    for upath in unit_paths:
        unit = FSDPUnit(upath, wrapper if upath == "" else mods[upath], state)
        groups: dict[tuple, list[dict]] = {}
        for e in params.values():
            if e["unit"] != upath:
                continue
            p = e["param"]
            key = (p.dtype, ".experts." in f".{e['name']}.", p.requires_grad)
            groups.setdefault(key, []).append(e)
        for key, entries in groups.items():
            dtype, is_expert = key[0], key[1]
            comm = comms.expt if is_expert else comms.dp
            main, grads, comm_dtype = state.mp_policy.resolve(dtype)
            bucket = Bucket(
                unit=upath, key=key, names=[e["name"] for e in entries],
                plan=plan_bucket([_block_shape(e) for e in entries],
                                 1 if replicated else comm.size * factor),
                rank=0 if replicated else comm.rank, device=state.device, dtype=dtype,
                main_dtype=main, grad_dtype=grads, comm_dtype=comm_dtype,
                sharded_params=state.strategy.shards_params,
                sharded_grads=state.strategy.shards_grads, replicated=replicated,
                outer_factor=factor,
                outer_rank=comms.outer.rank if factor > 1 else 0,
                comm=comm, ag_comm=comms.expt_ag if is_expert else comms.dp_ag,
                grad_scale=scale,
            )
            for i, e in enumerate(entries):
                slot[id(e["param"])] = (bucket, i)
            unit.buckets.append(bucket)
        units.append(unit)
    pool = grad_pool = None
    if state.double_buffer and len(units) > 1:
        pool = DoubleBuffer(units[1:], state.device)
    if state.grad_double_buffer and len(units) > 1:
        grad_pool = GradDoubleBuffer(units[1:], state.device,
                                     state.options.fsdp_db_use_persist_buf_on_alloc_fail)
    buckets = [b for u in units for b in u.buckets]
    _check_replicas(state, params, slot, meta_init)
    _load_values(state, root, buckets, params, slot, meta_init)
    out = Construction(units, pool, grad_pool)
    # Replace every parameter by a ShardedParam: a view of its bucket during forward, a DTensor
    # over its main-weight rows outside (see mfsdp/fsdp/param.py).
    paths = {id(m): path for path, m in root.named_modules(remove_duplicate=False)}
    unit_by_name = {u.name: u for u in units}
    meshes: dict[tuple, tuple] = {}
    for e in params.values():
        bucket, i = slot[id(e["param"])]
        mesh, group = _param_mesh(state, bucket, meshes, e["tp"] is not None)
        names = [f"{paths[id(m)]}.{a}" if paths[id(m)] else a for m, a in e["uses"]]
        sp = ShardedParam(e["name"], bucket, i, e["uses"], mesh, group,
                          e["param"].requires_grad, e["tp"], names=names)
        new = sp.unsharded
        _carry_grad_hooks(e["param"], new)
        bucket.sparams.append(sp)
        sp.to_sharded()
        unit_by_name[bucket.unit].params.append(sp)
        out.sparams.append(sp)
        for face in (e["param"], new, sp.sharded, sp.local):  # the optimizer may hold any
            out.by_face[face] = sp
    for b in buckets:
        b.n_grad_params = len(b.names) if b.requires_grad else 0
        b.used = [0.0] * len(b.names)
        if not b.main_aliases_model():
            b.main_shard.copy_(b.model_sub_shard())
    for m in root.modules():  # buffers follow the device; parameters are done
        for name, buf in m._buffers.items():
            if buf is not None and buf.device != state.device and buf.device.type != "meta":
                m._buffers[name] = buf.to(state.device)
    return out


# [Note: user hooks on parameters] A gradient hook the user registered on a parameter before
# fully_shard (``p.register_hook(fn)``) moves to the parameter the model trains, the full view
# that forward uses (``ShardedParam.unsharded``): it fires with this rank's local gradient
# before the reduction, and what it returns is what is reduced, as under DDP (FSDP2 and upstream
# Megatron-FSDP drop it). A post-accumulate-grad hook cannot move: the engine's own hook takes
# the accumulated gradient into the bucket, so the user's would see another tensor than DDP
# hands it; fully_shard refuses it naming the parameter.
def _carry_grad_hooks(original: torch.Tensor, trained: torch.Tensor) -> None:
    """Register ``original``'s gradient hooks on ``trained``, in their order."""
    for hook in (original._backward_hooks or {}).values():
        trained.register_hook(hook)


def _refuse_post_accumulate_hooks(params: dict[int, dict]) -> None:
    """Refuse a parameter that carries a post-accumulate-grad hook (see [Note: user hooks on
    parameters])."""
    for e in params.values():
        if e["param"]._post_accumulate_grad_hooks:
            raise ValueError(
                f"parameter {e['name']!r} has a post-accumulate-grad hook "
                "(register_post_accumulate_grad_hook), which fully_shard cannot carry over: "
                "the sharded model accumulates gradients in its buckets; use register_hook "
                "(carried over to the parameter the model trains), or read the reduced "
                "gradient from the model's parameter after backward")


def _check_replicas(state: ShardingState, params: dict[int, dict], slot, meta_init: bool) -> None:
    """The ranks that hold copies of a parameter start from the same values, broadcast where
    they differ (see :mod:`mfsdp.fsdp.agreement`): its data-parallel group, the outer group when the outer
    dimension replicates, and the TP group for a parameter TP replicates."""

    def group(comm):
        if comm is None:
            return None
        return comm.group if comm.group is not None else dist.group.WORLD

    comms = state.comms
    outer = group(comms.outer) if not comms.outer_sharded else None
    # No values yet (or none ever: a model sharded onto the meta device by a dry run): equal
    # generator states draw equal weights.
    if meta_init or state.device.type == "meta":
        agree_on_rng(state.device, [outer])
        return
    entries = []
    for e in params.values():
        bucket, _ = slot[id(e["param"])]
        p = e["param"].detach()
        tp = comms.tp_group if (comms.tp_group is not None and not isinstance(p, DTensor)) else None
        entries.append((e["name"], p.to_local() if isinstance(p, DTensor) else p,
                        (group(bucket.comm), outer, tp)))
    agree_on_values(entries, state.device)


def _block_shape(entry: dict) -> tuple:
    """The shape the bucket holds for a parameter: its TP block, or the whole parameter."""
    return tuple(entry["tp"].local_shape) if entry["tp"] is not None else tuple(entry["param"].shape)


def _param_mesh(state: ShardingState, bucket: Bucket, cache: dict, tp: bool):
    """(device mesh, process group) of the ranks holding distinct rows of ``bucket``'s
    parameters; the group is ``None`` when every rank holds them whole (``no_shard``). Under TP
    the mesh is 2-D, ``(dp, tp)``; the group is the data-parallel one."""
    comm = bucket.comm
    key = (id(comm), bucket.outer_factor, tp)
    if key not in cache:
        group = comm.group if comm.group is not None else dist.group.WORLD
        if bucket.outer_factor > 1:  # HFSDP: main rows differ over inner x outer
            given = state.comms.expt_hybrid if bucket.is_expert else state.comms.hybrid
            group = (given.group if given is not None  # the caller's hybrid_fsdp(_expt)_group
                     else _hybrid_group(group, state.comms.outer.group, state.comms.layout,
                                        bucket.is_expert))
        if tp:
            mesh = _dp_tp_mesh(group, state.comms.tp_group, state.device.type,
                               state.comms.layout)
        else:
            mesh = DeviceMesh.from_group(group, state.device.type)
        cache[key] = (mesh, group)
    mesh, group = cache[key]
    # no_shard: a DTensor replicated over the data-parallel mesh; no rows differ between ranks
    return (mesh, None) if bucket.replicated else (mesh, group)


def _ordered_ranks(group: dist.ProcessGroup) -> list[int]:
    """The global ranks of ``group`` in the order of their group ranks."""
    ranks = dist.get_process_group_ranks(group)
    return sorted(ranks, key=lambda r: dist.get_group_rank(group, r))


def _dp_tp_mesh(dp_group: dist.ProcessGroup, tp_group: dist.ProcessGroup,
                device_type: str, layout=None) -> DeviceMesh:
    """The 2-D ``(dp, tp)`` mesh whose row ``i`` is the TP group of the ``i``-th rank of
    ``dp_group`` (a collective over the world: every rank learns the others' TP groups, from
    ``layout``, the :class:`~mfsdp.layout.ParallelLayout` the groups were made from, when
    given)."""
    if layout is not None:
        tp_of = {r: sorted(g) for g in layout.groups("tp") for r in g}
    else:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (dist.get_rank(), _ordered_ranks(tp_group)))
        tp_of = dict(everyone)
    rows = [tp_of[r] for r in _ordered_ranks(dp_group)]
    if any(len(row) != len(rows[0]) for row in rows):
        raise ValueError("the data-parallel ranks' TP groups differ in size; build the mesh "
                         "with init_device_mesh so that every TP group has the same size")
    return DeviceMesh.from_group([dp_group, tp_group], device_type,
                                 mesh=torch.tensor(rows, dtype=torch.int),
                                 mesh_dim_names=("dp", "tp"))


@torch.no_grad()
def _load_values(state: ShardingState, root: nn.Module, buckets: list[Bucket], params: dict[int, dict],
                 slot: dict[int, tuple[Bucket, int]], meta_init: bool) -> None:
    """Copy initial values into the buckets (the local rows only, under ZeRO-3)."""

    def store(bucket: Bucket, i: int, value: torch.Tensor) -> None:
        if bucket.sharded_params:
            bucket.store_local(i, value)
        else:
            bucket.param_view(i).copy_(value)

    def block(value: torch.Tensor) -> torch.Tensor:
        return value.to_local() if isinstance(value, DTensor) else value

    if not meta_init:
        for e in params.values():
            store(*slot[id(e["param"])], block(e["param"].detach()))
        return
    # Meta-device initialisation, one module at a time, in construction order.
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for b in buckets for t in (b.model_shard, b.main_shard, b.full)}
    held = sum(storages.values())  # what the buckets hold already (shards, under ZeRO-3)
    done: set[int] = set()
    init_fn = state.options.param_init_fn
    for path, m in root.named_modules():
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
        if state.device.type == "meta":  # a dry run: shapes only, no values to draw or store
            continue
        originals = {a: p for a, p in own}
        m.to_empty(device=state.device, recurse=False)
        for a in meta_bufs:  # persistent buffers start at zero (a checkpoint overwrites them)
            m._buffers[a].zero_()
        if reset is not None:
            reset()
        temp = sum(p.numel() * p.element_size() for p in m._parameters.values() if p is not None)
        state.memory["init_peak_bytes"] = max(state.memory["init_peak_bytes"], held + temp)
        for a, p in originals.items():
            store(*slot[id(p)], block(m._parameters[a].detach()))
            m._parameters[a] = p  # keep the original object until the views replace it
            done.add(id(p))
