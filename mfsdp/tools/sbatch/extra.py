"""Which flags ``extra_args`` may add to a train script: none that the script writes itself
or that a key sets (``tp``: ``--tensor-model-parallel-size``, ``recompute``: the
``--recompute-*`` flags, ``model_args``: the model's flags). A second copy would either fail the
trainer's parser or override a value that the render planned and that the header describes;
the refusal names the key to set instead.

>>> from mfsdp.tools.sbatch import render
>>> render("llama3-70b", {"extra_args": "--recompute-num-layers 80"})
Traceback (most recent call last):
...
mfsdp.tools.sbatch.RenderError: extra_args='--recompute-num-layers 80' passes --recompute-num-layers: the script writes it already; use --set recompute=... instead
"""

from __future__ import annotations

import re
import shlex

from mfsdp.tools.sbatch.arguments import megatron_lm_model_flags, train_args
from mfsdp.tools.sbatch.checks import _RECOMPUTE_FLAGS, _flag, _model_preset
from mfsdp.tools.sbatch.errors import RenderError
from mfsdp.tools.sbatch.presets import SCHEMA

__all__ = ["check_extra_args"]


# Flags the train template writes outside train_args (data, tokenizer, W&B), by the key
_TEMPLATE_FLAGS = {"--data-path": "data_path", "--split": "split", "--mock-data": "mock_data",
                   "--tokenizer-type": "tokenizer_model", "--tokenizer-model": "tokenizer_model",
                   "--vocab-size": "model_args", "--wandb-project": "wandb_project",
                   "--wandb-exp-name": "job_name", "--wandb-save-dir": "log_dir"}
# Flags train_args writes for a key whose help does not start with the flag
_KEY_FLAGS = {"--sequence-parallel": "sequence_parallel", "--save": "save",
              "--load": "load", "--exit-signal-handler": "signal_seconds",
              "--tensorboard-dir": "log_dir", "--log-jsonl": "log_jsonl",
              "--compile": "compile", "--fused-adam": "fused_adam",
              "--data-cache-path": "log_dir", "--fsdp-manual-registration": "nccl_ub",
              **{flag: "recompute" for flag in _RECOMPUTE_FLAGS}}


def _flag_keys() -> dict[str, str]:
    """Each trainer flag a key sets -> the key: the flag its help opens with (``tp``:
    ``--tensor-model-parallel-size ...``), those of ``_KEY_FLAGS`` and ``_TEMPLATE_FLAGS``,
    and mfsdp train's model and MoE flags (``model_args``: the model the render plans is the
    one model_args builds)."""
    from mfsdp.trainer.config.flags import flag_arguments, flag_fields
    from mfsdp.trainer.config.model import ModelConfig, MoEConfig

    out = {name: "model_args" for cls in (ModelConfig, MoEConfig) for f in flag_fields(cls)
           for name in flag_arguments(cls, f)[0] if name.startswith("--")}
    for key, (_, help_) in SCHEMA.items():
        m = re.match(r"^(?:trainer=mfsdp: |with tp > 1: )?(--[a-z0-9-]+)", help_)
        if m:
            out[m.group(1)] = key
    return {**out, **_KEY_FLAGS, **_TEMPLATE_FLAGS}


def _mfsdp_train_flags() -> list[str]:
    """Every flag of ``mfsdp train``'s parser (its config classes' flags, group by group)."""
    from mfsdp.trainer.config import GROUPS
    from mfsdp.trainer.config.flags import flag_arguments, flag_fields

    return [name for _, kinds in GROUPS for cls in kinds for f in flag_fields(cls)
            for name in flag_arguments(cls, f)[0] if name.startswith("--")]


def check_extra_args(v: dict) -> None:
    """Refuse an extra_args flag the script writes already or a key sets (a second copy would
    either fail the trainer's parser or override the value the render planned and described),
    naming the key. For mfsdp train, whose parser takes unique prefixes of its flags, a prefix
    counts as the flag it stands for (Megatron-LM's parser takes no prefixes)."""
    words = [w for w in shlex.split(v["extra_args"]) if w.startswith("--")]
    if not words:
        return
    written = {t for t in train_args(dict(v, extra_args="")) if isinstance(t, str)
               and t.startswith("--")}
    owned = _flag_keys()
    options = _mfsdp_train_flags() if v["trainer"] == "mfsdp" else []
    for word in words:
        flag = _flag(word)
        if flag not in options:  # argparse's abbreviation: the one option it begins
            longer = [o for o in options if o.startswith(flag)]
            flag = longer[0] if len(longer) == 1 else flag
        if flag not in written and flag not in owned:
            continue
        key = owned.get(flag) or ("model_args" if flag in _model_flags(v) else None)
        where = ("the script writes it already" if flag in written else
                 f"it is {key}'s to set (the render plans and describes {key})")
        fix = (f"use --set {key}=... instead" if key else
               "the script always passes it; drop it from extra_args")
        raise RenderError(f"extra_args={v['extra_args']!r} passes {flag}: {where}; {fix}")


def _model_flags(v: dict) -> set[str]:
    """The flags the script writes for the model, which model_args changes: its own, and for
    Megatron-LM the architecture flags written for its ``--model-preset``."""
    words = shlex.split(v["model_args"])
    name = _model_preset(v["model_args"])
    if v["trainer"] == "megatron-lm" and name:
        try:
            words += megatron_lm_model_flags(name, v["seq_length"])
        except KeyError:  # (not a preset: refused below, naming model_args)
            pass
    return {_flag(w) for w in words if w.startswith("--")}
