"""A communication timeline of ZeRO-3 steps, with one process group and with a separate
all-gather group (``fsdp_group_ag``), read from the model's communication log.

Run it with ``torchrun --nproc-per-node 2 -m mfsdp.examples.comm_timeline``; the
guide's recipe (``recipes/plot_comm_timeline.py``) runs :func:`timeline` and draws
it.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

__all__ = ["timeline", "main"]


def timeline(steps: int = 6, warmup: int = 2, dim: int = 256, hidden: int = 1024,
             blocks: int = 6, local_batch: int = 32) -> dict:
    """Train the same model twice side by side (alternating steps, so that drift in the
    machine's speed hits both alike): once with one process group for everything,
    once with a separate all-gather group. Returns, per variant, the median step time
    and the median time the training thread was blocked waiting for communication
    (the *exposed* communication), in seconds, and the last step's collectives as
    ``(op, group, start, end)`` from the step's start.
    """
    import mfsdp
    from mfsdp.models import Block, ToyModel

    # A layout's groups, with a second group over each shard group's ranks for
    # all-gathers.
    layout = mfsdp.ParallelLayout(dist.get_world_size())
    groups = layout.create_groups(all_gather_groups=True)
    variants = {}
    for name, ag in (("one group", None),
                     ("separate all-gather group", groups["dp_shard_ag"])):
        torch.manual_seed(0)
        model = ToyModel(dim, hidden, blocks)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = mfsdp.fully_shard(model, optimizer, fsdp_unit_modules=[Block],
                                       zero_dp_strategy="optim_grads_params",
                                       fsdp_group_ag=ag)
        variants[name] = {"model": model, "opt": opt, "steps": [], "waits": []}
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    x = torch.randn(local_batch, dim, generator=g)
    y = torch.randn(local_batch, dim, generator=g)
    for step in range(warmup + steps):
        for v in variants.values():  # interleaved: A, B, A, B, ...
            model, opt = v["model"], v["opt"]
            dist.barrier()
            # every collective of this model is logged with its times
            model.fsdp_state().comms.log.clear()
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            # (ZeRO-1/2's post-step gathers belong to this step)
            model.wait_param_sync()
            t1 = time.perf_counter()
            if step >= warmup:
                v["steps"].append(t1 - t0)
                v["waits"].append(model.fsdp_state().comms.log.wait_seconds())
                v["timeline"] = [
                    (r["op"], r["group"], r["start"] - t0, r.get("end", t1) - t0)
                    for r in model.fsdp_state().comms.log.records if r["op"] != "flags"]
    return {name: {"step_s": statistics.median(v["steps"]),
                   "exposed_s": statistics.median(v["waits"]),
                   "step_spread_s": max(v["steps"]) - min(v["steps"]),
                   "timeline": v["timeline"]} for name, v in variants.items()}


def main() -> None:
    """Print both variants' median step and exposed communication (rank 0)."""
    from mfsdp.runtime import shutdown

    dist.init_process_group("gloo")
    result = timeline()
    if dist.get_rank() == 0:
        for name, r in result.items():
            print(f"{name:<26} step {1e3 * r['step_s']:.1f} ms, "
                  f"exposed {1e3 * r['exposed_s']:.1f} ms")
    shutdown()


if __name__ == "__main__":
    main()
