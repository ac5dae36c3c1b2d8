"""All-gather and reduce-scatter bus bandwidth, set beside the planner's link assumptions.

``mfsdp bandwidth`` times the two collectives FSDP uses (``all_gather_into_tensor`` and
``reduce_scatter_tensor``) inside a node, across nodes and over the whole job, and reports
their bus bandwidth as nccl-tests defines it (its ``doc/PERFORMANCE.md``): for a gathered
(full) size ``S`` bytes moved in ``t`` seconds by ``n`` ranks, ``algbw = S / t`` and
``busbw = algbw * (n - 1) / n`` for both collectives. ``busbw`` is what
:mod:`mfsdp.tools.plan_time` calls a link's GB/s (``--nvlink-gbps``, ``--network-gbps`` of
``mfsdp plan``), so the two can be set side by side. Under torchrun it
joins the job (NCCL on GPUs)::

    srun --ntasks-per-node=1 python -m torch.distributed.run --nnodes 2 --nproc-per-node 8 \\
        --rdzv-backend c10d --rdzv-endpoint "$HEAD_NODE:29500" --rdzv-id "$SLURM_JOB_ID" \\
        -m mfsdp.cli bandwidth

and without it starts ranks on this machine (``mfsdp bandwidth --nproc 4 --ranks-per-node 2
--device cpu`` pretends to have two nodes of two ranks).

Three kinds of group are measured, one kind at a time (:func:`rank_groups`): ``node`` (the ranks
of one node; every node's group runs at once), ``network`` (one rank per node, all of the same
local rank; every local rank's group runs at once, so each GPU uses its own NIC, as the planner
assumes) and ``world``. A collective's time is the slowest rank's mean over ``--iters``
iterations, each ended by a CUDA synchronisation, after ``--warmup`` untimed ones. The data are
float32; every result is checked against the values the ranks sent.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

from mfsdp.argtypes import non_negative_int, positive_float, positive_int
from mfsdp.tools.plan_time import GPUS

__all__ = ["OPS", "rank_groups", "bus_bandwidth", "measure", "links", "plan_flags", "report",
           "build_parser", "run"]

OPS = ("all_gather_into_tensor", "reduce_scatter_tensor")
"""The collectives timed: FSDP's parameter gather and gradient reduction."""

_ELEMENT = 4  # bytes of one float32
_LOW = 0.7  # a link under this fraction of the planner's assumption gets a warning
_DEFAULTS = {"cuda": {"size_mib": [256.0, 1024.0], "iters": 20, "warmup": 5},
             "cpu": {"size_mib": [4.0, 16.0], "iters": 5, "warmup": 1}}


def rank_groups(world: int, ranks_per_node: int) -> dict[str, list[list[int]]]:
    """The groups measured, by kind, for ``world`` ranks placed ``ranks_per_node`` to a node in
    rank order (as torchrun and Slurm place them).

    >>> rank_groups(4, 2)
    {'node': [[0, 1], [2, 3]], 'network': [[0, 2], [1, 3]], 'world': [[0, 1, 2, 3]]}
    """
    if ranks_per_node < 1 or world % ranks_per_node:
        raise ValueError(f"--ranks-per-node {ranks_per_node} does not divide the world size "
                         f"{world}; pass a divisor of {world} (the GPUs of one node)")
    nodes = world // ranks_per_node
    return {"node": [list(range(i * ranks_per_node, (i + 1) * ranks_per_node))
                     for i in range(nodes)],
            "network": [list(range(local, world, ranks_per_node))
                        for local in range(ranks_per_node)],
            "world": [list(range(world))]}


def bus_bandwidth(size_bytes: float, seconds: float, ranks: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (10^9 bytes) of an all-gather or reduce-scatter of ``size_bytes``
    gathered (full) bytes over ``ranks`` ranks that took ``seconds`` (nccl-tests' definitions).

    >>> bus_bandwidth(1e9, 0.01, 8)
    (100.0, 87.5)
    """
    algbw = size_bytes / seconds / 1e9
    return algbw, algbw * (ranks - 1) / ranks


def _sizes(size_mib: list[float], world: int) -> list[int]:
    """Each ``--size-mib`` in bytes, refused when its float32 elements do not split evenly over
    ``world`` ranks (every group's size divides the world's)."""
    sizes = []
    for mib in size_mib:
        if not mib > 0:
            raise ValueError(f"--size-mib {mib:g} is not above 0; pass sizes in MiB such as 256 1024")
        size = int(mib * 2**20)
        elements = size // _ELEMENT
        if size % _ELEMENT or not elements or elements % world:
            fit = max(elements // world, 1) * world * _ELEMENT / 2**20
            raise ValueError(f"--size-mib {mib:g} is {elements:,} float32 elements, which do not "
                             f"split evenly over {world} ranks; pass a multiple of {world} "
                             f"elements, such as --size-mib {fit:g}")
        sizes.append(size)
    return sizes


def measure(size_mib: list[float], ranks_per_node: int, iters: int, warmup: int) -> dict:
    """Time both collectives over every group kind of :func:`rank_groups` (run on every rank of
    an initialised default process group; NCCL means CUDA, the current device).

    Returns, the same on every rank: ``rows`` (one per kind, op and size: ``group``, ``ranks``,
    ``op``, ``size_bytes``, ``time_s``, ``algbw_gbps``, ``busbw_gbps``) and ``skipped`` (kind ->
    why); and this rank's own: ``mine`` (kind -> its group's ranks) and ``observed`` (kind -> op
    -> per destination chunk, the first and last values it received at the first size).
    """
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sizes = _sizes(size_mib, world)
    layout = rank_groups(world, ranks_per_node)
    out = {"rows": [], "skipped": {}, "mine": {}, "observed": {}}
    for kind, groups in layout.items():
        n = len(groups[0])
        if n == 1:
            out["skipped"][kind] = (f"{kind}: groups of one rank (--ranks-per-node "
                                    f"{ranks_per_node} of {world}): nothing to measure")
            continue
        same = [k for k in out["mine"] if len(layout[k]) == 1]
        if kind == "world" and same:  # one node, or one rank per node
            out["skipped"][kind] = f"world: the same ranks as {same[0]}: measured once"
            continue
        group = (dist.group.WORLD if kind == "world"
                 else dist.new_subgroups_by_enumeration(groups)[0])
        mine = next(g for g in groups if rank in g)
        out["mine"][kind] = mine
        for size in sizes:
            for op in OPS:
                seconds, seen = _time_op(op, size, mine, group, device, iters, warmup)
                if size == sizes[0]:
                    out["observed"].setdefault(kind, {})[op] = seen
                # the slowest rank's mean: every group of the kind ran at once
                t = torch.tensor([seconds], dtype=torch.float64, device=device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                algbw, busbw = bus_bandwidth(size, t.item(), n)
                out["rows"].append({"group": kind, "ranks": n, "groups": len(groups), "op": op,
                                    "size_bytes": size, "time_s": t.item(),
                                    "algbw_gbps": algbw, "busbw_gbps": busbw})
    return out


def _time_op(op: str, size: int, ranks: list[int], group, device, iters: int,
             warmup: int) -> tuple[float, list]:
    """This rank's mean seconds of ``op`` on ``group`` (whose members are ``ranks``), and what it
    received; raises when the result is not what the ranks sent."""
    import torch
    import torch.distributed as dist

    n, me = len(ranks), dist.get_rank()
    shard = size // _ELEMENT // n
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # Each rank sends its own rank number: a gather's chunk i holds ranks[i]; a sum over the
    # group holds sum(ranks) everywhere.
    if op == "all_gather_into_tensor":
        inp = torch.full((shard,), float(me), device=device)
        res = torch.empty(shard * n, device=device)
        call = lambda: dist.all_gather_into_tensor(res, inp, group=group)  # noqa: E731
        expected = torch.tensor(ranks, dtype=torch.float32, device=device)
    else:
        inp = torch.full((shard * n,), float(me), device=device)
        res = torch.empty(shard, device=device)
        call = lambda: dist.reduce_scatter_tensor(res, inp, group=group)  # noqa: E731
        expected = torch.tensor([float(sum(ranks))], device=device)
    for _ in range(warmup):
        call()
    sync()
    flag = torch.zeros(1, device=device)
    dist.all_reduce(flag)  # every group starts together
    sync()
    total = 0.0
    for _ in range(iters):
        start = time.perf_counter()
        call()
        sync()
        total += time.perf_counter() - start
    chunks = res.view(len(expected), -1)
    if not torch.equal(chunks, expected[:, None].expand_as(chunks)):
        raise RuntimeError(f"{op} over ranks {ranks} returned other values than the ranks sent: "
                           "the collective is broken on this machine")
    seen = chunks[:, [0, -1]].tolist()
    del inp, res
    return total / iters, seen


def links(rows: list[dict]) -> dict[str, float]:
    """The measured busbw of each link, as ``mfsdp plan`` takes it: the lower of the two
    collectives' at the largest size, for ``node`` (NVLink) and ``network``, where measured.

    >>> links([{"group": "node", "op": op, "size_bytes": 4, "busbw_gbps": b}
    ...        for op, b in zip(OPS, (300.0, 280.0))])
    {'node': 280.0}
    """
    out = {}
    for kind in ("node", "network"):
        mine = [r for r in rows if r["group"] == kind]
        if mine:
            largest = max(r["size_bytes"] for r in mine)
            out[kind] = min(r["busbw_gbps"] for r in mine if r["size_bytes"] == largest)
    return out


def _figure(x: float) -> str:
    """Three significant figures, without an exponent (``mfsdp plan`` reads it as a float)."""
    return f"{float(f'{x:.3g}'):g}" if x >= 1e-4 else f"{x:.3g}"


def plan_flags(measured: dict[str, float]) -> str | None:
    """The ``mfsdp plan`` flags that set the measured links, or None when none was measured.

    >>> plan_flags({"node": 301.234, "network": 41.96})
    '--nvlink-gbps 301 --network-gbps 42'
    """
    flags = [f"--{name}-gbps {_figure(measured[kind])}"
             for kind, name in (("node", "nvlink"), ("network", "network")) if kind in measured]
    return " ".join(flags) or None


def report(result: dict, gpu: str = "h100", cpu: bool = False) -> str:
    """The table of ``result`` (:func:`measure`'s), the planner's assumptions for ``gpu`` beside
    the measured links, warnings for links under 70% of them, and the ``mfsdp plan`` flags."""
    lines = [f"mfsdp bandwidth: {why}" for why in result["skipped"].values()]
    head = ("group", "ranks", "op", "size MiB", "time ms", "algbw GB/s", "busbw GB/s")
    table = [head] + [(r["group"], str(r["ranks"]), r["op"], f"{r['size_bytes'] / 2**20:g}",
                       f"{r['time_s'] * 1e3:.3f}", f"{r['algbw_gbps']:#.3g}",
                       f"{r['busbw_gbps']:#.3g}") for r in result["rows"]]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        lines.append("  ".join(c.ljust(w) if i < 3 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    measured = links(result["rows"])
    spec = GPUS[gpu]
    if cpu and measured:
        lines.append(f"(measured on CPU with gloo: the comparison with --gpu {gpu} says nothing "
                     "about a GPU's links)")
    for kind, name, assumed in (("node", "NVLink", spec.nvlink_gbps),
                                ("network", "network", spec.network_gbps)):
        if kind not in measured:
            continue
        ratio = measured[kind] / assumed
        lines.append(f"{name} ({kind} groups): measured busbw {_figure(measured[kind])} GB/s, the "
                     f"planner assumes {assumed:g} GB/s for {spec.name} "
                     f"({_figure(100 * ratio) if ratio < 0.01 else f'{100 * ratio:.0f}'}%)")
        if ratio < _LOW and not cpu:  # gloo on CPU is no GPU link: nothing to check
            hint = ("check NCCL_DEBUG=INFO for NET/IB; NET/Socket is TCP" if kind == "network"
                    else "check NCCL_DEBUG=INFO for P2P/CUMEM or NVLS and nvidia-smi topo -m "
                         "for NV links between the GPUs")
            lines.append(f"warning: {name} is under {100 * _LOW:.0f}% of the planner's "
                         f"assumption: {hint}")
    flags = plan_flags(measured)
    lines.append(f"mfsdp plan ... {flags}" if flags else
                 "mfsdp bandwidth: no link measured (one rank per node and one node)")
    return "\n".join(lines)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The ``mfsdp bandwidth`` argument parser."""
    parser = parser or argparse.ArgumentParser(prog="mfsdp bandwidth",
                                               description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="cuda: NCCL, one GPU per rank; cpu: gloo; auto: cuda where a GPU "
                             "is visible (default)")
    parser.add_argument("--nproc", type=positive_int,
                        help="without torchrun: ranks to start on this machine (default: every "
                             "GPU on cuda, 2 on cpu); under torchrun the job's ranks are used")
    parser.add_argument("--ranks-per-node", type=positive_int,
                        help="ranks of one node (default: LOCAL_WORLD_SIZE under torchrun, "
                             "else --nproc: one node)")
    parser.add_argument("--size-mib", type=float, nargs="+",
                        help="gathered (full) sizes in MiB (default: 256 1024 on cuda, 4 16 on cpu)")
    parser.add_argument("--iters", type=positive_int,
                        help="timed iterations per collective (default: 20 on cuda, 5 on cpu)")
    parser.add_argument("--warmup", type=non_negative_int,
                        help="untimed iterations before them (default: 5 on cuda, 1 on cpu)")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100",
                        help="the GPU whose planner assumptions (mfsdp plan --gpu) are set beside "
                             "the measured links (default: %(default)s)")
    parser.add_argument("--json", metavar="PATH",
                        help="write the rows, the links and the environment to PATH")
    parser.add_argument("--timeout", type=positive_float, default=600.0,
                        help="seconds the ranks may take (default: %(default)s)")
    return parser


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _settings(args: argparse.Namespace) -> dict:
    """The run's settings from ``args``, every default filled in and every input checked."""
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("mfsdp bandwidth: --device cuda, but no CUDA GPU is visible here; run "
                         "on a GPU node or pass --device cpu")
    torchrun = _under_torchrun()
    if torchrun:
        if args.nproc is not None:
            raise SystemExit("mfsdp bandwidth: --nproc starts ranks on this machine, but this "
                             "is a torchrun job already; drop --nproc (torchrun's "
                             "--nproc-per-node sets the ranks)")
        world = int(os.environ["WORLD_SIZE"])
        per_node = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    else:
        world = args.nproc or (torch.cuda.device_count() if device == "cuda" else 2)
        if device == "cuda" and world > torch.cuda.device_count():
            raise SystemExit(f"mfsdp bandwidth: --nproc {world} needs as many GPUs; this "
                             f"machine has {torch.cuda.device_count()}: pass --nproc "
                             f"{torch.cuda.device_count()} or fewer")
        per_node = args.ranks_per_node or world
    defaults = _DEFAULTS[device]
    settings = {"device": device, "torchrun": torchrun, "world": world,
                "ranks_per_node": per_node,
                "size_mib": args.size_mib or defaults["size_mib"],
                "iters": args.iters or defaults["iters"],
                "warmup": defaults["warmup"] if args.warmup is None else args.warmup}
    rank_groups(world, per_node)  # refuses a --ranks-per-node that does not divide the world
    _sizes(settings["size_mib"], world)  # refuses a size that is not above 0 or does not split
    return settings


def environment(settings: dict) -> dict:
    """What a saved result needs to be read later: device, world, backend, versions, date."""
    import platform

    import torch

    from mfsdp import __version__

    cuda = settings["device"] == "cuda"
    return {"device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
            "world_size": settings["world"], "ranks_per_node": settings["ranks_per_node"],
            "nodes": settings["world"] // settings["ranks_per_node"],
            "backend": "nccl" if cuda else "gloo", "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
            "mfsdp": __version__, "host": platform.node(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``mfsdp bandwidth`` command: under torchrun in this rank, else on
    ``--nproc`` ranks it starts; rank 0 prints the report and writes ``--json``."""
    settings = _settings(args)
    call = (settings["size_mib"], settings["ranks_per_node"], settings["iters"],
            settings["warmup"])
    backend = "nccl" if settings["device"] == "cuda" else "gloo"
    if settings["torchrun"]:
        import torch.distributed as dist

        from mfsdp.runtime import init_from_env, shutdown

        started = not dist.is_initialized()
        if started:
            init_from_env(backend, timeout_s=args.timeout)
        result = measure(*call)
        if dist.get_rank() == 0:
            _output(result, settings, args)
        if started:
            shutdown(exit_code=0)  # see mfsdp.runtime.shutdown: no interpreter teardown
        return 0
    from mfsdp.launch import launch

    result = launch("mfsdp.tools.bandwidth:measure", settings["world"], args=call,
                    backend=backend, timeout=args.timeout)[0]
    _output(result, settings, args)
    return 0


def _output(result: dict, settings: dict, args: argparse.Namespace) -> None:
    print(report(result, args.gpu, cpu=settings["device"] == "cpu"), flush=True)
    if args.json:
        measured = links(result["rows"])
        with open(args.json, "w") as f:
            json.dump({"environment": environment(settings), "gpu": args.gpu,
                       "settings": {k: settings[k] for k in ("size_mib", "iters", "warmup")},
                       "rows": result["rows"], "skipped": result["skipped"],
                       "links_gbps": measured, "plan_flags": plan_flags(measured)}, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m mfsdp.tools.bandwidth``."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
