"""Memory and communication planner: will this model fit, and what does a step move?

The ``mfsdp plan`` command (this module: its parser, its run, and ``--dry-run``'s report). The
estimates are :mod:`mfsdp.tools.plan`'s; the dry run is :mod:`mfsdp.tools.dry_run`'s::

    mfsdp plan llama3-70b --world-size 1024 --recompute-granularity full --dry-run

Your own model: a preset with Megatron-LM's model flags layered on it, as ``mfsdp train``
layers them (:mod:`mfsdp.tools.plan_model`)::

    mfsdp plan llama3-8b --model-args "--num-layers 40 --hidden-size 5120 \\
        --ffn-hidden-size 13824 --num-attention-heads 40"
"""

from __future__ import annotations

import argparse
import sys

from mfsdp.argtypes import fraction, non_negative_float, positive_float, positive_int
from mfsdp.tools.plan import (PRESETS, GiB, Layout, plan, smallest_layout, smallest_world,
                              with_global_batch)
from mfsdp.tools.plan_terms import TRANSFORMER_IMPLS
from mfsdp.tools.plan_time import GPUS, step_time

__all__ = ["build_parser", "run", "describe", "main"]


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The ``mfsdp plan`` argument parser (every size positive, the efficiency in (0, 1])."""
    parser = parser or argparse.ArgumentParser(prog="mfsdp plan", description=__doc__.splitlines()[0])
    parser.add_argument("preset", choices=sorted(PRESETS),
                        help="model: a trainer preset, or the base --model-args changes")
    parser.add_argument("--model-args", metavar='"FLAGS"', default="",
                        help="mfsdp train's (Megatron-LM's) model and MoE flags, quoted as one "
                             "argument, layered on the preset as the trainer layers them: "
                             "\"--num-layers 40 --hidden-size 5120\" plans that model (the "
                             "preset is required: without one the trainer's base is a GPT-2-style "
                             "model the planner does not model)")
    parser.add_argument("--world-size", type=positive_int, default=8)
    # The trainer's (Megatron-LM's) names first; the short names stay as aliases.
    parser.add_argument("--data-parallel-sharding-strategy", "--strategy", dest="strategy",
                        default="optim_grads_params",
                        choices=["no_shard", "optim", "optim_grads", "optim_grads_params"])
    parser.add_argument("--num-distributed-optimizer-instances", "--dp-outer", dest="dp_outer",
                        type=positive_int, default=1, help="HSDP outer size")
    parser.add_argument("--outer-dp-sharding-strategy", "--outer-strategy", dest="outer_strategy",
                        default="no_shard", choices=["no_shard", "optim"])
    parser.add_argument("--expert-model-parallel-size", "--ep", dest="ep", type=positive_int, default=1)
    parser.add_argument("--tensor-model-parallel-size", dest="tp", type=positive_int, default=1,
                        help="tensor-parallel size (Megatron-LM's split of every projection)")
    parser.add_argument("--context-parallel-size", dest="cp", type=positive_int, default=1,
                        help="context-parallel size (each rank holds seq_length / cp tokens)")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="sequence parallelism in the TP regions (needs TP > 1)")
    parser.add_argument("--micro-batch-size", "--micro-batch", dest="micro_batch", type=positive_int,
                        default=1, help="sequences per micro-batch (the trainer's name)")
    parser.add_argument("--global-batch-size", type=positive_int,
                        help="sequences per optimizer step over all data-parallel ranks (default: "
                             "one micro-batch per rank, no accumulation)")
    parser.add_argument("--seq-length", type=positive_int, default=4096)
    parser.add_argument("--recompute-granularity", choices=("full", "selective"),
                        help="activation recomputation, as mfsdp train and Megatron-LM name it")
    parser.add_argument("--recompute-method", choices=("uniform", "block"), default="uniform")
    parser.add_argument("--recompute-num-layers", type=positive_int, default=1)
    parser.add_argument("--recompute", action="store_true",
                        help="shorthand for --recompute-granularity full (uniform, 1 layer)")
    parser.add_argument("--transformer-impl", choices=TRANSFORMER_IMPLS, default="local",
                        help="the layer and loss the activations are counted for (Megatron-LM's "
                             "flag): local, mfsdp train's (measured); transformer_engine, "
                             "Megatron-LM's Transformer Engine layer (Megatron-LM's estimate)")
    memory = ", ".join(f"{k} {g.memory_gib:g}" for k, g in GPUS.items())
    parser.add_argument("--device-gib", type=positive_float,
                        help=f"GiB of one GPU (default: the --gpu's memory: {memory})")
    gpu = parser.add_argument_group("time estimate (mfsdp/tools/plan_time.py)")
    gpu.add_argument("--gpu", choices=tuple(GPUS), default="h100",
                     help="peak, NVLink, network and memory figures of this GPU (defaults "
                          "below; an h200 computes as an h100)")
    gpu.add_argument("--peak-tflops", type=positive_float,
                     help="dense peak at the training precision (h100 and h200: 989 bf16, "
                          "1979 FP8; gb200 and gb300: 2500 bf16, 5000 FP8)")
    gpu.add_argument("--compute-efficiency", type=fraction,
                     help="fraction of the peak a step's kernels reach (default 0.4)")
    gpu.add_argument("--nvlink-gbps", type=positive_float, help="GB/s per GPU inside an NVLink domain")
    gpu.add_argument("--network-gbps", type=positive_float, help="GB/s per GPU between domains")
    parser.add_argument("--grad-reduce-in-bf16", action="store_true",
                        help="reduce gradients in bf16 (Megatron-LM's flag); default: in the main "
                             "gradients' fp32")
    dry = parser.add_argument_group("dry run (mfsdp/tools/dry_run.py)")
    dry.add_argument("--dry-run", action="store_true",
                     help="also build the model with the real engine at this world size, in this "
                          "process (fake process group, meta tensors), and compare what each rank "
                          "holds and sends with the plan; exit 1 when weights, gradients or "
                          "optimizer state differ by more than 2%%, 2 when the layout cannot be "
                          "built")
    dry.add_argument("--json", metavar="PATH",
                     help="with --dry-run: write the measured and planned bytes per rank there")
    dry.add_argument("--dry-run-ranks", metavar="R,R,...",
                     type=lambda v: [int(r) for r in v.split(",")],
                     help="with --dry-run: the ranks to build (default: the first and last of the "
                          "world and of each of rank 0's groups, and up to 8 positions of its EP "
                          "group)")
    dry.add_argument("--fsdp-double-buffer", action="store_true",
                     help="with --dry-run: build with the trainer's --fsdp-double-buffer and "
                          "report its two slots")
    parser.add_argument("--smallest", action="store_true",
                        help="also find the smallest number of devices (whole 8-GPU nodes) that "
                             "fits with --margin to spare: with this layout's TP/CP, and "
                             "searching TP (with SP) and CP; with --global-batch-size, only "
                             "layouts whose DP x micro-batch divides it. The fewest devices, "
                             "with the smallest TP x CP there and no recomputation beyond what "
                             "you pass: it does not weigh speed (the guide's layouts page does)")
    parser.add_argument("--margin", metavar="GIB", type=non_negative_float,
                        help="with --smallest: GiB a plan must leave spare, beyond the 4 kept for "
                             "the CUDA context (default 5, the margin under which a plan is "
                             "called tight)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``mfsdp plan`` command."""
    model, name = PRESETS[args.preset], args.preset
    if args.model_args:
        from mfsdp.tools.plan_model import planned_model

        try:
            model, name = planned_model(args.preset, args.model_args, seq_length=args.seq_length)
        except ValueError as exc:
            raise SystemExit(f"mfsdp plan: --model-args: {exc}") from None
        if args.dry_run:
            raise SystemExit("mfsdp plan: --dry-run builds the preset itself, not --model-args'"
                             " model; drop one of them")
    # the layout's own checks first: a TP x CP larger than the world is its error, not a
    # division by zero below
    Layout(args.world_size, args.strategy, args.dp_outer, args.outer_strategy, args.ep,
           tp=args.tp, cp=args.cp, sequence_parallel=args.sequence_parallel)
    layout = Layout(args.world_size, args.strategy, args.dp_outer, args.outer_strategy, args.ep,
                    micro_batch=args.micro_batch, seq_length=args.seq_length,
                    recompute=args.recompute, recompute_granularity=args.recompute_granularity,
                    recompute_method=args.recompute_method,
                    recompute_num_layers=args.recompute_num_layers, tp=args.tp, cp=args.cp,
                    sequence_parallel=args.sequence_parallel,
                    grad_comm_bytes=2 if args.grad_reduce_in_bf16 else None,
                    transformer_impl=args.transformer_impl)
    dp = args.world_size // (args.tp * args.cp)  # data-parallel ranks: one batch slice each
    fitted = with_global_batch(layout, args.global_batch_size or None)
    if fitted is None:  # the micro-batches a rank runs must make the global batch exactly
        raise SystemExit(f"mfsdp plan: --global-batch-size {args.global_batch_size} is not a "
                         f"multiple of --micro-batch-size x data-parallel ranks = "
                         f"{args.micro_batch} x {dp}")
    layout = fitted
    if (args.json or args.fsdp_double_buffer or args.dry_run_ranks) and not args.dry_run:
        raise SystemExit("mfsdp plan: --json, --dry-run-ranks and --fsdp-double-buffer belong "
                         "to the dry run; add --dry-run")
    if args.margin is not None and not args.smallest:
        raise SystemExit("mfsdp plan: --margin belongs to the --smallest search; add --smallest")
    margin = TIGHT_GIB if args.margin is None else args.margin
    given_gib = args.device_gib is not None
    if not given_gib:  # the GPU's own memory; an explicit --device-gib wins
        args.device_gib = GPUS[args.gpu].memory_gib
    if args.smallest and margin >= args.device_gib - 4:
        raise SystemExit(f"mfsdp plan: --margin {margin:g} leaves nothing of --device-gib "
                         f"{args.device_gib:g} - 4; give a smaller --margin")
    bad = [r for r in args.dry_run_ranks or () if not 0 <= r < args.world_size]
    if bad:
        raise SystemExit(f"mfsdp plan: --dry-run-ranks {bad[0]} is not a rank of --world-size "
                         f"{args.world_size} (0 to {args.world_size - 1})")
    p = plan(model, layout)
    if args.model_args:
        print(f"{name}; {args.world_size} ranks, {args.strategy}")
    else:
        print(f"{args.preset}: {p.params / 1e9:.1f}B parameters ({p.expert_params / 1e9:.1f}B "
              f"in experts), {args.world_size} ranks, {args.strategy}")
    print(describe(layout, dp))
    print(p.table())
    print(f"dominant term: {p.dominant}; fits on {args.device_gib:g} GiB: "
          f"{'yes' if p.fits(args.device_gib) else 'no'} (total <= {args.device_gib:g} - 4 GiB "
          f"kept for the CUDA context and the allocator; {args.device_gib:g} GiB: "
          + ("--device-gib)" if given_gib else f"--gpu {args.gpu}'s memory, --device-gib to "
             "change)"))
    if p.fits(args.device_gib) and not p.fits(args.device_gib - TIGHT_GIB):
        print(f"  tight: within {TIGHT_GIB:g} GiB of the limit; on the one GPU run compared "
              "the plan was 0.8% high, but it is one run of 6 layers (the guide's planner page, "
              "\"How accurate it is, at a glance\")")
    given = {"peak_tflops": args.peak_tflops, "efficiency": args.compute_efficiency,
             "nvlink_gbps": args.nvlink_gbps, "network_gbps": args.network_gbps}
    print(step_time(model, layout, p.comm, args.gpu,
                    **{k: v for k, v in given.items() if v is not None}).summary())
    if args.smallest:
        usable, spare = args.device_gib - margin, f"with {margin:g} GiB spare"
        gbs_given = args.global_batch_size
        if gbs_given:
            spare += f" and DP x micro-batch dividing --global-batch-size {gbs_given}"
        world = smallest_world(model, layout, usable, progress=_bar_stream(),
                               global_batch=gbs_given)
        print(f"smallest world that fits {spare}: "
              f"{world if world else 'none up to 4096 nodes'}")
        best = smallest_layout(model, layout, usable, progress=_bar_stream(),
                               global_batch=gbs_given)
        if best is not None:
            print(f"smallest with TP/CP searched {spare}: {best.world_size} (TP {best.tp}"
                  f"{' + SP' if best.sequence_parallel else ''}, CP {best.cp}; "
                  f"{plan(model, best).total / GiB:.2f} GiB)")
    if args.dry_run:
        return _dry_run(args, layout)
    return 0


def _dry_run(args: argparse.Namespace, layout: Layout) -> int:
    """``--dry-run``: the real engine's bytes beside the plan; the exit status says whether they
    agree (0), disagree (1) or the layout cannot be built (2)."""
    import json

    from mfsdp.tools.dry_run import DryRunError, dry_run

    try:
        result = dry_run(args.preset, layout, ranks=args.dry_run_ranks, gpu=args.gpu,
                         double_buffer=args.fsdp_double_buffer)
    except DryRunError as exc:
        print(f"mfsdp plan --dry-run: {exc}", file=sys.stderr)
        return 2
    print(result.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_json(), f, indent=1)
    return 0 if result.ok() else 1


def describe(layout: Layout, dp: int) -> str:
    """What a step is and what the estimate assumes, in two lines (``mfsdp plan`` prints them).

    >>> print(describe(Layout(world_size=16, micro_batches=4, seq_length=8192), dp=16))
    step: one optimizer step = 4 micro-batches x 1 sequence x 8192 tokens on each of 16 data-parallel ranks (global batch 64)
    assumed: bytes per parameter: weights 2 (bf16), main weights 4 (fp32), gradients 4 (fp32, reduced in 4), Adam moments 8; flash attention; prefetch depth 1; no recomputation
    """
    m, b = layout.micro_batches, layout.micro_batch
    recompute = layout.recompute_granularity or ("full" if layout.recompute else None)
    return (f"step: one optimizer step = {m} micro-batch{'es' if m > 1 else ''} x {b} "
            f"sequence{'s' if b > 1 else ''} x {layout.seq_length} tokens on each of {dp} "
            f"data-parallel ranks (global batch {m * b * dp})\n"
            f"assumed: bytes per parameter: weights {layout.compute_bytes} (bf16), main weights "
            f"{layout.main_bytes} (fp32), gradients {layout.grad_bytes} (fp32, reduced in "
            f"{layout.grad_comm_bytes or layout.grad_bytes}), Adam moments "
            f"{layout.optimizer_bytes}; "
            f"{'flash attention' if layout.flash_attention else 'attention scores kept'}; "
            f"prefetch depth {layout.prefetch_depth}; "
            f"{recompute + ' recomputation' if recompute else 'no recomputation'}"
            + (" (saves nothing with flash attention: the attention scores it drops are not "
               "kept)" if recompute == "selective" and layout.flash_attention else "")
            + ("; Transformer Engine layers and loss (Megatron-LM's estimate)"
               if layout.transformer_impl == "transformer_engine" else ""))


TIGHT_GIB = 5.0
"""A plan that fits with less than this to spare is called tight: the planner's total was 0.8%
(0.5 GiB) above the one whole-step peak measured on a GPU (the planner page), but that is one
run of a 6-layer model; deeper models, other layouts and the allocator's fragmentation are not
measured."""


def _bar_stream():
    """stderr for the search's progress bar when it is a terminal; None (no bar) when it is
    piped or redirected, so that no carriage-return frames end up in a file."""
    return sys.stderr if sys.stderr.isatty() else None


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m mfsdp.tools.plan``."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
