"""Read and write the safetensors file format with torch alone (no extra dependency).

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
import struct
from pathlib import Path

import torch

__all__ = ["save_file", "load_file"]

_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
          torch.uint8: "U8", torch.bool: "BOOL"}
_DTYPES = {v: k for k, v in _CODES.items()}


def _bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""


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
