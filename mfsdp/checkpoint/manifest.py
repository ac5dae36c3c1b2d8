"""What every mfsdp checkpoint directory has: ``manifest.json`` and its checks, the error type.

The bottom of the checkpoint package: it imports nothing else of mfsdp. Recognising other
formats by what is on disk is :mod:`mfsdp.checkpoint.detect`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch

__all__ = ["FORMAT_VERSION", "DTYPES", "FULL_FORMAT", "CheckpointError", "RankZeroOSError",
           "os_error_in", "describe_os_error", "os_error_remedy", "resolve_checkpoint",
           "read_manifest", "read_text", "read_json", "is_full_format", "CHECKSUMS",
           "file_sha256", "checksum_owner", "file_checksums", "verify_checksums"]

FORMAT_VERSION = 1
# mfsdp's full-tensor format (mfsdp.checkpoint.full); manifests before the rename say torch_dist
FULL_FORMAT = "mfsdp_full"
_FULL_FORMAT_NAMES = (FULL_FORMAT, "torch_dist")
# manifest key: file name -> hex SHA-256 of every file of the directory but manifest.json
CHECKSUMS = "sha256"
DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.bfloat16, torch.float16,
                               torch.int64, torch.int32, torch.uint8, torch.bool)}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded: the message names the key or file and what is wrong."""


def os_error_in(exc: BaseException) -> OSError | None:
    """The ``OSError`` behind ``exc``: itself, its cause or context, or the first one of a
    ``torch.distributed.checkpoint`` ``CheckpointException``'s per-rank failures (or of the
    message rank 0 handed every rank); None when there is none."""
    seen = set()
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo.extend(f[0] if isinstance(f, tuple) else f for f in failures.values())
        todo.extend([e.__cause__, e.__context__])
        if isinstance(e, RankZeroOSError):
            return e.error
    return None


class RankZeroOSError(RuntimeError):
    """An ``OSError`` one rank met (e.g. rank 0 converting a save), as every rank raises it."""

    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


def os_error_remedy(exc: OSError) -> str:
    """What to do about ``exc``: ``free space there``, ``make the file system writable again``..."""
    import errno

    return {errno.ENOSPC: "free space there", errno.EDQUOT: "free space within your quota",
            errno.EROFS: "make the file system writable again",
            errno.EACCES: "make the directory writable by this user",
            errno.EPERM: "make the directory writable by this user"}.get(
                exc.errno, "repair the file system")


def describe_os_error(exc: OSError) -> str:
    """``no space left on device (/path)``: what the file system said, and where."""
    what = exc.strerror or str(exc)
    where = exc.filename
    return f"{what[:1].lower() + what[1:]} ({where})" if where else what



def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint directory: ``path`` itself, or what ``path/latest`` names."""
    path = Path(path)
    if (path / "manifest.json").exists():
        return path
    latest = path / "latest"
    if latest.exists():
        text = read_text(latest)
        name = text.strip()
        if not name or "\n" in name or Path(name).name != name or name in (".", ".."):
            # never a path: nothing outside the root is read through it
            raise CheckpointError(
                f"{latest} holds {text!r}, not the name of a checkpoint directory beside it "
                "(such as 'iter_0000100'); write the name of the checkpoint to load into it, or "
                "point --load at that directory")
        target = path / name
        if not (target / "manifest.json").exists():
            waited = _settle(target)
            if waited is None:
                raise CheckpointError(f"{latest} names {name!r}, which has no manifest.json "
                                      "(incomplete or deleted checkpoint)"
                                      + (f"; waited {NFS_SETTLE_S:g} s for a network file "
                                         "system to show it" if target.is_dir() else ""))
        return target
    raise CheckpointError(f"no checkpoint at {path}: neither {path}/manifest.json nor "
                          f"{path}/latest exists (a directory named .tmp-* is an unfinished save)")



# How long a checkpoint directory that exists may take to show its manifest.json: NFS clients
# cache directory listings (acdirmax, 60 s by default; 30 s is what most sites set), so a job
# on another node can see `latest` and the directory before the manifest written last.
NFS_SETTLE_S = 30.0


def _settle(target: Path) -> float | None:
    """Wait for ``target/manifest.json`` while ``target`` exists (reading the directory, which
    makes an NFS client ask the server again); the seconds waited, or None if it never came."""
    import time

    if not target.is_dir():
        return None
    start = time.monotonic()
    while time.monotonic() - start < NFS_SETTLE_S:
        try:
            if "manifest.json" in os.listdir(target):
                return time.monotonic() - start
        except OSError:
            return None
        time.sleep(0.5)
    return None


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of a checkpoint, checked for format version and file sizes."""
    ckpt = resolve_checkpoint(path)
    manifest = read_json(ckpt / "manifest.json")
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{ckpt}/manifest.json is not an mfsdp manifest (no files table): "
                              "the file is damaged; restore it or load another iteration")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"{ckpt}/manifest.json has format_version={version!r}, newer than "
                              f"this mfsdp reads ({FORMAT_VERSION}); upgrade mfsdp")
    for fname, size in manifest["files"].items():
        f = ckpt / fname
        if not f.exists():
            raise CheckpointError(f"checkpoint file {f} is missing (the manifest lists it)")
        if f.stat().st_size != size:
            raise CheckpointError(f"checkpoint file {f} has {f.stat().st_size} bytes, the manifest "
                                  f"says {size}: the file is truncated or was modified")
    return manifest


def read_text(path: Path) -> str:
    """The text of a small checkpoint file (``latest``, a tracker), or a CheckpointError naming
    the file when it is not text."""
    try:
        return Path(path).read_text()
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is not text: the file is damaged; restore it or point at "
                              "another checkpoint") from None


def read_json(path: Path):
    """A JSON file of a checkpoint (``manifest.json``, ``model_config.json``, ...), or a
    CheckpointError naming the file and what is wrong with it."""
    try:
        return json.loads(read_text(path))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}): the "
                              "file is damaged; restore it or point at another checkpoint") from None


def is_full_format(manifest: dict) -> bool:
    """Whether a manifest is of mfsdp's full-tensor format (under its new or its old name)."""
    return manifest.get("format") in _FULL_FORMAT_NAMES


def file_sha256(path: str | os.PathLike) -> str:
    """The hex SHA-256 of a file, read in blocks (what ``sha256sum`` prints)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def checksum_owner(names: dict[str, int], rank: int, world: int) -> list[str]:
    """The files (name -> size) rank ``rank`` of ``world`` hashes: the ``__<r>_*.distcp`` files
    that rank ``r`` wrote go to ``r`` (still in its page cache after a save); the rest are spread
    by size, largest first, to the rank with the fewest bytes so far."""
    load = [0] * world
    owner = {}
    for name, size in names.items():
        m = _RANK_FILE.match(name)
        if m and int(m.group(1)) < world:
            owner[name] = int(m.group(1))
            load[owner[name]] += size
    for name in sorted(set(names) - set(owner), key=lambda n: (-names[n], n)):
        owner[name] = min(range(world), key=lambda r: (load[r], r))
        load[owner[name]] += names[name]
    return sorted(n for n, r in owner.items() if r == rank)


def file_checksums(directory: str | os.PathLike, rank: int = 0, world: int = 1) -> dict[str, str]:
    """SHA-256 of this rank's share (``checksum_owner``) of the files in ``directory``
    (``manifest.json`` excepted); all of them in one process."""
    directory = Path(directory)
    sizes = {f.name: f.stat().st_size for f in directory.iterdir()
             if f.is_file() and f.name != "manifest.json"}
    return {n: file_sha256(directory / n) for n in checksum_owner(sizes, rank, world)}


def verify_checksums(ckpt: str | os.PathLike, manifest: dict, rank: int = 0,
                     world: int = 1) -> int:
    """Check this rank's share of the checkpoint's files against the SHA-256 sums its manifest
    records; return the bytes checked. A mismatch raises a CheckpointError naming the file.
    Checkpoints written before mfsdp recorded sums have none: nothing is checked (0)."""
    ckpt = Path(ckpt)
    sums = manifest.get(CHECKSUMS)
    if not isinstance(sums, dict):
        return 0
    sizes = {n: int(manifest["files"].get(n, 0)) for n in sums}
    checked = 0
    for name in checksum_owner(sizes, rank, world):
        if not (ckpt / name).is_file():
            raise CheckpointError(f"checkpoint file {ckpt / name} is missing (the manifest "
                                  "records its SHA-256)")
        if file_sha256(ckpt / name) != sums[name]:
            raise CheckpointError(
                f"checkpoint file {ckpt / name} does not match the SHA-256 its manifest records "
                "(same size, different bytes): it was modified or damaged after the save; "
                "restore it from a copy or load another iteration")
        checked += sizes[name]
    return checked
