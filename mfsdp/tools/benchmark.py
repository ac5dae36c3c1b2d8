"""Side-by-side benchmark: DDP, PyTorch FSDP2 and mfsdp on the same model, data and world size.

``mfsdp bench`` (or ``python -m mfsdp.tools.benchmark``) starts the ranks itself. Two passes:

* **time** (one launch, all systems alive at once): after warm-up, each round runs one step of every
  system in turn, so drift in the machine's speed hits all alike. Before and after each step the
  ranks meet at a barrier and rank 0 reads the loopback interface's byte counters
  (``/proc/net/dev``): the bytes that really crossed the wire in that step, divided by the ranks.
* **memory** (one launch per system, a fresh process each): peak RSS after the steps, and for mfsdp
  the tensor bytes by kind.

Every system trains the same model with AdamW on the same global batch, and the losses are reported
so that one can see they train the same thing: ``--model toy`` (default), the residual MLP
``ToyModel`` (6 blocks, ~9M parameters); ``--model gpt``, a GPT (token and position embeddings,
attention, GELU MLP, vocabulary head) trained on token sequences; ``--model llama``, the Llama
family of :mod:`mfsdp.models.gpt` (``--model llama-1b``: 1.1B parameters, TinyLlama's shape).

``--device cuda`` runs on GPUs with NCCL (one rank per GPU): steps are timed with CUDA events,
memory is ``torch.cuda.max_memory_allocated``, and the table adds tokens/s and model FLOPs
utilisation against ``--peak-tflops`` (989, an H100's dense bf16, by default); ``--bf16`` trains
in bf16 with fp32 main weights. The system ``megatron_fsdp`` (upstream's package, when it is
installed) runs next to the others.

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

from mfsdp.tools.benchmark_systems import (DEFAULTS, FLOOR_SYSTEMS, LLAMA_1B, MODEL_PRESETS,
                                     OPTIONAL_SYSTEMS, SYSTEMS,
                                     TP_SYSTEMS,
                                     batch, build_system, loopback_bytes,
                                     model_flops_per_token, reference_parameters,
                                     loss_fn, timed_step, train_step)

__all__ = ["LLAMA_1B", "SYSTEMS", "bench_memory", "bench_time", "build_parser", "config_of",
           "loopback_bytes",
           "main", "model_flops_per_token", "phases_table", "plot", "profile_step", "run_benchmark",
           "step_phases", "table"]


def bench_time(systems: list[str], cfg: dict | None = None) -> dict:
    """Interleaved step times and wire bytes of ``systems`` (run in every rank; see module doc)."""
    cfg = dict(DEFAULTS, **(cfg or {}))
    rank, world = dist.get_rank(), dist.get_world_size()
    built = {s: build_system(s, cfg) for s in systems}
    numel = sum(p.numel() for p in reference_parameters(cfg))
    times = {s: [] for s in systems}
    wire = {s: [] for s in systems}
    losses = {s: [] for s in systems}
    asked = {}
    for r in range(cfg["warmup"] + cfg["rounds"]):
        x, y = batch(cfg, r)
        for s in systems:
            model, opt = built[s]
            if hasattr(model, "fsdp_state"):
                model.fsdp_state().comms.log.clear()
            dist.barrier()
            before = loopback_bytes() if rank == 0 else 0
            dt, loss = timed_step(model, opt, x, y, loss_fn(cfg))
            dist.barrier()
            after = loopback_bytes() if rank == 0 else 0
            if r >= cfg["warmup"]:
                times[s].append(dt)
                wire[s].append((after - before) / world)
                losses[s].append(loss)
                if hasattr(model, "fsdp_state"):
                    asked[s] = model.fsdp_state().comms.log.total("sent_bytes")
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
    if cfg["model"] in ("gpt", "llama"):  # throughput and model FLOPs utilisation
        tokens = cfg["local_batch"] * cfg["seq_length"] * world // cfg.get("tp", 1)
        flops = model_flops_per_token(cfg) * tokens
        for v in result.values():
            v["tokens_per_s"] = tokens / v["median_s"]
            v["mfu"] = flops / v["median_s"] / world / (cfg["peak_tflops"] * 1e12)
    return {"systems": result, "numel": numel, "world": world, "cfg": cfg}


def bench_memory(system: str, cfg: dict | None = None) -> dict:
    """Peak RSS (MiB) of a fresh process training ``system`` for a few steps, and mfsdp's tensor
    bytes by kind (run in every rank)."""
    cfg = dict(DEFAULTS, **(cfg or {}))
    cuda = cfg["device"] == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model, opt = build_system(system, cfg)
    for r in range(cfg["warmup"] + 2):
        train_step(model, opt, *batch(cfg, r), loss_fn(cfg))
    out = {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if cuda:
        torch.cuda.synchronize()
        out["peak_cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20
    if hasattr(model, "fsdp_state"):  # (an mfsdp model; the other systems hold no buckets)
        out["state_bytes"] = {**model.fsdp_state().memory_by_kind(),
                              "optimizer_state": opt.local_state_bytes()}
        out["comm_scratch_bytes"] = model.fsdp_state().comm_scratch_bytes()
    return out


def profile_step(system: str, cfg: dict | None = None, steps: int = 3, top: int = 30) -> str:
    """``torch.profiler`` table of ``steps`` steps of ``system`` after warm-up (run in every rank;
    rank 0's table is the one to read). mfsdp's collectives carry ``mfsdp::`` labels."""
    from torch.profiler import ProfilerActivity, profile

    cfg = dict(DEFAULTS, **(cfg or {}))
    model, opt = build_system(system, cfg)
    for r in range(cfg["warmup"]):
        train_step(model, opt, *batch(cfg, r), loss_fn(cfg))
    activities = [ProfilerActivity.CPU]
    if cfg.get("device") == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for r in range(steps):
            train_step(model, opt, *batch(cfg, cfg["warmup"] + r), loss_fn(cfg))
    sort = "cuda_time_total" if cfg.get("device") == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=top)


def step_phases(system: str, cfg: dict | None = None) -> dict:
    """Median milliseconds of a step's phases for ``system`` (run in every rank; the ranks meet at
    a barrier before each step): ``forward`` (to the loss), ``backward`` (``loss.backward()``,
    with the reductions it waits for), ``optimizer`` (the step, and for mfsdp ZeRO-1/2 the weights'
    all-gather it waits for) and ``step``. Host clock: CPU only."""
    cfg = dict(DEFAULTS, **(cfg or {}))
    model, opt = build_system(system, cfg)
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": [], "step": []}
    for r in range(cfg["warmup"] + cfg["rounds"]):
        x, y = batch(cfg, r)
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(cfg)(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        if hasattr(model, "wait_param_sync"):
            model.wait_param_sync()
        loss.item()
        t3 = time.perf_counter()
        if r >= cfg["warmup"]:
            for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                phases[k].append(v)
    return {k: statistics.median(v) * 1e3 for k, v in phases.items()}


def phases_table(rows: dict[str, dict], world: int) -> str:
    """The table of :func:`step_phases` results (slowest rank per phase), one system per line.

    >>> print(phases_table({"ddp": dict(forward=80, backward=210, optimizer=35, step=325)}, 2))
    2 ranks; median ms per phase (slowest rank)
    system                      forward backward optimizer     step
    ddp                            80.0    210.0      35.0    325.0
    """
    lines = [f"{world} ranks; median ms per phase (slowest rank)",
             f"{'system':<26} {'forward':>8} {'backward':>8} {'optimizer':>9} {'step':>8}"]
    for s, v in rows.items():
        lines.append(f"{s:<26} {v['forward']:8.1f} {v['backward']:8.1f} {v['optimizer']:9.1f} "
                     f"{v['step']:8.1f}")
    return "\n".join(lines)


def run_benchmark(world_sizes=(2, 4), systems=SYSTEMS, cfg: dict | None = None,
                  memory: bool = True, progress=print) -> dict:
    """Both passes for each world size; returns ``{world: {"time": ..., "memory": ...}}``."""
    from mfsdp.launch import launch

    out = {}
    for world in world_sizes:
        progress(f"[bench] {world} ranks: interleaved timing of {len(systems)} systems ...")
        backend = "nccl" if (cfg or {}).get("device") == "cuda" else "gloo"
        t = launch("mfsdp.tools.benchmark:bench_time", world, args=(list(systems), cfg), timeout=1800,
                   backend=backend)[0]
        mem = {}
        if memory:
            for s in systems:
                progress(f"[bench] {world} ranks: memory of {s} ...")
                runs = launch("mfsdp.tools.benchmark:bench_memory", world, args=(s, cfg), timeout=900,
                              backend=backend)
                mem[s] = max(runs, key=lambda m: (m.get("peak_cuda_mib", 0), m["peak_rss_mib"]))
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
        gpu = t["cfg"].get("device") == "cuda"
        rate = any("tokens_per_s" in v for v in t["systems"].values())
        mem_head = "peak GPU MiB" if gpu else "peak RSS MiB"
        lines.append(f"{'system':<26} {'step ms':>8} {'IQR ms':>7} {'vs FSDP2':>8} "
                     f"{'wire/model':>10} {'asked/model':>11} {mem_head:>12}"
                     + (f" {'tokens/s':>10}" if rate else "")
                     + (f" {'MFU':>6}" if rate and gpu else ""))
        for s, v in t["systems"].items():
            ratio = f"{v['median_s'] / ref:.2f}x" if ref else "-"
            asked = (f"{v['asked_bytes_per_rank'] / model_bytes:.2f}"
                     if v["asked_bytes_per_rank"] is not None else "-")
            key = "peak_cuda_mib" if gpu else "peak_rss_mib"
            peak = f"{mem[s][key]:.0f}" if s in mem and key in mem[s] else "-"
            lines.append(f"{s:<26} {v['median_s'] * 1e3:8.1f} {v['spread_s'] * 1e3:7.1f} "
                         f"{ratio:>8} {v['wire_bytes_per_rank'] / model_bytes:10.2f} {asked:>11} "
                         f"{peak:>12}"
                         + (f" {v['tokens_per_s']:10,.0f}" if rate else "")
                         # (MFU against a GPU's peak: meaningless on CPU)
                         + (f" {v['mfu']:6.1%}" if rate and gpu else ""))
        lines.append("")
    return "\n".join(lines)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The ``mfsdp bench`` argument parser."""
    if parser is None:
        parser = argparse.ArgumentParser(prog="mfsdp bench", description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4],
                        help="ranks to benchmark with (default: 2 4)")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS + OPTIONAL_SYSTEMS + FLOOR_SYSTEMS,
                        default=list(SYSTEMS),
                        help="systems to time (default: all but megatron_fsdp, which needs "
                        "upstream's package, and no-comm: the machine's floor, every rank "
                        "training alone with no communication)")
    parser.add_argument("--model", choices=("toy", "gpt", "llama", *MODEL_PRESETS),
                        default=DEFAULTS["model"],
                        help="toy: residual MLP blocks on vectors; gpt: a GPT on token sequences; "
                             "llama: the Llama family with the sizes below; llama-1b: 1.1B "
                             "parameters (TinyLlama's shape); llama-3b: 3.0B (Llama 3.2 3B's "
                             "layers, a 32,000-token vocabulary); a preset's sizes yield to the "
                             "size flags given")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each transformer layer's forward and the loss "
                        "(torchtitan's per-block compile), every system alike")
    parser.add_argument("--fused-adam", action="store_true",
                        help="PyTorch's fused AdamW (one kernel) for every system (CUDA and CPU)")
    parser.add_argument("--recompute", action="store_true",
                        help="full activation recompute of every layer (Megatron-LM's "
                        "--recompute-granularity full --recompute-method uniform "
                        "--recompute-num-layers 1), every system alike")
    parser.add_argument("--num-query-groups", "--kv-heads", dest="kv_heads", type=int,
                        help="key/value heads (llama; default: --num-attention-heads)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: NCCL, one rank per GPU, CUDA-event timing and GPU memory")
    parser.add_argument("--bf16", action="store_true",
                        help="bf16 compute, fp32 main weights (every system)")
    parser.add_argument("--peak-tflops", type=float, default=DEFAULTS["peak_tflops"],
                        help="the device's dense peak for MFU (default: H100 bf16, %(default)s)")
    parser.add_argument("--seq-length", type=int, default=None,
                        help="tokens per sample (gpt)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="vocabulary (gpt)")
    parser.add_argument("--num-attention-heads", "--heads", dest="heads", type=int,
                        default=None,
                        help="attention heads (gpt; default: one per 64 channels of "
                             "--hidden-size)")
    parser.add_argument("--hidden-size", "--dim", dest="dim", type=int, default=None,
                        help="model width")
    parser.add_argument("--ffn-hidden-size", "--hidden", dest="hidden", type=int,
                        default=None, help="MLP width")
    parser.add_argument("--num-layers", "--blocks", dest="blocks", type=int,
                        default=None, help="blocks")
    parser.add_argument("--micro-batch-size", "--local-batch", dest="local_batch", type=int,
                        default=DEFAULTS["local_batch"],
                        help="samples per rank per step")
    parser.add_argument("--tensor-model-parallel-size", dest="tp", type=int, default=1,
                        help="tensor-parallel size: FSDP2 and mfsdp run on a (dp, tp) mesh with "
                             "Megatron-LM's TP plan of the GPT (needs --model gpt; default 1)")
    parser.add_argument("--rounds", type=int, default=DEFAULTS["rounds"],
                        help="timed steps per system (after --warmup)")
    parser.add_argument("--warmup", type=int, default=DEFAULTS["warmup"])
    parser.add_argument("--no-memory", action="store_true", help="skip the memory pass")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PNG", help="write a bar chart of step times")
    parser.add_argument("--data-path", nargs="+", metavar="PATH",
                        help="instead: the data loader's throughput on Megatron indexed "
                        "datasets (prefixes, optionally weighted), in tokens/s")
    parser.add_argument("--profile", metavar="SYSTEM", choices=SYSTEMS + OPTIONAL_SYSTEMS,
                        help="instead: print torch.profiler's table for SYSTEM on the first world "
                        "size")
    parser.add_argument("--phases", action="store_true",
                        help="instead: median forward, backward and optimizer-step time of each "
                        "of --systems on the first world size (one system at a time)")
    return parser


# Bytes per parameter a system keeps on its ranks in total with AdamW, whatever the sharding:
# fp32 weights, gradients and two moments (16), plus bf16 compute weights with --bf16 (2).
_STATE_BYTES = {False: 16, True: 18}


def check_gpu_fit(cfg: dict, systems, world: int, gpu_bytes: int) -> None:
    """Refuse, naming ``--systems``, a timing run whose systems' states cannot fit on the GPUs.

    The interleaved timing keeps every system's model and optimizer alive in one process per
    rank, so their states add up; on a GPU that is the limit (a 1.1B model with AdamW and bf16
    holds 18 GiB per system on one H100), while on CPU the host's memory is usually larger.

    >>> cfg = dict(DEFAULTS, **LLAMA_1B, bf16=True)
    >>> check_gpu_fit(cfg, ["fsdp2", "mfsdp-optim_grads_params"], 1, 80 * 2**30)
    >>> check_gpu_fit(cfg, ["ddp", "fsdp2", "mfsdp-optim_grads_params"], 1, 80 * 2**30)
    Traceback (most recent call last):
    ...
    SystemExit: mfsdp bench: 3 systems hold 55.3 GiB of weights, gradients and AdamW state per GPU (1 ranks), 69% of the 80.0 GiB GPU before activations; pass fewer --systems per run (e.g. two), or more ranks
    """
    numel = sum(p.numel() for p in reference_parameters(cfg))
    per_rank = [numel * _STATE_BYTES[bool(cfg.get("bf16"))] / (1 if s.startswith("ddp") or
                                                                  s == "mfsdp-no_shard" else world)
                for s in systems]
    need = sum(per_rank)
    if need > 0.6 * gpu_bytes:
        raise SystemExit(f"mfsdp bench: {len(per_rank)} systems hold {need / 2**30:.1f} GiB of "
                         f"weights, gradients and AdamW state per GPU ({world} ranks), "
                         f"{need / gpu_bytes:.0%} of the {gpu_bytes / 2**30:.1f} GiB GPU before "
                         "activations; pass fewer --systems per run (e.g. two), or more ranks")


def loader_throughput(data_path: list[str], seq_length: int, samples: int = 4096,
                      seed: int = 1234) -> dict:
    """Tokens per second the indexed-dataset loader delivers: ``samples`` training samples of
    ``seq_length + 1`` tokens read in Megatron-LM's shuffled order (after building the index).

    >>> import os, tempfile, numpy
    >>> from mfsdp.data.indexed import IndexedDatasetBuilder
    >>> d = tempfile.mkdtemp(); b = IndexedDatasetBuilder(os.path.join(d, "t.bin"), numpy.uint16)
    >>> for n in range(200): b.add_document(list(range(1, 50)) + [0])
    >>> b.finalize(os.path.join(d, "t.idx"))
    >>> r = loader_throughput([os.path.join(d, "t")], seq_length=32, samples=64)
    >>> r["samples"], r["tokens"], r["tokens_per_s"] > 0
    (64, 2112, True)
    """
    from mfsdp.data.gpt_dataset import build_gpt_datasets

    t0 = time.perf_counter()
    train = build_gpt_datasets(data_path, "1,0,0", [samples, 0, 0], seq_length, seed)[0]
    t1 = time.perf_counter()
    tokens = sum(len(train[i][1]) for i in range(samples))
    t2 = time.perf_counter()
    return {"samples": samples, "tokens": tokens, "index_s": t1 - t0,
            "tokens_per_s": tokens / (t2 - t1)}


def config_of(args: argparse.Namespace) -> dict:
    """The benchmark configuration of parsed ``mfsdp bench`` flags: a ``--model`` preset's shape
    (else the defaults), then every size flag given on the command line.

    >>> cfg = config_of(build_parser().parse_args(["--model", "llama-1b", "--seq-length", "4096"]))
    >>> cfg["model"], cfg["dim"], cfg["blocks"], cfg["seq_length"]
    ('llama', 2048, 22, 4096)
    """
    cfg = dict(local_batch=args.local_batch, rounds=args.rounds, warmup=args.warmup,
               model=args.model, device=args.device, bf16=args.bf16,
               peak_tflops=args.peak_tflops, tp=args.tp, recompute=args.recompute,
               compile=args.compile, fused_adam=args.fused_adam)
    sizes = dict(dim=args.dim, hidden=args.hidden, blocks=args.blocks,
                 seq_length=args.seq_length, vocab_size=args.vocab_size, heads=args.heads,
                 kv_heads=args.kv_heads)
    preset = MODEL_PRESETS.get(args.model, {})
    cfg.update({k: DEFAULTS[k] for k in sizes}, **preset)  # a preset's shape, else the defaults
    cfg.update({k: v for k, v in sizes.items() if v is not None})  # the flags given win
    if cfg["heads"] is None:  # heads of 64 channels, as the presets have
        cfg["heads"] = max(1, cfg["dim"] // 64)
    return cfg


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``mfsdp bench`` command."""
    if args.data_path:
        seq = args.seq_length
        r = loader_throughput(args.data_path, seq)
        print(f"loader: {r['samples']} samples of {seq + 1} tokens in Megatron-LM's order: "
              f"{r['tokens_per_s'] / 1e6:.2f} M tokens/s (index built in {r['index_s']:.2f} s)")
        return 0
    cfg = config_of(args)
    if args.tp > 1:
        others = [s for s in args.systems if s not in TP_SYSTEMS]
        if others and args.systems != list(SYSTEMS):
            raise SystemExit(f"mfsdp bench: {', '.join(others)} cannot run with "
                             f"--tensor-model-parallel-size {args.tp}; choose among "
                             f"{', '.join(TP_SYSTEMS)}")
        args.systems = [s for s in args.systems if s in TP_SYSTEMS]  # the default: those that can
        if args.model not in ("gpt",):
            raise SystemExit("mfsdp bench: --tensor-model-parallel-size needs --model gpt "
                             "(the plan splits a GELU MLP; SwiGLU's stacked fc1 is not split)")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("mfsdp bench: --device cuda, but CUDA is not available here")
        if max(args.world_sizes) > torch.cuda.device_count():
            raise SystemExit(f"mfsdp bench: --world-sizes {max(args.world_sizes)} needs as many "
                             f"GPUs; this machine has {torch.cuda.device_count()}")
        fit = [args.profile] if args.profile else args.systems  # the systems alive at once
        check_gpu_fit(cfg, fit, min(args.world_sizes),
                      torch.cuda.get_device_properties(0).total_memory)
    if args.profile:
        from mfsdp.launch import launch

        print(launch("mfsdp.tools.benchmark:profile_step", args.world_sizes[0],
                     args=(args.profile, cfg), timeout=900,
                     backend="nccl" if args.device == "cuda" else "gloo")[0])
        return 0
    if args.phases:
        if args.device == "cuda":
            raise SystemExit("mfsdp bench --phases: host timers cannot split a GPU step into "
                             "phases (the host runs ahead); use --profile on CUDA")
        from mfsdp.launch import launch

        rows = {}
        for s in args.systems:
            print(f"[bench] {args.world_sizes[0]} ranks: phases of {s} ...", file=sys.stderr,
                  flush=True)
            per_rank = launch("mfsdp.tools.benchmark:step_phases", args.world_sizes[0], args=(s, cfg),
                              timeout=900)
            rows[s] = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
        print(phases_table(rows, args.world_sizes[0]))
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
    """Entry point of ``python -m mfsdp.tools.benchmark``."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
