"""The model a Megatron-LM checkpoint names when ``mfsdp train --load`` reads it directly: the
arguments Megatron-LM saved (``--ckpt-format torch_dist`` or ``fsdp_dtensor``), read as ``mfsdp
convert`` reads them (:func:`~mfsdp.checkpoint.megatron_common.config_from_megatron_args`, the
rule of Megatron-LM's ``--use-checkpoint-args``).

A model flag given on the command line wins over the saved argument; where the two differ,
:func:`flags_against_saved` says so in one line. Where the checkpoint saved no arguments, or
arguments without a size the model needs, the refusal names the flags to pass."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from mfsdp.models.config import GPTConfig
from mfsdp.trainer.config import ModelConfig

__all__ = ["megatron_lm_checkpoint", "megatron_lm_model", "flags_against_saved"]

# the sizes without which no model is named: GPTConfig field -> Megatron-LM's argument
_REQUIRED = {"num_layers": "num_layers", "hidden_size": "hidden_size",
             "num_attention_heads": "num_attention_heads", "vocab_size": "padded_vocab_size"}
# GPTConfig fields set by a flag of another name (the rest: the field's name with dashes)
_FLAG_OF = {"add_bias_linear": "--disable-bias-linear",
            "share_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
            "rope_scaling_factor": "--use-rope-scaling --rope-scaling-factor"}
_SWITCHES = ("add_bias_linear", "share_embeddings_and_output_weights")
# GPTConfig fields read from a Megatron-LM argument of another name (the rest: the same name)
_ARGUMENT_OF = {"vocab_size": "padded_vocab_size",
                "share_embeddings_and_output_weights": "untie_embeddings_and_output_weights",
                "rope_scaling_factor": "use_rope_scaling",
                "moe_first_dense_layers": "moe_layer_freq"}


def megatron_lm_checkpoint(load: str | None) -> tuple[Path, str] | None:
    """``(iteration directory, format)`` where ``--load`` is a Megatron-LM checkpoint mfsdp reads
    (``torch_dist`` or ``fsdp_dtensor``); ``None`` otherwise, and for anything the loader
    refuses with its own message (an unreadable tracker, another Megatron-LM format)."""
    from mfsdp.checkpoint.detect import megatron_lm_backend, resolve_megatron_lm
    from mfsdp.checkpoint.manifest import CheckpointError

    if not load or (Path(load) / "manifest.json").exists() or (Path(load) / "latest").exists():
        return None  # mfsdp's own (its model_config.json names the model)
    try:
        found = resolve_megatron_lm(load)
        backend = megatron_lm_backend(found[0]) if found else None
    except CheckpointError:
        return None
    if backend not in ("torch_dist", "fsdp_dtensor"):
        return None
    return found[0], backend


def megatron_lm_model(load: str, model: ModelConfig
                      ) -> tuple[GPTConfig, frozenset[str]] | None:
    """The model the Megatron-LM checkpoint ``load`` names (see :func:`megatron_lm_checkpoint`;
    ``None`` where it is none), and the GPTConfig fields its saved arguments hold: the sizes
    they lack are taken from the model flags ``model`` gives, the rest of what they lack is
    Megatron-LM's default. The flags are not applied here (see
    :func:`mfsdp.trainer.build.overridden_config`). A ``SystemExit`` names every flag still
    needed, in one line."""
    from mfsdp.checkpoint.manifest import CheckpointError
    from mfsdp.checkpoint.megatron_common import config_from_megatron_args
    from mfsdp.checkpoint.megatron_lm import saved_arguments

    found = megatron_lm_checkpoint(load)
    if found is None:
        return None
    directory, backend = found
    try:
        args = saved_arguments(directory, backend)
    except CheckpointError as exc:
        raise SystemExit(f"mfsdp train: --load {load}: {exc}") from None
    merged = dict(vars(args)) if args is not None else {}
    for name, key in _REQUIRED.items():  # (only where the arguments lack it: no conflict)
        if merged.get(key) is None and getattr(model, name) is not None:
            merged[key] = getattr(model, name)
    missing = [n for n, key in _REQUIRED.items() if merged.get(key) is None]
    if missing and args is None:
        raise SystemExit(f"mfsdp train: --load {load}: {directory} saved no Megatron-LM "
                         "arguments; name its model with "
                         f"{', '.join('--' + n.replace('_', '-') for n in missing)} and the "
                         "flags of its architecture (--swiglu, --normalization, "
                         "--position-embedding-type, ...), or --model-preset")
    if missing:
        lack = ", ".join(f"{_REQUIRED[n]} (--{n.replace('_', '-')})" for n in missing)
        raise SystemExit(f"mfsdp train: --load {load}: the Megatron-LM arguments saved in "
                         f"{directory} lack {lack}; pass those flags, or --model-preset")
    try:
        cfg = GPTConfig.from_dict(config_from_megatron_args(argparse.Namespace(**merged),
                                                            str(directory)))
    except CheckpointError as exc:
        raise SystemExit(f"mfsdp train: --load {load}: {exc}") from None
    saved = vars(args) if args is not None else {}
    held = frozenset(f.name for f in fields(GPTConfig)
                     if saved.get(_ARGUMENT_OF.get(f.name, f.name)) is not None)
    return cfg, held


def flags_against_saved(saved: GPTConfig, held: frozenset[str], cfg: GPTConfig) -> str:
    """The model flags given on the command line that changed a field ``held`` of the model
    ``saved`` (what a checkpoint's saved arguments hold) in ``cfg`` (``saved`` with the flags
    applied, by :func:`mfsdp.trainer.build.overridden_config`), each with the saved value:
    ``"--num-layers 3 (saved num_layers=2), ..."``; ``""`` where none did."""
    out = []
    for f in fields(GPTConfig):
        mine, theirs = getattr(cfg, f.name), getattr(saved, f.name)
        if mine == theirs or f.name not in held:
            continue
        name = _FLAG_OF.get(f.name, "--" + f.name.replace("_", "-"))
        switch = f.name in _SWITCHES or isinstance(mine, bool)
        given = name if switch else f"{name} {mine}"
        out.append(f"{given} (saved {f.name}={theirs})")
    return ", ".join(out)
