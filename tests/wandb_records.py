"""Read what W&B wrote: the records of an offline run's ``.wandb`` file.

The file is W&B's own format, read here independently of the trainer: a 7-byte header (``:W&B``,
a magic number, a version), then a LevelDB-style log (32 KiB blocks; each record a 7-byte header
of CRC, little-endian length and type, FULL / FIRST / MIDDLE / LAST) whose payloads are
``wandb_internal_pb2.Record`` protobufs, parsed with the classes the ``wandb`` package ships.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

_BLOCK = 32 * 1024
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def payloads(path: Path) -> list[bytes]:
    """Every record payload of a ``.wandb`` file, in order."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    out: list[bytes] = []
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _HEADER:  # the block's tail is padding
            pos += left_in_block
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        if length == 0 and kind == 0:  # zero padding
            pos += left_in_block
            continue
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind == _FULL:
            out.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            out.append(pending + chunk)
            pending = b""
    return out


def read_run(directory: Path) -> dict:
    """The run W&B wrote offline under ``directory``: its project, name and config, and the
    history as ``{step: {key: value}}``."""
    from wandb.proto import wandb_internal_pb2 as pb

    files = sorted(Path(directory).rglob("*.wandb"))
    assert len(files) == 1, f"expected one .wandb file under {directory}, found {files}"
    run = {"project": None, "name": None, "config": {}, "history": {}}
    for raw in payloads(files[0]):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["project"] = record.run.project
            run["name"] = record.run.display_name
            for item in record.run.config.update:
                run["config"][item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                run["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            row = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                   for item in record.history.item}
            run["history"][row.get("_step")] = row
    return run
