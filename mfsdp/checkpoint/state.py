"""State dicts of a sharded model and its optimizer, as uneven DTensors of global shape.

Keys (the same in every layout, which is what makes resharding possible):

* ``model.<name>``: the main weights (fp32 by default) of parameter ``<name>``;
* ``optimizer.state.<name>.<key>``: optimizer state (``exp_avg``, ``exp_avg_sq``, ``step``, ...);
  tensors shaped like the parameter are sharded like it, scalars are replicated;
* ``optimizer.param_groups``: the hyperparameters of each group (without the parameters);
* ``extra``: whatever the caller adds (iteration, data position, RNG state).

``<name>`` is the parameter's name in the unwrapped model; expert parameters use their *global*
expert index (set with :meth:`mfsdp.fsdp.state.ShardingState.set_global_names`), so a
checkpoint written with EP 2 can be read with EP 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mfsdp.checkpoint.dcp import DCPSource
from mfsdp.checkpoint.megatron_common import mfsdp_name
from mfsdp.fsdp.dtensor import uneven_dtensor

__all__ = ["param_entries", "model_state", "optimizer_state", "param_groups_state",
           "param_to_param_group_map", "global_param_to_param_group_map",
           "dump_param_to_param_group_map", "read_param_to_param_group_map"]


def _where(model, bucket, i: int) -> tuple[str, tuple, int, object]:
    """(checkpoint name, global shape, first local element, TP spec or None) of parameter ``i``
    of ``bucket`` (under TP the first element counts in the parameter's TP block)."""
    sp = bucket.sparams[i]
    name = model.fsdp_state().global_name(bucket.names[i])
    return name, (sp.global_shape or (1,)), sp.start, sp.tp


def param_entries(model) -> list[tuple[str, torch.Tensor, tuple, int, object]]:
    """(checkpoint name, local main-weight piece, global shape, its first element, TP spec or
    None) per parameter."""
    out = []
    for _, local, b, i in model.fsdp_state().named_main_shards():
        name, shape, start, tp = _where(model, b, i)
        out.append((name, local, shape, start, tp))
    return out


def model_state(model) -> dict:
    """``model.<name>`` -> uneven DTensor over the main weights (reads and writes in place)."""
    mesh = model.fsdp_state().world_mesh
    return {f"model.{name}": uneven_dtensor(local, mesh, shape, start, tp=tp)
            for name, local, shape, start, tp in param_entries(model)}


def optimizer_state(model, optimizer, template: dict[str, tuple] | None = None) -> dict:
    """``optimizer.state.<name>.<key>`` -> tensors over the optimizer's local state.

    ``template`` (key -> (global shape, dtype), from a checkpoint's manifest) creates missing
    state so that a fresh optimizer can be loaded into.
    """
    mesh = model.fsdp_state().world_mesh
    out = {}
    for main, bucket, i in optimizer.main_shards:
        name, shape, start, tp = _where(model, bucket, i)
        state = optimizer.optimizer.state.setdefault(main, {})
        if template is not None:
            prefix = f"optimizer.state.{name}."
            for key, (gshape, dtype) in template.items():
                k = key[len(prefix):]
                if key.startswith(prefix) and k not in state:
                    state[k] = (torch.zeros_like(main, dtype=dtype) if tuple(gshape) == shape
                                else torch.zeros(gshape, dtype=dtype))
        for k, v in state.items():
            key = f"optimizer.state.{name}.{k}"
            if torch.is_tensor(v) and v.dim() > 0 and tuple(v.shape) == tuple(main.shape):
                out[key] = uneven_dtensor(v, mesh, shape, start, tp=tp)
            else:
                out[key] = v
        if not state:
            del optimizer.optimizer.state[main]
    return out


def param_groups_state(optimizer) -> list[dict]:
    """Hyperparameters of each optimizer group (no parameters)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def param_to_param_group_map(model, optimizer) -> dict[str, int]:
    """Checkpoint name of every optimized parameter -> index of its optimizer group."""
    mains = iter(optimizer.main_shards)
    out = {}
    for g, group in enumerate(optimizer.param_groups):
        for _ in group["params"]:
            _, bucket, i = next(mains)
            out[_where(model, bucket, i)[0]] = g
    return out


def global_param_to_param_group_map(model, optimizer) -> dict[str, int]:
    """:func:`param_to_param_group_map` over every rank: with expert parallelism each rank holds
    other experts, so the ranks' maps are merged (rank 0's order, then each further rank's
    parameters not seen yet, in its order). Collective: every rank calls it."""
    mine = list(param_to_param_group_map(model, optimizer).items())
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(mine)
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    merged: dict[str, int] = {}
    for part in parts:
        for name, group in part:
            if merged.setdefault(name, group) != group:
                raise RuntimeError(f"parameter {name} is in optimizer group {merged[name]} on one "
                                   f"rank and {group} on another; build the same groups on every rank")
    return merged


def dump_param_to_param_group_map(model, optimizer, path) -> None:
    """Write :func:`global_param_to_param_group_map` to ``path`` (rank 0 writes; every rank calls
    it). As upstream's ``--dump-param-to-param-group-map`` does, ``path`` becomes a
    ``torch.distributed.checkpoint`` directory of ``{parameter name: group}``; the JSON that
    upstream's ``checkpoint_inspector.py print-torch-dcp-in-json`` makes of it,
    ``param_to_param_group_map.json``, is written inside. A ``path`` ending in ``.json`` is that
    JSON file alone."""
    import json
    import warnings
    from pathlib import Path

    import torch.distributed.checkpoint as dcp

    mapping = global_param_to_param_group_map(model, optimizer)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    path = Path(path)
    if path.suffix == ".json":
        path.write_text(json.dumps(mapping, indent=1))
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(dict(mapping), checkpoint_id=str(path), no_dist=True)
    (path / "param_to_param_group_map.json").write_text(json.dumps(mapping, indent=1))


def read_param_to_param_group_map(path) -> dict[str, int]:
    """A parameter-to-group map, in the optimizer's order, under mfsdp's parameter names, from
    any of: mfsdp's JSON, the directory upstream's ``--dump-param-to-param-group-map`` writes (a
    DCP of ``{name: group}``), or the JSON upstream's ``checkpoint_inspector.py
    print-torch-dcp-in-json`` makes of it (``model.module.decoder.layers.0...``). Megatron-LM's
    names become mfsdp's (:func:`mfsdp.checkpoint.megatron_common.mfsdp_name`)."""
    import json
    from pathlib import Path


    path = Path(path)
    if path.is_dir():
        if (path / ".metadata").is_file():

            source = DCPSource(path)
            raw = {k: int(source.object(k)) for k in source.blob_keys}
            raw.update({k: int(source.get(k)) for k in source.tensors})
            # DCP does not keep insertion order: the optimizer's order is by group, then by
            # the order the writer listed them, which the JSON beside it keeps where present
            if (path / "param_to_param_group_map.json").is_file():
                listed = json.loads((path / "param_to_param_group_map.json").read_text())
                if set(listed) == set(raw):
                    raw = listed
        elif (path / "param_to_param_group_map.json").is_file():
            raw = json.loads((path / "param_to_param_group_map.json").read_text())
        else:
            raise FileNotFoundError(f"{path} holds neither a torch.distributed.checkpoint of the "
                                    "map nor param_to_param_group_map.json")
    else:
        raw = json.loads(path.read_text())
    out: dict[str, int] = {}
    for name, group in raw.items():
        ours = mfsdp_name(name)
        if ours in out:
            raise ValueError(f"{path}: {name!r} and another entry both name {ours!r}")
        out[ours] = int(group)
    return out
