"""Benchmarks that run inside launched ranks (see :mod:`mfsdp.launch`).

:func:`all_gather_group_timeline` trains the same model twice side by side, once with one process
group for everything and once with a separate all-gather group, alternating steps so that drift in
the machine's speed hits both alike. It records every collective's launch and completion time and
the time the training thread spent blocked waiting for communication (the *exposed*
communication). Run it from Python::

    from mfsdp.launch import launch
    from mfsdp.bench import all_gather_group_timeline
    result = launch(all_gather_group_timeline, 2, args=({"steps": 8},))[0]
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

__all__ = ["all_gather_group_timeline", "unused_parameter_peak"]

_DEFAULTS = dict(dim=256, hidden=1024, blocks=6, local_batch=32, steps=6, warmup=2, seed=0)


def all_gather_group_timeline(cfg: dict | None = None) -> dict:
    """Step time and exposed communication with one group vs a separate all-gather group.

    Returns, per variant, the median step time and exposed wait (seconds), and the timeline of the
    last step: ``(op, group, start, end)`` relative to the step's start.
    """
    import mfsdp
    from mfsdp.layout import ParallelLayout
    from mfsdp.models import Block, ToyModel

    c = {**_DEFAULTS, **(cfg or {})}
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = ParallelLayout(world).create_groups(all_gather_groups=True)
    variants = {}
    for name, ag in (("one group", None), ("separate all-gather group", groups["dp_shard_ag"])):
        torch.manual_seed(c["seed"])
        model = ToyModel(c["dim"], c["hidden"], c["blocks"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = mfsdp.fully_shard(model, opt, fsdp_unit_modules=[Block],
                                       zero_dp_strategy="optim_grads_params", fsdp_group_ag=ag)
        variants[name] = {"model": model, "opt": opt, "steps": [], "waits": []}
    g = torch.Generator().manual_seed(c["seed"] + 1 + rank)
    x = torch.randn(c["local_batch"], c["dim"], generator=g)
    y = torch.randn(c["local_batch"], c["dim"], generator=g)
    for step in range(c["warmup"] + c["steps"]):
        for v in variants.values():  # interleaved: A, B, A, B, ...
            model, opt = v["model"], v["opt"]
            dist.barrier()
            model.comm_log.clear()
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            model._begin_forward()  # wait for the post-step gathers: they belong to this step
            t1 = time.perf_counter()
            if step >= c["warmup"]:
                v["steps"].append(t1 - t0)
                v["waits"].append(model.comm_log.wait_seconds())
                v["timeline"] = [(r["op"], r["group"], r["start"] - t0, r.get("end", t1) - t0)
                                 for r in model.comm_log.records if r["op"] != "flags"]
    return {name: {"step_s": statistics.median(v["steps"]),
                   "exposed_s": statistics.median(v["waits"]),
                   "step_spread_s": max(v["steps"]) - min(v["steps"]),
                   "timeline": v["timeline"]} for name, v in variants.items()}


def unused_parameter_peak(blocks: int = 8, dim: int = 256, unused: bool = True) -> float:
    """Peak full-gradient buffer bytes of a ZeRO-3 model as a share of all its gradient buckets,
    when every block holds a parameter that gets no gradient (``unused``) or not (run in every
    rank; rank 0's value is the one to read).

    Full gradient buffers live from a bucket's first gradient to the end of its reduce-scatter;
    with per-unit completion, an unused parameter no longer keeps them until the end of backward.
    """
    from torch import nn

    import mfsdp

    class _Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(dim, 4 * dim)
            self.fc2 = nn.Linear(4 * dim, dim)
            self.spare = nn.Linear(dim, dim) if unused else None  # never called

        def forward(self, x):
            return x + self.fc2(torch.tanh(self.fc1(x)))

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, dim), *[_Block() for _ in range(blocks)], nn.Linear(dim, 1))
    model, opt = mfsdp.fully_shard(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                   fsdp_unit_modules=[_Block], zero_dp_strategy=3)
    for _ in range(2):
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    total = sum(b.plan.padded_numel * 4 for b in model.buckets if b.requires_grad)
    return model.memory["peak_grad_full_bytes"] / total
