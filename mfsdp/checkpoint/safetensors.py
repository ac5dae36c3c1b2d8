"""Read and write the safetensors file format with torch alone (no extra dependency).

:class:`SafetensorsReader` opens a file or a Hugging Face directory (one ``model.safetensors`` or
shards listed by ``model.safetensors.index.json``) and reads one tensor at a time;
:func:`write_sharded` writes shards and their index from a stream of tensors, so neither side
holds more than one tensor.

A file is an 8-byte little-endian header length, a JSON header mapping each tensor name to its
dtype, shape and byte range, then the raw little-endian bytes.

>>> import tempfile, torch
>>> path = tempfile.mkdtemp() + "/w.safetensors"
>>> save_file({"a": torch.arange(6.0).view(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)}, path,
...           metadata={"format": "pt"})
>>> tensors, meta = load_file(path)
>>> tensors["a"].tolist(), tensors["b"].dtype, meta
([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], torch.bfloat16, {'format': 'pt'})
"""

from __future__ import annotations

import ctypes
import json
import math
import struct
from pathlib import Path

import torch

__all__ = ["SafetensorsReader", "load_file", "save_file", "write_sharded"]

_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
          torch.uint8: "U8", torch.bool: "BOOL"}
_DTYPES = {v: k for k, v in _CODES.items()}


def _bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""


def _write_tensor(f, t: torch.Tensor) -> None:
    """Write ``t``'s bytes to ``f`` without copying them (a view of its memory)."""
    t = t.detach().to("cpu").contiguous()
    n = t.numel() * t.element_size()
    if n:
        f.write(memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B"))


def save_file(tensors: dict[str, torch.Tensor], path: str | Path,
              metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` to ``path`` in safetensors format (sorted by name)."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    chunks, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype not in _CODES:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
        data = _bytes(t)
        header[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # align the data to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for data in chunks:
            f.write(data)


def load_file(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a safetensors file: (name -> tensor, metadata)."""
    raw = Path(path).read_bytes()
    if len(raw) < 8:
        raise ValueError(f"{path} is not a safetensors file (shorter than its header length)")
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n > len(raw):
        raise ValueError(f"{path}: header of {n} bytes runs past the end of the file (truncated)")
    header = json.loads(raw[8:8 + n])
    metadata = header.pop("__metadata__", {})
    data = memoryview(raw)[8 + n:]
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        if end > len(data):
            raise ValueError(f"{path}: tensor {name!r} ends at byte {end} of {len(data)} "
                             "(the file is truncated)")
        dtype = _DTYPES[info["dtype"]]
        buf = bytearray(data[begin:end])
        t = (torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype))
        out[name] = t.reshape(info["shape"]).clone()
    return out, metadata


def _header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", raw)
        size = path.stat().st_size
        if 8 + n > size:
            raise ValueError(f"{path}: header of {n} bytes runs past the end of the file "
                             "(truncated, or not a safetensors file)")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    for name, info in header.items():
        if 8 + n + info["data_offsets"][1] > size:
            raise ValueError(f"{path}: tensor {name!r} runs past the end of the file (truncated)")
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which mfsdp "
                             "does not read")
    return 8 + n, header


class SafetensorsReader:
    """Tensors of a safetensors file or Hugging Face directory, read one at a time on demand.

    >>> import tempfile, torch
    >>> d = Path(tempfile.mkdtemp())
    >>> index = write_sharded(iter([("a", torch.ones(3)), ("b", torch.zeros(2, 2))]),
    ...                       {"a": ((3,), torch.float32), "b": ((2, 2), torch.float32)}, d,
    ...                       max_shard_bytes=12)
    >>> sorted(index["weight_map"].items())
    [('a', 'model-00001-of-00002.safetensors'), ('b', 'model-00002-of-00002.safetensors')]
    >>> r = SafetensorsReader(d)
    >>> r.shape("b"), r.get("a").tolist()
    ((2, 2), [1.0, 1.0, 1.0])
    """

    def __init__(self, path: str | Path):
        path = Path(path)
        if path.is_dir():
            index = path / "model.safetensors.index.json"
            if index.exists():
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            elif (path / "model.safetensors").exists():
                files = ["model.safetensors"]
            else:
                raise FileNotFoundError(f"{path} holds neither model.safetensors nor "
                                        "model.safetensors.index.json (not a Hugging Face model "
                                        "directory)")
            files = [path / f for f in files]
        else:
            files = [path]
        self._where: dict[str, tuple[Path, int, dict]] = {}
        for f in files:
            if not f.exists():
                raise FileNotFoundError(f"{f} is missing (the index lists it)")
            start, header = _header(f)
            for name, info in header.items():
                self._where[name] = (f, start, info)

    def keys(self) -> list[str]:
        """Every tensor name."""
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of ``name`` (no data read)."""
        return tuple(self._where[name][2]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        """Dtype of ``name`` (no data read)."""
        return _DTYPES[self._where[name][2]["dtype"]]

    def get(self, name: str) -> torch.Tensor:
        """Read tensor ``name`` (a new tensor that owns its memory)."""
        if name not in self._where:
            raise KeyError(f"no tensor {name!r} in the safetensors files")
        f, start, info = self._where[name]
        begin, end = info["data_offsets"]
        dtype = _DTYPES[info["dtype"]]
        out = torch.empty(info["shape"], dtype=dtype)
        if end > begin:
            with open(f, "rb") as fh:
                fh.seek(start + begin)
                view = memoryview(ctypes.cast(out.data_ptr(), ctypes.POINTER(
                    ctypes.c_char * (end - begin))).contents).cast("B")
                if fh.readinto(view) != end - begin:
                    raise ValueError(f"{f}: tensor {name!r} is truncated")
        return out


def write_sharded(tensors, specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                  directory: str | Path, max_shard_bytes: int = 5 * 2**30,
                  metadata: dict[str, str] | None = None, progress=None) -> dict:
    """Write ``tensors`` (an iterator of ``(name, tensor)`` in ``specs`` order) as safetensors.

    ``specs`` gives every name's shape and dtype up front, so each shard's header is written
    before its data and only one tensor is in memory at a time. One file is
    ``model.safetensors``; more are ``model-0000i-of-0000n.safetensors`` with
    ``model.safetensors.index.json``. Returns the index dict.
    """
    directory = Path(directory)
    shards: list[list[str]] = [[]]
    size = 0
    for name, (shape, dtype) in specs.items():
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    n = len(shards)
    fname = (["model.safetensors"] if n == 1 else
             [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
    weight_map, total = {}, 0
    stream = iter(tensors)
    for names, file in zip(shards, fname):
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        for name in names:
            shape, dtype = specs[name]
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _CODES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = file
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)
        with open(directory / file, "wb") as f:
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            for name in names:
                got, t = next(stream)
                shape, dtype = specs[name]
                if got != name or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                    raise ValueError(f"write_sharded expected {name} {tuple(shape)} {dtype}, "
                                     f"got {got} {tuple(t.shape)} {t.dtype}")
                _write_tensor(f, t)
                total += t.numel() * t.element_size()
                if progress is not None:
                    progress(name, t)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    if n > 1:
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return index
