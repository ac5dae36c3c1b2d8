"""What ``mfsdp check`` trains: the user's model from a ``MODEL`` argument, its FSDP units, the
random token batches, and the forward + loss every run uses.

``MODEL`` is one of

* ``package.module:factory``: a zero-argument callable importable from the current directory,
  returning an ``nn.Module`` that maps token ids ``[B, S]`` to logits ``[B, S, V]``;
* a Hugging Face config or model directory (its ``config.json``): built with
  ``transformers.AutoModelForCausalLM.from_config``, random weights, nothing downloaded;
* a preset of the trainer (``mfsdp train --model-preset``, e.g. ``llama-tiny``), optionally
  followed by ``mfsdp train``'s model flags layered on it, as the trainer and ``mfsdp plan
  --model-args`` layer them (``"llama-tiny --num-layers 4 --hidden-size 256"``; the CLI's
  ``--model-args``).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["build_model", "check_model_spec", "vocab_size", "default_unit_classes",
           "resolve_units", "make_batches", "logits_of", "next_token_loss", "bypassed_units"]


def _preset_with_flags(spec: str):
    """The GPTConfig of ``"PRESET --flag value ..."`` (a preset and the trainer's model flags),
    ``None`` where ``spec`` does not start with a preset and a flag; a one-line ``ValueError``
    for flags the trainer refuses."""
    import shlex

    from mfsdp.models.config import GPT_PRESETS

    words = spec.split(None, 1)
    if len(words) < 2 or words[0] not in GPT_PRESETS or not words[1].lstrip().startswith("--"):
        return None
    from mfsdp.tools.plan_model import gpt_config

    try:
        return gpt_config(words[0], shlex.split(words[1]))[0]
    except ValueError as exc:
        raise ValueError(f"MODEL={spec!r}: {exc}") from None


def check_model_spec(spec: Any) -> None:
    """Raise a one-line ``ValueError`` when ``spec`` names no model ``mfsdp check`` can build."""
    if callable(spec):
        return
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"MODEL={spec!r}: give package.module:factory, a Hugging Face config "
                         "directory, or a trainer preset")
    from mfsdp.models.config import GPT_PRESETS

    if spec in GPT_PRESETS:
        return
    if _preset_with_flags(spec) is not None:
        return
    path = Path(spec)
    if path.is_dir() or spec.endswith(".json"):
        where = path if path.is_dir() else path.parent
        if not (where / "config.json").exists():
            raise ValueError(f"MODEL={spec!r} has no config.json; point at a Hugging Face "
                             "config or model directory")
        return
    if ":" in spec:
        module, _, name = spec.partition(":")
        try:
            obj = importlib.import_module(module)
        except ImportError as exc:
            raise ValueError(f"MODEL={spec!r}: cannot import {module!r} ({exc}); run from the "
                             "directory that holds it, or set PYTHONPATH") from None
        for part in name.split("."):
            if not hasattr(obj, part):
                raise ValueError(f"MODEL={spec!r}: {module!r} has no {name!r}; name a "
                                 "zero-argument function that returns the model") from None
            obj = getattr(obj, part)
        if not callable(obj):
            raise ValueError(f"MODEL={spec!r} is not callable; name a zero-argument function")
        return
    raise ValueError(f"MODEL={spec!r} is neither package.module:factory, a directory with "
                     f"config.json, nor a trainer preset ({', '.join(sorted(GPT_PRESETS))})")


def build_model(spec: Any, seed: int = 0) -> nn.Module:
    """Build the model ``spec`` names (see the module docstring) in fp32 on the CPU, seeded so
    that every rank and the reference start from the same weights; dropout is switched off (it
    draws different masks on every rank)."""
    check_model_spec(spec)
    torch.manual_seed(seed)
    if callable(spec):
        model = spec()
    else:
        from mfsdp.models.config import GPT_PRESETS

        config = GPT_PRESETS.get(spec) or _preset_with_flags(spec)
        if config is not None:
            from mfsdp.models.gpt import GPT

            model = GPT(config)
        elif ":" in spec and not Path(spec).exists():
            module, _, name = spec.partition(":")
            obj: Any = importlib.import_module(module)
            for part in name.split("."):
                obj = getattr(obj, part)
            model = obj()
        else:
            from transformers import AutoConfig, AutoModelForCausalLM

            path = Path(spec)
            config = AutoConfig.from_pretrained(path if path.is_dir() else path.parent)
            model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    if not isinstance(model, nn.Module):
        raise ValueError(f"MODEL={spec!r} returned {type(model).__name__}, not an nn.Module")
    model = model.float()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model.train()


def vocab_size(model: nn.Module) -> int:
    """The number of token ids the model takes: its config's ``vocab_size``, else its first
    ``nn.Embedding``'s rows."""
    config = getattr(model, "config", None)
    if getattr(config, "vocab_size", None):
        return int(config.vocab_size)
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return m.num_embeddings
    raise ValueError(f"{type(model).__name__} has no nn.Embedding and no config.vocab_size; "
                     "mfsdp check feeds token ids, so the model must take them")


def default_unit_classes(model: nn.Module) -> list[type]:
    """The model's repeated block class: the class of the modules in the ``nn.ModuleList`` that
    holds most of its parameters (none: no units, everything in the root unit). That is the
    transformer layers, as the trainer and Megatron-LM choose, even in a MoE model whose layers
    each hold a longer list of experts."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return []
    heaviest = max(lists, key=lambda m: (sum(p.numel() for p in m.parameters()), len(m)))
    return sorted({type(m) for m in heaviest}, key=lambda c: c.__name__)


def resolve_units(model: nn.Module, names: list[str] | None) -> list[type]:
    """``--units CLASS ...`` as classes found in ``model`` (``None``: the default)."""
    if not names:
        return default_unit_classes(model)
    by_name = {type(m).__name__: type(m) for m in model.modules()}
    out = []
    for name in names:
        if name not in by_name:
            raise ValueError(f"--units {name}: {type(model).__name__} has no module of class "
                             f"{name!r}; its classes are {', '.join(sorted(by_name))}")
        out.append(by_name[name])
    return out


def make_batches(vocab: int, steps: int, global_batch: int, seq_len: int,
                 seed: int = 0) -> list[torch.Tensor]:
    """Random token ids ``[global_batch, seq_len]`` for every step, from the seed alone."""
    g = torch.Generator().manual_seed(1000 + seed)
    return [torch.randint(0, vocab, (global_batch, seq_len), generator=g) for _ in range(steps)]


def logits_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The model's logits ``[B, S, V]`` for ``tokens`` ``[B, S]`` (a Hugging Face output's
    ``.logits``, a tuple's first item, a flattened ``[B*S, V]`` reshaped)."""
    out = model(tokens)
    if hasattr(out, "logits"):
        out = out.logits
    elif isinstance(out, (tuple, list)):
        out = out[0]
    B, S = tokens.shape
    return out.reshape(B, S, -1)


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``tokens`` (computed in fp32)."""
    logits = logits_of(model, tokens)
    V = logits.shape[-1]
    return nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, V),
                                       tokens[:, 1:].reshape(-1))


def bypassed_units(model: nn.Module, units: list[type], tokens: torch.Tensor) -> list[str]:
    """Unit modules whose parameters get gradients although their ``forward`` never ran (a fused
    parent read their weights directly): under ``optim_grads_params`` FSDP never gathers them
    (see docs/fused-experts.md). Runs one forward and backward on ``model``; returns the module
    names."""
    if not units:
        return []
    ran: set[str] = set()
    handles = []
    classes = tuple(units)
    for name, m in model.named_modules():
        if isinstance(m, classes):
            handles.append(m.register_forward_pre_hook(
                lambda mod, args, name=name: ran.add(name)))
    try:
        next_token_loss(model, tokens).backward()
    finally:
        for h in handles:
            h.remove()
    out = []
    for name, m in model.named_modules():
        if isinstance(m, classes) and name not in ran and any(
                p.grad is not None for p in m.parameters()):
            out.append(name)
    model.zero_grad(set_to_none=True)
    return out


def load_callable(path: str, what: str) -> Callable:
    """``package.module:function`` as the function (``what`` names the input in errors)."""
    module, sep, name = path.partition(":")
    if not sep:
        raise ValueError(f"{what}={path!r}: give package.module:function")
    try:
        obj: Any = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what}={path!r}: cannot import it ({exc}); run from the directory "
                         "that holds it") from None
    return obj
