"""Every rule across the flag groups of ``mfsdp train``, in one place: :data:`RULES` (checked by
``TrainConfig.__post_init__``: a config that breaks one is never built) and
:data:`LAYOUT_RULES` (checked by ``TrainConfig.validate(world_size, model=...)``: what needs the
world size, the model's configuration, the file system or the device). The command line and a
config built in code meet the same rules, with the same one-line message naming the flag and
the fix (a ``ValueError`` in code; the command prints it and exits with status 2).

A rule reads the config's fields by their flag names through a :class:`View`, and carries an
``example``: field values that break it (the tests build each example in code and on the command
line and expect the same refusal, so a new rule is tested as soon as it is added).

The rules of one group alone stay in that group's ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from mfsdp.config import not_implemented_reason
from mfsdp.trainer.config.flags import flag_arguments

__all__ = ["ALWAYS", "LAYOUT_RULES", "NEEDS", "Needs", "RULES", "Rule", "View", "check",
           "command_line"]

_DDP = "the DDP path replicates the model with PyTorch DDP"


class View:
    """A read-only view of a ``TrainConfig``'s fields by their flag names (``view.save``,
    ``view.use_megatron_fsdp``), with each field's default and spelling on the command line."""

    def __init__(self, config: Any) -> None:
        # the groups of the config, and the group each field name belongs to
        self._groups = {f.name: getattr(config, f.name) for f in fields(config)}
        self._owner = {g.name: name for name, group in self._groups.items()
                       for g in fields(group)}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._groups[self._owner[name]], name)

    def _field(self, name: str) -> tuple[type, dataclasses.Field]:
        group = type(self._groups[self._owner[name]])
        return group, next(f for f in fields(group) if f.name == name)

    def default(self, name: str) -> Any:
        """The default of field ``name`` (the flag's default)."""
        _, f = self._field(name)
        return f.default_factory() if f.default is MISSING else f.default

    def flag(self, name: str, value: Any = None) -> str:
        """The spelling of field ``name`` on the command line that gives ``value`` (the
        ``--no-...`` spelling for a default that is on and switched off)."""
        group, f = self._field(name)
        names, kw = flag_arguments(group, f)
        if value is False and kw["default"] is not False:
            if f.metadata["also"] is not None:
                return f.metadata["also"][0][0]
            if "BooleanOptional" in str(kw.get("action")):
                return "--no-" + names[0][2:]
        return names[0]

    def shown(self, name: str, value: Any) -> str:
        """``--flag VALUE`` as a user types it (no value for a switch)."""
        spelled = self.flag(name, value)
        if isinstance(value, bool):
            return spelled
        return f"{spelled} {' '.join(map(str, value)) if isinstance(value, list) else value}"


def command_line(config_cls: type, example: dict[str, Any]) -> list[str]:
    """The ``mfsdp train`` words that set the fields of ``example`` (flag name -> value) of a
    config of class ``config_cls`` (``TrainConfig``)."""
    view = View(config_cls())
    words: list[str] = []
    for name, value in example.items():
        if isinstance(value, bool):
            words.append(view.flag(name, value))
        elif isinstance(value, list):
            words += [view.flag(name), *map(str, value)]
        else:
            words += [view.flag(name), str(value)]
    return words


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One rule across the groups: ``check`` returns the refusal line, or None."""

    name: str  # what the rule is about (the test's id)
    # (view,) for RULES; (view, world_size, model, device) for LAYOUT_RULES
    check: Callable[..., "str | None"]
    example: dict[str, Any]  # field values (by flag name) that break the rule
    world: int = 1  # the world size the example is validated for (LAYOUT_RULES)


@dataclass(frozen=True, kw_only=True)
class Needs:
    """A non-default ``dest`` needs ``present(view)``, else ``why`` is the refusal."""

    dest: str  # the field (flag destination)
    present: Callable[[View], bool]  # whether what the flag works with is there
    why: str  # the rest of the line after "--flag VALUE": what it needs and the fix
    example: Any = None  # a value of dest that it refuses alone (None: derived from the field)
    also: dict[str, Any] = field(default_factory=dict)  # fields the example needs besides


def _fsdp(a: View) -> bool:
    """Whether the run shards with mfsdp (else: PyTorch DDP)."""
    return bool(a.use_megatron_fsdp)


def _indexed(a: View) -> bool:
    """Whether ``--data-path`` names Megatron indexed datasets (a weighted list always does)."""
    from mfsdp.data.batches import is_indexed_prefix

    return bool(a.data_path) and (len(a.data_path) > 1 or is_indexed_prefix(a.data_path[0]))


def _needs_fsdp(dest: str, reason: str, **kw: Any) -> Needs:
    """The rule for an option of mfsdp's engine, which the DDP path does not have."""
    return Needs(dest=dest, present=_fsdp, why=f"needs --use-megatron-fsdp ({reason})", **kw)


_VALID = ("needs an indexed --data-path (validation reads its valid split; mock and byte data "
          "have none)")

NEEDS: tuple[Needs, ...] = (
    # sharding-engine options: the DDP path has no engine to hand them to
    _needs_fsdp("data_parallel_sharding_strategy", f"{_DDP}: nothing is sharded"),
    _needs_fsdp("outer_dp_sharding_strategy", f"{_DDP}: nothing is sharded",
                also={"num_distributed_optimizer_instances": 2}),
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
              "on your data; pass one", also={"data_path": ["bundled"]}),
    Needs(dest="eval_interval", present=_indexed, why=_VALID),
    Needs(dest="eval_iters", present=lambda a: a.eval_iters == 0 or _indexed(a), why=_VALID),
    Needs(dest="make_vocab_size_divisible_by", present=lambda a: bool(a.tokenizer_type),
          why="needs --tokenizer-type (it pads the tokenizer's vocabulary; without one "
              "--vocab-size is used as given)"),
    # optimizer and schedule
    Needs(dest="sgd_momentum", present=lambda a: a.optimizer == "sgd",
          why="needs --optimizer sgd"),
    *(Needs(dest=dest, present=lambda a: a.optimizer == "adam", why="needs --optimizer adam",
            also={"optimizer": "sgd"})
      for dest in ("adam_beta1", "adam_beta2", "adam_eps")),
    Needs(dest="fused_adam", present=lambda a: a.optimizer == "adam",
          why="needs --optimizer adam (it is PyTorch's fused AdamW): drop it with --optimizer sgd",
          also={"optimizer": "sgd"}),
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
    *(Needs(dest=dest, present=lambda a: bool(a.profile), why="needs --profile",
            example=ex)
      for dest, ex in (("profile_step_start", 3), ("profile_step_end", 30),
                       ("profile_ranks", [1]))),
    *(Needs(dest=dest, present=lambda a: bool(a.profile and a.use_pytorch_profiler),
            why="needs --profile --use-pytorch-profiler (it is an option of the trace)")
      for dest in ("pytorch_profiler_collect_shapes", "pytorch_profiler_collect_callstack")),
    Needs(dest="memory_snapshot_path", present=lambda a: bool(a.record_memory_history),
          why="needs --record-memory-history (it is where that history is written)",
          example="elsewhere.pickle"),
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


def _other_value(view: View, name: str) -> Any:
    """A value of field ``name`` other than its default, valid for its own group."""
    group, f = view._field(name)
    _, kw = flag_arguments(group, f)
    default = view.default(name)
    if isinstance(default, bool) or str(f.type).startswith("bool"):
        return not default
    if kw.get("choices"):
        return next(c for c in kw["choices"] if c != default)
    kind = str(f.type)
    if kind.startswith("float"):
        return 0.5 if default != 0.5 else 0.25
    if kind.startswith("int"):
        return (default or 2) + 1
    if kind.startswith("list"):
        return ["somewhere"]
    return "somewhere"


def _needs_rule(rule: Needs) -> Rule:
    def check(a: View) -> str | None:
        value = getattr(a, rule.dest)
        if value != a.default(rule.dest) and not rule.present(a):
            return f"{a.shown(rule.dest, value)} {rule.why}"
        return None
    return Rule(name=rule.dest, check=check, example={})  # (example: see _examples)


def _always_rule(dest: str, why: str) -> Rule:
    def check(a: View) -> str | None:
        return f"{a.flag(dest)}: {why}" if getattr(a, dest) else None
    return Rule(name=dest, check=check, example={dest: True})


def _grad_comm(a: View) -> str | None:
    comm = a.megatron_fsdp_grad_comm_dtype
    if a.grad_reduce_in_bf16 and comm not in (None, "bf16"):
        return (f"--grad-reduce-in-bf16 and --megatron-fsdp-grad-comm-dtype {comm} ask for "
                "different gradient-reduction dtypes: pass one")
    return None


def _engine_for_tp_cp(a: View) -> str | None:
    if a.context_parallel_size > 1 and not a.use_megatron_fsdp:
        return ("--context-parallel-size needs --use-megatron-fsdp (the DDP path replicates "
                "the model)")
    if a.tensor_model_parallel_size > 1 and not a.use_megatron_fsdp:
        return ("--tensor-model-parallel-size needs --use-megatron-fsdp (the DDP path "
                "replicates the model)")
    return None


def _engine_for_ep_outer(a: View) -> str | None:
    if not a.use_megatron_fsdp and (a.expert_model_parallel_size > 1
                                    or a.num_distributed_optimizer_instances > 1):
        return ("expert parallelism and --num-distributed-optimizer-instances need "
                "--use-megatron-fsdp (the DDP path replicates everything)")
    return None


def _engine_for_checkpoints(a: View) -> str | None:
    if (a.save or a.load) and not a.use_megatron_fsdp:
        return "--save and --load need --use-megatron-fsdp (checkpoints are sharded DTensors)"
    return None


def _data_path_list(a: View) -> str | None:
    if a.data_path and len(a.data_path) > 1:
        from mfsdp.data.gpt_dataset import parse_data_path

        try:
            parse_data_path(a.data_path)
        except ValueError as e:
            return str(e)
    return None


def _wandb_dir(a: View) -> str | None:
    if a.wandb_project and not a.wandb_dir:
        return ("--wandb-project needs --wandb-save-dir DIR (or --save, whose wandb/ "
                "subdirectory is then used): W&B keeps its local files there")
    return None


def _profiler_dir(a: View) -> str | None:
    if a.profile and a.use_pytorch_profiler and not a.tensorboard_dir:
        return ("--profile --use-pytorch-profiler writes its trace into --tensorboard-dir, as "
                "Megatron-LM does: pass --tensorboard-dir DIR")
    return None


RULES: tuple[Rule, ...] = (
    *(_always_rule(dest, why) for dest, why in ALWAYS.items()),
    *(_needs_rule(rule) for rule in NEEDS),
    Rule(name="engine_for_tp_cp", check=_engine_for_tp_cp,
         example={"context_parallel_size": 2}),
    Rule(name="engine_for_ep_outer", check=_engine_for_ep_outer,
         example={"num_distributed_optimizer_instances": 2}),
    Rule(name="engine_for_checkpoints", check=_engine_for_checkpoints,
         example={"load": "somewhere"}),
    Rule(name="data_path_list", check=_data_path_list, example={"data_path": ["1", "a", "b"]}),
    Rule(name="grad_comm_dtypes", check=_grad_comm,
         example={"use_megatron_fsdp": True, "grad_reduce_in_bf16": True,
                  "megatron_fsdp_grad_comm_dtype": "fp32"}),
    Rule(name="wandb_dir", check=_wandb_dir,
         example={"wandb_project": "p", "wandb_exp_name": "e"}),
    Rule(name="profiler_trace_dir", check=_profiler_dir,
         example={"profile": True, "use_pytorch_profiler": True}),
)
"""The rules ``TrainConfig.__post_init__`` checks, in this order."""


# -- the rules that need the world size, the model, the file system or the device ------------

def _layout_divides(a: View, world: int, model: Any, device: str | None) -> str | None:
    tp, cp, outer = (a.tensor_model_parallel_size, a.context_parallel_size,
                     a.num_distributed_optimizer_instances)
    if world % (tp * cp * outer):
        return (f"--tensor-model-parallel-size {tp} x --context-parallel-size {cp} x "
                f"--num-distributed-optimizer-instances {outer} does not divide the {world} "
                "ranks")
    return None


def _tensor_parallel_model(a: View, world: int, model: Any, device: str | None) -> str | None:
    tp = a.tensor_model_parallel_size
    if tp > 1:
        from mfsdp.models.tensor_parallel import check_tensor_parallel

        try:
            check_tensor_parallel(model, tp)
        except ValueError as e:
            return f"--tensor-model-parallel-size {tp}: {e}"
    return None


def _expert_tensor_parallel(a: View, world: int, model: Any, device: str | None) -> str | None:
    etp = a.expert_tensor_parallel_size or a.tensor_model_parallel_size  # Megatron-LM's default
    if etp != 1 and model.num_experts:
        return (f"expert tensor parallelism {etp}"
                + ("" if a.expert_tensor_parallel_size else
                   " (Megatron-LM's default for --expert-tensor-parallel-size is the TP size)")
                + ": mfsdp keeps experts whole, split over EP; pass "
                "--expert-tensor-parallel-size 1")
    return None


def _batch_divides(a: View, world: int, model: Any, device: str | None) -> str | None:
    dp = world // (a.tensor_model_parallel_size * a.context_parallel_size)
    per = a.micro_batch_size * dp
    if a.global_batch_size % per:
        return (f"--global-batch-size {a.global_batch_size} is not divisible by "
                f"--micro-batch-size x data-parallel size = {a.micro_batch_size} x {dp}; "
                f"pick a multiple of {per}")
    return None


def _data_files(a: View, world: int, model: Any, device: str | None) -> str | None:
    from mfsdp.data.batches import half_pair, is_indexed_prefix

    if a.data_path and len(a.data_path) == 1 and half_pair(a.data_path[0]):
        return f"--data-path {a.data_path[0]}: {half_pair(a.data_path[0])}"
    if a.data_path and len(a.data_path) == 1 and not is_indexed_prefix(a.data_path[0]) \
            and model.vocab_size < 256:
        return f"--data-path reads bytes: --vocab-size must be at least 256, not {model.vocab_size}"
    return None


def _vocabulary(a: View, world: int, model: Any, device: str | None) -> str | None:
    if model.vocab_size < 2:
        return f"--vocab-size {model.vocab_size}: a language model needs at least 2 tokens"
    return None


def _experts(a: View, world: int, model: Any, device: str | None) -> str | None:
    ep = a.expert_model_parallel_size
    if ep > 1 and model.num_experts == 0:
        return (f"--expert-model-parallel-size {ep} needs an MoE model (--num-experts > 0 or "
                "--model-preset deepseek-proxy)")
    if model.num_experts and model.num_experts % ep:
        return (f"--expert-model-parallel-size {ep} does not divide the {model.num_experts} "
                "experts (--num-experts); pick a divisor")
    return None


def _router_topk(a: View, world: int, model: Any, device: str | None) -> str | None:
    if model.num_experts and model.moe_router_topk > model.num_experts:
        return (f"--moe-router-topk {model.moe_router_topk} exceeds the {model.num_experts} "
                "experts (--num-experts)")
    return None


def _bias_rate(a: View, world: int, model: Any, device: str | None) -> str | None:
    rate = a.moe_router_bias_update_rate
    if rate != a.default("moe_router_bias_update_rate") and not model.moe_router_enable_expert_bias:
        return (f"--moe-router-bias-update-rate {rate} needs the balancing bias it updates: add "
                "--moe-router-enable-expert-bias (or a preset that has it, such as "
                "deepseek-proxy)")
    return None


def _profiler_device(a: View, world: int, model: Any, device: str | None) -> str | None:
    if a.profile and not a.use_pytorch_profiler and device == "cpu":
        return ("--profile without --use-pytorch-profiler marks an nsys capture range "
                "(cudaProfilerStart/Stop), which needs CUDA; on CPU add --use-pytorch-profiler "
                "for a torch.profiler trace")
    if a.record_memory_history and device == "cpu":
        return ("--record-memory-history records the CUDA caching allocator, which a CPU run "
                "does not use; on CPU the log's rss and state_mib columns (--log-jsonl) show "
                "memory per iteration")
    return None


def _paths(a: View, world: int, model: Any, device: str | None) -> str | None:
    """Every path the run writes can be written, checked before the model is built."""
    if a.save:
        said = _save_dir(Path(a.save))
        if said:
            return said
    dump = a.dump_param_to_param_group_map
    for flag, path, file in (("--log-jsonl", a.log_jsonl, True),
                             ("--tensorboard-dir", a.tensorboard_dir, False),
                             ("--wandb-save-dir", a.wandb_save_dir, False),
                             ("--data-cache-path", a.data_cache_path, False),
                             ("--dump-param-to-param-group-map", dump,
                              bool(dump) and dump.endswith(".json"))):
        said = _writable(flag, Path(path), file) if path else None
        if said:
            return said
    return None


def _writable(flag: str, path: Path, file: bool) -> str | None:
    """Why ``path`` cannot be written, or None: a file (``file``) goes into an existing
    directory this process may write in; a directory may be created below the nearest one
    that exists."""
    if file:
        if path.is_dir():
            return f"{flag} {path} is a directory; name a file in it"
        if path.exists() and not os.access(path, os.W_OK):
            return f"{flag} {path}: the file is not writable by this process"
        parent = path.parent
        if not parent.is_dir():
            return (f"{flag} {path}: the directory {parent} does not exist; create it or name "
                    "a file in an existing directory")
    else:
        if path.exists() and not path.is_dir():
            return f"{flag} {path} is a file; name a directory"
        parent = path
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            return f"{flag} {path}: {parent} is a file, not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return (f"{flag} {path}: {parent} is not a directory this process may write in; "
                "choose another path")
    return None


def _save_dir(save: Path) -> str | None:
    """Why ``--save`` cannot be written, or None: it must be a directory or not exist yet
    below a directory this process may write in."""
    if save.exists() and not save.is_dir():
        return f"--save {save} is a file; name a directory (new or one --save wrote)"
    parent = save
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        return (f"--save {save}: {parent} is not a directory this process may write in; "
                "choose another --save")
    return None


_FSDP = {"use_megatron_fsdp": True}

LAYOUT_RULES: tuple[Rule, ...] = (
    Rule(name="layout_divides_ranks", check=_layout_divides,
         example={**_FSDP, "tensor_model_parallel_size": 3}, world=2),
    Rule(name="tensor_parallel_model", check=_tensor_parallel_model,
         example={**_FSDP, "tensor_model_parallel_size": 3, "global_batch_size": 2,
                  "micro_batch_size": 1}, world=3),
    Rule(name="expert_tensor_parallel", check=_expert_tensor_parallel,
         example={**_FSDP, "num_experts": 4, "expert_tensor_parallel_size": 2}),
    Rule(name="global_batch_divides", check=_batch_divides,
         example={"global_batch_size": 5, "micro_batch_size": 2}),
    Rule(name="data_files", check=_data_files, example={"data_path": ["bundled"],
                                                        "vocab_size": 128}),
    Rule(name="vocabulary", check=_vocabulary, example={"vocab_size": 1}),
    Rule(name="experts", check=_experts,
         example={**_FSDP, "num_experts": 3, "expert_model_parallel_size": 2}, world=2),
    Rule(name="router_topk", check=_router_topk, example={"num_experts": 2,
                                                          "moe_router_topk": 3}),
    Rule(name="expert_bias_rate", check=_bias_rate,
         example={"num_experts": 4, "moe_router_bias_update_rate": 0.01}),
    Rule(name="profiler_device", check=_profiler_device, example={"record_memory_history": True}),
    Rule(name="paths", check=_paths, example={"log_jsonl": "/"}),
)
"""The rules ``TrainConfig.validate`` checks, in this order."""


def check(config: Any, world_size: int | None = None, model: Any = None,
          device: str | None = "cpu") -> None:
    """Raise ``ValueError`` with the first broken rule's line: :data:`RULES` without a
    ``world_size``, :data:`LAYOUT_RULES` with one (``model``: the model's ``GPTConfig``;
    ``device``: ``"cpu"``, ``"cuda"``, or None to leave the device's rules out)."""
    view = View(config)
    for rule in RULES if world_size is None else LAYOUT_RULES:
        said = (rule.check(view) if world_size is None
                else rule.check(view, world_size, model, device))
        if said:
            raise ValueError(said)


def examples(config_cls: type) -> list[Rule]:
    """Every rule with its example filled in (a :class:`Needs` rule's: a value other than
    the flag's default, and what the value needs besides): the tests' list of refusals."""
    view = View(config_cls())
    needs = {n.dest: n for n in NEEDS}
    out = []
    for rule in RULES + LAYOUT_RULES:
        if rule.name in needs and not rule.example:
            n = needs[rule.name]
            value = n.example if n.example is not None else _other_value(view, n.dest)
            rule = dataclasses.replace(rule, example={n.dest: value, **n.also})
        out.append(rule)
    return out
