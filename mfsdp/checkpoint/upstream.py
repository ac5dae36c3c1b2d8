"""Checkpoints written by upstream Megatron-FSDP (the ``megatron_fsdp`` package), read and written.

Upstream's README saves a checkpoint with::

    torch.distributed.checkpoint.save({"model": model.state_dict(),
                                       "optimizer": optimizer.state_dict()}, checkpoint_id=DIR)

which puts in ``DIR`` a plain DCP checkpoint (``.metadata`` and ``__<rank>_0.distcp``, no
manifest) holding

* ``model.module.<name>``: each weight, a DTensor of global shape (``module.`` because the
  wrapper holds the model as ``module``);
* ``optimizer.state.<i>.<key>``: the optimizer state by *position* ``i`` in the optimizer's
  parameter order (groups in order, parameters in order): ``step``, ``exp_avg``, ``exp_avg_sq``;
* ``optimizer.param_groups.<g>.<field>``: each hyperparameter of each group, and
  ``optimizer.param_groups.<g>.params``, the positions in group ``g``.

mfsdp's own ``fsdp_dtensor`` keys the optimizer state by parameter *name*. Positions become names
through the optimizer's parameter order: the one of the optimizer being loaded (the training
script builds the same groups), or, for a conversion, the model's parameter order and the
parameter-to-group map (``--param-to-param-group-map-json``; one group needs none).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from mfsdp.checkpoint.dcp import MAP_FILE, MODEL_CONFIG_FILE, DCPSource, LazyPlanner, write_streaming
from mfsdp.checkpoint.detect import POSITIONAL_STATE, is_megatron_fsdp
from mfsdp.checkpoint.full import fsdp_source
from mfsdp.checkpoint.io import load_converted
from mfsdp.checkpoint.manifest import CheckpointError
from mfsdp.checkpoint.state import param_to_param_group_map

__all__ = ["FORMAT", "fsdp_to_megatron_fsdp", "is_megatron_fsdp",
           "load_megatron_fsdp", "megatron_fsdp_to_fsdp", "positions_to_names"]

FORMAT = "megatron_fsdp"
_GROUP = re.compile(r"^optimizer\.param_groups\.(\d+)\.(.+)$")



def _groups(source) -> list[dict]:
    groups: dict[int, dict] = {}
    for key in source.blob_keys:
        m = _GROUP.match(key)
        if m:
            groups.setdefault(int(m.group(1)), {})[m.group(2)] = source.blob(key)
    return [groups[g] for g in sorted(groups)]


def positions_to_names(model_names: list[str], group_of: dict[str, int] | None,
                       groups: list[dict]) -> list[str]:
    """The parameter name at each optimizer position.

    ``model_names``: the model's parameters in order; ``group_of``: parameter name -> group (the
    parameter-to-group map; ``None`` with one group). Positions run through the groups in order,
    and through each group's parameters in the model's order.

    >>> positions_to_names(["a", "b", "c"], {"a": 0, "b": 1, "c": 0},
    ...                    [{"params": [0, 1]}, {"params": [2]}])
    ['a', 'c', 'b']
    """
    if group_of is None:
        if len(groups) > 1:
            raise CheckpointError(f"the checkpoint has {len(groups)} optimizer parameter groups; "
                                  "pass the parameter-to-group map "
                                  "(--param-to-param-group-map-json) to tell which parameter "
                                  "each position is")
        group_of = {n: 0 for n in model_names}
    order = [n for g in range(len(groups)) for n in model_names if group_of.get(n) == g]
    listed = [i for grp in groups for i in grp.get("params", [])]
    if listed and sorted(listed) != list(range(len(order))):
        raise CheckpointError(f"the checkpoint's groups list {len(listed)} parameters, the map "
                              f"and the model give {len(order)}: they describe different models")
    for g, grp in enumerate(groups):
        mine = [i for i, n in enumerate(order) if group_of[n] == g]
        if "params" in grp and list(grp["params"]) != mine:
            raise CheckpointError(f"optimizer group {g} lists positions {grp['params']}; the map "
                                  f"puts positions {mine} in it")
    return order


def megatron_fsdp_to_fsdp(src: str | Path, dst: str | Path, names: list[str] | None = None,
                          model_names: list[str] | None = None,
                          group_of: dict[str, int] | None = None,
                          model_config: dict | None = None, weights_only: bool = False) -> Path:
    """Upstream Megatron-FSDP DCP checkpoint -> mfsdp ``fsdp_dtensor`` (streamed, tensor by tensor).

    ``names``: the parameter name at each optimizer position (from the optimizer that will load
    the result); else computed by :func:`positions_to_names` from ``model_names`` (default: the
    checkpoint's weights, when it has one group) and ``group_of``. Every position's state must
    have its parameter's shape (checked). ``weights_only`` leaves the optimizer state out.
    """

    src = Path(src)
    source = DCPSource(src)
    weights = {}
    for key in source.tensors:
        if key.startswith("model."):
            name = key[len("model."):].removeprefix("module.")
            weights[f"model.{name}"] = key
    states = {}
    for key in source.tensors:
        m = POSITIONAL_STATE.match(key)
        if m and not weights_only:
            states[key] = (int(m.group(1)), m.group(2))
    groups = _groups(source)
    files: dict[str, str] = {}
    if model_config is not None:
        files[MODEL_CONFIG_FILE] = json.dumps(model_config, indent=1)
    out_keys = {k: (source.tensors[v][0], source.tensors[v][1]) for k, v in weights.items()}
    origin = dict(weights)
    blobs: dict[str, object] = {"extra": {"iteration": 0, "source": FORMAT}}
    if states:
        if names is None:
            names = positions_to_names(model_names or [k[len("model."):] for k in weights],
                                       group_of, groups)
        for key, (i, field) in states.items():
            if i >= len(names):
                raise CheckpointError(f"{src} has optimizer state at position {i}; the optimizer "
                                      f"has {len(names)} parameters")
            name = names[i]
            shape, dtype = source.tensors[key]
            if f"model.{name}" not in weights:
                raise CheckpointError(f"position {i} is {name!r}, which {src} has no weight for")
            wshape = source.tensors[weights[f"model.{name}"]][0]
            if shape not in ((), wshape):
                raise CheckpointError(f"optimizer state {key} has shape {shape}; position {i} is "
                                      f"{name!r} of shape {wshape}: the parameter order does not "
                                      "match (pass the parameter-to-group map)")
            out_keys[f"optimizer.state.{name}.{field}"] = (shape, dtype)
            origin[f"optimizer.state.{name}.{field}"] = key
        blobs["optimizer.param_groups"] = [{k: v for k, v in g.items() if k != "params"}
                                           for g in groups]
        gmap = {n: g for g, grp in enumerate(groups) for n in
                [names[i] for i in grp.get("params", range(len(names)))]}
        files[MAP_FILE] = json.dumps({n: gmap.get(n, 0) for n in names}, indent=1)
    return write_streaming(dst, out_keys, lambda k: source.get(origin[k]), blobs, "fsdp_dtensor",
                           {"source": FORMAT}, files)


def fsdp_to_megatron_fsdp(src: str | Path, dst: str | Path) -> Path:
    """mfsdp ``fsdp_dtensor`` -> what upstream Megatron-FSDP's README checkpoint holds (``.metadata``
    and ``.distcp`` files, ``model.module.<name>``, optimizer state by position, param groups per
    field), loadable by upstream's ``dcp.load`` + ``load_state_dict``. Positions follow the
    checkpoint's parameter-to-group map (the optimizer's order)."""
    import secrets
    import shutil
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter


    src, dst = fsdp_source(src, dst)
    source = DCPSource(src)
    origin: dict[str, str] = {}
    for key in source.tensors:
        if key.startswith("model."):
            origin["model.module." + key[len("model."):]] = key
    state: dict[str, object] = {}
    groups_blob = None
    if "optimizer.param_groups" in source.blob_keys:
        groups_blob = source.blob("optimizer.param_groups")
        group_of = json.loads((src / MAP_FILE).read_text())
        order = list(group_of)
        for key in source.tensors:
            if key.startswith("optimizer.state."):
                name, _, field = key[len("optimizer.state."):].rpartition(".")
                origin[f"optimizer.state.{order.index(name)}.{field}"] = key
        for g, grp in enumerate(groups_blob):
            for field, value in dict(grp, params=[i for i, n in enumerate(order)
                                                  if group_of[n] == g]).items():
                state[f"optimizer.param_groups.{g}.{field}"] = value
    for key, src_key in origin.items():
        shape, dtype = source.tensors[src_key]
        state[key] = torch.empty(shape, dtype=dtype, device="meta")
    tmp = dst.parent / f".tmp-{dst.name}-{secrets.token_hex(4)}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=FileSystemWriter(str(tmp), single_file_per_rank=False,
                                                            thread_count=1),
                     planner=LazyPlanner(lambda k: source.get(origin[k])), no_dist=True)
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def load_megatron_fsdp(path: str | Path, model, optimizer=None) -> dict:
    """Load an upstream Megatron-FSDP checkpoint into an mfsdp model (and optimizer): a collective
    call. Rank 0 converts it next to ``path`` (positions named by ``optimizer``'s parameter
    order), every rank loads the result with :func:`mfsdp.checkpoint.load_checkpoint`, rank 0
    removes it."""

    names = list(param_to_param_group_map(model, optimizer)) if optimizer is not None else None
    return load_converted(path, model, optimizer, lambda tmp: megatron_fsdp_to_fsdp(
        path, tmp, names=names, weights_only=optimizer is None),
        "an upstream Megatron-FSDP checkpoint")
