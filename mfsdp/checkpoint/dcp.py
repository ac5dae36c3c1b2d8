"""Streaming ``torch.distributed.checkpoint`` I/O shared by every format module.

Full-tensor reads and writes of a DCP directory with ``manifest.json`` (:func:`read_full`,
:func:`write_full`), writes that produce one tensor at a time (:func:`write_streaming` with
:class:`LazyPlanner`), reads of one tensor or one window of it (:class:`DCPSource`), the atomic
commit of a written directory, spreading a conversion over the ranks of a job, and the progress
bar of long conversions.
"""

import dataclasses
import io
import json
import math
import pickle
import secrets
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from mfsdp.checkpoint.manifest import (CHECKSUMS, FORMAT_VERSION, CheckpointError,
                                      RankZeroOSError, file_checksums, file_sha256, read_manifest,
                                      verify_checksums)

__all__ = ["MAP_FILE", "MODEL_CONFIG_FILE", "read_full", "write_full", "write_streaming",
           "LazyPlanner", "DCPSource", "Progress", "spread_over_ranks", "ranks",
           "shared_temp_name", "owned_keys", "on_rank_zero", "from_rank_zero", "commit_dir",
           "nbytes", "human_bytes"]

MAP_FILE = "param_to_param_group_map.json"
MODEL_CONFIG_FILE = "model_config.json"


def read_full(path: str | Path, verify: bool = True
              ) -> tuple[dict[str, torch.Tensor], dict[str, object], dict]:
    """Every tensor of a DCP checkpoint as a full tensor, every blob unpickled, and the manifest;
    with ``verify``, the files are first checked against their recorded SHA-256 sums."""
    path = Path(path)
    manifest = read_manifest(path)
    if verify:
        verify_checksums(path, manifest)
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
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
        for name, text in (files or {}).items():
            (tmp / name).write_text(text)
        manifest = {"format": fmt, "format_version": FORMAT_VERSION, "layout": layout or {},
                    "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype)}
                                for k, v in tensors.items()},
                    "blobs": sorted(blobs),
                    "files": {f.name: f.stat().st_size for f in sorted(tmp.iterdir())},
                    CHECKSUMS: file_checksums(tmp)}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
        tmp.rename(path)
    except BaseException:  # a full disk, Ctrl-C: nothing is left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


class LazyPlanner(DefaultSavePlanner):
    """A save planner whose tensors are produced one at a time, when the writer asks for them.

    ``split``: keys written as one chunk per index of their first dimension (as megatron-core
    writes a tensor stacked over layers or experts), each made by ``produce(key, i)``: the writer
    then holds one slice, not the stacked tensor."""

    def __init__(self, produce, flatten_state_dict: bool = True,
                 split: set[str] | frozenset = frozenset()):
        # (no ShardedTensor to flatten; flattening them rebuilds nested objects with str keys)
        super().__init__(flatten_state_dict=flatten_state_dict, flatten_sharded_tensors=False)
        self._produce = produce
        self._split = set(split)

    def create_local_plan(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem

        plan = super().create_local_plan()
        if not self._split:
            return plan
        items = []
        for item in plan.items:
            if item.index.fqn not in self._split or item.tensor_data is None:
                items.append(item)
                continue
            size = item.tensor_data.size
            for i in range(size[0]):
                offsets = torch.Size([i] + [0] * (len(size) - 1))
                items.append(WriteItem(
                    index=MetadataIndex(item.index.fqn, offsets), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets,
                                                   sizes=torch.Size([1, *size[1:]])),
                        properties=item.tensor_data.properties, size=size)))
        plan = dataclasses.replace(plan, items=items)
        self.plan = plan
        return plan

    def resolve_data(self, write_item):
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        fqn = write_item.index.fqn
        if fqn in self._split:
            return self._produce(fqn, write_item.index.offset[0]).unsqueeze(0)
        return self._produce(fqn)


_SPREAD = [False]


class spread_over_ranks:
    """Within this context, the streaming conversions are collective calls over the default
    process group: every rank makes and writes its share of the tensors (what ``mfsdp convert``
    does under ``torchrun``). Outside it a conversion is one process's work even where a process
    group exists (as when rank 0 converts a checkpoint for a training job)."""

    def __init__(self):
        self._was = False  # the setting outside this context, restored on the way out

    def __enter__(self):
        self._was, _SPREAD[0] = _SPREAD[0], True
        return self

    def __exit__(self, *exc):
        _SPREAD[0] = self._was
        return False


def ranks() -> tuple[int, int]:
    """(rank, world size) a conversion spreads over: the process group's inside
    :class:`spread_over_ranks`, else (0, 1)."""
    import torch.distributed as dist

    if _SPREAD[0] and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _group(rank: int | None, world: int | None) -> tuple[int, int]:
    """``(rank, world)`` as given, else the default process group's (one process without one)."""
    if rank is None or world is None:
        import torch.distributed as dist

        up = dist.is_available() and dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if up else (0, 1)
    return rank, world


def from_rank_zero(make: Callable[[], object], *, rank: int | None = None,
                   world: int | None = None) -> object:
    """Rank 0's ``make()``, on every rank (the others do not call it). ``rank``/``world``: who
    takes part (default: the default process group, or one process)."""
    rank, world = _group(rank, world)
    value = [make() if rank == 0 else None]
    if world > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(value, src=0)
    return value[0]


def shared_temp_name(parent: Path, name: str, prefix: str = ".tmp", *,
                     group: bool = False) -> Path:
    """A fresh temporary path ``parent/<prefix>-<name>-<token>``, the same on every rank: the
    ranks :func:`ranks` names (a conversion), or with ``group`` the default process group's."""
    rank, world = _group(None, None) if group else ranks()
    token = from_rank_zero(lambda: secrets.token_hex(4), rank=rank, world=world)
    return parent / f"{prefix}-{name}-{token}"


def owned_keys(nbytes: dict[str, int]) -> set[str]:
    """The keys this rank writes when a conversion runs on several ranks (``torchrun``): each
    key to the rank with the fewest bytes so far, largest keys first, so the ranks' shares of
    reading and writing are even. All keys in one process."""
    rank, world = ranks()
    if world == 1:
        return set(nbytes)
    load = [0] * world
    mine = set()
    for key in sorted(nbytes, key=lambda k: (-nbytes[k], k)):
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += nbytes[key]
        if r == rank:
            mine.add(key)
    return mine


def on_rank_zero(work: Callable[[], object], *, cleanup: Callable[[], object] | None = None,
                 catch: type[BaseException] = Exception, keep_os_error: bool = False,
                 rank: int | None = None, world: int | None = None,
                 describe: Callable[[BaseException], object] | None = None) -> object:
    """Rank 0 runs ``work()``, then every rank learns how it went (none waits at a barrier for a
    rank that raised): ``None``, or the error as ``"Type: message"`` (the ``OSError`` itself with
    ``keep_os_error``, for the caller to word; ``describe(exc)`` when given). ``cleanup()`` runs
    on rank 0 after a failure. ``rank``/``world``: who takes part (default: the default process
    group, or one process)."""
    rank, world = _group(rank, world)

    def attempt():
        try:
            work()
        except catch as exc:  # noqa: BLE001 - every rank stops with the reason
            if cleanup is not None:
                cleanup()
            if keep_os_error and isinstance(exc, OSError):
                return exc
            return describe(exc) if describe is not None else f"{type(exc).__name__}: {exc}"
        return None

    return from_rank_zero(attempt, rank=rank, world=world)


def commit_dir(tmp: Path, path: Path, write) -> None:
    """Rank 0 runs ``write()`` (files beside the DCP data) and renames ``tmp`` to ``path``; every
    rank learns whether it worked; a failure removes ``tmp``."""
    rank, world = ranks()

    def work():
        write()
        tmp.rename(path)

    error = on_rank_zero(work, cleanup=lambda: shutil.rmtree(tmp, ignore_errors=True),
                         catch=BaseException, keep_os_error=True, rank=rank, world=world)
    if isinstance(error, OSError):  # a full disk: said by the caller, in its words
        raise RankZeroOSError(error)
    if error:
        raise CheckpointError(f"writing {path} failed: {error}")


def write_streaming(path: str | Path, specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                    produce, blobs: dict[str, object], fmt: str, layout: dict | None = None,
                    files: dict[str, str] | None = None) -> Path:
    """Like ``write_full``, but tensor ``key`` (of shape and dtype ``specs[key]``) is made by
    ``produce(key)`` only when it is written: one file per tensor, so the writer holds one.

    Within :class:`spread_over_ranks` every rank calls it: each makes and writes its share of
    the tensors (:func:`owned_keys`), rank 0 the blobs and the manifest."""
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} exists; choose a new output directory")
    rank, world = ranks()
    tmp = shared_temp_name(path.parent, path.name)
    mine = owned_keys({k: tensor_nbytes(*v) for k, v in specs.items()})
    state: dict[str, object] = {k: torch.empty(shape, dtype=dtype, device="meta")
                                for k, (shape, dtype) in specs.items() if k in mine}
    if rank == 0:
        state.update({k: pickle.dumps(v) for k, v in blobs.items()})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=FileSystemWriter(str(tmp), single_file_per_rank=False,
                                                            thread_count=1),
                     planner=LazyPlanner(produce), no_dist=world == 1)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written is left behind
        raise
    sums = [file_checksums(tmp, rank, world)]  # each rank the files it wrote
    if world > 1:
        import torch.distributed as dist

        gathered: list = [None] * world
        dist.all_gather_object(gathered, sums[0])
        sums = gathered

    def finish() -> None:
        for name, text in (files or {}).items():
            (tmp / name).write_text(text)
        checksums = {k: v for part in sums for k, v in part.items()}
        checksums.update({name: file_sha256(tmp / name) for name in (files or {})})
        manifest = {"format": fmt, "format_version": FORMAT_VERSION, "layout": layout or {},
                    "tensors": {k: {"shape": list(shape), "dtype": str(dtype)}
                                for k, (shape, dtype) in specs.items()},
                    "blobs": sorted(blobs),
                    "files": {f.name: f.stat().st_size for f in sorted(tmp.iterdir())},
                    CHECKSUMS: dict(sorted(checksums.items()))}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))

    commit_dir(tmp, path, finish)
    return path


class _CachedReader(FileSystemReader):
    """A reader that reads a checkpoint's metadata once."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._cached = None  # the metadata, once read (a conversion asks for it many times)

    def read_metadata(self):
        if self._cached is None:
            self._cached = super().read_metadata()
        return self._cached


class _Window(io.RawIOBase):
    """A seekable read-only view of ``length`` bytes of ``f`` from ``offset`` (one DCP item)."""

    def __init__(self, f, offset: int, length: int):
        super().__init__()
        self._f, self._start, self._len, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._len}[whence]
        self._pos = max(0, min(self._len, base + pos))
        return self._pos

    def readinto(self, buf) -> int:
        n = min(len(buf), self._len - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(buf)[:n])
        self._pos += got
        return got


def read_dcp_metadata(reader, path: Path):
    """``reader.read_metadata()``, or a CheckpointError naming the damaged ``.metadata`` (DCP's
    index of the checkpoint's files) instead of the reader's own exceptions."""
    try:
        return reader.read_metadata()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - unpickling errors, EOFError, DCP's own
        raise CheckpointError(
            f"{Path(path) / '.metadata'} cannot be read ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}): the checkpoint's index of its "
            "files is damaged; restore it from a copy or load another iteration") from None


class DCPSource:
    """Read one tensor of a DCP checkpoint at a time (whatever layout wrote it), in one process.

    An mfsdp checkpoint's files are first checked against the SHA-256 sums of its manifest
    (``verify``); within :class:`spread_over_ranks` each rank checks its share."""

    def __init__(self, path: str | Path, verify: bool = True):
        self.path = Path(path)
        if verify and (self.path / "manifest.json").exists():
            verify_checksums(self.path, read_manifest(self.path), *ranks())
        self._reader = _CachedReader(str(self.path))
        meta = read_dcp_metadata(self._reader, self.path)
        self.tensors = {k: (tuple(md.size), md.properties.dtype)
                        for k, md in meta.state_dict_metadata.items()
                        if not isinstance(md, BytesStorageMetadata)}
        self.blob_keys = [k for k, md in meta.state_dict_metadata.items()
                          if isinstance(md, BytesStorageMetadata)]

    def get(self, key: str, index: tuple[int, ...] = ()) -> torch.Tensor:
        """The full tensor ``key``, read chunk by chunk (a tensor saved whole is returned as read,
        without a second copy); with ``index``, only ``tensor[index]`` (leading dimensions), read
        from the chunks that hold it: one layer of a tensor megatron-core stacked per layer
        costs the memory of that layer."""
        shape, dtype = self.tensors[key]
        md = self._reader.read_metadata()
        chunks = md.state_dict_metadata[key].chunks
        storage = md.storage_data or {}
        infos = [storage.get(MetadataIndex(key, c.offsets)) for c in chunks]
        if any(i is None or getattr(i, "transform_descriptors", None) for i in infos):
            full = self._get_dcp(key)  # compressed or unusual storage: let DCP read it
            return full[index].clone() if index else full
        k = len(index)
        want = tuple(shape[k:])
        out = None
        for chunk, info in zip(chunks, infos):
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if any(not o <= i < o + n for i, o, n in zip(index, offsets, sizes)):
                continue  # holds none of tensor[index]
            part = self._read_chunk(info).reshape(sizes)
            loaded = part.numel()
            part = part[tuple(i - o for i, o in zip(index, offsets))]
            if tuple(sizes[k:]) == want:  # a view of a chunk wider than the slice is copied
                return part.clone() if part.numel() < loaded else part
            if out is None:
                out = torch.empty(want, dtype=dtype)
            where = tuple(slice(o, o + n) for o, n in zip(offsets[k:], sizes[k:]))
            out[where].copy_(part)
            del part
        return out if out is not None else torch.empty(want, dtype=dtype)

    def get_range(self, key: str, start: int, stop: int) -> torch.Tensor:
        """``tensor[start:stop]`` of the one-dimensional tensor ``key``, read from the chunks
        that hold it (megatron-core's flat optimizer buckets: one chunk per parameter and
        data-parallel rank)."""
        md = self._reader.read_metadata()
        storage = md.storage_data or {}
        out = torch.zeros(stop - start, dtype=self.tensors[key][1])
        for chunk in md.state_dict_metadata[key].chunks:
            lo, n = chunk.offsets[0], chunk.sizes[0]
            a, b = max(start, lo), min(stop, lo + n)
            if a >= b:
                continue
            info = storage.get(MetadataIndex(key, chunk.offsets))
            if info is None or getattr(info, "transform_descriptors", None):
                return self._get_dcp(key)[start:stop].clone()
            part = self._read_chunk(info).reshape(-1)
            out[a - start:b - start].copy_(part[a - lo:b - lo])
        return out

    def _read_chunk(self, info) -> torch.Tensor:
        """The one chunk DCP stored at ``info`` (its file, offset and length), read alone."""
        with open(self.path / info.relative_path, "rb") as f:
            return torch.load(_Window(f, info.offset, info.length), map_location="cpu",
                              weights_only=True)

    def _get_dcp(self, key: str) -> torch.Tensor:
        shape, dtype = self.tensors[key]
        state = {key: torch.empty(shape, dtype=dtype)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=self._reader, no_dist=True)
        return state[key]

    def object(self, key: str, safe_globals: tuple = ()) -> object:
        """A non-tensor entry that another program saved with ``torch.save`` (megatron-core's
        ``ShardedObject``), read with ``weights_only=True``: nothing but ``safe_globals``
        (e.g. ``argparse.Namespace``) is unpickled."""
        md = self._reader.read_metadata()
        info = (md.storage_data or {}).get(MetadataIndex(key))
        if info is None or getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{self.path}: cannot read {key!r} as a plain torch.save entry")
        with open(self.path / info.relative_path, "rb") as f, \
                torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(_Window(f, info.offset, info.length), map_location="cpu",
                              weights_only=True)

    def blob(self, key: str) -> Any:
        """A non-tensor entry (mfsdp's pickled blobs unpickled; others as DCP stored them)."""
        state = {key: b""}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=self._reader, no_dist=True)
        value = state[key]
        return pickle.loads(value) if isinstance(value, bytes) else value


class Progress:
    """Progress of a long conversion on stderr, through ``tqdm``: a bar on a terminal; in a log
    (no terminal: a Slurm job's output) a plain line in tqdm's format at most every
    ``interval_s`` seconds (30) and one at the end, never a carriage return, so a 20-minute
    conversion writes about 40 lines and a short one writes one. Call it with the bytes done
    since the last call; ``enabled=False`` prints nothing. ``clock``: seconds (tests pass
    their own)."""

    def __init__(self, what: str, total_bytes: int, enabled: bool = True,
                 interval_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        from tqdm.auto import tqdm

        self.what, self.total, self.done, self.enabled = what, max(total_bytes, 1), 0, enabled
        self.interval_s = interval_s
        self._tqdm = tqdm
        self._clock = clock
        # when the conversion started, and when the log last had a line (no terminal only)
        self._start = clock()
        self._last = self._start
        self._bar = (tqdm(total=self.total, desc=what, unit="B", unit_scale=True,
                          unit_divisor=1024, file=sys.stderr, dynamic_ncols=True)
                     if enabled and sys.stderr.isatty() else None)

    def __call__(self, nbytes: int) -> None:
        if not self.enabled:
            return
        before = self.done
        self.done += nbytes
        if self._bar is not None:
            self._bar.update(nbytes)
            if self.done >= self.total:
                self._bar.close()
            return
        now = self._clock()
        finished = self.done >= self.total > before
        if finished or (self.done < self.total and now - self._last >= self.interval_s):
            self._last = now
            line = self._tqdm.format_meter(min(self.done, self.total), self.total,
                                           now - self._start, prefix=self.what,
                                           unit="B", unit_scale=True, unit_divisor=1024,
                                           ascii=True, ncols=80)
            sys.stderr.write(line + "\n")
            sys.stderr.flush()


def human_bytes(n: int) -> str:
    """``n`` bytes in GiB, MiB or KiB, for messages."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def tensor_nbytes(shape, dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()
