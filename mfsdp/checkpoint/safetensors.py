"""The safetensors file format, read with the ``safetensors`` package and written as a stream.

:class:`SafetensorsReader` opens a file or a Hugging Face directory (one ``model.safetensors`` or
shards listed by ``model.safetensors.index.json``) with ``safetensors.safe_open`` and reads one
tensor at a time. :func:`load_file` / :func:`save_file` are the package's whole-file calls with
errors that name the file. :func:`write_sharded` writes shards and their index from a stream of
tensors: the package's writers take every tensor of a file at once, so exporting a model would
hold a whole shard (5 GiB by default) in memory; here each shard's header is written first and
then one tensor at a time (a file is an 8-byte little-endian header length, a JSON header of
each tensor's dtype, shape and byte range, then the raw little-endian bytes). The package reads
what it writes (``tests/test_model_families.py``).

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

import safetensors
import safetensors.torch
import torch

__all__ = ["SafetensorsReader", "load_file", "save_file", "write_sharded"]

# The dtype codes of the format (what a header says), for the streaming writer.
_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
          torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
          torch.float8_e5m2: "F8_E5M2"}
_DTYPES = {v: k for k, v in _CODES.items()}


def _open(path: Path):
    """``safe_open`` with an error that names the file and says what is wrong with it."""
    try:
        return safetensors.safe_open(str(path), framework="pt")
    except safetensors.SafetensorError as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e}: truncated, or not "
                         "safetensors)") from None


def _write_tensor(f, t: torch.Tensor) -> None:
    """Write ``t``'s bytes to ``f`` without copying them (a view of its memory)."""
    t = t.detach().to("cpu").contiguous()
    n = t.numel() * t.element_size()
    if n:
        f.write(memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B"))


def save_file(tensors: dict[str, torch.Tensor], path: str | Path,
              metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` to ``path`` in safetensors format (``safetensors.torch.save_file``;
    tensors that share memory, such as the halves of a split SwiGLU weight, are copied first)."""
    seen: set = set()
    own = {}
    for name, t in tensors.items():
        t = t.detach().to("cpu")
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        own[name] = t.contiguous() if key not in seen and t.is_contiguous() else t.clone()
        seen.add(key)
    for name, t in own.items():
        if t.dtype not in _CODES:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
    safetensors.torch.save_file(own, str(path), metadata=metadata)


def load_file(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a safetensors file: (name -> tensor, metadata)."""
    with _open(Path(path)) as f:
        return {name: f.get_tensor(name) for name in f.keys()}, dict(f.metadata() or {})


def read_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a ``model.safetensors.index.json`` (tensor name -> shard file), or
    a ``ValueError`` naming the index when it is not JSON, has no ``weight_map`` object, or
    maps a name to anything but a file name beside it."""
    try:
        data = json.loads(index.read_text())
    except UnicodeDecodeError as exc:
        raise ValueError(f"{index} is not JSON text ({exc.reason} at byte {exc.start}): the "
                         "index of the safetensors shards is damaged; copy it again from the "
                         "model's source") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{index} is not JSON ({exc.msg} at line {exc.lineno} column "
                         f"{exc.colno}): the index of the safetensors shards is damaged or cut "
                         "short; copy it again from the model's source") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        what = ("has no 'weight_map'" if not isinstance(data, dict) or "weight_map" not in data
                else "has an empty or malformed 'weight_map'")
        raise ValueError(f"{index} {what} (a Hugging Face index maps every tensor name to its "
                         "shard file there); copy it again from the model's source, or remove "
                         "it when the directory holds a single model.safetensors")
    for name, file in weight_map.items():
        if not isinstance(file, str) or Path(file).name != file:
            raise ValueError(f"{index}: 'weight_map' maps {name!r} to {file!r}, not the name of "
                             "a shard file beside the index; copy the index again from the "
                             "model's source")
    return weight_map


class SafetensorsReader:
    """Tensors of a safetensors file or Hugging Face directory, read one at a time on demand.

    The headers are read at once; each :meth:`get` opens its file with ``safetensors.safe_open``,
    reads the one tensor and closes the file again. (A file kept open stays memory-mapped, and
    every tensor read from it would stay resident: reading a 1 GiB checkpoint through one open
    handle peaks at the whole file, through one handle per tensor at its largest tensor.)

    >>> import tempfile, torch
    >>> d = Path(tempfile.mkdtemp())
    >>> tensors = [("a", torch.ones(3)), ("b", torch.zeros(2, 2))]
    >>> shapes = {"a": ((3,), torch.float32), "b": ((2, 2), torch.float32)}
    >>> index = write_sharded(iter(tensors), shapes, d, max_shard_bytes=12)
    >>> for name, file in sorted(index["weight_map"].items()):
    ...     print(name, file)
    a model-00001-of-00002.safetensors
    b model-00002-of-00002.safetensors
    >>> r = SafetensorsReader(d)
    >>> r.shape("b"), r.get("a").tolist()
    ((2, 2), [1.0, 1.0, 1.0])
    """

    def __init__(self, path: str | Path):
        path = Path(path)
        if path.is_dir():
            index = path / "model.safetensors.index.json"
            if index.exists():
                files = sorted(set(read_index(index).values()))
            elif (path / "model.safetensors").exists():
                files = ["model.safetensors"]
            else:
                raise FileNotFoundError(f"{path} holds neither model.safetensors nor "
                                        "model.safetensors.index.json (not a Hugging Face model "
                                        "directory)")
            files = [path / f for f in files]
        else:
            files = [path]
        self._where: dict[str, tuple[Path, tuple[int, ...], torch.dtype]] = {}
        for f in files:
            if not f.exists():
                raise FileNotFoundError(f"{f} is missing (the index lists it)")
            with _open(f) as handle:
                for name in handle.keys():
                    info = handle.get_slice(name)
                    code = info.get_dtype()
                    if code not in _DTYPES:
                        raise ValueError(f"{f}: tensor {name!r} has dtype {code}, which mfsdp "
                                         "does not read")
                    self._where[name] = (f, tuple(info.get_shape()), _DTYPES[code])

    def keys(self) -> list[str]:
        """Every tensor name."""
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of ``name`` (no data read)."""
        return self._where[name][1]

    def dtype(self, name: str) -> torch.dtype:
        """Dtype of ``name`` (no data read)."""
        return self._where[name][2]

    def get(self, name: str) -> torch.Tensor:
        """Read tensor ``name`` (a new tensor that owns its memory)."""
        if name not in self._where:
            raise KeyError(f"no tensor {name!r} in the safetensors files")
        f = self._where[name][0]
        with _open(f) as handle:
            try:
                return handle.get_tensor(name)
            except safetensors.SafetensorError as e:
                raise ValueError(f"{f}: tensor {name!r} could not be read ({e})") from None


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
