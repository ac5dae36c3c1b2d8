"""Flags that a combination of ``mfsdp train``'s other flags would leave without effect: each is
refused at start with one line naming the flag and the fix, so no flag is accepted and ignored.

A flag is refused when its value differs from the parser's default and the flags it works with
are missing (``--fsdp-double-buffer`` without ``--use-megatron-fsdp``, ``--rope-scaling-factor``
without ``--use-rope-scaling``, ...), when two flags ask for different things (``--mock-data``
with ``--data-path``), or, for ``--use-nccl-ub`` and ``--fsdp-manual-registration``, always:
mfsdp does not register NCCL user buffers, and :func:`mfsdp.fully_shard` refuses
``nccl_ub=True`` with the same reason. :func:`check_with_model` refuses those that the model's
configuration leaves without effect. The guide's trainer page lists them all.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

from mfsdp.config import not_implemented_reason

__all__ = ["ALWAYS", "NEEDS", "Needs", "check_combinations", "check_with_model", "flag_of"]

_DDP = "the DDP path replicates the model with PyTorch DDP"


@dataclass(frozen=True, kw_only=True)
class Needs:
    """One rule: a non-default ``dest`` needs ``present(args)``, else ``why`` is the refusal."""

    dest: str  # the flag's argparse destination
    present: Callable[[argparse.Namespace], bool]  # whether what the flag works with is there
    why: str  # the rest of the line after "--flag VALUE": what it needs and the fix


def _fsdp(a) -> bool:
    """Whether the run shards with mfsdp (else: PyTorch DDP)."""
    return bool(a.use_megatron_fsdp)


def _indexed(a) -> bool:
    """Whether ``--data-path`` names Megatron indexed datasets (a weighted list always does)."""
    from mfsdp.data.batches import is_indexed_prefix

    return bool(a.data_path) and (len(a.data_path) > 1 or is_indexed_prefix(a.data_path[0]))


def _needs_fsdp(dest: str, reason: str) -> Needs:
    """The rule for an option of mfsdp's engine, which the DDP path does not have."""
    return Needs(dest=dest, present=_fsdp, why=f"needs --use-megatron-fsdp ({reason})")


NEEDS: tuple[Needs, ...] = (
    # sharding-engine options: the DDP path has no engine to hand them to
    _needs_fsdp("data_parallel_sharding_strategy", f"{_DDP}: nothing is sharded"),
    _needs_fsdp("outer_dp_sharding_strategy", f"{_DDP}: nothing is sharded"),
    _needs_fsdp("fsdp_double_buffer", f"{_DDP} and gathers no weights into a buffer"),
    _needs_fsdp("create_all_gather_group", f"{_DDP}, which all-gathers nothing"),
    _needs_fsdp("init_model_with_meta_device",
                f"{_DDP}, which needs the whole model built on every rank"),
    _needs_fsdp("overlap_grad_reduce",
                "PyTorch DDP always overlaps its gradient all-reduces with the backward"),
    _needs_fsdp("overlap_param_gather", f"{_DDP}, which gathers no weights"),
    _needs_fsdp("grad_reduce_in_bf16",
                "PyTorch DDP reduces gradients in the model's dtype: pass --bf16 for bf16 ones"),
    *(_needs_fsdp(f"megatron_fsdp_{what}_dtype",
                  "the DDP path trains the model's own parameters and gradients, in --bf16 "
                  "or fp32")
      for what in ("main_params", "main_grads", "grad_comm")),
    _needs_fsdp("dump_param_to_param_group_map", f"{_DDP}, whose optimizer is not mfsdp's"),
    # model
    Needs(dest="rope_scaling_factor", present=lambda a: bool(a.use_rope_scaling),
          why="needs --use-rope-scaling (as in Megatron-LM, the factor scales RoPE only with "
              "it): add --use-rope-scaling or drop the factor"),
    Needs(dest="moe_flex_dispatcher_backend",
          present=lambda a: a.moe_token_dispatcher_type == "flex",
          why="needs --moe-token-dispatcher-type flex (the backend of the flex dispatcher)"),
    # data
    Needs(dest="mock_data", present=lambda a: not a.data_path,
          why="contradicts --data-path: --mock-data trains on synthetic sequences, --data-path "
              "on your data; pass one"),
    Needs(dest="eval_interval", present=lambda a: _indexed(a),
          why="needs an indexed --data-path (validation reads its valid split; mock and byte "
              "data have none)"),
    Needs(dest="eval_iters", present=lambda a: a.eval_iters == 0 or _indexed(a),
          why="needs an indexed --data-path (validation reads its valid split; mock and byte "
              "data have none)"),
    Needs(dest="make_vocab_size_divisible_by", present=lambda a: bool(a.tokenizer_type),
          why="needs --tokenizer-type (it pads the tokenizer's vocabulary; without one "
              "--vocab-size is used as given)"),
    # optimizer and schedule
    Needs(dest="sgd_momentum", present=lambda a: a.optimizer == "sgd",
          why="needs --optimizer sgd"),
    *(Needs(dest=dest, present=lambda a: a.optimizer == "adam", why="needs --optimizer adam")
      for dest in ("adam_beta1", "adam_beta2", "adam_eps")),
    Needs(dest="lr_wsd_decay_style", present=lambda a: a.lr_decay_style == "WSD",
          why="needs --lr-decay-style WSD"),
    Needs(dest="lr_wsd_decay_iters", present=lambda a: a.lr_decay_style == "WSD",
          why="needs --lr-decay-style WSD"),
    # checkpoints: what --load reads or --save writes
    Needs(dest="ckpt_format", present=lambda a: bool(a.save),
          why="needs --save (it is the format --save writes; --load recognises every format)"),
    *(Needs(dest=dest, present=lambda a: bool(a.load), why="needs --load DIR")
      for dest in ("ckpt_verify", "override_opt_param_scheduler",
                   "use_checkpoint_opt_param_scheduler", "exit_on_missing_checkpoint")),
    # profiling
    *(Needs(dest=dest, present=lambda a: bool(a.profile), why="needs --profile")
      for dest in ("profile_step_start", "profile_step_end", "profile_ranks")),
    *(Needs(dest=dest, present=lambda a: bool(a.profile and a.use_pytorch_profiler),
            why="needs --profile --use-pytorch-profiler (it is an option of the trace)")
      for dest in ("pytorch_profiler_collect_shapes", "pytorch_profiler_collect_callstack")),
    Needs(dest="memory_snapshot_path", present=lambda a: bool(a.record_memory_history),
          why="needs --record-memory-history (it is where that history is written)"),
)

# Flags refused whatever else is given: upstream's NCCL user buffers, which mfsdp does not
# register (the API's nccl_ub=True is refused with the same reason).
ALWAYS: dict[str, str] = {
    "use_nccl_ub": f"{not_implemented_reason('nccl_ub')}; drop --use-nccl-ub, or train with "
                   "Megatron-LM on GPUs for it",
    "fsdp_manual_registration": f"registers buffers for --use-nccl-ub, and "
                                f"{not_implemented_reason('nccl_ub')}; drop "
                                "--fsdp-manual-registration",
}


def flag_of(parser: argparse.ArgumentParser, dest: str, value=None) -> str:
    """The spelling of ``dest`` on the command line that gives ``value`` (``--no-...`` for a
    switched-off default, the first option string otherwise)."""
    for action in parser._actions:
        if action.dest != dest or not action.option_strings:
            continue
        if value is False and action.default is not False:
            names = [o for o in action.option_strings if o.startswith("--no-")]
            if names:
                return names[0]
        if isinstance(action, argparse._StoreConstAction) or action.nargs == 0:
            if action.const == value or value is None:
                return action.option_strings[0]
            continue
        return action.option_strings[0]
    raise KeyError(dest)


def _shown(parser, dest: str, value) -> str:
    """``--flag VALUE`` as the user typed it (no value for a switch)."""
    flag = flag_of(parser, dest, value)
    if isinstance(value, bool):
        return flag
    return f"{flag} {' '.join(map(str, value)) if isinstance(value, list) else value}"


def check_combinations(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse (``SystemExit``, one line naming the flag and the fix) every flag in ``args`` that
    the other flags would leave without effect; see :data:`NEEDS` and :data:`ALWAYS`.
    ``parser`` (the one that parsed ``args``) gives the defaults and the spellings."""
    for dest, why in ALWAYS.items():
        if getattr(args, dest):
            raise SystemExit(f"{flag_of(parser, dest)}: {why}")
    for rule in NEEDS:
        value = getattr(args, rule.dest)
        if value != parser.get_default(rule.dest) and not rule.present(args):
            raise SystemExit(f"{_shown(parser, rule.dest, value)} {rule.why}")
    comm = args.megatron_fsdp_grad_comm_dtype
    if args.grad_reduce_in_bf16 and comm not in (None, "bf16"):
        raise SystemExit(f"--grad-reduce-in-bf16 and --megatron-fsdp-grad-comm-dtype {comm} ask "
                         "for different gradient-reduction dtypes: pass one")


def check_with_model(args: argparse.Namespace, cfg, parser: argparse.ArgumentParser) -> None:
    """Refuse the flags that the model's configuration ``cfg`` (a preset's, a checkpoint's, or
    the flags') would leave without effect: ``--moe-router-bias-update-rate`` without the
    balancing bias it updates."""
    rate = args.moe_router_bias_update_rate
    if rate != parser.get_default("moe_router_bias_update_rate") and \
            not cfg.moe_router_enable_expert_bias:
        raise SystemExit(f"--moe-router-bias-update-rate {rate} needs the balancing bias it "
                         "updates: add --moe-router-enable-expert-bias (or a preset that has it, "
                         "such as deepseek-proxy)")
