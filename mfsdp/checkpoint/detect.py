"""The tests on what is on disk that the format registry (:mod:`mfsdp.checkpoint.formats`) and
the loaders use to recognise a checkpoint, and the messages for what is none.

mfsdp's own directories have ``manifest.json`` (or a root with ``latest``); Megatron-LM's have its
tracker ``latest_checkpointed_iteration.txt`` or ``metadata.json`` beside a DCP (``torch_dist``),
or Megatron-LM's entries in a plain DCP (``fsdp_dtensor``); upstream Megatron-FSDP's README
checkpoint is a DCP of ``model.*`` and positional ``optimizer.state.<i>.*`` keys. Which format a
directory is in is the registry's answer (:func:`mfsdp.checkpoint.formats.detect`), so a
directory is never mistaken for another format.
"""

from __future__ import annotations

import re
from pathlib import Path

from mfsdp.checkpoint.dcp import DCPSource
from mfsdp.checkpoint.manifest import CheckpointError, read_json, read_text

__all__ = ["TRACKER", "is_fsdp_dtensor_keys", "resolve_megatron_lm", "is_megatron_lm",
           "megatron_lm_backend", "is_megatron_fsdp", "describe_unreadable",
           "is_empty_directory", "describe_non_checkpoint"]

TRACKER = "latest_checkpointed_iteration.txt"


MODULE_PREFIX = re.compile(r"^(?:module\.)+")
POSITIONAL_STATE = re.compile(r"^optimizer\.state\.(\d+)\.(.+)$")


def is_fsdp_dtensor_keys(keys) -> bool:
    """Whether DCP ``keys`` are Megatron-LM ``fsdp_dtensor`` model keys (``model.module.*``)."""
    return any(k.startswith("model.module.") for k in keys)



def _is_megatron_lm_dcp(path: Path) -> bool:
    """Whether ``path`` is an iteration directory Megatron-LM wrote as a plain DCP (its
    ``fsdp_dtensor`` or ``torch_dcp`` formats: no ``metadata.json``; Megatron-LM's
    ``checkpoint_version`` and ``iteration`` among the entries)."""
    if not (path / ".metadata").is_file() or (path / "manifest.json").exists():
        return False
    return {"checkpoint_version", "iteration"} <= set(DCPSource(path).blob_keys)


def resolve_megatron_lm(path: str | Path) -> tuple[Path, int | None] | None:
    """``(iteration directory, iteration)`` of a Megatron-LM checkpoint (root with the tracker, or
    one ``iter_XXXXXXX``), or None when ``path`` is not one."""
    path = Path(path)
    if (path / TRACKER).is_file():
        text = read_text(path / TRACKER).strip()
        if text == "release":
            return path / "release", None
        try:
            iteration = int(text)
        except ValueError:
            raise CheckpointError(f"{path / TRACKER} holds {text!r}, not an iteration") from None
        return path / f"iter_{iteration:07d}", iteration
    if ((path / "metadata.json").is_file() and (path / ".metadata").is_file()
            or _is_megatron_lm_dcp(path)):
        name = path.name
        iteration = int(name[5:]) if name.startswith("iter_") and name[5:].isdigit() else None
        return path, iteration
    return None


def is_megatron_lm(path: str | Path) -> bool:
    """Whether ``path`` is a Megatron-LM checkpoint root or iteration directory."""
    return resolve_megatron_lm(path) is not None


def megatron_lm_backend(directory: Path) -> str:
    """The format of a Megatron-LM iteration directory (``torch_dist``'s ``sharded_backend``,
    or ``fsdp_dtensor``), or an error naming what the directory holds instead."""
    try:
        meta = read_json(directory / "metadata.json")
        if not isinstance(meta, dict):
            raise CheckpointError(f"{directory / 'metadata.json'} is not Megatron-LM's metadata "
                                  "(a JSON object): the file is damaged; restore it or load "
                                  "another iteration")
        return meta.get("sharded_backend", "?")
    except FileNotFoundError:
        pass
    where = f"{directory} holds a Megatron-LM checkpoint"
    if not directory.is_dir():
        raise CheckpointError(f"{where} tracker, but the iteration directory {directory.name} is "
                              "missing") from None
    if (directory / ".metadata").is_file():
        if is_fsdp_dtensor_keys(DCPSource(directory).tensors):
            return "fsdp_dtensor"
        raise CheckpointError(f"{where} in a format mfsdp does not read: a plain "
                              "torch.distributed.checkpoint without metadata.json or "
                              "Megatron-FSDP's model.module.* keys (Megatron-LM's --ckpt-format "
                              "torch_dcp); save it with --ckpt-format torch_dist, or with "
                              "--use-megatron-fsdp --ckpt-format fsdp_dtensor") from None
    if any(directory.glob("mp_rank_*")):
        raise CheckpointError(f"{where} in Megatron-LM's legacy --ckpt-format torch "
                              "(mp_rank_XX/model_optim_rng.pt), which mfsdp does not read; save "
                              "it with --ckpt-format torch_dist") from None
    raise CheckpointError(f"{where} tracker, but {directory} has no checkpoint files "
                          "(metadata.json and .metadata)") from None



def is_megatron_fsdp(path: str | Path) -> bool:
    """Whether ``path`` holds a checkpoint in upstream Megatron-FSDP's layout (by its keys)."""
    path = Path(path)
    if not (path / ".metadata").exists() or (path / "manifest.json").exists():
        return False
    source = DCPSource(path)
    keys = list(source.tensors)
    if "checkpoint_version" in source.blob_keys:  # Megatron-LM's (fsdp_dtensor, torch_dcp)
        return False
    return any(k.startswith("model.") for k in keys) and not any(
        k.startswith("optimizer.state.") and not POSITIONAL_STATE.match(k) for k in keys)



def describe_unreadable(path: str | Path) -> str | None:
    """What a directory holds when it is a checkpoint mfsdp cannot read yet (``None`` otherwise):
    a message naming the format, for an error instead of a silent fresh start."""
    path = Path(path)
    if (path / "manifest.json").exists() or (path / "latest").exists():
        return None  # mfsdp's own
    if is_megatron_lm(path):
        try:
            backend = megatron_lm_backend(resolve_megatron_lm(path)[0])
        except CheckpointError as exc:
            return str(exc)
        if backend not in ("torch_dist", "fsdp_dtensor"):
            return (f"{path} holds a Megatron-LM {backend!r} checkpoint; mfsdp reads "
                    "Megatron-LM's torch_dist and fsdp_dtensor")
        return None  # readable: mfsdp.checkpoint.megatron_lm
    if (path / ".metadata").exists() and not is_megatron_fsdp(path):
        return (f"{path} holds a torch.distributed.checkpoint whose keys are neither mfsdp's nor "
                "upstream Megatron-FSDP's (model.module.*, optimizer.state.<position>.*)")
    return None


def is_empty_directory(path: str | Path) -> bool:
    """Whether ``path`` is a directory with nothing but hidden leftovers (``.tmp-*`` of a save
    that never finished, staging directories): a place where a new run may start."""
    path = Path(path)
    return path.is_dir() and not any(not p.name.startswith(".") for p in path.iterdir())


def describe_non_checkpoint(path: str | Path) -> str:
    """What ``path`` is, when it exists, is not empty and is no checkpoint mfsdp reads: one
    sentence naming what was found and the fix, for an error instead of a fresh start that
    would later overwrite it."""
    path = Path(path)
    if not path.is_dir():
        return (f"{path} is a file, not a checkpoint directory; point --load at the directory "
                "--save wrote (it holds a file named latest)")
    names = sorted(p.name for p in path.iterdir() if not p.name.startswith("."))
    if (path / "config.json").is_file() and any(n.endswith(".safetensors") for n in names):
        return (f"{path} is a Hugging Face model directory; import it first with mfsdp convert "
                f"--from hf --to fsdp_dtensor {path} OUT, then --load OUT")
    iters = [n for n in names if n.startswith("iter_")]
    if iters:
        return (f"{path} holds iteration directories ({', '.join(iters[:3])}"
                f"{', ...' if len(iters) > 3 else ''}) but no latest file naming the one to "
                "load: point --load at one of them, or write its name into latest")
    return (f"{path} holds no checkpoint mfsdp reads (found {', '.join(names[:5])}"
            f"{', ...' if len(names) > 5 else ''}); point --load at a checkpoint, or at a new or "
            "empty directory to start from iteration 0")
