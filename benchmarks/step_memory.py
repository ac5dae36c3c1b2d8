"""Where a training step's memory peak lies: live allocations at the peak, by op and category.

Builds a system exactly as ``mfsdp bench`` does (``mfsdp.tools.benchmark_systems``: the model of
``--model llama-1b`` with fewer layers, ``--bf16``, the systems ``mfsdp-optim_grads_params`` and
``fsdp2``), runs warm-up steps, then profiles one step with ``torch.profiler``
(``profile_memory=True``) and replays its allocation and free events. It reports, per system and
layer count:

* ``held``: bytes allocated when the step starts (what the system keeps between steps);
* ``peak``: the most bytes live at once during the step, and in which phase;
* at that moment, the bytes allocated during the step and still live (by phase, op, the Python
  frame of mfsdp / torch.optim / FSDP2 that asked, and PyTorch's memory-profiler category), and
  the held bytes already freed (FSDP2's ``zero_grad(set_to_none=True)`` frees its gradients).

Two layer counts separate the per-layer part from the fixed part (embedding, output layer,
logits); the script prints both and the per-layer slope. One process per measurement (world size
1, gloo on CPU, NCCL on CUDA), the step as ``mfsdp.tools.benchmark_systems.train_step`` runs it
(eager; ``--fused-adam`` as the H100 run).

CPU (about 5 minutes on 2 cores)::

    python benchmarks/step_memory.py --num-layers 2 4 --seq-length 256 --fused-adam

One GPU (the H100 run's shape; the profile's allocations are the caching allocator's requests)::

    python benchmarks/step_memory.py --device cuda --num-layers 2 4 22 --seq-length 2048 \\
        --micro-batch-size 4 --fused-adam
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections import defaultdict

import torch

SYSTEMS = ("mfsdp-optim_grads_params", "fsdp2")
PHASES = ("zero_grad", "forward", "backward", "optimizer")
# Python frames worth naming as "who asked" (innermost wins).
_FRAMES = ("mfsdp/", "torch/optim/", "torch/distributed/fsdp/", "torch/nn/functional.py")


def _config(layers: int, seq_length: int, micro_batch: int, device: str, fused_adam: bool) -> dict:
    from mfsdp.tools.benchmark_systems import DEFAULTS, LLAMA_1B

    return {**DEFAULTS, **LLAMA_1B, "blocks": layers, "seq_length": seq_length,
            "local_batch": micro_batch, "device": device, "bf16": True, "fused_adam": fused_adam}


def _profiled_step(model, opt, x, y, loss_fn):
    """``train_step``'s body, each phase in a ``record_function`` range."""
    from torch.profiler import record_function

    with record_function("phase:zero_grad"):
        opt.zero_grad(set_to_none=True)
    with record_function("phase:forward"):
        loss = loss_fn(model(x), y)
    with record_function("phase:backward"):
        loss.backward()
    with record_function("phase:optimizer"):
        opt.step()
        if hasattr(model, "wait_param_sync"):
            model.wait_param_sync()
    return loss.item()


def _events(prof, device_type: str) -> list[tuple]:
    """``(time_ns, ptr, bytes (negative: a free), phase, op, frame, category)`` of every
    allocation event on ``device_type``, oldest first."""
    from torch._C._profiler import _EventType
    from torch.profiler._memory_profiler import TensorKey

    try:
        categories = prof._memory_profile()._categories
    except Exception:  # the category pass is best effort; the replay does not need it
        categories = None
    # Phases by time: a free is often recorded under a Python frame, not under the range
    # (a record_function node) that was open when it happened.
    phases, found = [], []
    stack = [(root, "", "") for root in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, op, frame = stack.pop()
        name = node.name
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            if f.device.type != device_type:
                continue
            category = None
            key = TensorKey.from_allocation(f)
            if categories is not None and key is not None:
                c = categories.get(key, 0)
                category = c.name if c is not None else None
            found.append((node.start_time_ns, f.ptr, f.alloc_size, op, frame, category or "?"))
            continue
        if name.startswith("phase:"):
            phases.append((node.start_time_ns, node.end_time_ns, name[len("phase:"):]))
        elif node.tag == _EventType.TorchOp:
            op = op or name  # the outermost op: what the Python code called
        elif node.tag == _EventType.PyCall and any(k in name for k in _FRAMES):
            k = next(k for k in _FRAMES if k in name)
            frame = name[name.rindex(k):]
            op = ""  # ops below a named frame belong to it
        stack.extend((c, op, frame) for c in node.children)
    out = []
    for t, ptr, size, op, frame, category in found:
        phase = next((p for lo, hi, p in phases if lo <= t <= hi), "")
        out.append((t, ptr, size, phase, op, frame, category))
    out.sort(key=lambda e: e[0])
    return out


def analyse(events: list[tuple], top: int = 12) -> dict:
    """Replay ``events`` (see :func:`_events`): held bytes, the peak, and what makes it."""
    live: dict[int, tuple] = {}  # ptr -> event of allocations made in the step
    freed_held: list[tuple] = []  # frees of allocations made before the step
    now = peak = 0
    peak_at = fwd_end = None
    for e in events:
        t, ptr, size, phase = e[:4]
        if not phase:
            continue
        if (phase != "forward" and fwd_end is None
                and any(ev[3] == "forward" for ev in live.values())):
            fwd_end = (now, dict(live), list(freed_held))  # the forward's activations, all there
        if size > 0:
            live[ptr] = e
        elif ptr in live:
            del live[ptr]
        else:
            freed_held.append(e)
        now += size
        if now > peak:
            peak, peak_at = now, (e, dict(live), list(freed_held))
    if peak_at is None:
        return {"peak_above_start": 0}
    e, live_at, freed_at = peak_at

    def group(items, idx):
        g: dict = defaultdict(int)
        for it in items:
            g[" | ".join(str(it[i]) for i in idx)] += it[2]
        return dict(sorted(g.items(), key=lambda kv: -abs(kv[1]))[:top])

    return {
        "peak_above_start": peak,
        "peak_phase": e[3],
        "allocated_in_step_live_at_peak": sum(v[2] for v in live_at.values()),
        "held_freed_before_peak": -sum(v[2] for v in freed_at),
        "live_by_phase": group(live_at.values(), (3,)),
        "live_by_category": group(live_at.values(), (6,)),
        "live_by_phase_frame_op": group(live_at.values(), (3, 5, 4)),
        "freed_by_phase_frame_op": group(freed_at, (3, 5, 4)),
        "step_end_minus_start": sum(ev[2] for ev in events if ev[3]),
        # When forward ends (its activations all live): where a long sequence's peak lies.
        "forward_end_above_start": fwd_end[0] if fwd_end else None,
        "forward_end_live_by_frame": group(fwd_end[1].values(), (5,)) if fwd_end else {},
        "forward_end_held_freed": -sum(v[2] for v in fwd_end[2]) if fwd_end else None,
    }


def measure(system: str, cfg: dict, warmup: int = 2) -> dict:
    """Profile one step of ``system`` after ``warmup`` steps (run in the rank of a world of 1)."""
    from torch.profiler import ProfilerActivity, profile

    from mfsdp.tools.benchmark_systems import (batch, build_system, loss_fn,
                                               reference_parameters, train_step)

    model, opt = build_system(system, cfg)
    for r in range(warmup - 1):
        train_step(model, opt, *batch(cfg, r), loss_fn(cfg))
    device = batch(cfg, 0)[0].device.type
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    # The last warm-up step runs under the profiler too: the CPU allocator reports the free of a
    # block only if the profiler saw it allocated (FSDP2's gradients, freed by zero_grad).
    with profile(activities=activities, profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        train_step(model, opt, *batch(cfg, warmup - 1), loss_fn(cfg))
        if device == "cuda":
            torch.cuda.synchronize()
            start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        loss = _profiled_step(model, opt, *batch(cfg, warmup), loss_fn(cfg))
    out = analyse(_events(prof, device))
    out.update(system=system, layers=cfg["blocks"], loss=loss,
               numel=sum(p.numel() for p in reference_parameters(cfg)))
    if device == "cuda":  # the allocator's own count, as a check of the replay
        out["cuda_start"] = start
        out["cuda_peak_above_start"] = torch.cuda.max_memory_allocated() - start
    return out


def _gib(n: float) -> str:
    return f"{n / 2**30:7.3f} GiB"


def report(rows: list[dict]) -> str:
    """The text report of :func:`measure` results, with per-layer slopes when two layer counts
    of a system were measured."""
    lines = []
    for r in rows:
        lines.append(f"== {r['system']}, {r['layers']} layers, {r['numel'] / 1e6:.1f}M parameters "
                     f"(loss {r['loss']:.4f})")
        lines.append(f"peak above step start   {_gib(r['peak_above_start'])}  "
                     f"(in {r['peak_phase']})")
        lines.append(f"  allocated in the step, live at the peak  "
                     f"{_gib(r['allocated_in_step_live_at_peak'])}")
        lines.append(f"  held at start, freed before the peak    "
                     f"{_gib(r['held_freed_before_peak'])}")
        if r.get("forward_end_above_start") is not None:
            lines.append(f"at the end of forward    {_gib(r['forward_end_above_start'])}  "
                         f"(held bytes freed by then: {_gib(r['forward_end_held_freed'])})")
            lines += [f"    {_gib(v)}  {k or '(model code)'}"
                      for k, v in r["forward_end_live_by_frame"].items()]
        if "cuda_peak_above_start" in r:
            lines.append(f"  torch.cuda peak above start             "
                         f"{_gib(r['cuda_peak_above_start'])}")
        for title, key in (("live at the peak, by phase", "live_by_phase"),
                           ("live at the peak, by category", "live_by_category"),
                           ("live at the peak, by phase | frame | op", "live_by_phase_frame_op"),
                           ("held bytes freed before the peak", "freed_by_phase_frame_op")):
            lines.append(f"  {title}:")
            lines += [f"    {_gib(abs(v))}  {k}" for k, v in r[key].items()]
    by_system = defaultdict(list)
    for r in rows:
        by_system[r["system"]].append(r)
    lines.append("== per layer (slope between the two layer counts) and fixed part")
    for s, rs in by_system.items():
        if len(rs) < 2:
            continue
        a, b = rs[0], rs[-1]
        dl = b["layers"] - a["layers"]
        for label, key in (("peak above start", "peak_above_start"),
                           ("end of forward", "forward_end_above_start")):
            if a.get(key) is None or b.get(key) is None:
                continue
            slope = (b[key] - a[key]) / dl
            fixed = a[key] - slope * a["layers"]
            lines.append(f"{s:<26} {label:<17} = {fixed / 2**20:8.1f} MiB + L x "
                         f"{slope / 2**20:7.1f} MiB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point: measure each system at each layer count, print the report."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS))
    p.add_argument("--num-layers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--fused-adam", action="store_true")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    from mfsdp import __version__
    from mfsdp.launch import launch

    backend = "nccl" if args.device == "cuda" else "gloo"
    rows = []
    for s in args.systems:
        for layers in args.num_layers:
            cfg = _config(layers, args.seq_length, args.micro_batch_size, args.device,
                          args.fused_adam)
            print(f"[step_memory] {s}, {layers} layers ...", file=sys.stderr, flush=True)
            rows.append(launch("step_memory:measure", 1, args=(s, cfg), backend=backend,
                               timeout=1800)[0])
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), platform.processor())
    print(f"device {args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else cpu})"
          f", torch {torch.__version__}, mfsdp {__version__}, llama-1b shape, bf16, "
          f"{'fused' if args.fused_adam else 'default'} AdamW, sequence {args.seq_length}, "
          f"micro-batch {args.micro_batch_size}, world size 1, eager")
    print(report(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
