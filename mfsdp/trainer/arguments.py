"""The trainer's command line: Megatron-LM's flags (``build_parser``) and Megatron-LM's checks
of their values (``check_args``), each error naming the flag and the fix."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from mfsdp.argtypes import (MIN_TIMEOUT_MINUTES, adam_beta, non_negative_float,  # noqa: F401
                            non_negative_int, positive_float, positive_int, timeout_minutes)
from mfsdp.data.batches import half_pair, is_indexed_prefix
from mfsdp.trainer.metrics import check_wandb_args


STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

class OneRankParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are printed by rank 0 only (``RANK`` of torchrun):
    a typo on 512 ranks is one message, not 512. Every rank still exits with status 2."""

    def error(self, message: str):
        """Print the usage and ``message`` on rank 0 (or without a rank), then exit 2."""
        if os.environ.get("RANK", "0") == "0":
            self.print_usage(sys.stderr)
            sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The trainer's argument parser (the flag reference of the guide is generated from it)."""
    if parser is None:
        parser = OneRankParser(prog="mfsdp train", description=__doc__.splitlines()[0])
    _model_flags(parser.add_argument_group("model"))
    _moe_flags(parser.add_argument_group("mixture of experts"))
    _parallel_flags(parser.add_argument_group("parallelism and sharding"))
    _precision_flags(parser.add_argument_group("precision"))
    training = parser.add_argument_group("training")
    _training_flags(training)
    _data_flags(training)  # (Megatron-LM lists them with the training flags)
    _job_flags(parser.add_argument_group("job"))
    _checkpoint_flags(parser.add_argument_group("checkpoints"))
    _logging_flags(parser.add_argument_group("logging"))
    _profiling_flags(parser.add_argument_group("profiling (Megatron-LM's flags)"))
    return parser


def _model_flags(m) -> None:
    """Megatron-LM's model flags: sizes, norms, positions, attention, recomputation."""
    from mfsdp.models.gpt import GPT_PRESETS

    m.add_argument("--model-preset", choices=sorted(GPT_PRESETS), default=None,
                   help="starting sizes; the flags below override them (default: the "
                        "configuration saved in the --load checkpoint, else gpt-tiny)")
    m.add_argument("--num-layers", type=positive_int, help="transformer layers")
    m.add_argument("--hidden-size", type=positive_int, help="model width")
    m.add_argument("--ffn-hidden-size", type=positive_int, help="dense MLP width")
    m.add_argument("--num-attention-heads", type=positive_int, help="attention heads")
    m.add_argument("--vocab-size", type=positive_int,
                   help="vocabulary (at least 256 with data files; under tensor parallelism "
                        "padded to a multiple of the TP size)")
    m.add_argument("--max-position-embeddings", type=positive_int,
                   help="longest sequence (default: --seq-length)")
    m.add_argument("--swiglu", action="store_true", default=None, help="gated MLPs")
    m.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"))
    m.add_argument("--norm-epsilon", type=positive_float, help="epsilon of the norms")
    m.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"))
    m.add_argument("--rotary-base", type=float, help="RoPE base (theta)")
    m.add_argument("--use-rope-scaling", action="store_true", default=None,
                   help="Llama-3 RoPE frequency scaling (factor: --rope-scaling-factor)")
    m.add_argument("--rope-scaling-factor", type=float, default=8.0,
                   help="with --use-rope-scaling, refused without it (default: %(default)s)")
    m.add_argument("--rotary-interleaved", action="store_true", default=None,
                   help="rotate interleaved channel pairs (DeepSeek)")
    m.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention with --num-query-groups key/value heads")
    m.add_argument("--num-query-groups", type=positive_int, help="key/value heads (with the above)")
    m.add_argument("--kv-channels", type=positive_int, help="width of one attention head")
    m.add_argument("--disable-bias-linear", action="store_true", help="no biases in linear layers")
    m.add_argument("--add-qkv-bias", action="store_true", default=None,
                   help="biases on query, key and value only (Qwen2)")
    m.add_argument("--qk-layernorm", action="store_true", default=None,
                   help="RMSNorm on each query and key head (Qwen3)")
    m.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="a separate output layer (the presets' default; see the migrating page)")
    m.add_argument("--multi-latent-attention", action="store_true", default=None,
                   help="DeepSeek's multi-head latent attention (the five sizes below)")
    m.add_argument("--q-lora-rank", type=positive_int)
    m.add_argument("--kv-lora-rank", type=positive_int)
    m.add_argument("--qk-head-dim", type=positive_int, help="MLA: plain query/key channels per head")
    m.add_argument("--qk-pos-emb-head-dim", type=positive_int,
                   help="MLA: rotary query/key channels per head")
    m.add_argument("--v-head-dim", type=positive_int, help="MLA: value channels per head")
    m.add_argument("--init-method-std", type=float,
                   help="initialise weights from N(0, std) (the Llama and DeepSeek presets: 0.02)")
    m.add_argument("--recompute-granularity", choices=("full", "selective"),
                   help="activation recomputation: whole layers (full) or the core attention "
                        "(selective)")
    m.add_argument("--recompute-method", choices=("uniform", "block"),
                   help="with full: recompute chunks of --recompute-num-layers layers (uniform) "
                        "or the first --recompute-num-layers layers (block)")
    m.add_argument("--recompute-num-layers", type=positive_int,
                   help="with full: layers per chunk (uniform) or layers recomputed (block)")


def _moe_flags(e) -> None:
    """The MoE flags: experts, router, capacity, dispatcher."""
    from mfsdp.moe.dispatcher import DISPATCHERS, FLEX_BACKENDS

    e.add_argument("--num-experts", type=int, help="routed experts per MoE layer (0: dense)")
    e.add_argument("--moe-router-topk", type=positive_int, help="experts per token")
    e.add_argument("--moe-first-dense-layers", type=int,
                   help="leading layers that stay dense (DeepSeek-V3: 3)")
    e.add_argument("--moe-ffn-hidden-size", type=positive_int, help="each expert's width")
    e.add_argument("--moe-shared-expert-intermediate-size", type=int,
                   help="width of the shared expert (0: none)")
    e.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"))
    e.add_argument("--moe-router-pre-softmax", action="store_true", default=None,
                   help="softmax over all experts, not renormalised over the chosen ones")
    e.add_argument("--moe-router-topk-scaling-factor", type=float,
                   help="multiply the routing weights (DeepSeek-V3: 2.5)")
    e.add_argument("--moe-shared-expert-gate", action="store_true", default=None,
                   help="sigmoid gate on the shared expert (Qwen2-MoE)")
    e.add_argument("--moe-router-num-groups", type=positive_int, help="expert groups (group-limited)")
    e.add_argument("--moe-router-group-topk", type=positive_int, help="groups each token may use")
    e.add_argument("--moe-router-enable-expert-bias", action="store_true", default=None,
                   help="auxiliary-loss-free balancing bias, updated every iteration")
    e.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                   help="step of the balancing bias (default: %(default)s)")
    e.add_argument("--moe-aux-loss-coeff", type=float, help="load-balancing loss weight")
    e.add_argument("--moe-z-loss-coeff", type=float, help="router z-loss weight")
    e.add_argument("--moe-expert-capacity-factor", type=float,
                   help="cap tokens per expert at factor x the fair share (default: no cap)")
    e.add_argument("--moe-token-drop-policy", choices=("probs", "position"),
                   help="which tokens an over-full expert keeps")
    e.add_argument("--moe-pad-expert-input-to-capacity", action="store_true", default=None,
                   help="fill every expert to exactly its capacity")
    e.add_argument("--moe-token-dispatcher-type", choices=DISPATCHERS, default="alltoall",
                   help="how tokens reach their experts (default: %(default)s)")
    e.add_argument("--moe-flex-dispatcher-backend", choices=FLEX_BACKENDS, default="torch",
                   help="backend of the flex dispatcher (default: %(default)s)")
    e.add_argument("--moe-grouped-gemm", action="store_true", default=None,
                   help="fused experts (one batched matmul) instead of one module per expert")


def _parallel_flags(p) -> None:
    """The engine and the parallel layout: ZeRO level, HSDP, EP, TP, SP, CP, overlap."""
    p.add_argument("--use-megatron-fsdp", action="store_true",
                   help="shard with mfsdp (without it: PyTorch DDP, dense models only)")
    p.add_argument("--data-parallel-sharding-strategy", choices=STRATEGIES,
                   default="optim_grads_params", help="ZeRO level (default: %(default)s)")
    p.add_argument("--outer-dp-sharding-strategy", choices=("no_shard", "optim"),
                   default="no_shard", help="across the outer groups (default: %(default)s)")
    p.add_argument("--num-distributed-optimizer-instances", type=positive_int, default=1,
                   help="outer (HSDP) size: model replicas, each sharded over world/N ranks")
    p.add_argument("--expert-model-parallel-size", type=positive_int, default=1,
                   help="EP size: ranks that split the experts of each MoE layer")
    p.add_argument("--tensor-model-parallel-size", type=positive_int, default=1,
                   help="TP size: consecutive ranks that split every layer (Megatron-LM's split: "
                        "column/row-parallel projections, vocabulary-parallel embedding)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with TP: norms on sequence shards, all-gather/reduce-scatter around "
                        "the TP regions")
    p.add_argument("--context-parallel-size", type=positive_int, default=1,
                   help="CP size: ranks that split every sequence (Megatron-LM's load-balanced "
                        "2 x CP chunks; attention over the whole sequence)")
    p.add_argument("--expert-tensor-parallel-size", type=positive_int, default=None,
                   help="TP size inside the experts (Megatron-LM's default: the TP size); "
                        "mfsdp keeps experts whole, split over EP: 1")
    p.add_argument("--create-all-gather-group", action="store_true",
                   help="all-gathers on their own communicator (overlap with reduce-scatters)")
    p.add_argument("--fsdp-double-buffer", action="store_true",
                   help="gathered weights in a fixed two-unit pool")
    p.add_argument("--init-model-with-meta-device", action="store_true",
                   help="build on meta and materialise shard by shard")
    p.add_argument("--overlap-grad-reduce", action=argparse.BooleanOptionalAction, default=True,
                   help="reduce each bucket's gradients during backward (default: on)")
    p.add_argument("--overlap-param-gather", action=argparse.BooleanOptionalAction, default=True,
                   help="prefetch the next unit's weights (default: on)")
    p.add_argument("--calculate-per-token-loss", action="store_true",
                   help="sum gradients over ranks; the loss is normalised by the global token count")
    p.add_argument("--use-nccl-ub", action="store_true",
                   help="Megatron-LM's NCCL user buffers: refused, mfsdp does not register them "
                        "(fully_shard refuses nccl_ub=True alike)")
    p.add_argument("--fsdp-manual-registration", action="store_true",
                   help="registers buffers for --use-nccl-ub: refused with it")


def _precision_flags(x) -> None:
    """bf16 compute and the dtypes of main weights, main gradients and their reduction."""
    x.add_argument("--bf16", action="store_true", help="bf16 weights and compute, fp32 main weights")
    x.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="reduce gradients in bf16 (shorthand for --megatron-fsdp-grad-comm-dtype "
                        "bf16; another --megatron-fsdp-grad-comm-dtype is refused)")
    for what in ("main-params", "main-grads", "grad-comm"):
        x.add_argument(f"--megatron-fsdp-{what}-dtype", choices=sorted(DTYPES),
                       help=f"dtype of the {what.replace('-', ' ')}")


def _training_flags(t) -> None:
    """Batch sizes, iterations, the learning-rate schedule, the optimizer, data."""
    t.add_argument("--micro-batch-size", type=positive_int, default=2,
                   help="sequences per micro-batch per rank (default: %(default)s)")
    t.add_argument("--global-batch-size", type=positive_int, default=8,
                   help="sequences per iteration over all ranks (default: %(default)s)")
    t.add_argument("--seq-length", type=positive_int, default=64,
                   help="tokens per sequence (the longest one with packing; default: %(default)s)")
    t.add_argument("--train-iters", type=positive_int, default=20, help="iterations to reach")
    t.add_argument("--lr", type=non_negative_float, default=3e-3, help="peak learning rate")
    t.add_argument("--min-lr", type=non_negative_float, default=0.0,
                   help="the learning rate decay ends at")
    t.add_argument("--lr-warmup-iters", type=non_negative_int, default=0,
                   help="linear warm-up iterations")
    t.add_argument("--lr-decay-style", default="linear",
                   choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"),
                   help="as Megatron-LM's scheduler (default: %(default)s)")
    t.add_argument("--lr-decay-iters", type=positive_int,
                   help="iterations of decay (default: --train-iters)")
    t.add_argument("--lr-warmup-init", type=float, default=0.0,
                   help="learning rate of the first warm-up step (default: %(default)s)")
    t.add_argument("--lr-wsd-decay-iters", type=positive_int,
                   help="WSD: the last N decay iterations anneal")
    t.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=("linear", "cosine", "exponential", "minus_sqrt"),
                   help="WSD: the shape of the anneal (default: %(default)s)")
    t.add_argument("--weight-decay", type=non_negative_float, default=0.01,
                   help="AdamW decay (not on biases and norms)")
    t.add_argument("--optimizer", choices=("adam", "sgd"), default="adam",
                   help="adam: AdamW (decoupled weight decay, as Megatron-LM's adam); sgd: SGD "
                   "with --sgd-momentum (default: %(default)s)")
    t.add_argument("--sgd-momentum", type=non_negative_float, default=0.9,
                   help="(default: %(default)s)")
    t.add_argument("--adam-beta1", type=adam_beta, default=0.9, help="in [0, 1)")
    t.add_argument("--adam-beta2", type=adam_beta, default=0.999, help="in [0, 1)")
    t.add_argument("--adam-eps", type=positive_float, default=1e-8,
                   help="added to Adam's denominator, above 0 (default: %(default)s)")
    t.add_argument("--clip-grad", type=non_negative_float, default=1.0,
                   help="largest global gradient norm; 0 turns clipping off, as in Megatron-LM "
                        "(default: %(default)s)")
    t.add_argument("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_true", default=True,
                   help="stop when the loss or the gradient norm is NaN or Inf, before the "
                        "optimizer step and before any save (Megatron-LM's default: on)")
    t.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false", help="train on through NaN/Inf (not recommended)")
    t.add_argument("--seed", type=int, default=1234, help="model init and data order")


def _data_flags(t) -> None:
    """The data flags: mock data, indexed datasets or a text file, split, cache, tokenizer,
    ``--train-samples``, and the evaluation's interval and size."""
    t.add_argument("--mock-data", action="store_true",
                   help="synthetic sequences (the default when no --data-path is given; "
                        "refused with --data-path)")
    t.add_argument("--data-path", nargs="+", metavar="PATH",
                   help="Megatron indexed dataset prefixes (PREFIX.bin/.idx), optionally "
                   "weighted: '0.3 a 0.7 b'; or one text file read as bytes (vocab 256); "
                   "'bundled' uses the small text shipped with mfsdp")
    t.add_argument("--split", default="969,30,1",
                   help="train,valid,test weights over each dataset's documents "
                   "(default: %(default)s)")
    t.add_argument("--data-cache-path", metavar="DIR",
                   help="keep the sample index arrays here and reuse them")
    t.add_argument("--tokenizer-type", choices=("NullTokenizer", "HuggingFaceTokenizer"),
                   help="sets the model's vocabulary (padded) and the EOD id")
    t.add_argument("--tokenizer-model", metavar="PATH",
                   help="HuggingFaceTokenizer: a local tokenizer directory")
    t.add_argument("--make-vocab-size-divisible-by", type=positive_int, default=128,
                   help="pad the tokenizer's vocabulary to a multiple of this times the "
                        "tensor-parallel size, as Megatron-LM does (default: %(default)s)")
    t.add_argument("--train-samples", type=positive_int,
                   help="samples to train on (sets --train-iters = samples / global batch)")
    t.add_argument("--eval-interval", type=positive_int, default=1000,
                   help="validation every N iterations and at the end (default: %(default)s)")
    t.add_argument("--eval-iters", type=non_negative_int, default=100,
                   help="global batches per validation (0: none; default: %(default)s)")
    t.add_argument("--sequence-packing", action="store_true",
                   help="variable-length sequences packed per micro-batch (THD); with indexed "
                   "datasets, each sample is cut into its documents at EOD tokens")


def _job_flags(j) -> None:
    """The job's timeout and error form."""
    j.add_argument("--distributed-timeout-minutes", type=timeout_minutes, default=10.0,
                   help="how long a collective waits for the other ranks before the job stops "
                   "(Megatron-LM's flag and default: %(default)s); shortly before, the rank that "
                   "waits names the ranks that are behind and where they are")
    j.add_argument("--debug", action="store_true",
                   help="errors with their full traceback (by default a user error is one line)")


def _checkpoint_flags(c) -> None:
    """Saving, loading, stopping, and the checkpoint's schedule and format."""
    c.add_argument("--save", help="checkpoint directory to write")
    c.add_argument("--load", help="checkpoint directory to resume from (latest); a new or empty "
                   "directory starts from iteration 0, anything else that is not a checkpoint "
                   "is refused")
    c.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="--load of a new or empty directory stops instead of starting from "
                        "iteration 0 (Megatron-LM's flag)")
    c.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM (Slurm's --signal before the time limit): save and exit 0")
    c.add_argument("--exit-duration-in-mins", type=positive_float,
                   help="save and exit once the run has lasted this many minutes")
    c.add_argument("--exit-interval", type=positive_int,
                   help="stop (after saving, with --save) when the iteration is a multiple of N")
    c.add_argument("--save-interval", type=positive_int, help="save every N iterations (and at the end)")
    c.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   action="store_true", dest="override_opt_param_scheduler",
                   help="--load: use this command's learning-rate schedule, not the checkpoint's")
    c.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   action="store_true", dest="use_checkpoint_opt_param_scheduler",
                   help="--load: continue the checkpoint's learning-rate schedule (--lr, --min-lr, "
                   "warm-up, decay iterations and style)")
    c.add_argument("--no-ckpt-verify", dest="ckpt_verify", action="store_false",
                   help="--load: skip checking every file of an mfsdp checkpoint against the "
                   "SHA-256 sums its manifest records (the check reads the checkpoint once more)")
    c.add_argument("--ckpt-format", choices=("fsdp_dtensor", "torch_dist", "mfsdp_full"),
                   default="fsdp_dtensor",
                   help="format of --save: mfsdp's sharded fsdp_dtensor, Megatron-LM's torch_dist "
                        "(a root with latest_checkpointed_iteration.txt that Megatron-LM loads), "
                        "or mfsdp's full-tensor mfsdp_full; --load reads each (default: "
                        "%(default)s)")
    c.add_argument("--dump-param-to-param-group-map", metavar="DIR",
                   help="write the parameter -> optimizer group map (as upstream: a "
                        "torch.distributed.checkpoint directory, with the JSON that "
                        "mfsdp convert --param-to-param-group-map-json reads inside; a path "
                        "ending in .json: that file alone) and go on training")


def _logging_flags(o) -> None:
    """The log lines, the JSON log, TensorBoard, W&B and throughput."""
    o.add_argument("--log-interval", type=positive_int, default=100,
                   help="print every N iterations and the last (default: %(default)s)")
    o.add_argument("--log-jsonl", metavar="PATH", help="one JSON object per iteration (rank 0)")
    o.add_argument("--tensorboard-dir", metavar="DIR",
                   help="TensorBoard event files (needs the tensorboard package)")
    o.add_argument("--log-throughput", action="store_true",
                   help="add TFLOP/s per rank (model FLOPs estimate) and peak memory to the log")
    o.add_argument("--wandb-project", metavar="NAME",
                   help="log the same scalars as TensorBoard to this Weights & Biases project "
                        "(rank 0; needs --wandb-exp-name and the wandb package; WANDB_MODE="
                        "offline keeps the run local)")
    o.add_argument("--wandb-exp-name", metavar="NAME",
                   help="the run's name in W&B")
    o.add_argument("--wandb-save-dir", metavar="DIR",
                   help="W&B's local files (default: --save/wandb)")
    o.add_argument("--wandb-entity", metavar="NAME",
                   help="the W&B team or user (default: the API key's)")


def _profiling_flags(f) -> None:
    """Profiler traces and CUDA memory history."""
    f.add_argument("--profile", action="store_true",
                   help="profile iterations --profile-step-start to --profile-step-end (an nsys "
                   "capture range on GPUs; a torch.profiler trace with --use-pytorch-profiler)")
    f.add_argument("--use-pytorch-profiler", action="store_true",
                   help="--profile writes a torch.profiler trace into --tensorboard-dir/profile")
    f.add_argument("--profile-step-start", type=int, default=10,
                   help="first profiled iteration (default: %(default)s)")
    f.add_argument("--profile-step-end", type=int, default=12,
                   help="profiling stops before this iteration (default: %(default)s)")
    f.add_argument("--profile-ranks", type=int, nargs="+", default=[0],
                   help="the ranks that profile (default: 0)")
    f.add_argument("--pytorch-profiler-collect-shapes", action="store_true",
                   help="record operator input shapes in the trace")
    f.add_argument("--pytorch-profiler-collect-callstack", action="store_true",
                   help="record Python call stacks in the trace")
    f.add_argument("--record-memory-history", action="store_true",
                   help="record the CUDA caching allocator's history and dump it to "
                   "--memory-snapshot-path after each logged iteration (GPU only)")
    f.add_argument("--memory-snapshot-path", default="snapshot.pickle",
                   help="where --record-memory-history writes (default: %(default)s)")


def check_args(args, world: int, cfg) -> int:
    """Validate the combination of flags; return the micro-batches per iteration per rank.

    Flags that the others would leave without effect are refused too
    (:func:`mfsdp.trainer.refusals.check_combinations`), after the checks of values."""
    from mfsdp.trainer.refusals import check_combinations, check_with_model

    if args.distributed_timeout_minutes <= 0:  # (the parser's type refuses it first)
        raise SystemExit("--distributed-timeout-minutes must be positive")
    per = _check_layout(args, world, cfg)
    _check_schedule(args)
    _check_data(args, cfg)
    _check_experts_and_replicas(args, world, cfg)
    _check_checkpoints(args)
    parser = build_parser()  # (the defaults and spellings of the flags)
    check_combinations(args, parser)
    check_with_model(args, cfg, parser)
    _check_paths(args)
    return args.global_batch_size // per


def _check_layout(args, world: int, cfg) -> int:
    """TP x CP x replicas divide the ranks, TP and CP have the engine, experts stay whole, the
    global batch splits into micro-batches; return the sequences per micro-batch step."""
    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
    if world % (tp * cp * args.num_distributed_optimizer_instances):
        raise SystemExit(f"--tensor-model-parallel-size {tp} x --context-parallel-size {cp} x "
                         f"--num-distributed-optimizer-instances "
                         f"{args.num_distributed_optimizer_instances} does not divide the "
                         f"{world} ranks")
    if cp > 1 and not args.use_megatron_fsdp:
        raise SystemExit("--context-parallel-size needs --use-megatron-fsdp (the DDP path "
                         "replicates the model)")
    if tp > 1:
        from mfsdp.models.tensor_parallel import check_tensor_parallel

        if not args.use_megatron_fsdp:
            raise SystemExit("--tensor-model-parallel-size needs --use-megatron-fsdp (the DDP "
                             "path replicates the model)")
        try:
            check_tensor_parallel(cfg, tp)
        except ValueError as e:
            raise SystemExit(f"--tensor-model-parallel-size {tp}: {e}") from None
    etp = args.expert_tensor_parallel_size or tp  # Megatron-LM's default: the TP size
    if etp != 1 and cfg.num_experts:
        raise SystemExit(f"expert tensor parallelism {etp}"
                         + ("" if args.expert_tensor_parallel_size else
                            " (Megatron-LM's default for --expert-tensor-parallel-size is the TP "
                            "size)") + ": mfsdp keeps experts whole, split over EP; pass "
                         "--expert-tensor-parallel-size 1")
    dp = world // (tp * cp)
    per = args.micro_batch_size * dp
    if args.global_batch_size % per:
        raise SystemExit(f"--global-batch-size {args.global_batch_size} is not divisible by "
                         f"--micro-batch-size x data-parallel size = {args.micro_batch_size} x "
                         f"{dp}; pick a multiple of {per}")
    return per


def _check_schedule(args) -> None:
    """``--train-samples`` sets the iterations; the schedule's flags fit together."""
    if args.train_samples:
        args.train_iters = max(1, args.train_samples // args.global_batch_size)
    if args.lr_decay_style == "WSD" and not args.lr_wsd_decay_iters:
        raise SystemExit("--lr-decay-style WSD needs --lr-wsd-decay-iters (the annealing tail)")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise SystemExit("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler "
                         "contradict each other: pass one")
    decay = args.lr_decay_iters or args.train_iters
    if args.lr_decay_style not in ("constant", "inverse-square-root") and \
            decay <= args.lr_warmup_iters:
        raise SystemExit(f"--lr-decay-iters {decay} must exceed --lr-warmup-iters "
                         f"{args.lr_warmup_iters}")
    if args.clip_grad < 0:
        raise SystemExit(f"--clip-grad {args.clip_grad}: the largest gradient norm must be "
                         "positive, or 0 to turn clipping off")


def _check_data(args, cfg) -> None:
    """``--data-path`` lists, byte files and the vocabulary, the tokenizer, ``--split``."""
    if args.data_path and len(args.data_path) > 1:
        from mfsdp.data.gpt_dataset import parse_data_path

        try:
            parse_data_path(args.data_path)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    if args.data_path and len(args.data_path) == 1 and half_pair(args.data_path[0]):
        raise SystemExit(f"--data-path {args.data_path[0]}: {half_pair(args.data_path[0])}")
    if args.data_path and len(args.data_path) == 1 and not is_indexed_prefix(args.data_path[0]) \
            and cfg.vocab_size < 256:
        raise SystemExit(f"--data-path reads bytes: --vocab-size must be at least 256, "
                         f"not {cfg.vocab_size}")
    if cfg.vocab_size < 2:
        raise SystemExit(f"--vocab-size {cfg.vocab_size}: a language model needs at least 2 "
                         "tokens")
    if args.tokenizer_model and not args.tokenizer_type:
        raise SystemExit(f"--tokenizer-model {args.tokenizer_model} needs --tokenizer-type "
                         "HuggingFaceTokenizer (as in Megatron-LM, the type says how to read it)")
    from mfsdp.data.gpt_dataset import parse_split

    try:
        parse_split(args.split)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def _check_experts_and_replicas(args, world: int, cfg) -> None:
    """Expert parallelism and HSDP replicas fit the ranks, the experts and the engine."""
    if world % args.num_distributed_optimizer_instances:
        raise SystemExit(f"--num-distributed-optimizer-instances "
                         f"{args.num_distributed_optimizer_instances} does not divide the "
                         f"{world} ranks")
    ep = args.expert_model_parallel_size
    if ep > 1 and cfg.num_experts == 0:
        raise SystemExit(f"--expert-model-parallel-size {ep} needs an MoE model (--num-experts > 0 "
                         "or --model-preset deepseek-proxy)")
    if not args.use_megatron_fsdp and (ep > 1 or args.num_distributed_optimizer_instances > 1):
        raise SystemExit("expert parallelism and --num-distributed-optimizer-instances need "
                         "--use-megatron-fsdp (the DDP path replicates everything)")
    if args.outer_dp_sharding_strategy == "optim" and args.num_distributed_optimizer_instances < 2:
        raise SystemExit("--outer-dp-sharding-strategy optim needs "
                         "--num-distributed-optimizer-instances of at least 2")
    if cfg.num_experts and cfg.num_experts % ep:
        raise SystemExit(f"--expert-model-parallel-size {ep} does not divide the "
                         f"{cfg.num_experts} experts (--num-experts); pick a divisor")
    if cfg.num_experts and cfg.moe_router_topk > cfg.num_experts:
        raise SystemExit(f"--moe-router-topk {cfg.moe_router_topk} exceeds the "
                         f"{cfg.num_experts} experts (--num-experts)")


def _check_checkpoints(args) -> None:
    """``--save``/``--load`` need the engine; ``--save-interval`` needs ``--save``."""
    if not args.save and args.save_interval:
        raise SystemExit("--save-interval needs --save DIR")
    if (args.save or args.load) and not args.use_megatron_fsdp:
        raise SystemExit("--save and --load need --use-megatron-fsdp (checkpoints are sharded "
                         "DTensors)")


def _check_paths(args) -> None:
    """Every path the run writes can be written, checked before the model is built."""
    if args.save:
        _check_save_dir(Path(args.save))
    check_wandb_args(args)
    dump = args.dump_param_to_param_group_map
    for flag, path, file in (("--log-jsonl", args.log_jsonl, True),
                             ("--tensorboard-dir", args.tensorboard_dir, False),
                             ("--wandb-save-dir", args.wandb_save_dir, False),
                             ("--data-cache-path", args.data_cache_path, False),
                             ("--dump-param-to-param-group-map", dump,
                              bool(dump) and dump.endswith(".json"))):
        if path:
            _check_writable(flag, Path(path), file)


def _check_writable(flag: str, path: Path, file: bool) -> None:
    """Fail at start, not after the model is built, when ``path`` cannot be written: a file
    (``file``) goes into an existing directory this process may write in; a directory may be
    created below the nearest one that exists."""
    if file:
        if path.is_dir():
            raise SystemExit(f"{flag} {path} is a directory; name a file in it")
        if path.exists() and not os.access(path, os.W_OK):
            raise SystemExit(f"{flag} {path}: the file is not writable by this process")
        parent = path.parent
        if not parent.is_dir():
            raise SystemExit(f"{flag} {path}: the directory {parent} does not exist; create it "
                             "or name a file in an existing directory")
    else:
        if path.exists() and not path.is_dir():
            raise SystemExit(f"{flag} {path} is a file; name a directory")
        parent = path
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            raise SystemExit(f"{flag} {path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise SystemExit(f"{flag} {path}: {parent} is not a directory this process may write "
                         "in; choose another path")


def _check_save_dir(save: Path) -> None:
    """Fail at start, not at the first save, when --save cannot be written: it must be a
    directory or not exist yet below a directory this process may write in."""
    if save.exists() and not save.is_dir():
        raise SystemExit(f"--save {save} is a file; name a directory (new or one --save wrote)")
    parent = save
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise SystemExit(f"--save {save}: {parent} is not a directory this process may write in; "
                         "choose another --save")
