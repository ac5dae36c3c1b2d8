"""Side-by-side benchmark: DDP, PyTorch FSDP2 and mfsdp on the same model, data and world size.

``mfsdp bench`` (or ``python -m mfsdp.benchmark``) starts the ranks itself. Two passes:

* **time** (one launch, all systems alive at once): after warm-up, each round runs one step of every
  system in turn, so drift in the machine's speed hits all alike. Before and after each step the
  ranks meet at a barrier and rank 0 reads the loopback interface's byte counters
  (``/proc/net/dev``): the bytes that really crossed the wire in that step, divided by the ranks.
* **memory** (one launch per system, a fresh process each): peak RSS after the steps, and for mfsdp
  the tensor bytes by kind.

Every system trains the same model with AdamW on the same global batch, and the losses are reported
so that one can see they train the same thing: ``--model toy`` (default), the residual MLP
``ToyModel`` (6 blocks, ~9M parameters); ``--model gpt``, a GPT (token and position embeddings,
attention, GELU MLP, vocabulary head) trained on token sequences.

>>> SYSTEMS
('ddp', 'fsdp2', 'fsdp2-no-reshard', 'mfsdp-no_shard', 'mfsdp-optim', 'mfsdp-optim_grads', 'mfsdp-optim_grads_params')
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

__all__ = ["SYSTEMS", "bench_memory", "bench_time", "build_parser", "loopback_bytes", "main",
           "plot", "profile_step", "run_benchmark", "table"]

SYSTEMS = ("ddp", "fsdp2", "fsdp2-no-reshard", "mfsdp-no_shard", "mfsdp-optim",
           "mfsdp-optim_grads", "mfsdp-optim_grads_params")
DEFAULTS = dict(dim=512, hidden=1408, blocks=6, local_batch=16, warmup=2, rounds=8, lr=1e-3,
                seed=0, model="toy", seq_length=64, vocab_size=2048, heads=6)


def _model(cfg: dict):
    """(model, its FSDP unit class) of the configured shape."""
    if cfg["model"] == "gpt":
        from mfsdp.models.gpt import GPT, GPTConfig, TransformerLayer

        return GPT(GPTConfig(vocab_size=cfg["vocab_size"], max_position_embeddings=cfg["seq_length"],
                             num_layers=cfg["blocks"], hidden_size=cfg["dim"],
                             ffn_hidden_size=cfg["hidden"],
                             num_attention_heads=cfg["heads"])), TransformerLayer
    if cfg["model"] != "toy":
        raise ValueError(f"model={cfg['model']!r}: use 'toy' or 'gpt'")
    from mfsdp.models import Block, ToyModel

    return ToyModel(cfg["dim"], cfg["hidden"], cfg["blocks"]), Block


def loopback_bytes() -> int:
    """Bytes sent on the loopback interface so far (0 where there is no /proc).

    Only the transmit counter: on loopback every byte sent is also received on the same
    interface, so adding both would count it twice.
    """
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == "lo":
                    fields = rest.split()
                    return int(fields[8])
    except OSError:
        pass
    return 0


def _build(system: str, cfg: dict):
    """(model, optimizer) of one system, built from the same seed."""
    torch.manual_seed(cfg["seed"])
    model, unit = _model(cfg)
    if system == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        return model, torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    if system.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard as fsdp2_shard

        reshard = system == "fsdp2"
        for block in [m for m in model.modules() if isinstance(m, unit)]:
            fsdp2_shard(block, reshard_after_forward=reshard)
        fsdp2_shard(model, reshard_after_forward=reshard)
        return model, torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    from mfsdp import fully_shard

    strategy = system.removeprefix("mfsdp-")
    extra = dict(cfg.get("mfsdp_kwargs", {}))
    if extra.pop("all_gather_group", False):  # all-gathers on their own communicator
        extra["fsdp_group_ag"] = dist.new_group(list(range(dist.get_world_size())))
    return fully_shard(model, torch.optim.AdamW(model.parameters(), lr=cfg["lr"]),
                       fsdp_unit_modules=[unit], zero_dp_strategy=strategy, **extra)


def _batch(cfg: dict, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(cfg["seed"] * 7919 + step)
    n = cfg["local_batch"]
    if cfg["model"] == "gpt":  # token sequences; the targets are the next tokens
        tokens = torch.randint(0, cfg["vocab_size"], (n * world, cfg["seq_length"]), generator=g)
        tokens = tokens[rank * n:(rank + 1) * n]
        return tokens, tokens.roll(-1, dims=1).reshape(-1)
    x = torch.randn(n * world, cfg["dim"], generator=g)[rank * n:(rank + 1) * n]
    return x, torch.sin(x)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if y.dtype == torch.long:
        return torch.nn.functional.cross_entropy(out.float(), y)
    return torch.nn.functional.mse_loss(out, y)


def _step(model, opt, x, y) -> float:
    opt.zero_grad(set_to_none=True)
    loss = _loss(model(x), y)
    loss.backward()
    opt.step()
    if hasattr(model, "wait_param_sync"):  # mfsdp ZeRO-1/2: the step ends when weights are back
        model.wait_param_sync()
    return loss.item()


def bench_time(systems: list[str], cfg: dict | None = None) -> dict:
    """Interleaved step times and wire bytes of ``systems`` (run in every rank; see module doc)."""
    cfg = dict(DEFAULTS, **(cfg or {}))
    rank, world = dist.get_rank(), dist.get_world_size()
    built = {s: _build(s, cfg) for s in systems}
    numel = sum(p.numel() for p in _build_reference_numel(cfg))
    times = {s: [] for s in systems}
    wire = {s: [] for s in systems}
    losses = {s: [] for s in systems}
    asked = {}
    for r in range(cfg["warmup"] + cfg["rounds"]):
        x, y = _batch(cfg, r)
        for s in systems:
            model, opt = built[s]
            if hasattr(model, "comm_log"):
                model.comm_log.clear()
            dist.barrier()
            before = loopback_bytes() if rank == 0 else 0
            t0 = time.perf_counter()
            loss = _step(model, opt, x, y)
            dt = time.perf_counter() - t0
            dist.barrier()
            after = loopback_bytes() if rank == 0 else 0
            if r >= cfg["warmup"]:
                times[s].append(dt)
                wire[s].append((after - before) / world)
                losses[s].append(loss)
                if hasattr(model, "comm_log"):
                    asked[s] = model.comm_log.total("sent_bytes")
    # Every rank's times: the step is as slow as its slowest rank.
    gathered = [None] * world
    dist.all_gather_object(gathered, times)
    result = {}
    for s in systems:
        per_round = [max(g[s][i] for g in gathered) for i in range(len(times[s]))]
        result[s] = {
            "median_s": statistics.median(per_round),
            "min_s": min(per_round), "max_s": max(per_round),
            "spread_s": (statistics.quantiles(per_round, n=4)[2] - statistics.quantiles(per_round, n=4)[0]
                         if len(per_round) >= 4 else max(per_round) - min(per_round)),
            "wire_bytes_per_rank": statistics.median(wire[s]) if rank == 0 else None,
            "asked_bytes_per_rank": asked.get(s),
            "final_loss": losses[s][-1],
        }
    return {"systems": result, "numel": numel, "world": world, "cfg": cfg}


def _build_reference_numel(cfg: dict):
    with torch.device("meta"):
        return list(_model(cfg)[0].parameters())


def bench_memory(system: str, cfg: dict | None = None) -> dict:
    """Peak RSS (MiB) of a fresh process training ``system`` for a few steps, and mfsdp's tensor
    bytes by kind (run in every rank)."""
    cfg = dict(DEFAULTS, **(cfg or {}))
    model, opt = _build(system, cfg)
    for r in range(cfg["warmup"] + 2):
        _step(model, opt, *_batch(cfg, r))
    out = {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if hasattr(model, "memory_by_kind"):
        out["state_bytes"] = {**model.memory_by_kind(), "optimizer_state": opt.local_state_bytes()}
        out["comm_scratch_bytes"] = model.comm_scratch_bytes()
    return out


def profile_step(system: str, cfg: dict | None = None, steps: int = 3, top: int = 12) -> str:
    """``torch.profiler`` table of ``steps`` steps of ``system`` after warm-up (run in every rank;
    rank 0's table is the one to read). mfsdp's collectives carry ``mfsdp::`` labels."""
    from torch.profiler import ProfilerActivity, profile

    cfg = dict(DEFAULTS, **(cfg or {}))
    model, opt = _build(system, cfg)
    for r in range(cfg["warmup"]):
        _step(model, opt, *_batch(cfg, r))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for r in range(steps):
            _step(model, opt, *_batch(cfg, cfg["warmup"] + r))
    return prof.key_averages().table(sort_by="cpu_time_total", row_limit=top)


def run_benchmark(world_sizes=(2, 4), systems=SYSTEMS, cfg: dict | None = None,
                  memory: bool = True, progress=print) -> dict:
    """Both passes for each world size; returns ``{world: {"time": ..., "memory": ...}}``."""
    from mfsdp.launch import launch

    out = {}
    for world in world_sizes:
        progress(f"[bench] {world} ranks: interleaved timing of {len(systems)} systems ...")
        t = launch("mfsdp.benchmark:bench_time", world, args=(list(systems), cfg), timeout=1800)[0]
        mem = {}
        if memory:
            for s in systems:
                progress(f"[bench] {world} ranks: memory of {s} ...")
                mem[s] = max((m for m in launch("mfsdp.benchmark:bench_memory", world, args=(s, cfg), timeout=900)),
                             key=lambda m: m["peak_rss_mib"])
        out[world] = {"time": t, "memory": mem}
    return out


def table(results: dict) -> str:
    """A plain-text table of :func:`run_benchmark`'s results, one block per world size."""
    lines = []
    for world, r in results.items():
        t, mem = r["time"], r["memory"]
        model_bytes = 4 * t["numel"]
        ref = t["systems"].get("fsdp2", {}).get("median_s")
        lines.append(f"{world} ranks, {t['cfg'].get('model', 'toy')} model, "
                     f"{t['numel'] / 1e6:.2f}M parameters, AdamW; "
                     f"median of {t['cfg']['rounds']} interleaved steps")
        lines.append(f"{'system':<26} {'step ms':>8} {'IQR ms':>7} {'vs FSDP2':>8} "
                     f"{'wire/model':>10} {'asked/model':>11} {'peak RSS MiB':>12}")
        for s, v in t["systems"].items():
            ratio = f"{v['median_s'] / ref:.2f}x" if ref else "-"
            asked = (f"{v['asked_bytes_per_rank'] / model_bytes:.2f}"
                     if v["asked_bytes_per_rank"] is not None else "-")
            rss = f"{mem[s]['peak_rss_mib']:.0f}" if s in mem else "-"
            lines.append(f"{s:<26} {v['median_s'] * 1e3:8.1f} {v['spread_s'] * 1e3:7.1f} "
                         f"{ratio:>8} {v['wire_bytes_per_rank'] / model_bytes:10.2f} {asked:>11} "
                         f"{rss:>12}")
        lines.append("")
    return "\n".join(lines)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The ``mfsdp bench`` argument parser."""
    if parser is None:
        parser = argparse.ArgumentParser(prog="mfsdp bench", description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4],
                        help="ranks to benchmark with (default: 2 4)")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--model", choices=("toy", "gpt"), default=DEFAULTS["model"],
                        help="toy: residual MLP blocks on vectors; gpt: a GPT on token sequences")
    parser.add_argument("--seq-length", type=int, default=DEFAULTS["seq_length"],
                        help="tokens per sample (gpt)")
    parser.add_argument("--vocab-size", type=int, default=DEFAULTS["vocab_size"],
                        help="vocabulary (gpt)")
    parser.add_argument("--heads", type=int, default=DEFAULTS["heads"],
                        help="attention heads (gpt)")
    parser.add_argument("--dim", type=int, default=DEFAULTS["dim"], help="model width")
    parser.add_argument("--hidden", type=int, default=DEFAULTS["hidden"], help="MLP width")
    parser.add_argument("--blocks", type=int, default=DEFAULTS["blocks"], help="blocks")
    parser.add_argument("--local-batch", type=int, default=DEFAULTS["local_batch"],
                        help="samples per rank per step")
    parser.add_argument("--rounds", type=int, default=DEFAULTS["rounds"],
                        help="timed steps per system (after --warmup)")
    parser.add_argument("--warmup", type=int, default=DEFAULTS["warmup"])
    parser.add_argument("--no-memory", action="store_true", help="skip the memory pass")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PNG", help="write a bar chart of step times")
    parser.add_argument("--profile", metavar="SYSTEM", choices=SYSTEMS,
                        help="instead: print torch.profiler's table for SYSTEM on the first world "
                        "size")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``mfsdp bench`` command."""
    cfg = dict(dim=args.dim, hidden=args.hidden, blocks=args.blocks, local_batch=args.local_batch,
               rounds=args.rounds, warmup=args.warmup, model=args.model,
               seq_length=args.seq_length, vocab_size=args.vocab_size, heads=args.heads)
    if args.profile:
        from mfsdp.launch import launch

        print(launch("mfsdp.benchmark:profile_step", args.world_sizes[0],
                     args=(args.profile, cfg), timeout=900)[0])
        return 0
    results = run_benchmark(tuple(args.world_sizes), tuple(args.systems), cfg,
                            memory=not args.no_memory,
                            progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(k): v for k, v in results.items()}, f, indent=1)
    if args.plot:
        plot(results, args.plot)
    return 0


def plot(results: dict, path: str | None = None):
    """Bar chart of median step time per system (error bars: min to max), one panel per world."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.6), squeeze=False)
    for ax, (world, r) in zip(axes[0], results.items()):
        systems = list(r["time"]["systems"])
        v = [r["time"]["systems"][s] for s in systems]
        med = [x["median_s"] * 1e3 for x in v]
        err = [[m - x["min_s"] * 1e3 for m, x in zip(med, v)],
               [x["max_s"] * 1e3 - m for m, x in zip(med, v)]]
        colors = ["tab:gray" if s == "ddp" else "tab:orange" if s.startswith("fsdp2")
                  else "tab:blue" for s in systems]
        ax.barh(systems, med, xerr=err, color=colors)
        ax.invert_yaxis()
        ax.set_xlabel("step time, ms (median; bars: min-max)")
        ax.set_title(f"{world} ranks")
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m mfsdp.benchmark``."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
