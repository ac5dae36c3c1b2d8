"""Convert checkpoints between ``torch_dist``, ``fsdp_dtensor`` and Hugging Face safetensors.

Run as ``mfsdp convert`` or ``python -m mfsdp.checkpoint.convert``::

    mfsdp convert --from torch_dist --to fsdp_dtensor IN OUT [--param-to-param-group-map MAP]
    mfsdp convert --from fsdp_dtensor --to torch_dist IN OUT
    mfsdp convert --from fsdp_dtensor --to safetensors IN OUT [--swiglu] [--dtype bf16]
    mfsdp convert --from safetensors --to fsdp_dtensor IN OUT [--swiglu]

Conversion runs in one process on full tensors; the result of a conversion to ``fsdp_dtensor`` is
read into any layout by :func:`mfsdp.checkpoint.load_checkpoint`, which reshards on load.

The formats (all but safetensors are ``torch.distributed.checkpoint`` directories with a
``manifest.json``):

* ``fsdp_dtensor``: ``model.<name>``, ``optimizer.state.<name>.<key>``, ``optimizer.param_groups``
  (hyperparameters), ``extra``; optimizer state is keyed by parameter *name*.
* ``torch_dist``: the same weights, and optimizer state keyed by *position*, as
  ``torch.optim.Optimizer.state_dict()`` does (``optimizer.state.<index>.<key>``, groups listing
  indices), with ``param_to_param_group_map.json`` naming each position's parameter and group.
* ``safetensors``: ``model.safetensors`` (weights by name, no optimizer) and ``config.json``.
"""

from __future__ import annotations

import argparse
import json
import pickle
import secrets
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from mfsdp.checkpoint.io import FORMAT_VERSION, CheckpointError, read_manifest
from mfsdp.checkpoint.safetensors import load_file, save_file

__all__ = ["read_full", "write_full", "fsdp_to_torch_dist", "torch_dist_to_fsdp",
           "fsdp_to_safetensors", "safetensors_to_fsdp", "split_swiglu", "join_swiglu",
           "save_torch_dist", "load_torch_dist", "main"]

MAP_FILE = "param_to_param_group_map.json"
_DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def read_full(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, object], dict]:
    """Every tensor of a DCP checkpoint as a full tensor, every blob unpickled, and the manifest."""
    path = Path(path)
    manifest = read_manifest(path)
    meta = FileSystemReader(str(path)).read_metadata()
    state: dict[str, object] = {}
    for key, md in meta.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            state[key] = b""
        else:
            state[key] = torch.empty(md.size, dtype=md.properties.dtype)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    tensors = {k: v for k, v in state.items() if torch.is_tensor(v)}
    blobs = {k: pickle.loads(v) for k, v in state.items() if not torch.is_tensor(v)}
    return tensors, blobs, manifest


def write_full(path: str | Path, tensors: dict[str, torch.Tensor], blobs: dict[str, object],
               fmt: str, layout: dict | None = None, files: dict[str, str] | None = None) -> Path:
    """Write a one-process DCP checkpoint directory (atomically: temporary name, then rename)."""
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} exists; choose a new output directory")
    tmp = path.parent / f".tmp-{path.name}-{secrets.token_hex(4)}"
    state = dict(tensors)
    state.update({k: pickle.dumps(v) for k, v in blobs.items()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
    for name, text in (files or {}).items():
        (tmp / name).write_text(text)
    manifest = {"format": fmt, "format_version": FORMAT_VERSION, "layout": layout or {},
                "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype)}
                            for k, v in tensors.items()},
                "blobs": sorted(blobs),
                "files": {f.name: f.stat().st_size for f in sorted(tmp.iterdir())}}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    tmp.rename(path)
    return path


def _check_format(manifest: dict, expected: str, path: Path) -> None:
    if manifest.get("format") != expected:
        raise CheckpointError(f"{path} is a {manifest.get('format')!r} checkpoint, not "
                              f"{expected!r}; pass --from {manifest.get('format')}")


def fsdp_to_torch_dist(src: str | Path, dst: str | Path) -> Path:
    """``fsdp_dtensor`` -> ``torch_dist``: optimizer state re-keyed from names to positions."""
    src = Path(src)
    tensors, blobs, manifest = read_full(src)
    _check_format(manifest, "fsdp_dtensor", src)
    out = {k: v for k, v in tensors.items() if k.startswith("model.")}
    files = {}
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
    return write_full(dst, out, blobs, "torch_dist", manifest.get("layout"), files)


def torch_dist_to_fsdp(src: str | Path, dst: str | Path,
                       param_map: str | Path | None = None) -> Path:
    """``torch_dist`` -> ``fsdp_dtensor``: optimizer state re-keyed from positions to names.

    The parameter order (positions) comes from the parameter-group map (``--param-to-param-group-
    map``, or the one inside ``src``); with a single optimizer group and no map, it is the order of
    the ``model.*`` keys in the checkpoint.
    """
    src = Path(src)
    tensors, blobs, manifest = read_full(src)
    _check_format(manifest, "torch_dist", src)
    groups = blobs.get("optimizer.param_groups")
    map_path = Path(param_map) if param_map else src / MAP_FILE
    if map_path.exists():
        group_of = json.loads(map_path.read_text())
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
    files = {}
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


def split_swiglu(weights: dict[str, torch.Tensor], pattern: str = "fc1") -> dict[str, torch.Tensor]:
    """Split fused gate/up weights ``<p>.<pattern>.<w>`` into ``<p>.gate_proj.<w>``, ``<p>.up_proj.<w>``.

    >>> split_swiglu({"mlp.fc1.weight": torch.arange(4.0).view(4, 1)})["mlp.up_proj.weight"].ravel()
    tensor([2., 3.])
    """
    out = {}
    for name, t in weights.items():
        prefix, _, leaf = name.rpartition(".")
        head, _, module = prefix.rpartition(".")
        if module == pattern:
            if t.shape[0] % 2:
                raise ValueError(f"{name} has {t.shape[0]} rows; a fused gate/up weight has an "
                                 "even number (gate rows, then up rows)")
            gate, up = t.chunk(2, dim=0)
            base = f"{head}." if head else ""
            out[f"{base}gate_proj.{leaf}"], out[f"{base}up_proj.{leaf}"] = gate.clone(), up.clone()
        else:
            out[name] = t
    return out


def join_swiglu(weights: dict[str, torch.Tensor], pattern: str = "fc1") -> dict[str, torch.Tensor]:
    """The inverse of :func:`mfsdp.checkpoint.convert.split_swiglu`."""
    out = {}
    for name, t in weights.items():
        prefix, _, leaf = name.rpartition(".")
        head, _, module = prefix.rpartition(".")
        base = f"{head}." if head else ""
        if module == "gate_proj":
            up = weights.get(f"{base}up_proj.{leaf}")
            if up is None:
                raise ValueError(f"{name} has no matching {base}up_proj.{leaf}")
            out[f"{base}{pattern}.{leaf}"] = torch.cat([t, up], dim=0)
        elif module != "up_proj":
            out[name] = t
    return out


def fsdp_to_safetensors(src: str | Path, dst: str | Path, swiglu: bool = False,
                        dtype: torch.dtype | None = None, config: dict | None = None) -> Path:
    """``fsdp_dtensor`` -> a Hugging Face style folder (``model.safetensors``, ``config.json``)."""
    src, dst = Path(src), Path(dst)
    tensors, _, manifest = read_full(src)
    _check_format(manifest, "fsdp_dtensor", src)
    weights = {k[len("model."):]: (v.to(dtype) if dtype else v) for k, v in tensors.items()
               if k.startswith("model.")}
    if swiglu:
        weights = split_swiglu(weights)
    dst.mkdir(parents=True, exist_ok=False)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = dict(config or {})
    cfg["mfsdp"] = {"source": str(src.name), "swiglu": swiglu, "layout": manifest.get("layout")}
    (dst / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True))
    return dst


def safetensors_to_fsdp(src: str | Path, dst: str | Path, swiglu: bool | None = None) -> Path:
    """A safetensors folder -> ``fsdp_dtensor`` (weights only; optimizer state starts fresh)."""
    src = Path(src)
    weights, _ = load_file(src / "model.safetensors")
    cfg_path = src / "config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    if swiglu is None:
        swiglu = bool(cfg.get("mfsdp", {}).get("swiglu", False))
    if swiglu:
        weights = join_swiglu(weights)
    tensors = {f"model.{k}": v.float() if v.is_floating_point() else v for k, v in weights.items()}
    return write_full(dst, tensors, {"extra": {"iteration": 0}}, "fsdp_dtensor",
                      (cfg.get("mfsdp") or {}).get("layout"))


def save_torch_dist(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    path: str | Path, iteration: int = 0) -> Path:
    """Write what a single-process (or 3D-parallel, gathered) job writes: ``torch_dist``."""
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {f"model.{n}": p.detach().float().clone() for n, p in model.named_parameters()}
    blobs: dict[str, object] = {"extra": {"iteration": iteration}}
    files = {}
    if optimizer is not None:
        sd = optimizer.state_dict()
        for idx, state in sd["state"].items():
            for k, v in state.items():
                tensors[f"optimizer.state.{idx}.{k}"] = v.clone() if torch.is_tensor(v) else v
        blobs["optimizer.param_groups"] = sd["param_groups"]
        group_of = {names[id(p)]: gi for gi, g in enumerate(optimizer.param_groups)
                    for p in g["params"]}
        files[MAP_FILE] = json.dumps(group_of, indent=1)
    return write_full(path, tensors, blobs, "torch_dist", {"world_size": 1}, files)


def load_torch_dist(path: str | Path, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> int:
    """Load a ``torch_dist`` checkpoint into an unsharded model (and optimizer); return its iteration."""
    tensors, blobs, manifest = read_full(path)
    _check_format(manifest, "torch_dist", Path(path))
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


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The ``mfsdp convert`` argument parser."""
    parser = parser or argparse.ArgumentParser(prog="mfsdp convert", description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="src_format", required=True,
                        choices=["torch_dist", "fsdp_dtensor", "safetensors"],
                        help="format of INPUT")
    parser.add_argument("--to", dest="dst_format", required=True,
                        choices=["torch_dist", "fsdp_dtensor", "safetensors"],
                        help="format of OUTPUT")
    parser.add_argument("input", metavar="INPUT", help="checkpoint directory (or its root with a 'latest' file)")
    parser.add_argument("output", metavar="OUTPUT", help="new directory to write")
    parser.add_argument("--param-to-param-group-map", metavar="FILE",
                        help="JSON map parameter name -> optimizer group (torch_dist input)")
    parser.add_argument("--swiglu", action="store_true",
                        help="split (to safetensors) or join (from safetensors) fused gate/up "
                             "projection weights named *.fc1.*")
    parser.add_argument("--dtype", choices=sorted(_DTYPE_NAMES),
                        help="cast weights when writing safetensors (default: keep fp32)")
    parser.add_argument("--config", metavar="JSON", help="model config merged into config.json")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``mfsdp convert`` command."""
    from mfsdp.checkpoint.io import resolve_checkpoint

    pair = (args.src_format, args.dst_format)
    src = args.input if args.src_format == "safetensors" else resolve_checkpoint(args.input)
    if pair == ("fsdp_dtensor", "torch_dist"):
        out = fsdp_to_torch_dist(src, args.output)
    elif pair == ("torch_dist", "fsdp_dtensor"):
        out = torch_dist_to_fsdp(src, args.output, args.param_to_param_group_map)
    elif pair == ("fsdp_dtensor", "safetensors"):
        config = json.loads(Path(args.config).read_text()) if args.config else None
        out = fsdp_to_safetensors(src, args.output, args.swiglu,
                                  _DTYPE_NAMES[args.dtype] if args.dtype else None, config)
    elif pair == ("safetensors", "fsdp_dtensor"):
        out = safetensors_to_fsdp(src, args.output, True if args.swiglu else None)
    else:
        raise SystemExit(f"mfsdp convert: no conversion from {pair[0]} to {pair[1]}; supported: "
                         "torch_dist<->fsdp_dtensor, fsdp_dtensor<->safetensors")
    print(f"wrote {args.dst_format} checkpoint {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m mfsdp.checkpoint.convert``."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
