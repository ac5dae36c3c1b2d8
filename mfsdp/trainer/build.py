"""What a training run is built from: the model configuration (preset, checkpoint, flags), the
mixed-precision policy, the optimizer and its parameter groups, the learning-rate schedule, and
the figures the logs report (FLOPs per token, resident memory)."""

from __future__ import annotations

from dataclasses import fields
import math

import torch

from mfsdp.data.batches import is_indexed_prefix, tokenizer_of
from mfsdp.models.config import GPTConfig

from mfsdp.trainer.arguments import DTYPES


def saved_config(load: str | None) -> dict | None:
    """The ``model_config.json`` of the checkpoint ``--load`` resolves to, if it has one."""
    from mfsdp.checkpoint.dcp import MODEL_CONFIG_FILE
    from mfsdp.checkpoint.manifest import CheckpointError, read_json, resolve_checkpoint

    if not load:
        return None
    try:
        path = resolve_checkpoint(load)
    except CheckpointError:
        return None  # reported by load_for_training
    f = path / MODEL_CONFIG_FILE
    if not f.exists():
        return None
    try:
        return read_json(f)
    except CheckpointError as exc:
        raise SystemExit(f"mfsdp train: --load: {exc}") from None


def model_config(args):
    """The model's :class:`~mfsdp.models.gpt.GPTConfig`: the checkpoint's or the preset's, with
    every model flag given on the command line applied."""
    from mfsdp.models.gpt import GPT_PRESETS, GPTConfig, with_overrides

    saved = saved_config(getattr(args, "load", None))
    if args.model_preset:
        base = GPT_PRESETS[args.model_preset]
    elif saved is not None:
        base = GPTConfig.from_dict(saved)
    else:
        base = GPT_PRESETS["gpt-tiny"]
    try:
        cfg = overridden_config(base, args, args.max_position_embeddings)
        if args.max_position_embeddings is None and cfg.position_embedding_type == "learned_absolute":
            # indexed-dataset samples hold seq_length + 1 tokens (inputs and the last label)
            indexed = bool(args.data_path) and any(is_indexed_prefix(p) for p in args.data_path)
            cfg = with_overrides(cfg, max_position_embeddings=max(args.seq_length, 1) + indexed)
        tok = tokenizer_of(args)
        tp = getattr(args, "tensor_model_parallel_size", 1) or 1
        if tok is not None:
            kept = (saved or {}).get("vocab_size", 0)  # a resumed job keeps its padded size
            size = (kept if kept >= tok.vocab_size and kept % tp == 0
                    else padded_vocab_size(tok.vocab_size, args.make_vocab_size_divisible_by, tp))
            _note_padding(tok.vocab_size, size)
            cfg = with_overrides(cfg, vocab_size=size)
        elif cfg.vocab_size % tp:  # the vocabulary-parallel layers need a multiple of TP
            size = padded_vocab_size(cfg.vocab_size, 1, tp)
            _note_padding(cfg.vocab_size, size)
            cfg = with_overrides(cfg, vocab_size=size)
        return cfg
    except ValueError as e:  # an inconsistent combination of model flags
        raise SystemExit(f"mfsdp train: {e}") from None


def padded_vocab_size(vocab: int, divisible_by: int, tp: int = 1) -> int:
    """Megatron-LM's padded vocabulary: ``vocab`` rounded up to a multiple of
    ``divisible_by x tp`` (``--make-vocab-size-divisible-by`` times the tensor-parallel size,
    so that every TP rank holds as many rows of the embedding and the output layer).

    >>> padded_vocab_size(50257, 128), padded_vocab_size(50257, 128, tp=8)
    (50304, 51200)
    """
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def _note_padding(vocab: int, size: int) -> None:
    """Megatron-LM's start-up line when the vocabulary gains dummy tokens (rank 0)."""
    import torch.distributed as dist

    if size != vocab and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f" > padded vocab (size: {vocab}) with {size - vocab} dummy tokens "
              f"(new size: {size})", flush=True)


def overridden_config(base, args, max_pos):
    """``base`` (a preset's or a checkpoint's config) with every model flag given on the command
    line applied; a flag not given keeps ``base``'s value."""
    from mfsdp.models.gpt import with_overrides

    # Flags whose value means something else than the field of the same name.
    special = {"max_position_embeddings": max_pos,
               "rope_scaling_factor": args.rope_scaling_factor if args.use_rope_scaling else None,
               "add_bias_linear": False if args.disable_bias_linear else None,
               "share_embeddings_and_output_weights": (
                   False if args.untie_embeddings_and_output_weights else None),
               "num_query_groups": None}  # checked with --group-query-attention below
    # Every other GPTConfig field is a Megatron-LM flag of the same name; a flag not given (None)
    # keeps the preset's value.
    flags = {f.name: getattr(args, f.name) for f in fields(GPTConfig)
             if f.name not in special and hasattr(args, f.name)}
    cfg = with_overrides(base, **flags, **special)
    if args.group_query_attention != bool(args.num_query_groups):
        raise ValueError("--group-query-attention and --num-query-groups go together (as in "
                         "Megatron-LM): pass both, or neither for multi-head attention")
    if args.num_query_groups:
        cfg = with_overrides(cfg, num_query_groups=args.num_query_groups)
    return cfg


def model_family(args, cfg) -> str:
    """What the log calls the model: its preset, or its Hugging Face family."""
    from mfsdp.models.hf import UnsupportedModel, hf_model_type

    if args.model_preset:
        return args.model_preset
    try:
        return hf_model_type(cfg)
    except UnsupportedModel:
        return "gpt"


def precision_policy(args):
    """The :class:`~mfsdp.MixedPrecisionPolicy` of ``--bf16``, ``--grad-reduce-in-bf16`` and the
    ``--megatron-fsdp-*-dtype`` flags (the two gradient-communication flags agree: see
    :mod:`mfsdp.trainer.refusals`)."""
    from mfsdp import MixedPrecisionPolicy

    main = DTYPES[args.megatron_fsdp_main_params_dtype] if args.megatron_fsdp_main_params_dtype \
        else (torch.float32 if args.bf16 else None)
    grads = DTYPES[args.megatron_fsdp_main_grads_dtype] if args.megatron_fsdp_main_grads_dtype \
        else (torch.float32 if args.bf16 else None)
    comm = DTYPES[args.megatron_fsdp_grad_comm_dtype] if args.megatron_fsdp_grad_comm_dtype \
        else (torch.bfloat16 if args.grad_reduce_in_bf16 else None)
    return MixedPrecisionPolicy(main_params_dtype=main, main_grads_dtype=grads, grad_comm_dtype=comm)


def build_param_groups(model, args) -> list[dict]:
    """The optimizer's two parameter groups (weight decay on matrices, none on norms and biases)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.dim() < 2 or name.endswith(".bias") else decay).append(p)
    return [{"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(groups: list[dict], args) -> torch.optim.Optimizer:
    """The optimizer ``--optimizer`` names, with ``--lr``, ``--weight-decay``, Adam's betas and
    ``--adam-eps``."""
    if args.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=args.lr, momentum=args.sgd_momentum)
    return torch.optim.AdamW(groups, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_eps)


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


def routers_of(model):
    """``(name, router)`` of every MoE router of the model (their expert bias is saved and updated)."""
    from mfsdp.moe.router import TopKRouter

    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, TopKRouter) and m.expert_bias is not None]


def rss_mib() -> float:
    """This process's resident memory now (VmRSS), in MiB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def flops_per_token(cfg, seq_length: int) -> float:
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
