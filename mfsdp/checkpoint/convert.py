"""Convert checkpoints between ``torch_dist``, ``fsdp_dtensor`` and Hugging Face safetensors.

Run as ``mfsdp convert`` or ``python -m mfsdp.checkpoint.convert``::

    mfsdp convert --from torch_dist --to fsdp_dtensor IN OUT [--param-to-param-group-map MAP]
    mfsdp convert --from fsdp_dtensor --to torch_dist IN OUT
    mfsdp convert --from fsdp_dtensor --to safetensors IN OUT [--swiglu] [--dtype bf16]
    mfsdp convert --from safetensors --to fsdp_dtensor IN OUT [--swiglu]
    mfsdp convert --from hf --to fsdp_dtensor HF_DIR OUT
    mfsdp convert --from fsdp_dtensor --to hf IN HF_DIR [--dtype bf16] [--max-shard-size 5GB]
    mfsdp convert --from megatron_lm --to fsdp_dtensor MLM_DIR OUT --model-config CFG [--weights-only]
    mfsdp convert --from fsdp_dtensor --to megatron_lm IN MLM_DIR [--weights-only]
    mfsdp convert --from fsdp_dtensor --to megatron_lm IN MLM_DIR --ckpt-format fsdp_dtensor [--bf16]

``hf`` is a Hugging Face model directory (``config.json`` and safetensors, sharded with an index
for large models) that ``transformers.AutoModelForCausalLM.from_pretrained`` loads; the model
families are those of :mod:`mfsdp.models.hf`. The ``hf`` conversions stream: one tensor (and the
few it is made of) is in memory at a time. The others run in one process on full tensors; the result of a conversion to ``fsdp_dtensor`` is
read into any layout by :func:`mfsdp.checkpoint.load_checkpoint`, which reshards on load.

The formats (all but safetensors are ``torch.distributed.checkpoint`` directories with a
``manifest.json``):

* ``fsdp_dtensor``: ``model.<name>``, ``optimizer.state.<name>.<key>``, ``optimizer.param_groups``
  (hyperparameters), ``extra``; optimizer state is keyed by parameter *name*.
* ``torch_dist``: the same weights, and optimizer state keyed by *position*, as
  ``torch.optim.Optimizer.state_dict()`` does (``optimizer.state.<index>.<key>``, groups listing
  indices), with ``param_to_param_group_map.json`` naming each position's parameter and group.
* ``safetensors``: ``model.safetensors`` (weights by mfsdp name, no optimizer) and ``config.json``.
* ``megatron_lm``: what Megatron-LM's ``--ckpt-format torch_dist`` writes (see
  :mod:`mfsdp.checkpoint.megatron_lm`), and its ``--ckpt-format fsdp_dtensor`` (with
  ``--use-megatron-fsdp``; see :mod:`mfsdp.checkpoint.megatron_lm_dtensor`): read by what is on
  disk (``--from torch_dist`` recognises both too), written as ``--ckpt-format`` says.

Checkpoints written by ``mfsdp train`` and by ``--from hf`` also hold ``model_config.json`` (the
:class:`~mfsdp.models.gpt.GPTConfig`), which ``--to hf`` and ``mfsdp train --load`` read.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import pickle
import secrets
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from mfsdp.checkpoint.io import FORMAT_VERSION, CheckpointError, read_manifest
from mfsdp.checkpoint.safetensors import load_file, save_file

__all__ = ["read_full", "write_full", "write_streaming", "DCPSource", "hf_to_fsdp", "fsdp_to_hf", "fsdp_to_torch_dist", "torch_dist_to_fsdp",
           "fsdp_to_safetensors", "safetensors_to_fsdp", "split_swiglu", "join_swiglu",
           "save_torch_dist", "load_torch_dist", "main", "owned_keys", "spread_over_ranks",
           "run_distributed"]

MAP_FILE = "param_to_param_group_map.json"
MODEL_CONFIG_FILE = "model_config.json"
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


class _LazyPlanner(DefaultSavePlanner):
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

    def __enter__(self):
        self._was, _SPREAD[0] = _SPREAD[0], True
        return self

    def __exit__(self, *exc):
        _SPREAD[0] = self._was
        return False


def _ranks() -> tuple[int, int]:
    """(rank, world size) a conversion spreads over: the process group's inside
    :class:`spread_over_ranks`, else (0, 1)."""
    import torch.distributed as dist

    if _SPREAD[0] and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shared_temp_name(parent: Path, name: str) -> Path:
    """A fresh temporary path next to ``name``, the same on every rank of the group."""
    token = [secrets.token_hex(4)]
    rank, world = _ranks()
    if world > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(token, src=0)
    return parent / f".tmp-{name}-{token[0]}"


def owned_keys(nbytes: dict[str, int]) -> set[str]:
    """The keys this rank writes when a conversion runs on several ranks (``torchrun``): each
    key to the rank with the fewest bytes so far, largest keys first, so the ranks' shares of
    reading and writing are even. All keys in one process."""
    rank, world = _ranks()
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


def _commit_dir(tmp: Path, path: Path, write) -> None:
    """Rank 0 runs ``write()`` (files beside the DCP data) and renames ``tmp`` to ``path``; every
    rank learns whether it worked; a failure removes ``tmp``."""
    rank, world = _ranks()
    error = [None]
    if rank == 0:
        try:
            write()
            tmp.rename(path)
        except BaseException as exc:  # noqa: BLE001 - every rank stops with the reason
            shutil.rmtree(tmp, ignore_errors=True)
            error[0] = f"{type(exc).__name__}: {exc}"
    if world > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(error, src=0)
    if error[0]:
        raise CheckpointError(f"writing {path} failed: {error[0]}")


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
    rank, world = _ranks()
    tmp = shared_temp_name(path.parent, path.name)
    mine = owned_keys({k: _nbytes(*v) for k, v in specs.items()})
    state: dict[str, object] = {k: torch.empty(shape, dtype=dtype, device="meta")
                                for k, (shape, dtype) in specs.items() if k in mine}
    if rank == 0:
        state.update({k: pickle.dumps(v) for k, v in blobs.items()})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=FileSystemWriter(str(tmp), single_file_per_rank=False,
                                                            thread_count=1),
                     planner=_LazyPlanner(produce), no_dist=world == 1)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written is left behind
        raise

    def finish() -> None:
        for name, text in (files or {}).items():
            (tmp / name).write_text(text)
        manifest = {"format": fmt, "format_version": FORMAT_VERSION, "layout": layout or {},
                    "tensors": {k: {"shape": list(shape), "dtype": str(dtype)}
                                for k, (shape, dtype) in specs.items()},
                    "blobs": sorted(blobs),
                    "files": {f.name: f.stat().st_size for f in sorted(tmp.iterdir())}}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))

    _commit_dir(tmp, path, finish)
    return path


class _CachedReader(FileSystemReader):
    def read_metadata(self):
        if not hasattr(self, "_cached"):
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


class DCPSource:
    """Read one tensor of a DCP checkpoint at a time (whatever layout wrote it), in one process."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._reader = _CachedReader(str(self.path))
        meta = self._reader.read_metadata()
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
            with open(self.path / info.relative_path, "rb") as f:
                part = torch.load(_Window(f, info.offset, info.length), map_location="cpu",
                                  weights_only=True).reshape(sizes)
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

    def blob(self, key: str) -> object:
        """A non-tensor entry (mfsdp's pickled blobs unpickled; others as DCP stored them)."""
        state = {key: b""}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=self._reader, no_dist=True)
        value = state[key]
        return pickle.loads(value) if isinstance(value, bytes) else value


class _Progress:
    """A one-line progress report on stderr: a bar on a terminal, a line every 10% otherwise."""

    def __init__(self, what: str, total_bytes: int, enabled: bool = True):
        self.what, self.total, self.done, self.enabled = what, max(total_bytes, 1), 0, enabled
        self.tty = sys.stderr.isatty()
        self._last = -1

    def __call__(self, nbytes: int) -> None:
        if not self.enabled:
            return
        self.done += nbytes
        pct = min(100, int(100 * self.done / self.total))
        if self.tty:
            bar = "#" * (pct // 4)
            sys.stderr.write(f"\r{self.what} [{bar:<25}] {pct:3d}% "
                             f"{_human(self.done)} of {_human(self.total)}")
            if pct == 100:
                sys.stderr.write("\n")
        elif pct // 10 != self._last:
            self._last = pct // 10
            sys.stderr.write(f"{self.what}: {pct}% ({_human(self.done)} of "
                             f"{_human(self.total)})\n")
        sys.stderr.flush()


def _human(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def hf_to_fsdp(src: str | Path, dst: str | Path, progress: bool = True) -> Path:
    """A Hugging Face model directory -> ``fsdp_dtensor`` (fp32 main weights, no optimizer state).

    Streams: each mfsdp tensor is built from its Hugging Face tensors when the writer reaches it.
    The checkpoint also holds ``model_config.json`` (the model's
    :class:`~mfsdp.models.gpt.GPTConfig`).
    """
    from mfsdp.checkpoint.safetensors import SafetensorsReader
    from mfsdp.models.gpt import GPT
    from mfsdp.models.hf import config_from_hf, hf_to_ours, read_hf_config, weight_rules

    src = Path(src)
    hf = read_hf_config(src)
    cfg = config_from_hf(hf)
    reader = SafetensorsReader(src)
    with torch.device("meta"):
        ref = GPT(cfg).state_dict()
    rules = {f"model.{r.ours}": r for r in weight_rules(cfg, hf["model_type"])}
    used = set()
    for key, rule in rules.items():
        missing = [n for n in rule.hf if n not in reader]
        if missing:
            raise CheckpointError(f"{src} has no tensor {missing[0]!r} (needed for {rule.ours})")
        used.update(rule.hf)
    if cfg.share_embeddings_and_output_weights:
        used.add("lm_head.weight")
    extra = sorted(set(reader.keys()) - used)
    if extra:
        raise CheckpointError(f"{src} holds {len(extra)} tensors a {hf['model_type']} model of "
                              f"this config does not have, e.g. {extra[0]!r}")
    specs = {key: (tuple(ref[r.ours].shape), torch.float32) for key, r in rules.items()}
    bar = _Progress(f"import {src.name}", sum(_nbytes(*v) for v in specs.values()), progress)

    def produce(key: str) -> torch.Tensor:
        rule = rules[key]
        t = hf_to_ours(rule, [reader.get(n) for n in rule.hf], cfg).float()
        if tuple(t.shape) != specs[key][0]:
            raise CheckpointError(f"{rule.hf[0]} makes {rule.ours} of shape {tuple(t.shape)}; "
                                  f"config.json implies {specs[key][0]}")
        bar(t.numel() * 4)
        return t

    files = {MODEL_CONFIG_FILE: json.dumps(cfg.to_dict(), indent=1),
             "hf_config.json": json.dumps(hf, indent=1)}
    return write_streaming(dst, specs, produce, {"extra": {"iteration": 0}}, "fsdp_dtensor",
                           {"source": "hf", "model_type": hf["model_type"]}, files)


def fsdp_to_hf(src: str | Path, dst: str | Path, dtype: torch.dtype | None = None,
               max_shard_bytes: int = 5 * 2**30, model_config: dict | None = None,
               progress: bool = True) -> Path:
    """``fsdp_dtensor`` -> a Hugging Face model directory (``config.json`` + safetensors).

    Streams: each Hugging Face tensor is cut from its mfsdp tensor as the writer reaches it, the
    last mfsdp tensor read is kept for its siblings (q/k/v, gate/up). ``model_config`` (a
    :class:`~mfsdp.models.gpt.GPTConfig` dict) is needed when the checkpoint has no
    ``model_config.json``.
    """
    from mfsdp.checkpoint.safetensors import write_sharded
    from mfsdp.models.gpt import GPTConfig
    from mfsdp.models.hf import config_to_hf, hf_model_type, ours_to_hf, weight_rules

    from mfsdp.checkpoint.io import resolve_checkpoint

    src, dst = resolve_checkpoint(src), Path(dst)
    manifest = read_manifest(src)
    _check_format(manifest, "fsdp_dtensor", src)
    if model_config is None:
        f = src / MODEL_CONFIG_FILE
        if not f.exists():
            raise CheckpointError(f"{src} has no {MODEL_CONFIG_FILE} (checkpoints of mfsdp train "
                                  "and of --from hf have one); pass --model-preset NAME or "
                                  "--model-config FILE naming the model's configuration")
        model_config = json.loads(f.read_text())
    cfg = GPTConfig.from_dict(model_config)
    mt = hf_model_type(cfg)
    source = DCPSource(src)
    rules = weight_rules(cfg, mt)
    for r in rules:
        if f"model.{r.ours}" not in source.tensors:
            raise CheckpointError(f"{src} has no tensor 'model.{r.ours}' that a {mt} export needs "
                                  "(was it written for another model configuration?)")
    out_dtype = {}
    specs, origin = {}, {}
    for r in rules:
        shape, sdtype = source.tensors[f"model.{r.ours}"]
        parts = ours_to_hf(r, torch.empty(shape, device="meta"), cfg)
        for name, t in zip(r.hf, parts):
            out_dtype[name] = dtype or sdtype
            specs[name] = (tuple(t.shape), out_dtype[name])
            origin[name] = r
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"{dst} exists and is not empty; choose a new output directory")
    tmp = dst.parent / f".tmp-{dst.name}-{secrets.token_hex(4)}"
    tmp.mkdir(parents=True)
    bar = _Progress(f"export {dst.name}", sum(_nbytes(*v) for v in specs.values()), progress)
    cache: dict[str, list[torch.Tensor]] = {}

    def stream():
        for name in specs:
            r = origin[name]
            if r.ours not in cache:
                cache.clear()  # one mfsdp tensor (and its pieces) at a time
                cache[r.ours] = ours_to_hf(r, source.get(f"model.{r.ours}"), cfg)
            t = cache[r.ours][r.hf.index(name)]
            yield name, t.to(out_dtype[name]).contiguous()

    try:
        write_sharded(stream(), specs, tmp, max_shard_bytes,
                      progress=lambda name, t: bar(t.numel() * t.element_size()))
        hf = config_to_hf(cfg, dtype or torch.float32)
        (tmp / "config.json").write_text(json.dumps(hf, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps({"_from_model_config": True}))
        if dst.exists():
            dst.rmdir()
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def fsdp_source(src: str | Path, dst: str | Path) -> tuple[Path, Path]:
    """``src`` resolved to an ``fsdp_dtensor`` checkpoint (a root with ``latest`` or the
    directory) and ``dst`` as a path that does not exist yet; an error names what is wrong."""
    from mfsdp.checkpoint.io import resolve_checkpoint

    src, dst = resolve_checkpoint(src), Path(dst)
    manifest = read_manifest(src)
    if manifest.get("format") != "fsdp_dtensor":
        raise CheckpointError(f"{src} is a {manifest.get('format')!r} checkpoint; convert it to "
                              "fsdp_dtensor first")
    if dst.exists():
        raise FileExistsError(f"{dst} exists; choose a new output directory")
    return src, dst


def _check_format(manifest: dict, expected: str, path: Path) -> None:
    if manifest.get("format") != expected:
        raise CheckpointError(f"{path} is a {manifest.get('format')!r} checkpoint, not "
                              f"{expected!r}; pass --from {manifest.get('format')}")


def _carried(src: Path) -> dict[str, str]:
    """Files a conversion copies along: the model configuration."""
    f = Path(src) / MODEL_CONFIG_FILE
    return {MODEL_CONFIG_FILE: f.read_text()} if f.exists() else {}


def fsdp_to_torch_dist(src: str | Path, dst: str | Path) -> Path:
    """``fsdp_dtensor`` -> ``torch_dist``: optimizer state re-keyed from names to positions."""
    src = Path(src)
    tensors, blobs, manifest = read_full(src)
    _check_format(manifest, "fsdp_dtensor", src)
    out = {k: v for k, v in tensors.items() if k.startswith("model.")}
    files = _carried(src)
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
        from mfsdp.checkpoint.state import read_param_to_param_group_map

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
    files = _carried(src)
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


def split_swiglu(weights: dict[str, torch.Tensor],
                 pattern: str | tuple[str, ...] = ("fc1", "linear_fc1")) -> dict[str, torch.Tensor]:
    """Split fused gate/up weights ``<p>.<pattern>.<w>`` into ``<p>.gate_proj.<w>``, ``<p>.up_proj.<w>``.

    ``pattern``: the fused module's name or names (the toy models' ``fc1``, the trainer's and
    Megatron-LM's ``linear_fc1``).

    >>> split_swiglu({"mlp.fc1.weight": torch.arange(4.0).view(4, 1)})["mlp.up_proj.weight"].ravel()
    tensor([2., 3.])
    """
    out = {}
    for name, t in weights.items():
        prefix, _, leaf = name.rpartition(".")
        head, _, module = prefix.rpartition(".")
        if module in ((pattern,) if isinstance(pattern, str) else pattern):
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
    fused_name = None
    saved = src / MODEL_CONFIG_FILE
    if swiglu and saved.exists() and not json.loads(saved.read_text()).get("swiglu"):
        raise CheckpointError(f"--swiglu: the model of {src} has no fused gate/up weight (its "
                              f"{MODEL_CONFIG_FILE} says swiglu is false: GELU MLPs); leave "
                              "--swiglu out")
    if swiglu:
        fused = {n.rpartition(".")[0].rpartition(".")[2] for n in weights} & {"fc1", "linear_fc1"}
        if not fused:
            raise CheckpointError(f"--swiglu: {src} has no fused gate/up weight (a module named "
                                  "fc1 or linear_fc1); leave --swiglu out, or use --to hf for "
                                  "the trainer's models")
        if len(fused) > 1:
            raise CheckpointError(f"--swiglu: {src} has fused weights named both fc1 and "
                                  "linear_fc1; cannot tell which to split")
        fused_name = fused.pop()
        weights = split_swiglu(weights, fused_name)
    dst.mkdir(parents=True, exist_ok=False)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = dict(config or {})
    cfg["mfsdp"] = {"source": str(src.name), "swiglu": bool(fused_name),
                    "swiglu_module": fused_name, "layout": manifest.get("layout")}
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
        weights = join_swiglu(weights, cfg.get("mfsdp", {}).get("swiglu_module") or "fc1")
    tensors = {f"model.{k}": v.float() if v.is_floating_point() else v for k, v in weights.items()}
    return write_full(dst, tensors, {"extra": {"iteration": 0}}, "fsdp_dtensor",
                      (cfg.get("mfsdp") or {}).get("layout"))


def save_torch_dist(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    path: str | Path, iteration: int = 0) -> Path:
    """Write what a single-process (or 3D-parallel, gathered) job writes: ``torch_dist``."""
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


FORMATS = ["torch_dist", "fsdp_dtensor", "safetensors", "hf", "megatron_fsdp", "megatron_lm"]


def parse_size(text: str) -> int:
    """Bytes in a size such as ``5GB``, ``500MB``, ``2GiB`` or ``1000000``.

    >>> parse_size("5GB"), parse_size("2GiB"), parse_size("100")
    (5000000000, 2147483648, 100)
    """
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    t = text.strip().upper()
    num = t.rstrip("KMGTIB")
    try:
        value, unit = float(num), t[len(num):]
        if unit not in units or value <= 0:
            raise ValueError
    except ValueError:
        raise SystemExit(f"mfsdp convert: --max-shard-size {text!r} is not a size; write e.g. "
                         "5GB, 500MB or 2GiB") from None
    return int(value * units[unit])


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The ``mfsdp convert`` argument parser."""
    parser = parser or argparse.ArgumentParser(prog="mfsdp convert", description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="src_format", required=True,
                        choices=FORMATS, help="format of INPUT")
    parser.add_argument("--to", dest="dst_format", required=True,
                        choices=FORMATS, help="format of OUTPUT")
    parser.add_argument("input", metavar="INPUT", help="checkpoint directory (or its root with a 'latest' file)")
    parser.add_argument("output", metavar="OUTPUT", help="new directory to write")
    parser.add_argument("--param-to-param-group-map", "--param-to-param-group-map-json",
                        dest="param_to_param_group_map", metavar="PATH",
                        help="map parameter name -> optimizer group, in the optimizer's order "
                             "(torch_dist and megatron_fsdp input): mfsdp's or upstream's JSON, "
                             "or the directory --dump-param-to-param-group-map writes; upstream's "
                             "flag name --param-to-param-group-map-json works too")
    parser.add_argument("--swiglu", action="store_true",
                        help="split (to safetensors) or join (from safetensors) fused gate/up "
                             "projection weights named *.fc1.*")
    parser.add_argument("--dtype", choices=sorted(_DTYPE_NAMES),
                        help="cast weights when writing safetensors or hf (default: keep fp32)")
    parser.add_argument("--config", metavar="JSON",
                        help="(--to safetensors) model config merged into config.json")
    parser.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="(--to hf) largest safetensors file, e.g. 5GB or 500MB "
                             "(default: %(default)s)")
    parser.add_argument("--model-preset", metavar="NAME",
                        help="(--to hf, --from megatron_fsdp or megatron_lm) the model's "
                             "preset, for checkpoints without model_config.json")
    parser.add_argument("--model-config", metavar="FILE",
                        help="(--to hf, --from megatron_fsdp or megatron_lm) the model's "
                             "GPTConfig as JSON, for checkpoints without model_config.json")
    parser.add_argument("--weights-only", action="store_true",
                        help="(megatron_lm) leave the optimizer state out, e.g. to read the "
                             "weights of a checkpoint whose distributed-optimizer state is in "
                             "Megatron-LM's dp_reshardable layout")
    parser.add_argument("--ckpt-format", choices=("torch_dist", "fsdp_dtensor"),
                        help="(--to megatron_lm) the Megatron-LM checkpoint format to write: "
                             "torch_dist (default) or fsdp_dtensor, for a Megatron-LM job with "
                             "--use-megatron-fsdp")
    parser.add_argument("--bf16", action="store_true",
                        help="(--to megatron_lm --ckpt-format fsdp_dtensor) the job that loads "
                             "it trains with --bf16 (its optimizer's keys have one more "
                             "module. prefix)")
    parser.add_argument("--fp16", action="store_true",
                        help="(--to megatron_lm --ckpt-format fsdp_dtensor) the job that loads "
                             "it trains with --fp16")
    parser.add_argument("--transformer-impl", choices=("transformer_engine", "local"),
                        help="(--to megatron_lm) the loading job's layer spec: "
                             "transformer_engine (default) or local; the norms' names differ "
                             "for fsdp_dtensor, and for torch_dist with multi-latent attention")
    parser.add_argument("--expert-model-parallel-size", type=int, metavar="N",
                        help="(--to megatron_lm, torch_dist) the loading job's expert "
                             "parallelism: above 1, the optimizer's groups are written for "
                             "megatron-core's chained expert optimizer (default 1)")
    parser.add_argument("--no-progress", action="store_true", help="no progress report")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``mfsdp convert`` command."""
    from mfsdp.checkpoint.io import resolve_checkpoint

    from mfsdp.checkpoint.megatron_lm import is_megatron_lm

    pair = (args.src_format, args.dst_format)
    shard_bytes = parse_size(args.max_shard_size)  # a bad value is reported before any work
    dtensor_flags = [f for f, on in (("--bf16", args.bf16), ("--fp16", args.fp16)) if on]
    if args.expert_model_parallel_size and not (pair == ("fsdp_dtensor", "megatron_lm")
                                                 and args.ckpt_format != "fsdp_dtensor"):
        raise SystemExit("mfsdp convert: --expert-model-parallel-size names the expert "
                         "parallelism of the Megatron-LM job that loads the torch_dist output "
                         "of --to megatron_lm (an fsdp_dtensor checkpoint serves any)")
    if args.transformer_impl and pair != ("fsdp_dtensor", "megatron_lm"):
        raise SystemExit("mfsdp convert: --transformer-impl names the layer spec of the "
                         "Megatron-LM job that loads the output of --to megatron_lm")
    if args.ckpt_format and pair != ("fsdp_dtensor", "megatron_lm"):
        raise SystemExit("mfsdp convert: --ckpt-format chooses what --to megatron_lm writes; the "
                         "input's format is recognised by what is on disk")
    if dtensor_flags and not (pair == ("fsdp_dtensor", "megatron_lm")
                              and args.ckpt_format == "fsdp_dtensor"):
        raise SystemExit(f"mfsdp convert: {', '.join(dtensor_flags)} name the Megatron-LM job "
                         "that loads an fsdp_dtensor checkpoint: use them with --to megatron_lm "
                         "--ckpt-format fsdp_dtensor")
    if args.bf16 and args.fp16:
        raise SystemExit("mfsdp convert: --bf16 or --fp16, not both")
    megatron_lm = (pair == ("megatron_lm", "fsdp_dtensor")
                   or pair == ("torch_dist", "fsdp_dtensor") and is_megatron_lm(args.input))
    if args.weights_only and "megatron_lm" not in pair and not megatron_lm:
        raise SystemExit("mfsdp convert: --weights-only applies to Megatron-LM checkpoints "
                         "(--from megatron_lm or --to megatron_lm)")
    src = (args.input if args.src_format in ("safetensors", "hf", "megatron_fsdp", "megatron_lm")
           or megatron_lm else resolve_checkpoint(args.input))
    model_config = None
    if args.model_config:
        model_config = json.loads(Path(args.model_config).read_text())
    elif args.model_preset:
        from mfsdp.models.gpt import GPT_PRESETS

        if args.model_preset not in GPT_PRESETS:
            raise SystemExit(f"mfsdp convert: --model-preset {args.model_preset!r} is not one "
                             f"of {', '.join(sorted(GPT_PRESETS))}")
        model_config = GPT_PRESETS[args.model_preset].to_dict()
    if megatron_lm:  # Megatron-LM's own torch_dist, recognised by its tracker and metadata.json
        from mfsdp.checkpoint.megatron_lm import megatron_lm_to_fsdp

        if model_config is None:
            raise SystemExit(f"mfsdp convert: {args.input} is a Megatron-LM checkpoint; "
                             "name its model with --model-preset or --model-config (Megatron-LM "
                             "keeps its arguments pickled, not as a config mfsdp can read)")
        out = megatron_lm_to_fsdp(args.input, args.output, model_config,
                                  weights_only=args.weights_only, progress=not args.no_progress)
        print(f"wrote fsdp_dtensor checkpoint {out} from the Megatron-LM checkpoint "
              f"{args.input}")
        return 0
    if pair == ("fsdp_dtensor", "megatron_lm") and args.ckpt_format == "fsdp_dtensor":
        from mfsdp.checkpoint.megatron_lm_dtensor import fsdp_to_megatron_lm_dtensor

        precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
        out = fsdp_to_megatron_lm_dtensor(src, args.output, model_config,
                                          weights_only=args.weights_only, precision=precision,
                                          transformer_impl=(args.transformer_impl
                                                            or "transformer_engine"),
                                          progress=not args.no_progress)
        print(f"wrote Megatron-LM fsdp_dtensor checkpoint {out} (load it with "
              "--use-megatron-fsdp --ckpt-format fsdp_dtensor"
              + (f" --{precision}" if precision != "fp32" else "") + ")")
        return 0
    if pair == ("fsdp_dtensor", "megatron_lm"):
        from mfsdp.checkpoint.megatron_lm import fsdp_to_megatron_lm

        out = fsdp_to_megatron_lm(src, args.output, model_config, weights_only=args.weights_only,
                                  progress=not args.no_progress,
                                  transformer_impl=args.transformer_impl or "transformer_engine",
                                  expert_model_parallel_size=args.expert_model_parallel_size or 1)
        print(f"wrote Megatron-LM torch_dist checkpoint {out} (load it with --ckpt-format "
              "torch_dist" + ("" if args.weights_only else
                              "; Adam state: --use-distributed-optimizer") + ")")
        return 0
    if pair == ("megatron_fsdp", "fsdp_dtensor"):
        from mfsdp.checkpoint.upstream import megatron_fsdp_to_fsdp

        from mfsdp.checkpoint.state import read_param_to_param_group_map

        group_of = (read_param_to_param_group_map(args.param_to_param_group_map)
                    if args.param_to_param_group_map else None)
        model_names = None
        if model_config is not None:
            from mfsdp.models.gpt import GPT, GPTConfig

            with torch.device("meta"):
                model_names = [n for n, _ in GPT(GPTConfig.from_dict(model_config))
                               .named_parameters()]
        elif group_of is not None:
            model_names = list(group_of)
        out = megatron_fsdp_to_fsdp(args.input, args.output, model_names=model_names,
                                    group_of=group_of, model_config=model_config)
        print(f"wrote fsdp_dtensor checkpoint {out}")
        return 0
    if pair == ("fsdp_dtensor", "megatron_fsdp"):
        from mfsdp.checkpoint.upstream import fsdp_to_megatron_fsdp

        out = fsdp_to_megatron_fsdp(args.input, args.output)
        print(f"wrote megatron_fsdp checkpoint {out}")
        return 0
    if pair == ("hf", "fsdp_dtensor"):
        out = hf_to_fsdp(src, args.output, progress=not args.no_progress)
    elif pair == ("fsdp_dtensor", "hf"):
        out = fsdp_to_hf(src, args.output, _DTYPE_NAMES[args.dtype] if args.dtype else None,
                         shard_bytes, model_config,
                         progress=not args.no_progress)
    elif pair == ("fsdp_dtensor", "torch_dist"):
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
                         "torch_dist<->fsdp_dtensor, fsdp_dtensor<->safetensors, "
                         "fsdp_dtensor<->hf, fsdp_dtensor<->megatron_fsdp, "
                         "fsdp_dtensor<->megatron_lm")
    print(f"wrote {args.dst_format} checkpoint {out}")
    return 0


_PARALLEL = {("hf", "fsdp_dtensor"), ("megatron_lm", "fsdp_dtensor"),
             ("fsdp_dtensor", "megatron_lm"), ("megatron_fsdp", "fsdp_dtensor")}


def run_distributed(args: argparse.Namespace) -> int:
    """``mfsdp convert`` under ``torchrun``: a gloo process group over the ranks, each converting
    its share of the tensors (the conversions that stream: ``--from hf``, ``--from/--to
    megatron_lm``, ``--from megatron_fsdp``); rank 0 prints. Others run on rank 0 alone."""
    import os

    import torch.distributed as dist

    from mfsdp.launch import init_from_env

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or dist.is_initialized():
        return run(args)
    from mfsdp.checkpoint.megatron_lm import is_megatron_lm

    pair = (args.src_format, args.dst_format)
    if pair == ("torch_dist", "fsdp_dtensor") and is_megatron_lm(args.input):
        pair = ("megatron_lm", "fsdp_dtensor")
    if pair not in _PARALLEL:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"mfsdp convert: {pair[0]} -> {pair[1]} runs in one process; ranks other "
                  "than 0 have nothing to do", flush=True)
            return run(args)
        return 0
    from mfsdp.launch import shutdown

    init_from_env(backend="gloo")
    code = None
    try:
        with spread_over_ranks():
            if dist.get_rank() != 0:
                args.no_progress = True
                import contextlib
                import io as _io

                with contextlib.redirect_stdout(_io.StringIO()):
                    code = run(args)
            else:
                code = run(args)
    finally:
        # A finished conversion leaves without the interpreter's teardown (see shutdown()).
        shutdown(barrier=code is not None, exit_code=code)
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m mfsdp.checkpoint.convert`` (under ``torchrun`` too)."""
    return run_distributed(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
