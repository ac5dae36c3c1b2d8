"""Train the small GPT or MoE GPT with Megatron-LM's flags: ``mfsdp train`` / ``python -m mfsdp.train``.

Launch it with ``torchrun`` (one process per GPU, or as many CPU processes as you like)::

    torchrun --nproc-per-node 2 -m mfsdp.train --use-megatron-fsdp \\
        --data-parallel-sharding-strategy optim_grads_params --train-iters 20

The backend is chosen for you: NCCL when CUDA is available, gloo otherwise. Rank 0 prints one line
per ``--log-interval`` iterations and, with ``--log-jsonl PATH``, writes one JSON object per
iteration (``iteration``, ``loss``, ``grad_norm``, ``lr``, ``tokens_per_s``, ``elapsed_s``, ...).

The data of iteration ``i`` depends only on ``--seed`` and ``--global-batch-size``: every layout
(world size, strategy, outer size, EP size, dispatcher) trains on the same global batch, split
over the data-parallel ranks, and the loss is normalised by the global number of predicted tokens.
The same command under another layout therefore gives the same loss curve, up to floating-point
summation order.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["build_parser", "global_batch", "main", "run", "run_in_rank"]

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DATA_FILE = Path(__file__).parent / "data" / "fsdp_notes.txt"
GPU_ONLY = {
    "use_nccl_ub": "--use-nccl-ub registers NCCL user buffers for zero-copy collectives",
    "fsdp_manual_registration": "--fsdp-manual-registration registers FSDP buffers with NCCL "
                                "by hand",
}


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return n


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The trainer's argument parser (the flag reference of the guide is generated from it)."""
    from mfsdp.models.gpt import GPT_PRESETS
    from mfsdp.moe.dispatcher import DISPATCHERS, FLEX_BACKENDS

    if parser is None:
        parser = argparse.ArgumentParser(prog="mfsdp train", description=__doc__.splitlines()[0])
    m = parser.add_argument_group("model")
    m.add_argument("--model-preset", choices=sorted(GPT_PRESETS), default=None,
                   help="starting sizes; the flags below override them (default: the "
                        "configuration saved in the --load checkpoint, else gpt-tiny)")
    m.add_argument("--num-layers", type=_positive, help="transformer layers")
    m.add_argument("--hidden-size", type=_positive, help="model width")
    m.add_argument("--ffn-hidden-size", type=_positive, help="dense MLP width")
    m.add_argument("--num-attention-heads", type=_positive, help="attention heads")
    m.add_argument("--vocab-size", type=_positive, help="vocabulary (at least 256 with data files)")
    m.add_argument("--max-position-embeddings", type=_positive,
                   help="longest sequence (default: --seq-length)")
    m.add_argument("--swiglu", action="store_true", default=None, help="gated MLPs")
    m.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"))
    m.add_argument("--norm-epsilon", type=float, help="epsilon of the norms")
    m.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"))
    m.add_argument("--rotary-base", type=float, help="RoPE base (theta)")
    m.add_argument("--use-rope-scaling", action="store_true", default=None,
                   help="Llama-3 RoPE frequency scaling (factor: --rope-scaling-factor)")
    m.add_argument("--rope-scaling-factor", type=float, default=8.0,
                   help="with --use-rope-scaling (default: %(default)s)")
    m.add_argument("--rotary-interleaved", action="store_true", default=None,
                   help="rotate interleaved channel pairs (DeepSeek)")
    m.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention with --num-query-groups key/value heads")
    m.add_argument("--num-query-groups", type=_positive, help="key/value heads (with the above)")
    m.add_argument("--kv-channels", type=_positive, help="width of one attention head")
    m.add_argument("--disable-bias-linear", action="store_true", help="no biases in linear layers")
    m.add_argument("--add-qkv-bias", action="store_true", default=None,
                   help="biases on query, key and value only (Qwen2)")
    m.add_argument("--qk-layernorm", action="store_true", default=None,
                   help="RMSNorm on each query and key head (Qwen3)")
    m.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="a separate output layer (the presets' default; see the migrating page)")
    m.add_argument("--multi-latent-attention", action="store_true", default=None,
                   help="DeepSeek's multi-head latent attention (the five sizes below)")
    m.add_argument("--q-lora-rank", type=_positive)
    m.add_argument("--kv-lora-rank", type=_positive)
    m.add_argument("--qk-head-dim", type=_positive, help="MLA: plain query/key channels per head")
    m.add_argument("--qk-pos-emb-head-dim", type=_positive,
                   help="MLA: rotary query/key channels per head")
    m.add_argument("--v-head-dim", type=_positive, help="MLA: value channels per head")
    m.add_argument("--init-method-std", type=float,
                   help="initialise weights from N(0, std) (the Llama and DeepSeek presets: 0.02)")
    m.add_argument("--recompute-granularity", choices=("full", "selective"),
                   help="activation recomputation: whole layers (full) or the core attention "
                        "(selective)")
    m.add_argument("--recompute-method", choices=("uniform", "block"),
                   help="with full: recompute chunks of --recompute-num-layers layers (uniform) "
                        "or the first --recompute-num-layers layers (block)")
    m.add_argument("--recompute-num-layers", type=_positive,
                   help="with full: layers per chunk (uniform) or layers recomputed (block)")
    e = parser.add_argument_group("mixture of experts")
    e.add_argument("--num-experts", type=int, help="routed experts per MoE layer (0: dense)")
    e.add_argument("--moe-router-topk", type=_positive, help="experts per token")
    e.add_argument("--moe-first-dense-layers", type=int,
                   help="leading layers that stay dense (DeepSeek-V3: 3)")
    e.add_argument("--moe-ffn-hidden-size", type=_positive, help="each expert's width")
    e.add_argument("--moe-shared-expert-intermediate-size", type=int,
                   help="width of the shared expert (0: none)")
    e.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"))
    e.add_argument("--moe-router-pre-softmax", action="store_true", default=None,
                   help="softmax over all experts, not renormalised over the chosen ones")
    e.add_argument("--moe-router-topk-scaling-factor", type=float,
                   help="multiply the routing weights (DeepSeek-V3: 2.5)")
    e.add_argument("--moe-shared-expert-gate", action="store_true", default=None,
                   help="sigmoid gate on the shared expert (Qwen2-MoE)")
    e.add_argument("--moe-router-num-groups", type=_positive, help="expert groups (group-limited)")
    e.add_argument("--moe-router-group-topk", type=_positive, help="groups each token may use")
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
    p = parser.add_argument_group("parallelism and sharding")
    p.add_argument("--use-megatron-fsdp", action="store_true",
                   help="shard with mfsdp (without it: PyTorch DDP, dense models only)")
    p.add_argument("--data-parallel-sharding-strategy", choices=STRATEGIES,
                   default="optim_grads_params", help="ZeRO level (default: %(default)s)")
    p.add_argument("--outer-dp-sharding-strategy", choices=("no_shard", "optim"),
                   default="no_shard", help="across the outer groups (default: %(default)s)")
    p.add_argument("--num-distributed-optimizer-instances", type=_positive, default=1,
                   help="outer (HSDP) size: model replicas, each sharded over world/N ranks")
    p.add_argument("--expert-model-parallel-size", type=_positive, default=1,
                   help="EP size: ranks that split the experts of each MoE layer")
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
    p.add_argument("--use-nccl-ub", action="store_true", help="GPU only: NCCL user buffers")
    p.add_argument("--fsdp-manual-registration", action="store_true",
                   help="GPU only: register FSDP buffers with NCCL by hand")
    x = parser.add_argument_group("precision")
    x.add_argument("--bf16", action="store_true", help="bf16 weights and compute, fp32 main weights")
    x.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="reduce gradients in bf16 (shorthand for --megatron-fsdp-grad-comm-dtype bf16)")
    for what in ("main-params", "main-grads", "grad-comm"):
        x.add_argument(f"--megatron-fsdp-{what}-dtype", choices=sorted(DTYPES),
                       help=f"dtype of the {what.replace('-', ' ')}")
    t = parser.add_argument_group("training")
    t.add_argument("--micro-batch-size", type=_positive, default=2,
                   help="sequences per micro-batch per rank (default: %(default)s)")
    t.add_argument("--global-batch-size", type=_positive, default=8,
                   help="sequences per iteration over all ranks (default: %(default)s)")
    t.add_argument("--seq-length", type=_positive, default=64,
                   help="tokens per sequence (the longest one with packing; default: %(default)s)")
    t.add_argument("--train-iters", type=_positive, default=20, help="iterations to reach")
    t.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    t.add_argument("--min-lr", type=float, default=0.0, help="the learning rate decay ends at")
    t.add_argument("--lr-warmup-iters", type=int, default=0, help="linear warm-up iterations")
    t.add_argument("--lr-decay-style", default="linear",
                   choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"),
                   help="as Megatron-LM's scheduler (default: %(default)s)")
    t.add_argument("--lr-decay-iters", type=_positive,
                   help="iterations of decay (default: --train-iters)")
    t.add_argument("--lr-warmup-init", type=float, default=0.0,
                   help="learning rate of the first warm-up step (default: %(default)s)")
    t.add_argument("--lr-wsd-decay-iters", type=_positive,
                   help="WSD: the last N decay iterations anneal")
    t.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=("linear", "cosine", "exponential", "minus_sqrt"),
                   help="WSD: the shape of the anneal (default: %(default)s)")
    t.add_argument("--weight-decay", type=float, default=0.01,
                   help="AdamW decay (not on biases and norms)")
    t.add_argument("--optimizer", choices=("adam", "sgd"), default="adam",
                   help="adam: AdamW (decoupled weight decay, as Megatron-LM's adam); sgd: SGD "
                   "with --sgd-momentum (default: %(default)s)")
    t.add_argument("--sgd-momentum", type=float, default=0.9, help="(default: %(default)s)")
    t.add_argument("--adam-beta1", type=float, default=0.9)
    t.add_argument("--adam-beta2", type=float, default=0.999)
    t.add_argument("--clip-grad", type=float, default=1.0, help="gradient-norm clip (0: off)")
    t.add_argument("--seed", type=int, default=1234, help="model init and data order")
    t.add_argument("--mock-data", action="store_true",
                   help="synthetic sequences (the default when no --data-path is given)")
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
    t.add_argument("--make-vocab-size-divisible-by", type=_positive, default=128,
                   help="pad the tokenizer's vocabulary to a multiple (default: %(default)s)")
    t.add_argument("--train-samples", type=_positive,
                   help="samples to train on (sets --train-iters = samples / global batch)")
    t.add_argument("--eval-interval", type=_positive, default=1000,
                   help="validation every N iterations and at the end (default: %(default)s)")
    t.add_argument("--eval-iters", type=int, default=100,
                   help="global batches per validation (0: none; default: %(default)s)")
    t.add_argument("--sequence-packing", action="store_true",
                   help="variable-length sequences packed per micro-batch (THD); with indexed "
                   "datasets, each sample is cut into its documents at EOD tokens")
    c = parser.add_argument_group("checkpoints")
    c.add_argument("--save", help="checkpoint directory to write")
    c.add_argument("--load", help="checkpoint directory to resume from (latest)")
    c.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM (Slurm's --signal before the time limit): save and exit 0")
    c.add_argument("--exit-duration-in-mins", type=float,
                   help="save and exit once the run has lasted this many minutes")
    c.add_argument("--exit-interval", type=_positive,
                   help="stop (after saving, with --save) when the iteration is a multiple of N")
    c.add_argument("--save-interval", type=_positive, help="save every N iterations (and at the end)")
    c.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   action="store_true", dest="override_opt_param_scheduler",
                   help="--load: use this command's learning-rate schedule, not the checkpoint's")
    c.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   action="store_true", dest="use_checkpoint_opt_param_scheduler",
                   help="--load: continue the checkpoint's learning-rate schedule (--lr, --min-lr, "
                   "warm-up, decay iterations and style)")
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
    o = parser.add_argument_group("logging")
    o.add_argument("--log-interval", type=_positive, default=100,
                   help="print every N iterations and the last (default: %(default)s)")
    o.add_argument("--log-jsonl", metavar="PATH", help="one JSON object per iteration (rank 0)")
    o.add_argument("--tensorboard-dir", metavar="DIR",
                   help="TensorBoard event files (needs the tensorboard package)")
    o.add_argument("--log-throughput", action="store_true",
                   help="add TFLOP/s per rank (model FLOPs estimate) and peak memory to the log")
    return parser


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------
class MegatronData:
    """Train/valid/test samples of Megatron indexed datasets and the tokenizer's EOD id."""

    def __init__(self, splits, eod: int | None):
        self.train, self.valid, self.test = splits
        self.eod = eod

    def sample(self, split, i: int) -> torch.Tensor:
        """Sample ``i`` (``seq_length + 1`` tokens) of ``split``."""
        return torch.from_numpy(split[i][1])


def _tokenizer(args):
    if not args.tokenizer_type:
        return None
    from mfsdp.data.tokenizers import build_tokenizer

    try:
        return build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"mfsdp train: {e}") from None


def _read_data(args) -> "torch.Tensor | MegatronData | None":
    """None (mock data), a byte tensor (one text file), or :class:`MegatronData`."""
    from mfsdp.data.indexed import MAGIC, is_indexed_prefix

    paths = args.data_path
    if not paths:
        return None
    if len(paths) == 1 and not is_indexed_prefix(paths[0]):
        path = paths[0]
        if path.endswith((".bin", ".idx")) and is_indexed_prefix(path[:-4]):
            raise SystemExit(f"--data-path {path}: a Megatron dataset is named by its prefix; "
                             f"pass --data-path {path[:-4]}")
        file = DATA_FILE if path == "bundled" else Path(path)
        if not file.is_file():
            raise SystemExit(f"--data-path {path}: neither {path}.bin/.idx (a Megatron indexed "
                             "dataset) nor a text file exists")
        raw = file.read_bytes()
        if raw.startswith(MAGIC):
            raise SystemExit(f"--data-path {path} is a Megatron index without its .bin; pass the "
                             "prefix of a complete .bin/.idx pair")
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    from mfsdp.data.gpt_dataset import build_gpt_datasets

    gbs = args.global_batch_size
    sizes = [args.train_iters * gbs,
             (args.train_iters // args.eval_interval + 1) * args.eval_iters * gbs,
             args.eval_iters * gbs]
    try:
        splits = build_gpt_datasets(paths, args.split, sizes, args.seq_length, args.seed,
                                    args.data_cache_path)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"mfsdp train: {e}") from None
    if splits[0] is None:
        raise SystemExit(f"--split {args.split} leaves no training documents")
    tok = _tokenizer(args)
    if args.sequence_packing and tok is None:
        raise SystemExit("--sequence-packing with indexed datasets cuts samples at EOD tokens: "
                         "name the tokenizer (--tokenizer-type) so its EOD id is known")
    return MegatronData(splits, tok.eod if tok is not None else None)


def _documents(sample: torch.Tensor, eod: int) -> list[torch.Tensor]:
    """Cut a sample after each EOD token into its documents (pieces of one token are dropped:
    they predict nothing)."""
    ends = (sample == eod).nonzero().flatten() + 1
    pieces = torch.tensor_split(sample, ends.tolist())
    return [p for p in pieces if len(p) > 1]


def global_batch(args: argparse.Namespace, iteration: int, vocab_size: int,
                 data: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The ``--global-batch-size`` sequences of ``iteration`` (1-based): a function of the seed only.

    Mock sequences are arithmetic progressions modulo the vocabulary (learnable from two tokens of
    context); with ``--sequence-packing`` lengths vary between a quarter of and the full
    ``--seq-length``.
    """
    if isinstance(data, MegatronData):  # Megatron-LM's order: consumed samples = (iteration-1) x GBS
        base = (iteration - 1) * args.global_batch_size
        seqs = [data.sample(data.train, base + j) for j in range(args.global_batch_size)]
        high = max(int(t.max()) for t in seqs)
        if high >= vocab_size:
            raise SystemExit(f"--data-path holds token id {high}, beyond the model's vocabulary of "
                             f"{vocab_size}: pass --tokenizer-type/--tokenizer-model (or a larger "
                             "--vocab-size)")
        if args.sequence_packing:
            return [_documents(t, data.eod) for t in seqs]
        return seqs
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + iteration)
    vocab, S = vocab_size, args.seq_length
    seqs = []
    for _ in range(args.global_batch_size):
        n = int(torch.randint(max(2, S // 4), S + 1, (1,), generator=g)) if args.sequence_packing else S
        if data is None:
            start = int(torch.randint(vocab, (1,), generator=g))
            step = int(torch.randint(1, 8, (1,), generator=g))
            seqs.append((start + step * torch.arange(n)) % vocab)
        else:
            if len(data) <= n:
                raise SystemExit(f"--data-path holds {len(data)} bytes; --seq-length {n} needs more")
            off = int(torch.randint(len(data) - n, (1,), generator=g))
            seqs.append(data[off:off + n].clone())
    return seqs


# ---------------------------------------------------------------------------------------------
# setup
# ---------------------------------------------------------------------------------------------
def _saved_config(load: str | None) -> dict | None:
    """The ``model_config.json`` of the checkpoint ``--load`` resolves to, if it has one."""
    from mfsdp.checkpoint.dcp import MODEL_CONFIG_FILE
    from mfsdp.checkpoint.manifest import CheckpointError, resolve_checkpoint

    if not load:
        return None
    try:
        path = resolve_checkpoint(load)
    except CheckpointError:
        return None  # reported by _load
    f = path / MODEL_CONFIG_FILE
    return json.loads(f.read_text()) if f.exists() else None


def _config(args):
    from mfsdp.models.gpt import GPT_PRESETS, GPTConfig, with_overrides

    saved = _saved_config(getattr(args, "load", None))
    if args.model_preset:
        base = GPT_PRESETS[args.model_preset]
    elif saved is not None:
        base = GPTConfig.from_dict(saved)
    else:
        base = GPT_PRESETS["gpt-tiny"]
    try:
        cfg = _overridden(base, args, args.max_position_embeddings)
        if args.max_position_embeddings is None and cfg.position_embedding_type == "learned_absolute":
            # indexed-dataset samples hold seq_length + 1 tokens (inputs and the last label)
            indexed = bool(args.data_path) and any(_is_indexed(p) for p in args.data_path)
            cfg = with_overrides(cfg, max_position_embeddings=max(args.seq_length, 1) + indexed)
        tok = _tokenizer(args)
        if tok is not None:
            multiple = args.make_vocab_size_divisible_by
            cfg = with_overrides(cfg, vocab_size=-(-tok.vocab_size // multiple) * multiple)
        return cfg
    except ValueError as e:  # an inconsistent combination of model flags
        raise SystemExit(f"mfsdp train: {e}") from None


def _overridden(base, args, max_pos):
    from mfsdp.models.gpt import with_overrides

    cfg = with_overrides(
        base, num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
        vocab_size=args.vocab_size, swiglu=args.swiglu, num_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk, moe_first_dense_layers=args.moe_first_dense_layers,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_router_score_function=args.moe_router_score_function,
        moe_router_num_groups=args.moe_router_num_groups,
        moe_router_group_topk=args.moe_router_group_topk,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff, moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        moe_token_drop_policy=args.moe_token_drop_policy,
        moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_flex_dispatcher_backend=args.moe_flex_dispatcher_backend,
        moe_grouped_gemm=args.moe_grouped_gemm, max_position_embeddings=max_pos,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers,
        normalization=args.normalization, norm_epsilon=args.norm_epsilon,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        rope_scaling_factor=args.rope_scaling_factor if args.use_rope_scaling else None,
        rotary_interleaved=args.rotary_interleaved, kv_channels=args.kv_channels,
        add_bias_linear=False if args.disable_bias_linear else None,
        add_qkv_bias=args.add_qkv_bias, qk_layernorm=args.qk_layernorm,
        share_embeddings_and_output_weights=(False if args.untie_embeddings_and_output_weights
                                             else None),
        multi_latent_attention=args.multi_latent_attention, q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_head_dim,
        qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim,
        init_method_std=args.init_method_std, moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        moe_shared_expert_gate=args.moe_shared_expert_gate)
    if args.group_query_attention != bool(args.num_query_groups):
        raise ValueError("--group-query-attention and --num-query-groups go together (as in "
                         "Megatron-LM): pass both, or neither for multi-head attention")
    if args.num_query_groups:
        cfg = with_overrides(cfg, num_query_groups=args.num_query_groups)
    return cfg


def _family(args, cfg) -> str:
    """What the log calls the model: its preset, or its Hugging Face family."""
    from mfsdp.models.hf import UnsupportedModel, hf_model_type

    if args.model_preset:
        return args.model_preset
    try:
        return hf_model_type(cfg)
    except UnsupportedModel:
        return "gpt"


def _is_indexed(path: str) -> bool:
    from mfsdp.data.indexed import is_indexed_prefix

    return is_indexed_prefix(path)


def _check(args, world: int, cfg) -> int:
    """Validate the combination of flags; return the micro-batches per iteration per rank."""
    per = args.micro_batch_size * world
    if args.global_batch_size % per:
        raise SystemExit(f"--global-batch-size {args.global_batch_size} is not divisible by "
                         f"--micro-batch-size x data-parallel size = {args.micro_batch_size} x "
                         f"{world}; pick a multiple of {per}")
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
    if args.data_path and len(args.data_path) == 1 and not _is_indexed(args.data_path[0]) \
            and cfg.vocab_size < 256:
        raise SystemExit(f"--data-path reads bytes: --vocab-size must be at least 256, "
                         f"not {cfg.vocab_size}")
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
    if not args.save and args.save_interval:
        raise SystemExit("--save-interval needs --save DIR")
    if (args.save or args.load) and not args.use_megatron_fsdp:
        raise SystemExit("--save and --load need --use-megatron-fsdp (checkpoints are sharded "
                         "DTensors)")
    return args.global_batch_size // per


def _policy(args):
    from mfsdp import MixedPrecisionPolicy

    main = DTYPES[args.megatron_fsdp_main_params_dtype] if args.megatron_fsdp_main_params_dtype \
        else (torch.float32 if args.bf16 else None)
    grads = DTYPES[args.megatron_fsdp_main_grads_dtype] if args.megatron_fsdp_main_grads_dtype \
        else (torch.float32 if args.bf16 else None)
    comm = DTYPES[args.megatron_fsdp_grad_comm_dtype] if args.megatron_fsdp_grad_comm_dtype \
        else (torch.bfloat16 if args.grad_reduce_in_bf16 else None)
    return MixedPrecisionPolicy(main_params_dtype=main, main_grads_dtype=grads, grad_comm_dtype=comm)


def _param_groups(model, args) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.dim() < 2 or name.endswith(".bias") else decay).append(p)
    return [{"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def _optimizer(groups: list[dict], args) -> torch.optim.Optimizer:
    if args.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=args.lr, momentum=args.sgd_momentum)
    return torch.optim.AdamW(groups, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2))


def learning_rate(args, iteration: int) -> float:
    """The learning rate iteration ``iteration`` (1-based) trains with, as Megatron-LM's
    ``OptimizerParamScheduler`` gives it: the rate after ``iteration - 1`` steps (so with warm-up
    the first step uses ``--lr-warmup-init``), linear warm-up over ``--lr-warmup-iters``, then
    ``--lr-decay-style`` down to ``--min-lr`` at ``--lr-decay-iters`` (default ``--train-iters``),
    ``--min-lr`` after it.

    >>> from types import SimpleNamespace as NS
    >>> a = NS(lr=1e-3, min_lr=0.0, lr_warmup_iters=2, lr_warmup_init=0.0, lr_decay_iters=None,
    ...        train_iters=6, lr_decay_style="linear", lr_wsd_decay_iters=None,
    ...        lr_wsd_decay_style="exponential")
    >>> [round(learning_rate(a, i), 6) for i in range(1, 8)]
    [0.0, 0.0005, 0.001, 0.00075, 0.0005, 0.00025, 0.0]
    """
    steps, warmup = iteration - 1, args.lr_warmup_iters
    decay = args.lr_decay_iters or args.train_iters
    max_lr, min_lr = args.lr, args.min_lr
    if warmup > 0 and steps <= warmup:
        return args.lr_warmup_init + (max_lr - args.lr_warmup_init) * steps / warmup
    if args.lr_decay_style == "constant":
        return max_lr
    if steps > decay:
        return min_lr
    if args.lr_decay_style == "inverse-square-root":
        return max(min_lr, max_lr * max(warmup, 1) ** 0.5 / max(steps, 1) ** 0.5)
    ratio = (steps - warmup) / (decay - warmup)
    if args.lr_decay_style == "linear":
        coeff = 1.0 - ratio
    elif args.lr_decay_style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:  # WSD: constant, then the last --lr-wsd-decay-iters anneal
        wsd = args.lr_wsd_decay_iters
        start = decay - wsd
        if steps <= start:
            coeff = 1.0
        else:
            r = (steps - start) / wsd
            coeff = {"linear": 1.0 - r, "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
                     "exponential": 2.0 * 0.5 ** r - 1.0,
                     "minus_sqrt": 1.0 - math.sqrt(r)}[args.lr_wsd_decay_style]
    return min_lr + coeff * (max_lr - min_lr)


_lr = learning_rate


def _routers(model):
    from mfsdp.moe.router import TopKRouter

    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, TopKRouter) and m.expert_bias is not None]


def _rss_mib() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


# ---------------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------------
def _save(args, model, opt, iteration: int, routers, cfg) -> None:
    from mfsdp.checkpoint import save_checkpoint
    from mfsdp.checkpoint.dcp import MODEL_CONFIG_FILE
    from mfsdp.checkpoint.full import fsdp_to_full

    extra = {"expert_bias": {n: m.expert_bias.detach().cpu().clone() for n, m in routers},
             "data_position": iteration, "opt_param_scheduler": _scheduler_state(args, iteration)}
    files = {MODEL_CONFIG_FILE: json.dumps(cfg.to_dict(), indent=1)}
    root = Path(args.save)
    if args.ckpt_format == "fsdp_dtensor":
        save_checkpoint(root, model, opt, iteration=iteration, extra=extra, files=files)
        return
    staging = root / ".staging-fsdp_dtensor"
    written = save_checkpoint(staging, model, opt, iteration=iteration, extra=extra, files=files)
    error = [None]
    if dist.get_rank() == 0:  # rank 0 converts the sharded save into the asked format
        try:
            if args.ckpt_format == "torch_dist":
                _export_megatron_lm(args, written, root, iteration, cfg)
            else:
                final = root / written.name
                if final.exists():
                    shutil.rmtree(final)
                fsdp_to_full(written, final)
                (root / ".latest-tmp").write_text(written.name + "\n")
                os.replace(root / ".latest-tmp", root / "latest")
        except Exception as exc:  # noqa: BLE001 - every rank stops with the reason
            error[0] = f"{type(exc).__name__}: {exc}"
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    dist.broadcast_object_list(error, src=0)
    if error[0]:
        raise RuntimeError(f"--ckpt-format {args.ckpt_format}: writing iteration {iteration} to "
                           f"{root} failed: {error[0]}")


def _export_megatron_lm(args, written: Path, root: Path, iteration: int, cfg) -> None:
    """Megatron-LM's ``torch_dist`` into the save root, as Megatron-LM lays it out: the iteration
    directory moved in whole, then the tracker replaced (a crash in between leaves the previous
    iteration the one that loads)."""
    from mfsdp.checkpoint.detect import TRACKER
    from mfsdp.checkpoint.megatron_lm import fsdp_to_megatron_lm

    tmp_root = root / f".export-iter_{iteration:07d}"
    shutil.rmtree(tmp_root, ignore_errors=True)
    try:
        fsdp_to_megatron_lm(written, tmp_root, cfg.to_dict(), progress=False,
                            expert_model_parallel_size=args.expert_model_parallel_size)
        name = f"iter_{iteration:07d}"
        final = root / name
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp_root / name, final)
        (root / f".{TRACKER}.tmp").write_text(str(iteration))
        os.replace(root / f".{TRACKER}.tmp", root / TRACKER)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)


# Megatron-LM's OptimizerParamScheduler state keys and the names its messages use; steps are
# iterations here (Megatron-LM counts samples when it trains by --train-samples).
_SCHEDULER = (("max_lr", "lr", "learning rate"), ("min_lr", "min_lr", "minimum learning rate"),
              ("lr_warmup_steps", "lr_warmup_iters", "warmup iterations"),
              ("lr_decay_steps", "lr_decay_iters", "total number of iterations"),
              ("lr_decay_style", "lr_decay_style", "learning rate decay style"))


def _scheduler_state(args, iteration: int) -> dict:
    state = {key: getattr(args, attr) for key, attr, _ in _SCHEDULER}
    state["lr_decay_steps"] = args.lr_decay_iters or args.train_iters
    state["num_steps"] = iteration
    return state


def _restore_scheduler(args, saved: dict | None) -> None:
    """Megatron-LM's rule for the schedule of a resumed run: the command's values must equal the
    checkpoint's, unless ``--override-opt_param-scheduler`` (the command's win) or
    ``--use-checkpoint-opt_param-scheduler`` (the checkpoint's win)."""
    if not saved or args.override_opt_param_scheduler:
        return
    mine = _scheduler_state(args, 0)
    if args.use_checkpoint_opt_param_scheduler:
        for key, attr, _ in _SCHEDULER:
            setattr(args, attr, saved[key])
        return
    for key, attr, name in _SCHEDULER:
        if mine[key] != saved[key]:
            flag = "--" + attr.replace("_", "-")
            if key == "lr_decay_steps":
                flag = "--lr-decay-iters (default --train-iters)"
            raise SystemExit(
                f"--load: the {name} ({flag}) is {mine[key]} here and {saved[key]} in the "
                "checkpoint; pass the checkpoint's value, --use-checkpoint-opt_param-scheduler to "
                "continue its schedule, or --override-opt_param-scheduler to use this command's")


def _convert_on_rank0(tmp: Path, convert) -> None:
    """``convert(tmp)`` on rank 0 (a stale ``tmp`` removed first); every rank stops with the
    reason if it fails, none waits at a barrier for a rank that raised."""
    error = [None]
    if dist.get_rank() == 0:
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            convert(tmp)
        except Exception as exc:  # noqa: BLE001 - every rank stops with the reason
            shutil.rmtree(tmp, ignore_errors=True)
            error[0] = f"{type(exc).__name__}: {exc}"
    dist.broadcast_object_list(error, src=0)
    if error[0]:
        raise SystemExit(f"--load: {error[0]}")


def _load(args, model, opt, routers, cfg) -> int:
    from mfsdp.checkpoint import load_checkpoint, read_manifest
    from mfsdp.checkpoint.full import full_to_fsdp, is_full_format
    from mfsdp.checkpoint.manifest import resolve_checkpoint
    from mfsdp.checkpoint.detect import resolve_megatron_lm
    from mfsdp.checkpoint.megatron_lm import megatron_lm_to_fsdp

    from mfsdp.checkpoint.detect import describe_unreadable, is_megatron_fsdp

    root = Path(args.load)
    if is_megatron_fsdp(root):
        load_checkpoint(root, model, opt)
        if dist.get_rank() == 0:
            print(f"--load {root}: loaded an upstream Megatron-FSDP checkpoint (weights and "
                  "optimizer state); training starts at iteration 0", flush=True)
        return 0
    tmp = None
    if root.exists() and resolve_megatron_lm(root) is not None:
        # Megatron-LM's torch_dist or fsdp_dtensor: rank 0 converts it with this job's model config
        directory, _ = resolve_megatron_lm(root)
        tmp = root / f".from-megatron_lm-{directory.name}"
        _convert_on_rank0(tmp, lambda out: megatron_lm_to_fsdp(root, out, cfg.to_dict()))
        path = tmp
    else:
        unreadable = describe_unreadable(root)
        if unreadable:  # never a silent fresh start over a checkpoint we cannot read
            raise SystemExit(f"--load: {unreadable}")
        if not root.exists() or not ((root / "latest").exists()
                                     or (root / "manifest.json").exists()):
            if dist.get_rank() == 0:
                print(f"--load {root}: no checkpoint there yet, starting from iteration 0",
                      flush=True)
            return 0
        path = resolve_checkpoint(root)
    if tmp is None and is_full_format(read_manifest(path)):
        tmp = root / f".from-mfsdp_full-{path.name}"
        _convert_on_rank0(tmp, lambda out: full_to_fsdp(path, out))
        path = tmp
    extra = load_checkpoint(path, model, opt)
    if int(extra["iteration"]) == 0 and dist.get_rank() == 0:
        print(f"--load {root}: loaded the weights of {path} (iteration 0, e.g. imported from "
              "Hugging Face); training starts from them", flush=True)
    dist.barrier()
    if tmp is not None and dist.get_rank() == 0:
        shutil.rmtree(tmp)
    with torch.no_grad():
        for name, m in routers:
            if name in extra.get("expert_bias", {}):
                m.expert_bias.copy_(extra["expert_bias"][name])
    _restore_scheduler(args, extra.get("opt_param_scheduler"))
    return int(extra["iteration"])


# ---------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> list[dict]:
    """Train with parsed ``args`` in an initialised process group; return rank 0's log records."""
    from mfsdp import ParallelLayout, fully_shard
    from mfsdp.models.gpt import GPT, TransformerLayer, gpt_loss, pack_sequences
    from mfsdp.moe import collect_aux_losses, shard_experts

    rank, world = dist.get_rank(), dist.get_world_size()
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    is_cpu = device.type == "cpu"
    cfg = _config(args)
    num_micro = _check(args, world, cfg)
    log = print if rank == 0 else (lambda *a, **k: None)
    for flag, what in GPU_ONLY.items():
        if getattr(args, flag):
            log(f"note: {what}. " + ("This run is on CPU (gloo), so it is accepted and ignored."
                                     if is_cpu else "mfsdp does not register NCCL buffers yet; "
                                     "the flag is accepted and has no effect."), flush=True)
    data = _read_data(args)
    dtype = torch.bfloat16 if args.bf16 else torch.float32

    torch.manual_seed(args.seed)  # every rank builds the same model
    meta = args.init_model_with_meta_device and args.use_megatron_fsdp
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = GPT(cfg)
    model = model.to(dtype=dtype) if meta else model.to(device=device, dtype=dtype)
    groups = None
    ep = args.expert_model_parallel_size
    if args.use_megatron_fsdp:
        if ep > 1 or args.num_distributed_optimizer_instances > 1 or args.create_all_gather_group:
            layout = ParallelLayout(world, args.num_distributed_optimizer_instances, ep,
                                    cfg.num_experts or None)
            groups = layout.create_groups(all_gather_groups=args.create_all_gather_group)
        global_names = shard_experts(model, groups["ep"] if groups else None)
        opt = _optimizer(_param_groups(model, args), args)
        model, opt = fully_shard(
            model, opt, fsdp_unit_modules=[TransformerLayer],
            zero_dp_strategy=args.data_parallel_sharding_strategy,
            outer_dp_sharding_strategy=args.outer_dp_sharding_strategy, process_groups=groups,
            device=device, init_model_with_meta_device=meta, mixed_precision_policy=_policy(args),
            overlap_grad_reduce=args.overlap_grad_reduce,
            overlap_param_gather=args.overlap_param_gather,
            calculate_per_token_loss=args.calculate_per_token_loss,
            fsdp_double_buffer=args.fsdp_double_buffer)
        if global_names:
            model.set_global_names(global_names)
        inner = model.module
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        inner = model
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        opt = _optimizer(_param_groups(inner, args), args)
    routers = _routers(inner)
    if args.dump_param_to_param_group_map:
        from mfsdp.checkpoint.state import dump_param_to_param_group_map

        if not args.use_megatron_fsdp:
            raise SystemExit("--dump-param-to-param-group-map needs --use-megatron-fsdp")
        dump_param_to_param_group_map(model, opt, args.dump_param_to_param_group_map)
        log(f"wrote the parameter-to-group map to {args.dump_param_to_param_group_map}", flush=True)
    start = _load(args, model, opt, routers, cfg) if args.load else 0
    if start:
        log(f"resumed from iteration {start} of {args.load}", flush=True)
    numel = sum(p.numel() for p in inner.parameters())
    layout_name = (f"{args.data_parallel_sharding_strategy}" if args.use_megatron_fsdp else "ddp")
    log(f"mfsdp train: {world} ranks ({dist.get_backend()}), {layout_name}, outer "
        f"{args.num_distributed_optimizer_instances}, EP {ep}, model {_family(args, cfg)} "
        f"({cfg.num_layers} layers, hidden {cfg.hidden_size}, experts {cfg.num_experts}), "
        f"{num_micro} micro-batches of {args.micro_batch_size} per rank", flush=True)

    jsonl = open(args.log_jsonl, "a" if start else "w") if (args.log_jsonl and rank == 0) else None
    board = _tensorboard(args.tensorboard_dir) if rank == 0 else None
    flops_per_token = _flops_per_token(cfg, args.seq_length) if args.log_throughput else None
    stop = _StopRequest(args.exit_signal_handler)
    records: list[dict] = []
    t_start = time.perf_counter()
    per_rank = args.global_batch_size // world
    try:
        for iteration in range(start + 1, args.train_iters + 1):
            t0 = time.perf_counter()
            seqs = global_batch(args, iteration, cfg.vocab_size, data)
            # with packing of indexed samples, each sample is a list of its documents
            pieces = [t for s in seqs for t in (s if isinstance(s, list) else [s])]
            global_tokens = sum(len(t) - 1 for t in pieces)  # predicted tokens, all ranks
            mine = seqs[rank * per_rank:(rank + 1) * per_rank]
            lr = _lr(args, iteration)
            for g in opt.param_groups:
                g["lr"] = lr
            opt.zero_grad()
            # The engine averages gradients over ranks unless per-token loss asks it to sum.
            scale = (1.0 if args.calculate_per_token_loss else world) / global_tokens
            aux_scale = (1.0 / world if args.calculate_per_token_loss else 1.0) / num_micro
            loss_sum = torch.zeros((), dtype=torch.float64, device=device)
            for i in range(num_micro):
                chunk = mine[i * args.micro_batch_size:(i + 1) * args.micro_batch_size]
                chunk = [t for s in chunk for t in (s if isinstance(s, list) else [s])]
                tokens, cu = pack_sequences(chunk)
                tokens, cu = tokens.to(device), cu.to(device)
                last = i == num_micro - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    logits = model(tokens, cu)
                    loss, _ = gpt_loss(logits, tokens, cu)
                    total = loss * scale + collect_aux_losses(inner).to(loss.device) * aux_scale
                    total.backward()
                loss_sum += loss.detach().double()
            if args.use_megatron_fsdp:
                grad_norm = (opt.clip_grad_norm_(args.clip_grad) if args.clip_grad > 0
                             else opt.grad_norm())
            else:
                grad_norm = torch.nn.utils.clip_grad_norm_(
                    inner.parameters(), args.clip_grad if args.clip_grad > 0 else float("inf"))
            opt.step()
            for _, router in routers:  # balance from the global token counts: layout-invariant
                load = router.load.to(device)
                dist.all_reduce(load)
                router.update_expert_bias(load, args.moe_router_bias_update_rate)
            dist.all_reduce(loss_sum)
            now = time.perf_counter()
            rec = {"iteration": iteration, "loss": loss_sum.item() / global_tokens,
                   "grad_norm": float(grad_norm), "lr": lr,
                   "tokens_per_s": (global_tokens + len(pieces)) / (now - t0),
                   "elapsed_s": now - t_start, "tokens": global_tokens + len(pieces),
                   "rss_mib": _rss_mib()}
            if args.use_megatron_fsdp:
                rec["state_mib"] = (sum(model.memory_by_kind().values())
                                    + opt.local_state_bytes()) / 2**20
            if flops_per_token is not None:
                rec["tflops_per_rank"] = flops_per_token * rec["tokens_per_s"] / world / 1e12
                if device.type == "cuda":
                    rec["max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
            records.append(rec)
            if jsonl:
                jsonl.write(json.dumps(rec) + "\n")
                jsonl.flush()
            if board is not None:
                for tag, key in (("lm loss", "loss"), ("learning-rate", "lr"),
                                 ("grad-norm", "grad_norm"), ("throughput/tokens-per-s",
                                                              "tokens_per_s"),
                                 ("throughput/tflops-per-rank", "tflops_per_rank")):
                    if key in rec:
                        board.add_scalar(tag, rec[key], iteration)
            if iteration % args.log_interval == 0 or iteration == args.train_iters:
                extra = ""
                if "tflops_per_rank" in rec:
                    extra = f" | TFLOP/s per rank {rec['tflops_per_rank']:.3g}"
                    if "max_allocated_mib" in rec:
                        extra += f" | max allocated {rec['max_allocated_mib']:.0f} MiB"
                log(f"iteration {iteration:>5}/{args.train_iters} | loss {rec['loss']:.4f} | "
                    f"grad norm {rec['grad_norm']:.3f} | lr {lr:.2e} | tokens/s "
                    f"{rec['tokens_per_s']:,.0f} | rss {rec['rss_mib']:.0f} MiB{extra}", flush=True)
            if (isinstance(data, MegatronData) and data.valid is not None and args.eval_iters > 0
                    and (iteration % args.eval_interval == 0 or iteration == args.train_iters)):
                valid_loss = _evaluate(args, model, data, routers, device, iteration)
                rec.update(valid_loss=valid_loss, valid_ppl=math.exp(min(valid_loss, 700.0)))
                if jsonl:
                    jsonl.write(json.dumps({"iteration": iteration, "valid_loss": valid_loss,
                                            "valid_ppl": rec["valid_ppl"]}) + "\n")
                    jsonl.flush()
                log(f"validation after iteration {iteration} | loss {valid_loss:.4f} | "
                    f"perplexity {rec['valid_ppl']:.2f}", flush=True)
                if board is not None:
                    board.add_scalar("lm loss validation", valid_loss, iteration)
                    board.add_scalar("lm loss validation ppl", rec["valid_ppl"], iteration)
            leaving = bool(args.exit_interval) and iteration % args.exit_interval == 0
            why = stop.reason(args, t_start, device)  # every rank agrees (one all-reduce)
            if why and iteration < args.train_iters:
                leaving = True
                if not args.save:
                    log(f"warning: {why} but no --save: nothing is kept", flush=True)
                log(f"{why}: stopping after iteration {iteration}", flush=True)
            if args.save and args.use_megatron_fsdp and (
                    (args.save_interval and iteration % args.save_interval == 0)
                    or iteration == args.train_iters or leaving):
                _save(args, model, opt, iteration, routers, cfg)
                log(f"saved iteration {iteration} to {args.save} ({args.ckpt_format})", flush=True)
            if leaving:
                log(f"exiting after iteration {iteration}", flush=True)
                break
    finally:
        stop.restore()
        if jsonl:
            jsonl.close()
        if board is not None:
            board.close()
    return records


class _StopRequest:
    """SIGTERM (with ``--exit-signal-handler``) and ``--exit-duration-in-mins``, agreed by all ranks.

    The handler only records the signal; the loop checks it after each iteration, so the
    checkpoint is written between steps, by every rank, and the process exits with status 0.
    """

    def __init__(self, handle_signal: bool):
        import signal

        self.received = None
        self._previous = None
        if handle_signal:
            self._previous = signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum, frame) -> None:
        self.received = signum

    def reason(self, args, t_start: float, device) -> str | None:
        """Why to stop now ('' to go on), the same on every rank."""
        if not (args.exit_signal_handler or args.exit_duration_in_mins):
            return ""
        minutes = (time.perf_counter() - t_start) / 60
        flags = torch.tensor([float(self.received is not None),
                              float(bool(args.exit_duration_in_mins)
                                    and minutes >= args.exit_duration_in_mins)], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0] > 0:
            return "SIGTERM received (--exit-signal-handler)"
        if flags[1] > 0:
            return f"--exit-duration-in-mins {args.exit_duration_in_mins} reached"
        return ""

    def restore(self) -> None:
        """Put the previous SIGTERM handler back."""
        if self._previous is not None:
            import signal

            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def _tensorboard(directory: str | None):
    if not directory:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise SystemExit("--tensorboard-dir needs the tensorboard package "
                         "(pip install tensorboard)") from None
    return SummaryWriter(log_dir=directory)


def _flops_per_token(cfg, seq_length: int) -> float:
    """Training FLOPs per token: ``6 x`` the parameters a token passes through (the embedding
    lookups excluded, routed experts counted ``topk / num_experts``) plus causal attention's
    ``6 x layers x seq x hidden``."""
    from mfsdp.models.gpt import GPT

    with torch.device("meta"):
        model = GPT(cfg)
    n = 0.0
    for name, p in model.named_parameters():
        if name == "position_embedding.weight" or (
                name == "embedding.weight" and not cfg.share_embeddings_and_output_weights):
            continue  # lookups, not matrix products
        routed = ".experts." in name and "shared_expert" not in name
        n += p.numel() * (cfg.moe_router_topk / cfg.num_experts if routed and cfg.num_experts
                          else 1.0)
    return 6 * n + 6 * cfg.num_layers * seq_length * cfg.hidden_size


@torch.no_grad()
def _evaluate(args, model, data: MegatronData, routers, device, iteration: int) -> float:
    """Mean next-token loss over ``--eval-iters`` global batches of the validation split.

    The validation after iteration ``i`` reads run ``i // eval_interval`` of ``eval_iters x
    global batch`` validation samples (wrapping around); the routers' token counts are left as training made them.
    """
    from mfsdp.models.gpt import gpt_loss, pack_sequences

    rank, world = dist.get_rank(), dist.get_world_size()
    k = iteration // args.eval_interval
    n = args.eval_iters * args.global_batch_size
    per_rank = args.global_batch_size // world
    loads = [router.load.clone() for _, router in routers]
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for b in range(args.eval_iters):
        base = k * n + b * args.global_batch_size
        mine = [data.sample(data.valid, (base + j) % len(data.valid))
                for j in range(rank * per_rank, (rank + 1) * per_rank)]
        for i in range(0, per_rank, args.micro_batch_size):
            tokens, cu = pack_sequences(mine[i:i + args.micro_batch_size])
            tokens, cu = tokens.to(device), cu.to(device)
            loss, count = gpt_loss(model(tokens, cu), tokens, cu)
            sums += torch.stack([loss.detach().double(),
                                 torch.tensor(float(count), dtype=torch.float64, device=device)])
    for (_, router), load in zip(routers, loads):
        router.load = load
    dist.all_reduce(sums)
    return (sums[0] / sums[1]).item()


def run_in_rank(argv: list[str]) -> list[dict]:
    """Parse ``argv`` and :func:`run` it in a rank of :func:`mfsdp.launch.launch` (tests, recipes)."""
    return run(build_parser().parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    """Entry point under ``torchrun``: initialise the process group, train, clean up."""
    args = build_parser().parse_args(argv)
    return _main(args)


def _main(args: argparse.Namespace) -> int:
    started = False
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python -m mfsdp.train`: a world of one
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get(
                                  "MASTER_PORT", "29511"))
        from mfsdp.launch import init_from_env

        init_from_env()  # NCCL on GPUs, gloo otherwise; survives torchrun restarts
        started = True
    from mfsdp.launch import shutdown

    ok = False
    try:
        run(args)
        ok = True
    finally:
        if started and ok:
            # This process owns the group: barrier, destroy, and leave without the interpreter's
            # teardown, in which gloo's threads can abort a finished run (see shutdown()).
            shutdown(exit_code=0)
        elif started:  # an error: no barrier (a peer may never come); the error propagates
            shutdown(barrier=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
