"""What the checkpoint checksums cost: save and load of an fsdp_dtensor checkpoint on 2 CPU ranks,
load with and without verification, and the hashing alone (the figures of the reliability page).

    python tools/checksum_cost.py --layers 4 --width 4096

A model of ``layers`` Linear(width, width) layers with AdamW state (3 fp32 copies: weights and
two moments) is saved and loaded three times each; the median is reported, with the SHA-256
throughput of one core measured on the files the save wrote.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _rank(layers: int, width: int, root: str, repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    import mfsdp
    from mfsdp.checkpoint import load_checkpoint, save_checkpoint
    from mfsdp.checkpoint.manifest import file_checksums, read_manifest

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = mfsdp.fully_shard(model, opt, fsdp_unit_modules=[torch.nn.Linear],
                                   zero_dp_strategy="optim_grads_params")
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    out = {"save_s": [], "hash_s": [], "load_verify_s": [], "load_s": []}
    for i in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        written = save_checkpoint(Path(root) / f"run{i}", model, opt, iteration=1)
        out["save_s"].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        file_checksums(written, dist.get_rank(), dist.get_world_size())
        dist.barrier()
        out["hash_s"].append(time.perf_counter() - t0)
        for key, verify in (("load_verify_s", True), ("load_s", False)):
            dist.barrier()
            t0 = time.perf_counter()
            load_checkpoint(written, model, opt, verify=verify)
            dist.barrier()
            out[key].append(time.perf_counter() - t0)
    out["bytes"] = sum(read_manifest(written)["files"].values())
    return out


def main(argv: list[str] | None = None) -> int:
    """Measure and print one JSON object (medians in seconds, bytes, SHA-256 throughput)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="write the result here too")
    args = p.parse_args(argv)
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, here)
    from mfsdp.launch import launch

    with tempfile.TemporaryDirectory() as root:
        res = launch("checksum_cost:_rank", 2, args=(args.layers, args.width, root, args.repeats),
                     timeout=1800)[0]
    med = {k: statistics.median(v) for k, v in res.items() if isinstance(v, list)}
    result = {"ranks": 2, "checkpoint_mib": round(res["bytes"] / 2**20, 1),
              **{k: round(v, 3) for k, v in med.items()},
              "sha256_mib_per_s_per_rank": round(res["bytes"] / 2 / 2**20 / med["hash_s"], 0),
              "save_hash_share": round(med["hash_s"] / med["save_s"], 3),
              "load_verify_overhead": round(med["load_verify_s"] / med["load_s"] - 1, 3)}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
