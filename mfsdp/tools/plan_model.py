"""The model a plan is for, from a trainer preset and Megatron-LM's model flags: what
``mfsdp plan PRESET --model-args "..."`` and ``mfsdp sbatch render --set model_args=...`` plan.

The flags are parsed by ``mfsdp train``'s own parser and layered on the preset as the trainer
layers them (:func:`mfsdp.trainer.build.model_config`); the result is the planner's view of
that :class:`~mfsdp.models.gpt.GPTConfig` (:meth:`mfsdp.tools.plan.ModelConfig.from_gpt`). No
second table of flags: a flag the trainer takes is a flag the planner reads.

>>> model, text = planned_model("llama3-8b", "--num-layers 40 --hidden-size 5120 "
...                             "--ffn-hidden-size 13824 --num-attention-heads 40")
>>> print(text)
llama3-8b with 4 flags: 40 layers, hidden 5120, FFN 13824, 40 heads (8 KV), vocab 128,256 = 12.3B parameters
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from mfsdp.tools.plan import ModelConfig

__all__ = ["planned_model", "model_phrase", "model_flags"]


def model_flags() -> set[str]:
    """Every flag of ``mfsdp train``'s model and MoE groups (``--num-layers``,
    ``--num-experts``, ``--model-preset``, ...): what ``--model-args`` takes."""
    from mfsdp.trainer.config.flags import flag_arguments, flag_fields
    from mfsdp.trainer.config.model import ModelConfig as TrainerModel, MoEConfig

    return {name for cls in (TrainerModel, MoEConfig) for f in flag_fields(cls)
            for name in flag_arguments(cls, f)[0] if name.startswith("--")}


def model_phrase(name: str, flags: int, model: ModelConfig) -> str:
    """What the plan is for, in one line: the base, how many flags change it, the shape and the
    parameters (``llama3-8b with 4 flags: 40 layers, hidden 5120, ... = 13.0B parameters``)."""
    kv = model.num_kv_heads or model.num_heads
    text = (f"{name}{f' with {flags} flag' + ('s' if flags != 1 else '') if flags else ''}: "
            f"{model.num_layers} layers, hidden {model.hidden}, FFN {model.ffn_hidden}, "
            f"{model.num_heads} heads" + (f" ({kv} KV)" if kv != model.num_heads else "")
            + (", multi-latent attention" if model.mla else ""))
    if model.num_experts:
        first = model.first_dense_layers
        text += (f", {model.num_experts} experts top-{model.topk} (FFN {model.moe_ffn_hidden}"
                 + (f"; the first {f'{first} layers' if first > 1 else 'layer'} dense" if first else "")
                 + ")")
    dense, expert = model.param_counts()
    text += f", vocab {model.vocab:,} = {_count(dense + expert)} parameters"
    return text + (f" ({_count(expert)} in experts)" if expert else "")


def _count(n: float) -> str:
    """Parameters in B (from a billion) or M: ``12.3B``, ``0.4M``."""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def planned_model(preset: str, model_args: str | Sequence[str] = "", *,
                  seq_length: int = 4096) -> tuple[ModelConfig, str]:
    """The planner's model of ``preset`` with Megatron-LM's model flags ``model_args`` (a string
    split like a shell command line, or its words) layered on it, as ``mfsdp train
    --model-preset PRESET MODEL_ARGS`` builds it (``seq_length``: the run's), and :func:`model_phrase` of it.
    A ``--model-preset`` inside ``model_args`` replaces ``preset``. Raises ``ValueError`` in
    one line: for a flag that is not a model flag, one the trainer refuses, or a model the
    planner does not model (GELU MLPs, linear biases, LayerNorm, learned positions)."""
    words = shlex.split(model_args) if isinstance(model_args, str) else list(model_args)
    cfg, name = gpt_config(preset, words, seq_length=seq_length)
    model = ModelConfig.from_gpt(cfg)  # (its ValueError names the flags to add)
    flags = sum(1 for w in words if w.startswith("--") and w.split("=", 1)[0] != "--model-preset")
    return model, model_phrase(name, flags, model)


def gpt_config(preset: str, model_args: str | Sequence[str] = "", *,
               seq_length: int | None = None):
    """The :class:`~mfsdp.models.gpt.GPTConfig` that ``mfsdp train --model-preset PRESET
    MODEL_ARGS`` builds, and the preset's name (a ``--model-preset`` inside ``model_args``
    replaces ``preset``). Raises a one-line ``ValueError`` for a flag that is not a model flag
    or one the trainer refuses."""
    from mfsdp.models.gpt import GPT_PRESETS
    from mfsdp.trainer.arguments import build_parser
    from mfsdp.trainer.build import model_config

    words = shlex.split(model_args) if isinstance(model_args, str) else list(model_args)
    allowed = model_flags()
    for word in words:
        flag = word.split("=", 1)[0]
        if flag.startswith("--") and flag not in allowed:
            raise ValueError(f"{flag} is not one of mfsdp train's model or MoE flags, which "
                             "are what --model-args takes (e.g. --num-layers, --hidden-size, "
                             "--num-experts); the run's other settings are the command's own "
                             "flags")
    argv = ["--model-preset", preset, *words]
    if seq_length is not None:
        argv += ["--seq-length", str(seq_length)]
    parser = build_parser()
    parser.error = lambda message: (_ for _ in ()).throw(ValueError(message))  # one line
    args = parser.parse_args(argv)
    if args.model_preset not in GPT_PRESETS:
        raise ValueError(f"--model-preset {args.model_preset}: not a preset (one of "
                         f"{', '.join(sorted(GPT_PRESETS))})")
    try:
        return model_config(args), args.model_preset
    except SystemExit as exc:  # the trainer's own one-line refusal of the flags
        raise ValueError(str(exc).removeprefix("mfsdp train: ")) from None
