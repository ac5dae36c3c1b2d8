"""What a training run is built from: the model configuration (preset, checkpoint, flags), the
mixed-precision policy, the optimizer and its parameter groups, the learning-rate schedule, and
the figures the logs report (FLOPs per token, resident memory)."""

from __future__ import annotations

import argparse
from dataclasses import fields, replace
from typing import Any

import torch

from mfsdp.data.batches import is_indexed_prefix, tokenizer_of
from mfsdp.models.config import GPTConfig

from mfsdp.config import MixedPrecisionPolicy
from mfsdp.trainer.config import (DTYPES, ModelConfig, MoEConfig, PrecisionConfig, TrainConfig,
                                  TrainingConfig)
from mfsdp.trainer.saved_model import (flags_against_saved, megatron_lm_checkpoint,
                                       megatron_lm_model)
from mfsdp.trainer.state import LRScheduler


DEFAULT_MODEL_PRESET = "gpt-tiny"
"""The model ``mfsdp train`` builds without ``--model-preset`` or a checkpoint's model config."""


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


def model_config(config: TrainConfig | argparse.Namespace):
    """The model's :class:`~mfsdp.models.gpt.GPTConfig`: the checkpoint's or the preset's, with
    every model flag of ``config`` applied (parsed arguments are read into a
    :class:`~mfsdp.trainer.config.TrainConfig` first, its logging group left out)."""
    from mfsdp.models.gpt import GPT_PRESETS, GPTConfig, with_overrides

    if isinstance(config, argparse.Namespace):
        config = TrainConfig.from_args(config, logging=False)
    model, data = config.model, config.data
    load = config.checkpoint.load
    saved = saved_config(load)
    # a Megatron-LM checkpoint: the model its saved arguments name (as mfsdp convert reads them)
    megatron = None if model.model_preset or saved is not None else megatron_lm_model(load, model)
    if model.model_preset:
        base = GPT_PRESETS[model.model_preset]
    elif saved is not None:
        base = GPTConfig.from_dict(saved)
    elif megatron is not None:
        base, saved = megatron[0], megatron[0].to_dict()
    else:
        base = GPT_PRESETS[DEFAULT_MODEL_PRESET]
    try:
        cfg = overridden_config(base, model, config.moe)
        if megatron is not None:
            _note_flags_against_saved(load, *megatron, cfg)
        if model.max_position_embeddings is None and megatron is None and \
                cfg.position_embedding_type == "learned_absolute":
            # indexed-dataset samples hold seq_length + 1 tokens (inputs and the last label)
            indexed = bool(data.data_path) and any(is_indexed_prefix(p) for p in data.data_path)
            cfg = with_overrides(cfg, max_position_embeddings=max(config.training.seq_length, 1)
                                 + indexed)
        tok = tokenizer_of(data, model.vocab_size)
        tp = config.parallel.tensor_model_parallel_size
        if tok is not None:
            kept = (saved or {}).get("vocab_size", 0)  # a resumed job keeps its padded size
            size = (kept if kept >= tok.vocab_size and kept % tp == 0
                    else padded_vocab_size(tok.vocab_size, data.make_vocab_size_divisible_by, tp))
            _note_padding(tok.vocab_size, size)
            cfg = with_overrides(cfg, vocab_size=size)
        elif cfg.vocab_size % tp:  # the vocabulary-parallel layers need a multiple of TP
            size = padded_vocab_size(cfg.vocab_size, 1, tp)
            _note_padding(cfg.vocab_size, size)
            cfg = with_overrides(cfg, vocab_size=size)
        return cfg
    except ValueError as e:  # an inconsistent combination of model flags
        raise SystemExit(f"mfsdp train: {e}") from None


def _note_flags_against_saved(load: str, saved: GPTConfig, held: frozenset[str],
                              cfg: GPTConfig) -> None:
    """One line (rank 0) naming the model flags that differ from the Megatron-LM arguments saved
    in ``load`` (``held``: the fields they hold; the flags win), where any does."""
    import torch.distributed as dist

    differ = flags_against_saved(saved, held, cfg)
    if differ and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"--load {load}: the model flags given win over its saved Megatron-LM arguments: "
              f"{differ}", flush=True)


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


def overridden_config(base: GPTConfig, model: ModelConfig, moe: MoEConfig) -> GPTConfig:
    """``base`` (a preset's or a checkpoint's config) with every flag of the ``model`` and ``moe``
    groups (:class:`~mfsdp.trainer.config.ModelConfig`, :class:`~mfsdp.trainer.config.MoEConfig`)
    that was given applied; a flag not given keeps ``base``'s value."""
    from mfsdp.models.gpt import with_overrides

    # Flags whose value means something else than the field of the same name.
    special = {"max_position_embeddings": model.max_position_embeddings,
               "rope_scaling_factor": (model.rope_scaling_factor if model.use_rope_scaling
                                       else None),
               "add_bias_linear": False if model.disable_bias_linear else None,
               "share_embeddings_and_output_weights": (
                   False if model.untie_embeddings_and_output_weights else None),
               # with --group-query-attention (ModelConfig checks); in the same replace as
               # the heads, so that new heads are checked against the new groups
               "num_query_groups": model.num_query_groups or None}
    # Every other GPTConfig field is a Megatron-LM flag of the same name; a flag not given (None)
    # keeps the preset's value.
    flags = {f.name: getattr(group, f.name) for f in fields(GPTConfig)
             for group in (model, moe) if f.name not in special and hasattr(group, f.name)}
    return with_overrides(base, **flags, **special)


def model_family(model_preset: str | None, cfg: GPTConfig, load: str | None = None) -> str:
    """What the log calls the model: the ``--model-preset`` passed; without one, the default
    preset's name (``gpt-tiny``, what :func:`model_config` builds) unless ``load`` holds a
    model config: then the preset that config is, up to the sizes the run sets (a resumed run
    of the default says ``gpt-tiny`` again), else its Hugging Face family (``gpt`` when it has none).
    A Megatron-LM checkpoint's model (its saved arguments, or the model flags) is named the same
    way, never after the default preset."""
    from mfsdp.models.gpt import GPT_PRESETS
    from mfsdp.models.hf import UnsupportedModel, hf_model_type

    if model_preset:
        return model_preset
    if saved_config(load) is None and megatron_lm_checkpoint(load) is None:
        return DEFAULT_MODEL_PRESET
    # (the sizes the trainer sets from the run: the sequence length's and the tokenizer's)
    same = [name for name, preset in GPT_PRESETS.items() if replace(
        preset, max_position_embeddings=cfg.max_position_embeddings,
        vocab_size=cfg.vocab_size) == cfg]
    if same:
        return same[0]
    try:
        return hf_model_type(cfg)
    except UnsupportedModel:
        return "gpt"


def precision_policy(precision: PrecisionConfig | argparse.Namespace) -> MixedPrecisionPolicy:
    """The :class:`~mfsdp.MixedPrecisionPolicy` of the precision group
    (:class:`~mfsdp.trainer.config.PrecisionConfig`: ``--bf16``, ``--grad-reduce-in-bf16`` and
    the ``--megatron-fsdp-*-dtype`` flags; the two gradient-communication flags agree: see
    :mod:`mfsdp.trainer.refusals`)."""
    from mfsdp.config import MixedPrecisionPolicy

    p = precision
    main = DTYPES[p.megatron_fsdp_main_params_dtype] if p.megatron_fsdp_main_params_dtype \
        else (torch.float32 if p.bf16 else None)
    grads = DTYPES[p.megatron_fsdp_main_grads_dtype] if p.megatron_fsdp_main_grads_dtype \
        else (torch.float32 if p.bf16 else None)
    comm = DTYPES[p.megatron_fsdp_grad_comm_dtype] if p.megatron_fsdp_grad_comm_dtype \
        else (torch.bfloat16 if p.grad_reduce_in_bf16 else None)
    return MixedPrecisionPolicy(main_params_dtype=main, main_grads_dtype=grads, grad_comm_dtype=comm)


def build_param_groups(model: torch.nn.Module, training: TrainingConfig) -> list[dict]:
    """The optimizer's two parameter groups (``training.weight_decay`` on matrices, none on norms
    and biases); ``training``: a :class:`~mfsdp.trainer.config.TrainingConfig`."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.dim() < 2 or name.endswith(".bias") else decay).append(p)
    return [{"params": decay, "weight_decay": training.weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(groups: list[dict], training: TrainingConfig) -> torch.optim.Optimizer:
    """The optimizer ``--optimizer`` names, with ``--lr``, ``--weight-decay``, Adam's betas,
    ``--adam-eps`` and ``--fused-adam`` (PyTorch's one-kernel AdamW, ``fused=True``; else its
    default, ``foreach`` on CUDA); ``training``: the
    :class:`~mfsdp.trainer.config.TrainingConfig`."""
    if training.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=training.lr, momentum=training.sgd_momentum)
    return torch.optim.AdamW(groups, lr=training.lr,
                             betas=(training.adam_beta1, training.adam_beta2),
                             eps=training.adam_eps,
                             **({"fused": True} if training.fused_adam else {}))


def learning_rate(training: Any, iteration: int) -> float:
    """The learning rate iteration ``iteration`` (1-based) trains with, as Megatron-LM's
    ``OptimizerParamScheduler`` gives it: the rate after ``iteration - 1`` steps (so with warm-up
    the first step uses ``--lr-warmup-init``) of the
    :class:`~mfsdp.trainer.state.LRScheduler` of ``training`` (the
    :class:`~mfsdp.trainer.config.TrainingConfig`, or anything with its fields).

    >>> from types import SimpleNamespace as NS
    >>> a = NS(lr=1e-3, min_lr=0.0, lr_warmup_iters=2, lr_warmup_init=0.0, lr_decay_iters=None,
    ...        train_iters=6, lr_decay_style="linear", lr_wsd_decay_iters=None,
    ...        lr_wsd_decay_style="exponential")
    >>> [round(learning_rate(a, i), 6) for i in range(1, 8)]
    [0.0, 0.0005, 0.001, 0.00075, 0.0005, 0.00025, 0.0]
    """
    return LRScheduler.from_config(training).lr_at(iteration - 1)


def routers_of(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, router)`` of every MoE router of the model (their expert bias is saved and updated)."""
    from mfsdp.moe.router import TopKRouter

    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, TopKRouter) and m.expert_bias is not None]


def rss_mib() -> float:
    """This process's resident memory now (VmRSS), in MiB (NaN where /proc does not give it)."""
    from mfsdp.runtime import proc_status_mib

    rss = proc_status_mib("VmRSS")
    return float("nan") if rss is None else rss


def flops_per_token(cfg: GPTConfig, seq_length: int) -> float:
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
