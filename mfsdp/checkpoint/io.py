"""Atomic save and checked, resharding load of ``fsdp_dtensor`` checkpoints.

Layout of a checkpoint root::

    ROOT/latest                       "iter_0000003" (written last, by rename)
    ROOT/iter_0000003/                one complete checkpoint
        manifest.json                 format, version, layout, every key's shape and dtype, file sizes
        param_to_param_group_map.json
        __0_0.distcp, ... .metadata   torch.distributed.checkpoint files
    ROOT/.tmp-iter_0000006-ab12/      a save in progress (never read)

A save writes into a temporary directory and renames it when every rank has finished; ``latest``
is replaced last. A save killed midway leaves only a ``.tmp-`` directory: the previous checkpoint
stays the one that loads.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from mfsdp.checkpoint.dcp import on_rank_zero, shared_temp_name
from mfsdp.checkpoint.manifest import (
    CHECKSUMS,
    DTYPES,
    FORMAT_VERSION,
    CheckpointError,
    RankZeroOSError,
    file_checksums,
    read_manifest,
    resolve_checkpoint,
    verify_checksums,
)
from mfsdp.checkpoint.state import (
    global_param_to_param_group_map,
    model_state,
    optimizer_state,
    param_groups_state,
)

__all__ = ["save_checkpoint", "save_checkpoint_directory", "load_fsdp_dtensor", "load_converted",
           "buffer_state"]

def _describe(state: dict) -> dict[str, dict]:
    """Every rank's tensor keys with global shape and dtype (experts differ between EP ranks)."""
    mine = {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in state.items()
            if torch.is_tensor(v)}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {k: v for part in everyone for k, v in part.items()}


def _layout(model) -> dict:
    state = model.fsdp_state()
    comms = state.comms
    return {"world_size": dist.get_world_size(), "strategy": state.strategy.value,
            "dp_outer": comms.outer.size if comms.outer is not None else 1,
            "outer_sharded": comms.outer_sharded,
            "ep": comms.ep.size if comms.ep is not None else 1}


def buffer_state(model) -> dict:
    """``model.<name>`` -> the persistent module buffers (plain tensors, the same on every rank);
    a load writes into them in place."""
    out = {}
    for path, m in model.module.named_modules():
        for name, buf in m._buffers.items():
            if buf is not None and name not in m._non_persistent_buffers_set:
                out[f"model.{path}.{name}" if path else f"model.{name}"] = buf
    return out


def _rng_state(model) -> dict:
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and model.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(model.device)
    return rng


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(tmp: Path, model, optimizer, iteration: int, extra: dict | None,
           files: dict[str, str] | None) -> None:
    """Every rank writes its share of one checkpoint into ``tmp`` (rank 0 made it); rank 0 adds
    the files and ``manifest.json`` last (a collective call)."""
    state = model_state(model)
    if optimizer is not None:
        state.update(optimizer_state(model, optimizer))
        state["optimizer.param_groups"] = pickle.dumps(param_groups_state(optimizer))
    state.update(buffer_state(model))
    # Non-tensor values travel as one pickled blob each (DCP would flatten nested dicts).
    # Every rank's RNG state has a key of its own (one shared key would keep one rank's for
    # all).
    rng = _rng_state(model)
    state["extra"] = pickle.dumps(dict(extra or {}, iteration=iteration, rng_state=rng))
    state[f"rng_state.rank{dist.get_rank()}"] = pickle.dumps(rng)
    model.finish_grad_sync()
    dcp.save(state, checkpoint_id=str(tmp))
    described = _describe(state)
    blobs: list = [None] * dist.get_world_size()
    dist.all_gather_object(blobs, [k for k, v in state.items() if isinstance(v, bytes)])
    group_map = (global_param_to_param_group_map(model, optimizer)
                 if optimizer is not None else None)
    if dist.get_rank() == 0:
        for fname, text in (files or {}).items():
            (tmp / fname).write_text(text)
        if optimizer is not None:
            (tmp / "param_to_param_group_map.json").write_text(json.dumps(group_map, indent=1))
    dist.barrier()
    # Every rank hashes the files it wrote (still in its page cache): the save costs one
    # read of 1/world of the checkpoint per rank, in parallel.
    sums: list = [None] * dist.get_world_size()
    dist.all_gather_object(sums, file_checksums(tmp, dist.get_rank(), dist.get_world_size()))
    if dist.get_rank() == 0:
        manifest = {"format": "fsdp_dtensor", "format_version": FORMAT_VERSION,
                    "layout": _layout(model), "tensors": described,
                    "blobs": sorted({k for part in blobs for k in part}),
                    "files": {f.name: f.stat().st_size for f in sorted(tmp.iterdir())},
                    CHECKSUMS: {k: v for part in sums for k, v in sorted(part.items())}}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
        _fsync_dir(tmp)


def save_checkpoint(root: str | os.PathLike, model, optimizer=None, iteration: int = 0,
                    extra: dict | None = None, files: dict[str, str] | None = None) -> Path:
    """Save model (main weights), optimizer and ``extra`` under ``root`` (a collective call).

    ``extra`` is for what only the caller knows (data position, scheduler state); the iteration and
    the torch RNG state (CPU, and the GPU's) are added. ``files`` (name -> text) are written into
    the checkpoint directory (e.g. ``model_config.json``). Returns ``root/iter_<iteration>``.
    """
    root = Path(root)
    name = f"iter_{iteration:07d}"
    tmp = shared_temp_name(root, name, group=True)
    latest_tmp = root / f".latest-{tmp.name.rsplit('-', 1)[1]}"
    if dist.get_rank() == 0:
        tmp.mkdir(parents=True, exist_ok=False)
    try:
        dist.barrier()
        _write(tmp, model, optimizer, iteration, extra, files)
        if dist.get_rank() == 0:
            final = root / name
            if final.exists():  # an older save of the same iteration: replace it
                shutil.rmtree(final)
            tmp.rename(final)
            latest_tmp.write_text(name + "\n")
            os.replace(latest_tmp, root / "latest")
            _fsync_dir(root)
    except BaseException:
        # A failed or interrupted save (a full disk, Ctrl-C) leaves nothing behind on rank 0's
        # side: the temporary directory goes; latest and the checkpoints it names were never
        # touched.
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                latest_tmp.unlink(missing_ok=True)
            except OSError:
                pass
        raise
    dist.barrier()
    return root / name


def save_checkpoint_directory(path: str | os.PathLike, model, optimizer=None,
                              extra: dict | None = None) -> Path:
    """Save one checkpoint directly into the directory ``path`` (a collective call): the DCP
    files, with ``manifest.json`` beside them, and no ``iter_*/`` or ``latest`` (the layout of
    upstream's per-module ``save_checkpoint``; :func:`mfsdp.checkpoint.load_checkpoint` reads
    it). ``path`` may be missing, empty, or an earlier checkpoint (replaced whole, atomically);
    a directory holding anything else is refused. Returns ``path``."""
    path = Path(path)

    def check():
        if path.is_dir() and any(path.iterdir()) and not (path / "manifest.json").exists():
            raise CheckpointError(f"{path} is neither empty nor an mfsdp checkpoint directory; "
                                  "save into a new or empty directory (or an earlier checkpoint "
                                  "to replace it)")

    error = on_rank_zero(check, describe=lambda exc: str(exc) if isinstance(
        exc, CheckpointError) else f"{type(exc).__name__}: {exc}")
    if error:
        raise CheckpointError(error)
    tmp = shared_temp_name(path.parent, path.name, group=True)
    if dist.get_rank() == 0:
        tmp.mkdir(parents=True, exist_ok=False)
    dist.barrier()

    def commit():
        if path.exists():  # empty, or an earlier checkpoint: moved aside, then removed
            old = tmp.with_name(tmp.name.replace(".tmp-", ".old-", 1))
            path.rename(old)
            try:
                tmp.rename(path)
            except OSError:
                old.rename(path)  # the earlier checkpoint back where it was
                raise
            shutil.rmtree(old)
        else:
            tmp.rename(path)
        _fsync_dir(path.parent)

    try:
        _write(tmp, model, optimizer, 0, extra, None)
    except BaseException:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    error = on_rank_zero(commit, cleanup=lambda: shutil.rmtree(tmp, ignore_errors=True),
                         keep_os_error=True)
    if isinstance(error, OSError):
        raise RankZeroOSError(error)
    if error:
        raise CheckpointError(f"saving {path} failed: {error}")
    return path


def _check_keys(ours: dict[str, dict], theirs: dict[str, dict], where: Path) -> None:
    missing = sorted(set(ours) - set(theirs))
    unexpected = sorted(set(theirs) - set(ours))
    if missing:
        raise CheckpointError(f"checkpoint {where} has no key {missing[0]!r} "
                              f"({len(missing)} missing in all)")
    if unexpected:
        raise CheckpointError(f"checkpoint {where} has unexpected key {unexpected[0]!r} "
                              f"({len(unexpected)} unexpected in all); it was written for "
                              "another model")
    for key, desc in ours.items():
        if list(desc["shape"]) != list(theirs[key]["shape"]):
            raise CheckpointError(f"key {key!r} has shape {tuple(theirs[key]['shape'])} in "
                                  f"checkpoint {where} but {tuple(desc['shape'])} in the model")


def load_converted(path: str | os.PathLike, model, optimizer, convert, what: str) -> dict:
    """Load a checkpoint of another layout (``what``, for messages): a collective call. Rank 0
    runs ``convert(tmp)`` to write an ``fsdp_dtensor`` checkpoint next to ``path``, every rank
    loads it with :func:`load_fsdp_dtensor`, rank 0 removes it; a failed conversion stops every
    rank with its reason."""
    path = Path(path)
    tmp = shared_temp_name(path.parent, path.name, ".from", group=True)
    error = on_rank_zero(lambda: convert(tmp),  # every rank hears of a failure
                         cleanup=lambda: shutil.rmtree(tmp, ignore_errors=True))
    if error:
        raise CheckpointError(f"cannot read {path} as {what}: {error}")
    try:  # written just now by this job: no checksum to check again
        return load_fsdp_dtensor(tmp, model, optimizer, verify=False)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)


def verify_distributed(ckpt: Path, manifest: dict) -> None:
    """Check the checkpoint's files against their recorded SHA-256 sums, each rank a share (a
    collective call); every rank raises the same CheckpointError naming the first bad file."""
    error = None
    try:
        verify_checksums(ckpt, manifest, dist.get_rank(), dist.get_world_size())
    except (CheckpointError, OSError) as exc:
        error = str(exc)
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    bad = [e for e in errors if e]
    if bad:
        raise CheckpointError(bad[0])


def load_fsdp_dtensor(path: str | os.PathLike, model, optimizer=None, verify: bool = True) -> dict:
    """Load an mfsdp ``fsdp_dtensor`` checkpoint (or its root) into ``model`` (and
    ``optimizer``), resharding to their layout; :func:`mfsdp.checkpoint.load_checkpoint` reads
    every format and calls this for mfsdp's own.

    With ``verify`` (the default) every file is first checked against the SHA-256 its manifest
    records, the ranks sharing the reading; a damaged file is named and nothing is loaded.
    Restores the RNG state that was saved and returns the ``extra`` dict (with ``iteration``
    and ``rng_state``). A collective call.
    """
    ckpt = resolve_checkpoint(path)
    manifest = read_manifest(ckpt)
    if verify:
        verify_distributed(ckpt, manifest)
    theirs = manifest["tensors"]
    state = model_state(model)
    has_groups = "optimizer.param_groups" in manifest.get("blobs", [])
    if optimizer is not None and not has_groups:  # a weights-only checkpoint (e.g. converted)
        optimizer = None
    if optimizer is not None:
        template = {k: (tuple(v["shape"]), DTYPES[v["dtype"]]) for k, v in theirs.items()
                    if k.startswith("optimizer.state.")}
        state.update(optimizer_state(model, optimizer, template))
        state["optimizer.param_groups"] = b""
    else:
        theirs = {k: v for k, v in theirs.items() if not k.startswith("optimizer.")}
    # Buffers load where the checkpoint has them (checkpoints before format 1.1 have none).
    buffers = {k: v for k, v in buffer_state(model).items() if k in theirs}
    state.update(buffers)
    _check_keys(_describe(state), theirs, ckpt)
    state["extra"] = b""
    own_rng = f"rng_state.rank{dist.get_rank()}"
    if own_rng in manifest.get("blobs", []):
        state[own_rng] = b""
    from torch.distributed.checkpoint import FileSystemReader

    from mfsdp.checkpoint.dcp import read_dcp_metadata

    read_dcp_metadata(FileSystemReader(str(ckpt)), ckpt)  # (its own error, on every rank)
    try:
        dcp.load(state, checkpoint_id=str(ckpt))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        first = str(exc).strip().splitlines()
        raise CheckpointError(
            f"checkpoint {ckpt}: its tensor files cannot be read ({type(exc).__name__}"
            f"{': ' + first[-1] if first else ''}); they are damaged: restore them from a copy, "
            "load another iteration, or load without --no-ckpt-verify to have the damaged file "
            "named") from None
    if optimizer is not None:
        groups = pickle.loads(state["optimizer.param_groups"])
        if len(groups) != len(optimizer.param_groups):
            raise CheckpointError(f"checkpoint {ckpt} has {len(groups)} optimizer parameter "
                                  f"groups, the optimizer has {len(optimizer.param_groups)}")
        for group, saved in zip(optimizer.param_groups, groups):
            group.update(saved)
    model.fsdp_state().install_main_weights()
    model.wait_param_sync()
    extra = pickle.loads(state["extra"])
    # This rank's own RNG state; rank 0's for ranks the writing job did not have (or for
    # checkpoints that kept one state for all ranks).
    rng = pickle.loads(state[own_rng]) if own_rng in state else (extra.get("rng_state") or {})
    extra["rng_state"] = rng
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available() and model.device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], model.device)
    return extra
