"""mfsdp's full-tensor checkpoint format, ``mfsdp_full``: what a single-process (or gathered)
job writes.

The same keys as ``fsdp_dtensor`` with full, unsharded tensors, and optimizer state keyed by
*position*, as ``torch.optim.Optimizer.state_dict()`` does (``optimizer.state.<index>.<key>``,
groups listing indices), with ``param_to_param_group_map.json`` naming each position's
parameter and group. ``torch_dist`` means Megatron-LM's format everywhere
(:mod:`mfsdp.checkpoint.megatron_lm`); this format's earlier names (``CHANGELOG.md``) still work
until 0.2.0 and warn once.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from mfsdp.checkpoint.dcp import MAP_FILE, MODEL_CONFIG_FILE, read_full, write_full
from mfsdp.checkpoint.state import read_param_to_param_group_map
from mfsdp.checkpoint.manifest import (FULL_FORMAT, CheckpointError, is_full_format,
                                      read_manifest, resolve_checkpoint)

FORMAT = FULL_FORMAT


__all__ = ["FORMAT", "fsdp_source", "check_format", "carried_files", "fsdp_to_full", "full_to_fsdp",
           "save_full_checkpoint", "load_full_checkpoint", "is_full_format"]


def fsdp_source(src: str | Path, dst: str | Path) -> tuple[Path, Path]:
    """``src`` resolved to an ``fsdp_dtensor`` checkpoint (a root with ``latest`` or the
    directory) and ``dst`` as a path that does not exist yet; an error names what is wrong."""
    src, dst = resolve_checkpoint(src), Path(dst)
    manifest = read_manifest(src)
    if manifest.get("format") != "fsdp_dtensor":
        raise CheckpointError(f"{src} is a {manifest.get('format')!r} checkpoint; convert it to "
                              "fsdp_dtensor first")
    if dst.exists():
        raise FileExistsError(f"{dst} exists; choose a new output directory")
    return src, dst


def check_format(manifest: dict, expected: str, path: Path) -> None:
    """Raise unless ``manifest`` (of the checkpoint at ``path``) is of format ``expected``."""
    if expected == FORMAT and is_full_format(manifest):
        return
    if manifest.get("format") != expected:
        raise CheckpointError(f"{path} is a {manifest.get('format')!r} checkpoint, not "
                              f"{expected!r}; pass --from {manifest.get('format')}")


def carried_files(src: Path) -> dict[str, str]:
    """Files a conversion copies along: the model configuration."""
    f = Path(src) / MODEL_CONFIG_FILE
    return {MODEL_CONFIG_FILE: f.read_text()} if f.exists() else {}


def fsdp_to_full(src: str | Path, dst: str | Path, verify: bool = True) -> Path:
    """``fsdp_dtensor`` -> ``mfsdp_full``: optimizer state re-keyed from names to positions;
    ``verify``: check ``src``'s files against their SHA-256 sums first."""
    src = Path(src)
    tensors, blobs, manifest = read_full(src, verify=verify)
    check_format(manifest, "fsdp_dtensor", src)
    out = {k: v for k, v in tensors.items() if k.startswith("model.")}
    files = carried_files(src)
    groups = blobs.get("optimizer.param_groups")
    if groups is not None:
        group_of: dict[str, int] = json.loads((src / MAP_FILE).read_text())
        order = list(group_of)  # optimizer order: groups in order, parameters in order
        index = {name: i for i, name in enumerate(order)}
        for key, value in tensors.items():
            if key.startswith("optimizer.state."):
                name, _, k = key[len("optimizer.state."):].rpartition(".")
                out[f"optimizer.state.{index[name]}.{k}"] = value
        groups = [dict(g, params=[index[n] for n in order if group_of[n] == gi])
                  for gi, g in enumerate(groups)]
        blobs = dict(blobs, **{"optimizer.param_groups": groups})
        files[MAP_FILE] = json.dumps(group_of, indent=1)
    return write_full(dst, out, blobs, FORMAT, manifest.get("layout"), files)


def full_to_fsdp(src: str | Path, dst: str | Path,
                       param_map: str | Path | None = None, verify: bool = True) -> Path:
    """``mfsdp_full`` -> ``fsdp_dtensor``: optimizer state re-keyed from positions to names.

    The parameter order (positions) comes from the parameter-group map (``--param-to-param-group-
    map``, or the one inside ``src``); with a single optimizer group and no map, it is the order of
    the ``model.*`` keys in the checkpoint. ``verify``: check ``src``'s files against their
    SHA-256 sums first.
    """
    src = Path(src)
    tensors, blobs, manifest = read_full(src, verify=verify)
    check_format(manifest, FORMAT, src)
    groups = blobs.get("optimizer.param_groups")
    map_path = Path(param_map) if param_map else src / MAP_FILE
    if map_path.exists():

        group_of = read_param_to_param_group_map(map_path)
    elif groups is None or len(groups) <= 1:
        group_of = {k[len("model."):]: 0 for k in tensors if k.startswith("model.")}
    else:
        raise CheckpointError(f"{src} has {len(groups)} optimizer parameter groups but no "
                              f"{MAP_FILE}; pass --param-to-param-group-map (write it from the "
                              "training job with --dump-param-to-param-group-map)")
    order = list(group_of)
    unknown = [n for n in order if f"model.{n}" not in tensors]
    if unknown:
        raise CheckpointError(f"the parameter-group map names {unknown[0]!r}, which {src} does "
                              "not hold")
    out = {k: v for k, v in tensors.items() if k.startswith("model.")}
    for key, value in tensors.items():
        if key.startswith("optimizer.state."):
            idx, _, k = key[len("optimizer.state."):].partition(".")
            out[f"optimizer.state.{order[int(idx)]}.{k}"] = value
    files = carried_files(src)
    if groups is not None:
        for gi, g in enumerate(groups):
            expected = [i for i, n in enumerate(order) if group_of[n] == gi]
            if sorted(g.get("params", expected)) != expected:
                raise CheckpointError(f"optimizer group {gi} of {src} lists parameters "
                                      f"{g['params']}, the map places {expected} in it")
        blobs = dict(blobs, **{"optimizer.param_groups": [
            {k: v for k, v in g.items() if k != "params"} for g in groups]})
        files[MAP_FILE] = json.dumps(group_of, indent=1)
    blobs.setdefault("extra", {"iteration": 0})
    return write_full(dst, out, blobs, "fsdp_dtensor", manifest.get("layout"), files)


def save_full_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    path: str | Path, iteration: int = 0) -> Path:
    """Write what a single-process (or 3D-parallel, gathered) job writes: ``mfsdp_full``."""
    from mfsdp.models.gpt import GPTConfig

    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {f"model.{n}": p.detach().float().clone() for n, p in model.named_parameters()}
    blobs: dict[str, object] = {"extra": {"iteration": iteration}}
    files = {}
    if isinstance(getattr(model, "config", None), GPTConfig):
        files[MODEL_CONFIG_FILE] = json.dumps(model.config.to_dict(), indent=1)
    if optimizer is not None:
        sd = optimizer.state_dict()
        for idx, state in sd["state"].items():
            for k, v in state.items():
                tensors[f"optimizer.state.{idx}.{k}"] = v.clone() if torch.is_tensor(v) else v
        blobs["optimizer.param_groups"] = sd["param_groups"]
        group_of = {names[id(p)]: gi for gi, g in enumerate(optimizer.param_groups)
                    for p in g["params"]}
        files[MAP_FILE] = json.dumps(group_of, indent=1)
    return write_full(path, tensors, blobs, FORMAT, {"world_size": 1}, files)


def load_full_checkpoint(path: str | Path, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> int:
    """Load an ``mfsdp_full`` checkpoint into an unsharded model (and optimizer); return its iteration."""
    tensors, blobs, manifest = read_full(path)
    check_format(manifest, FORMAT, Path(path))
    with torch.no_grad():
        for n, p in model.named_parameters():
            key = f"model.{n}"
            if key not in tensors:
                raise CheckpointError(f"checkpoint {path} has no key {key!r}")
            p.copy_(tensors[key])
    if optimizer is not None and "optimizer.param_groups" in blobs:
        state: dict[int, dict] = {}
        for key, value in tensors.items():
            if key.startswith("optimizer.state."):
                idx, _, k = key[len("optimizer.state."):].partition(".")
                state.setdefault(int(idx), {})[k] = value
        optimizer.load_state_dict({"state": state, "param_groups": blobs["optimizer.param_groups"]})
    return int(blobs.get("extra", {}).get("iteration", 0))


def _deprecated(old: str, new):
    def alias(*args, **kwargs):
        warnings.warn(f"mfsdp.checkpoint: {old} is now {new.__name__} (the format's name is "
                      "mfsdp_full; torch_dist means Megatron-LM's format)", FutureWarning,
                      stacklevel=2)
        return new(*args, **kwargs)
    alias.__name__ = old
    alias.__doc__ = f"Deprecated spelling of :func:`{new.__name__}` (removed in the next release)."
    return alias


fsdp_to_torch_dist = _deprecated("fsdp_to_torch_dist", fsdp_to_full)
torch_dist_to_fsdp = _deprecated("torch_dist_to_fsdp", full_to_fsdp)
save_torch_dist = _deprecated("save_torch_dist", save_full_checkpoint)
load_torch_dist = _deprecated("load_torch_dist", load_full_checkpoint)
