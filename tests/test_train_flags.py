"""Every flag of ``mfsdp train --help`` acts, or is refused.

What these tests prove:

* ``test_every_flag_acts_or_is_refused`` walks the parser's actions (all of them: a flag added
  later without an entry here fails it). For each flag it parses a command that sets the flag to a
  value other than its default and checks that the parsed field changed. Then it checks the
  flag's effect, observed through the code that acts on it (:data:`OBSERVERS`): the model config
  the trainer's model builder makes (``model_config``), the mixed-precision policy handed to
  ``fully_shard``, the optimizer and learning-rate schedule the trainer builds, or the sharded
  model ``build_sharded_model`` builds on a fake process group of 8 ranks (engine strategy,
  options and groups, each parameter's shape, dtype and sum). The observation with the flag must
  differ from the one without it: a flag whose value is dropped on its way fails. A flag whose
  reader acts only while training (:data:`RUN_TIME`: loop, checkpoints, data files, logs,
  profiler, signals) must set exactly the typed config field it documents and no other; one that
  is refused on its own must be refused with a message naming it.
* ``test_a_flag_is_refused_where_it_would_do_nothing`` takes every rule of
  :data:`mfsdp.trainer.refusals.NEEDS` (again all of them): without the flags it works with, the
  flag is refused with a line that starts with its spelling; with them, it is accepted.
* The behaviour tests below check that the flags of the issue act: ``--mock-data`` selects
  synthetic data, ``--rope-scaling-factor`` reaches the model with ``--use-rope-scaling``, and
  ``--grad-reduce-in-bf16`` sets the gradient-communication dtype (with an agreeing
  ``--megatron-fsdp-grad-comm-dtype`` too); and a refusal is one line with exit status 2 at the CLI.

What they do not prove: that a changed build changes the training result, or that a run-time
field is used while training. That is what each feature's own tests do (tests/test_train.py,
tests/test_data.py, tests/test_reliability.py, ...).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest

from mfsdp.trainer.arguments import build_parser, checked_config
from mfsdp.trainer.config import TrainConfig, rules
from mfsdp.trainer.refusals import ALWAYS, NEEDS, check_combinations, flag_of

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
        "--ffn-hidden-size", "32", "--vocab-size", "64"]
WORLD = 8  # the fake process group's size the engine flags are built on


def _fields(obj, prefix: str = "") -> dict:
    """A dataclass's fields, nested ones flattened as ``group.field``."""
    out = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if is_dataclass(value):
            out.update(_fields(value, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = value
    return out


def _model(args) -> dict:
    """The :class:`~mfsdp.models.config.GPTConfig` the trainer's model builder makes."""
    from mfsdp.trainer.build import model_config

    return _fields(model_config(args))


def _precision(args) -> str:
    """The mixed-precision policy the trainer hands to ``fully_shard``."""
    from mfsdp.trainer.build import precision_policy
    from mfsdp.trainer.config import TrainConfig

    return repr(precision_policy(TrainConfig.from_args(args, logging=False).precision))


def _optimizer(args) -> tuple:
    """The optimizer the trainer builds (its class and hyperparameters per group) and the
    learning rate of its first 60 iterations."""
    import torch

    from mfsdp.trainer.build import build_param_groups, learning_rate, make_optimizer
    from mfsdp.trainer.config import TrainConfig

    training = TrainConfig.from_args(args, logging=False).training
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    opt = make_optimizer(build_param_groups(model, training), training)
    return (type(opt).__name__, [{k: v for k, v in g.items() if k != "params"}
                                 for g in opt.param_groups],
            [learning_rate(training, i) for i in range(1, 61)])


def _engine(args) -> dict:
    """What the trainer's model builder (``build_sharded_model``, as ``mfsdp plan --dry-run``
    calls it) makes of the flags on rank 0 of a fake process group of :data:`WORLD` ranks, on
    the CPU: the wrapper, the engine's strategy, precision and options, the groups, each
    parameter's shape, dtype and sum, the optimizer's groups, and which layers are compiled."""
    import gc
    import threading

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from mfsdp.trainer.build import model_config
    from mfsdp.trainer.config import TrainConfig
    from mfsdp.trainer.parallel import build_sharded_model

    config, cfg = TrainConfig.from_args(args, logging=False), model_config(args)
    out: dict = {}

    def build():  # (a thread of its own, as the dry run's: DTensor caches meshes per thread)
        dist.init_process_group("fake", rank=0, world_size=WORLD, store=FakeStore())
        try:
            model, inner, opt, par = build_sharded_model(config, cfg, WORLD, torch.device("cpu"),
                                                         log=lambda *a, **k: None)
            state = model.fsdp_state() if hasattr(model, "fsdp_state") else None
            out["built"] = {
                "wrapper": type(model).__name__,
                "engine": None if state is None else (
                    state.strategy, repr(state.mp_policy), repr(state.options),
                    [(c.name, c.size) for c in state.comms.distinct()]),
                "layout": (repr(par.layout), par.sequence_parallel, par.cp, par.dp_size),
                "params": [(n, tuple(p.shape), str(p.dtype),
                            None if p.is_meta else round(float(p.detach().float().sum()), 4))
                           for n, p in inner.named_parameters()],
                "optimizer": [{k: v for k, v in g.items() if k != "params"}
                              for g in opt.param_groups],
                # which layers' forward runs through torch.compile (--compile)
                "compiled": [hasattr(layer.forward, "_torchdynamo_orig_callable")
                             for layer in inner.layers]}
        except BaseException as exc:  # handed to the test's thread
            out["error"] = exc
        finally:
            dist.destroy_process_group()
            gc.collect()

    thread = threading.Thread(target=build)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["built"]


# How each flag's effect is observed: by the code that acts on it, given the parsed flags. A flag
# passes when the observation with it differs from the observation without it.
OBSERVERS = {
    "model": (_model, [], (
        "model_preset", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
        "vocab_size", "max_position_embeddings", "swiglu", "normalization", "norm_epsilon",
        "position_embedding_type", "rotary_base", "use_rope_scaling", "rope_scaling_factor",
        "rotary_interleaved", "group_query_attention", "num_query_groups", "kv_channels",
        "disable_bias_linear", "add_qkv_bias", "qk_layernorm", "multi_latent_attention",
        "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
        "init_method_std", "recompute_granularity", "recompute_method", "recompute_num_layers",
        "num_experts", "moe_router_topk", "moe_first_dense_layers", "moe_ffn_hidden_size",
        "moe_shared_expert_intermediate_size", "moe_router_score_function",
        "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_shared_expert_gate",
        "moe_router_num_groups", "moe_router_group_topk", "moe_router_enable_expert_bias",
        "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_expert_capacity_factor",
        "moe_token_drop_policy", "moe_pad_expert_input_to_capacity", "moe_token_dispatcher_type",
        "moe_flex_dispatcher_backend", "moe_grouped_gemm", "seq_length",
        "make_vocab_size_divisible_by")),
    "precision": (_precision, ["--use-megatron-fsdp"], (
        "grad_reduce_in_bf16", "megatron_fsdp_main_params_dtype",
        "megatron_fsdp_main_grads_dtype", "megatron_fsdp_grad_comm_dtype")),
    "optimizer": (_optimizer, [], (
        "lr", "min_lr", "lr_warmup_iters", "lr_decay_style", "lr_decay_iters", "lr_warmup_init",
        "lr_wsd_decay_iters", "lr_wsd_decay_style", "weight_decay", "optimizer", "sgd_momentum",
        "adam_beta1", "adam_beta2", "adam_eps", "train_iters", "train_samples", "fused_adam")),
    "engine": (_engine, TINY, (
        "use_megatron_fsdp", "data_parallel_sharding_strategy", "outer_dp_sharding_strategy",
        "num_distributed_optimizer_instances", "expert_model_parallel_size",
        "tensor_model_parallel_size", "sequence_parallel", "context_parallel_size",
        "create_all_gather_group", "fsdp_double_buffer", "init_model_with_meta_device",
        "overlap_grad_reduce", "overlap_param_gather", "calculate_per_token_loss", "bf16",
        "seed", "compile")),
}
# Flags whose effect is at run time only (the loop, checkpoints, data files, logs, profiler,
# signals): here the value must reach the one typed config field it documents (the field whose
# docstring is its --help) and no other; each feature's own tests run it (tests/test_train.py,
# tests/test_data.py, tests/test_reliability.py, tests/test_preemption.py, ...).
RUN_TIME = (
    "micro_batch_size", "global_batch_size", "clip_grad", "check_for_nan_in_loss_and_grad",
    "moe_router_bias_update_rate", "mock_data", "data_path", "split", "data_cache_path",
    "tokenizer_type", "tokenizer_model", "eval_interval", "eval_iters", "sequence_packing",
    "distributed_timeout_minutes", "debug", "save", "load", "exit_on_missing_checkpoint",
    "exit_signal_handler", "exit_duration_in_mins", "exit_interval", "save_interval",
    "override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler", "ckpt_verify",
    "ckpt_format", "dump_param_to_param_group_map", "log_interval", "log_jsonl",
    "tensorboard_dir", "log_throughput", "wandb_project", "wandb_exp_name", "wandb_save_dir",
    "wandb_entity", "profile", "use_pytorch_profiler", "profile_step_start", "profile_step_end",
    "profile_ranks", "pytorch_profiler_collect_shapes", "pytorch_profiler_collect_callstack",
    "record_memory_history", "memory_snapshot_path", "expert_tensor_parallel_size")
# The typed fields a run-time flag sets, where they are not the group field of the flag's name
# (W&B, once on, keeps its files in --save/wandb unless --wandb-save-dir names a directory)
RUN_TIME_FIELDS = {"wandb_save_dir": {"logging.wandb_save_dir", "logging.wandb_dir"},
                   **{d: {f"logging.{d}", "logging.wandb_dir"} for d in (
                       "wandb_project", "wandb_exp_name")}}
# Accepted, and observably without effect on every model mfsdp builds (the flag only undoes a
# preset's tied embeddings, and no preset ties them): checked to still change nothing.
NO_EFFECT = {"untie_embeddings_and_output_weights": "model"}

# Values that act where the generic "other value" would not (it equals the preset's, or the
# layout cannot take it on WORLD ranks), and the words each flag needs beside it.
OTHER: dict[str, list[str]] = {
    "hidden_size": ["--hidden-size", "96"], "num_attention_heads": ["--num-attention-heads", "8"],
    "normalization": ["--normalization", "RMSNorm"],
    "position_embedding_type": ["--position-embedding-type", "rope"],
    "moe_router_score_function": ["--moe-router-score-function", "sigmoid"],
    "moe_token_drop_policy": ["--moe-token-drop-policy", "position"],
    "num_query_groups": ["--num-query-groups", "2"], "kv_channels": ["--kv-channels", "8"],
    "model_preset": ["--model-preset", "llama-tiny"],
    "recompute_method": ["--recompute-method", "block"],
    "lr_warmup_iters": ["--lr-warmup-iters", "5"], "lr_decay_iters": ["--lr-decay-iters", "20"],
    "lr_wsd_decay_iters": ["--lr-wsd-decay-iters", "10"], "train_iters": ["--train-iters", "40"],
    "recompute_granularity": ["--recompute-granularity", "selective"],
    "recompute_num_layers": ["--recompute-num-layers", "2"],
    "split": ["--split", "90,10,0"],
    "profile_step_end": ["--profile-step-end", "30"],  # (after --profile-step-start's 10)
    "train_samples": ["--train-samples", "64", "--global-batch-size", "2"],
    "num_distributed_optimizer_instances": ["--num-distributed-optimizer-instances", "2"],
    "expert_model_parallel_size": ["--expert-model-parallel-size", "2"],
    "tensor_model_parallel_size": ["--tensor-model-parallel-size", "2"],
    "context_parallel_size": ["--context-parallel-size", "2"],
}
BESIDE: dict[str, list[str]] = {
    "multi_latent_attention": ["--position-embedding-type", "rope"],
    "recompute_method": ["--recompute-granularity", "full", "--recompute-num-layers", "1",
                         "--recompute-method", "uniform"],
    "recompute_num_layers": ["--recompute-granularity", "full", "--recompute-method", "block",
                             "--recompute-num-layers", "1"],
    **{d: ["--num-experts", "4"] for d in (
        "moe_router_topk", "moe_first_dense_layers", "moe_ffn_hidden_size",
        "moe_shared_expert_intermediate_size", "moe_router_score_function",
        "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_shared_expert_gate",
        "moe_router_num_groups", "moe_router_group_topk", "moe_router_enable_expert_bias",
        "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_expert_capacity_factor",
        "moe_token_drop_policy", "moe_pad_expert_input_to_capacity", "moe_token_dispatcher_type",
        "moe_grouped_gemm", "expert_model_parallel_size")},
    "moe_flex_dispatcher_backend": ["--num-experts", "4", "--moe-token-dispatcher-type", "flex"],
    "moe_router_group_topk": ["--num-experts", "4", "--moe-router-num-groups", "2"],
    # (expert parallelism needs the engine: a rule of TrainConfig)
    "expert_model_parallel_size": ["--num-experts", "4", "--use-megatron-fsdp"],
    "make_vocab_size_divisible_by": ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"],
    "sgd_momentum": ["--optimizer", "sgd"],
    **{d: ["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "10", "--train-iters", "40"]
       for d in ("lr_wsd_decay_style",)},
    "lr_wsd_decay_iters": ["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "5",
                           "--train-iters", "40"],
    **{d: ["--lr-warmup-iters", "5"] for d in ("lr_warmup_init",)},
    **{d: ["--train-iters", "40"] for d in ("lr_decay_iters", "lr_decay_style", "min_lr")},
    "outer_dp_sharding_strategy": ["--num-distributed-optimizer-instances", "2"],
    "sequence_parallel": ["--use-megatron-fsdp", "--tensor-model-parallel-size", "2"],
    **{d: ["--use-megatron-fsdp"] for d in (  # (the others have it from COMBOS)
        "num_distributed_optimizer_instances", "tensor_model_parallel_size",
        "context_parallel_size", "calculate_per_token_loss", "bf16", "seed")},
    "tokenizer_model": ["--tokenizer-type", "HuggingFaceTokenizer"],
    # (--save and --load need the engine: a rule of TrainConfig)
    **{d: ["--use-megatron-fsdp"] for d in ("save", "load")},
    "save_interval": ["--save", "somewhere", "--use-megatron-fsdp"],
    **{d: ["--wandb-project", "p", "--wandb-exp-name", "e", "--save", "somewhere",
           "--use-megatron-fsdp"] for d in ("wandb_save_dir", "wandb_entity")},
    **{d: ["--save", "somewhere", "--use-megatron-fsdp"] for d in (
        "wandb_project", "wandb_exp_name")},
    # (the torch.profiler trace is an option of --profile, written into --tensorboard-dir)
    "use_pytorch_profiler": ["--profile", "--tensorboard-dir", "tb"],
}
# Flags that only go in pairs (each alone is refused): the partner comes with the flag.
TOGETHER: dict[str, list[str]] = {
    "group_query_attention": ["--num-query-groups", "2"],
    "num_query_groups": ["--group-query-attention"],
    "wandb_project": ["--wandb-exp-name", "e"], "wandb_exp_name": ["--wandb-project", "p"],
}


def _parse(words: list[str]):
    parser = build_parser()
    args = parser.parse_args(words)
    check_combinations(args, parser)  # (the flags' own rules: a combination that would be
    return args                         # refused is no test of an effect)


def _flag_actions():
    return [a for a in build_parser()._actions if a.option_strings and a.dest != "help"]


def _walked(action) -> bool:
    """The "on" spelling of a switch that is on by default is walked by its "off" spelling."""
    return not (action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)
                and action.const == action.default)


def _other_value(action: argparse.Action) -> list[str]:
    """Command-line words that set ``action`` to a value other than its default."""
    if action.dest in OTHER:
        return OTHER[action.dest]
    if action.nargs == 0:  # a switch
        if isinstance(action, argparse.BooleanOptionalAction):
            return [action.option_strings[1 if action.default else 0]]
        return [action.option_strings[0]]
    if action.choices:
        return [action.option_strings[0], next(c for c in action.choices if c != action.default)]
    value = {int: "3", float: "0.5"}.get(action.type, "3" if action.type else "somewhere")
    if action.type is not None and action.type not in (int, float, str):
        value = "0.5" if "float" in action.type.__name__ or "beta" in action.type.__name__ \
            else "3"
    if action.default is not None and str(action.default) == value:
        value = "4"
    return [action.option_strings[0], value]


def _observer(dest: str) -> str | None:
    found = [name for name, (_, _, dests) in OBSERVERS.items() if dest in dests]
    assert len(found) <= 1, (dest, found)
    return found[0] if found else NO_EFFECT.get(dest)


@pytest.mark.parametrize("action", [a for a in _flag_actions() if _walked(a)],
                         ids=lambda a: a.option_strings[0])
def test_every_flag_acts_or_is_refused(action):
    """Every flag of ``mfsdp train --help`` changes what the trainer builds, or reaches the one
    typed config field its run-time reader takes, or is refused on its own."""
    from mfsdp.trainer.config import TrainConfig

    parser = build_parser()
    words = _other_value(action)
    dest = action.dest
    assert getattr(parser.parse_args(words), dest) != parser.get_default(dest), words
    if dest in ALWAYS:
        assert _observer(dest) is None and dest not in RUN_TIME, dest
        with pytest.raises(SystemExit, match=f"^{flag_of(parser, dest)}: "):
            check_combinations(parser.parse_args(words), parser)
        return
    base = COMBOS.get(dest, ([], []))[1] + BESIDE.get(dest, [])
    words = words + TOGETHER.get(dest, [])
    name = _observer(dest)
    if name is None:  # run time: the value lands in its typed field, and nothing else moves
        assert dest in RUN_TIME, f"{words[0]} is observed nowhere: add it to OBSERVERS or RUN_TIME"
        before = _fields(TrainConfig.from_args(_parse(base)))
        after = _fields(TrainConfig.from_args(_parse(base + words)))
        moved = {k for k in before if before[k] != after[k]} - {"logging.run_config"}
        partners = {a.dest for a in parser._actions if set(a.option_strings) & set(
            TOGETHER.get(dest, []))}
        assert moved == set().union(*(RUN_TIME_FIELDS.get(d) or {
            next(k for k in before if k.endswith("." + d))} for d in {dest} | partners)), (
            words, moved)
        return
    observe, observer_base, _ = OBSERVERS[name]
    before = observe(_parse(observer_base + base))
    after = observe(_parse(observer_base + base + words))
    if dest in NO_EFFECT:
        assert after == before, f"{words[0]} acts now: move it from NO_EFFECT to OBSERVERS"
    else:
        assert after != before, f"{words} changes nothing the {name} builder makes"


def test_the_tables_name_only_real_flags():
    dests = {a.dest for a in _flag_actions()}
    observed = [d for _, _, ds in OBSERVERS.values() for d in ds]
    assert len(observed) == len(set(observed))  # one observer each
    assert set(observed) | set(RUN_TIME) | set(NO_EFFECT) | set(ALWAYS) == dests
    assert not set(observed) & set(RUN_TIME)
    assert {rule.dest for rule in NEEDS} <= dests
    assert set(OTHER) | set(BESIDE) | set(TOGETHER) <= dests


# NEEDS rule -> (words that leave the flag without effect, words that give it its effect)
COMBOS: dict[str, tuple[list[str], list[str]]] = {
    **{dest: ([], ["--use-megatron-fsdp"]) for dest in (
        "data_parallel_sharding_strategy", "outer_dp_sharding_strategy", "fsdp_double_buffer",
        "create_all_gather_group", "init_model_with_meta_device", "overlap_grad_reduce",
        "overlap_param_gather", "grad_reduce_in_bf16", "megatron_fsdp_main_params_dtype",
        "megatron_fsdp_main_grads_dtype", "megatron_fsdp_grad_comm_dtype",
        "dump_param_to_param_group_map")},
    "outer_dp_sharding_strategy": ([], ["--use-megatron-fsdp",
                                        "--num-distributed-optimizer-instances", "2"]),
    "rope_scaling_factor": ([], ["--use-rope-scaling"]),
    "moe_flex_dispatcher_backend": ([], ["--moe-token-dispatcher-type", "flex"]),
    "mock_data": (["--data-path", "bundled"], []),
    "make_vocab_size_divisible_by": ([], ["--tokenizer-type", "NullTokenizer"]),
    # (a weighted list names indexed datasets without reading them)
    **{d: ([], ["--data-path", "1", "a", "1", "b"]) for d in ("eval_interval", "eval_iters")},
    "sgd_momentum": ([], ["--optimizer", "sgd"]),
    **{d: (["--optimizer", "sgd"], []) for d in ("adam_beta1", "adam_beta2", "adam_eps",
                                                 "fused_adam")},
    **{d: ([], ["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "2"])
       for d in ("lr_wsd_decay_style", "lr_wsd_decay_iters")},
    "ckpt_format": ([], ["--save", "somewhere", "--use-megatron-fsdp"]),
    **{d: ([], ["--load", "somewhere", "--use-megatron-fsdp"]) for d in (
        "ckpt_verify", "override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler",
        "exit_on_missing_checkpoint")},
    **{d: ([], ["--profile"]) for d in ("profile_step_start", "profile_step_end",
                                        "profile_ranks")},
    **{d: (["--profile"], ["--profile", "--use-pytorch-profiler", "--tensorboard-dir", "tb"])
       for d in (
        "pytorch_profiler_collect_shapes", "pytorch_profiler_collect_callstack")},
    "memory_snapshot_path": ([], ["--record-memory-history"]),
}


@pytest.mark.parametrize("rule", NEEDS, ids=lambda r: r.dest)
def test_a_flag_is_refused_where_it_would_do_nothing(rule):
    """The flag with a value of the rule's example (what it needs besides included) and the
    words that leave it without effect is refused in one line starting with its spelling; the
    flag alone with the words that give it its effect is accepted."""
    parser = build_parser()
    example = next(r for r in rules.examples(TrainConfig) if r.name == rule.dest).example
    without, with_ = COMBOS[rule.dest]
    args = parser.parse_args(rules.command_line(TrainConfig, example) + without)
    with pytest.raises(SystemExit) as refused:
        check_combinations(args, parser)
    line = str(refused.value.code)
    assert line.startswith(flag_of(parser, rule.dest, getattr(args, rule.dest)) + " "), line
    assert "\n" not in line
    alone = rules.command_line(TrainConfig, {rule.dest: example[rule.dest]})
    check_combinations(parser.parse_args(alone + with_), parser)  # accepted


def test_every_rule_is_walked():
    assert set(COMBOS) == {rule.dest for rule in NEEDS}


def test_the_gradient_communication_flags_agree_or_are_refused():
    """``--grad-reduce-in-bf16`` is ``--megatron-fsdp-grad-comm-dtype bf16``: together they are
    accepted when they agree and refused when they do not (no value silently wins)."""
    import torch

    from mfsdp.trainer.build import precision_policy

    parser = build_parser()
    fsdp = ["--use-megatron-fsdp"]
    for words in (["--grad-reduce-in-bf16"], ["--megatron-fsdp-grad-comm-dtype", "bf16"],
                  ["--grad-reduce-in-bf16", "--megatron-fsdp-grad-comm-dtype", "bf16"]):
        args = parser.parse_args(fsdp + words)
        check_combinations(args, parser)
        assert precision_policy(args).grad_comm_dtype == torch.bfloat16, words
    assert precision_policy(parser.parse_args(fsdp)).grad_comm_dtype is None
    for comm in ("fp32", "fp16"):
        args = parser.parse_args(fsdp + ["--grad-reduce-in-bf16",
                                         "--megatron-fsdp-grad-comm-dtype", comm])
        with pytest.raises(SystemExit, match=f"^--grad-reduce-in-bf16 and "
                                             f"--megatron-fsdp-grad-comm-dtype {comm} ask"):
            check_combinations(args, parser)


def test_rope_scaling_factor_reaches_the_model_with_use_rope_scaling():
    """Megatron-LM applies ``--rope-scaling-factor`` only with ``--use-rope-scaling``: with it the
    model's config holds the factor (8 by default, as Megatron-LM's), without it the factor is
    refused (above) and the preset's RoPE is unscaled."""
    from mfsdp.trainer.build import model_config

    parser = build_parser()
    rope = ["--position-embedding-type", "rope"]
    assert model_config(parser.parse_args(rope)).rope_scaling_factor is None
    assert model_config(parser.parse_args(rope + ["--use-rope-scaling"])).rope_scaling_factor == 8.0
    cfg = model_config(parser.parse_args(rope + ["--use-rope-scaling", "--rope-scaling-factor",
                                                 "4"]))
    assert cfg.rope_scaling_factor == 4.0


def test_mock_data_selects_synthetic_data_and_contradicts_data_path():
    from mfsdp.data.batches import read_data
    from mfsdp.trainer.config import TrainConfig

    parser = build_parser()
    mock = TrainConfig.from_args(parser.parse_args(["--mock-data"]))
    assert read_data(mock.data, mock.training) is None  # synthetic sequences
    bundled = TrainConfig.from_args(parser.parse_args(["--data-path", "bundled"]))
    text = read_data(bundled.data, bundled.training)
    assert text is not None and text.dtype.is_floating_point is False and len(text) > 1000
    with pytest.raises(SystemExit, match="^--mock-data contradicts --data-path"):
        check_combinations(parser.parse_args(["--mock-data", "--data-path", "bundled"]), parser)


def test_nccl_user_buffers_are_refused_by_the_trainer_and_the_api_alike():
    """mfsdp registers no NCCL user buffers: ``fully_shard_model(nccl_ub=True)`` and
    ``--use-nccl-ub`` are both refused, with the same reason."""
    import torch

    import mfsdp
    from mfsdp.config import not_implemented_reason

    reason = not_implemented_reason("nccl_ub")
    with pytest.raises(ValueError) as api:
        mfsdp.fully_shard_model(torch.nn.Linear(2, 2), nccl_ub=True)
    assert reason in str(api.value)
    parser = build_parser()
    for flag in ("--use-nccl-ub", "--fsdp-manual-registration"):
        with pytest.raises(SystemExit) as cli:
            check_combinations(parser.parse_args([flag]), parser)
        assert str(cli.value.code).startswith(f"{flag}: ") and reason in str(cli.value.code)


def test_a_refusal_at_the_command_line_is_one_line_and_status_2():
    """``python -m mfsdp.train`` (one process): the refusal comes before the model is built."""
    proc = subprocess.run([sys.executable, "-m", "mfsdp.train", "--fsdp-double-buffer",
                           "--train-iters", "1"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip() == ("mfsdp train: error: --fsdp-double-buffer needs "
                                   "--use-megatron-fsdp (the DDP path replicates the model with "
                                   "PyTorch DDP and gathers no weights into a buffer)")
    assert proc.stdout == ""


def test_the_expert_bias_rate_needs_the_expert_bias():
    """``--moe-router-bias-update-rate`` is refused for a model without the balancing bias, and
    accepted with it, from the flag or from the preset (deepseek-proxy has it)."""
    parser = build_parser()
    rate = ["--moe-router-bias-update-rate", "0.01"]
    args = parser.parse_args(rate + ["--num-experts", "4"])
    with pytest.raises(SystemExit, match=r"^--moe-router-bias-update-rate 0.01 needs"):
        checked_config(args, 1)
    for words in (["--num-experts", "4", "--moe-router-enable-expert-bias"],
                  ["--model-preset", "deepseek-proxy"]):
        checked_config(parser.parse_args(rate + words), 1)


def test_the_logging_flags_become_a_logging_config():
    """:class:`~mfsdp.trainer.config.LoggingConfig` holds the logging flags as parsed (W&B's
    directory defaulting to ``--save``/wandb, as Megatron-LM's) and refuses what cannot log."""
    from mfsdp.trainer.config import LoggingConfig

    parser = build_parser()
    config = LoggingConfig.from_args(parser.parse_args(
        ["--log-interval", "7", "--log-jsonl", "run.jsonl", "--log-throughput",
         "--wandb-project", "p", "--wandb-exp-name", "e", "--save", "ckpt"]))
    assert (config.log_interval, config.log_jsonl, config.log_throughput) == (7, "run.jsonl", True)
    assert (config.wandb_project, config.wandb_exp_name, config.wandb_dir) == (
        "p", "e", str(Path("ckpt") / "wandb"))
    assert config.run_config["save"] == "ckpt" and config.tensorboard_dir is None
    assert LoggingConfig.from_args(parser.parse_args(
        ["--wandb-project", "p", "--wandb-exp-name", "e", "--wandb-save-dir", "w",
         "--save", "ckpt"])).wandb_dir == "w"
    default = LoggingConfig.from_args(parser.parse_args([]))
    assert (default.log_interval, default.log_jsonl, default.wandb_dir) == (100, None, "")
    with pytest.raises(ValueError, match=r"^LoggingConfig: log_interval=0 must be at least 1"):
        LoggingConfig(log_interval=0)
    with pytest.raises(ValueError, match=r"^--wandb-project needs --wandb-exp-name"):
        LoggingConfig(wandb_project="p")
    with pytest.raises(ValueError, match=r"^--wandb-project needs --wandb-save-dir"):
        TrainConfig(logging=LoggingConfig(wandb_project="p", wandb_exp_name="e"))


def test_the_parser_is_generated_from_the_config_groups():
    """Each argument group of the parser lists the flag fields of its config classes, in their
    order and with their defaults; ``TrainConfig.from_args`` hands each group its flags' values
    (``--train-samples`` setting the iterations) and a group's own check is the command's
    refusal."""
    from dataclasses import MISSING

    from mfsdp.trainer.config import GROUPS, TrainConfig, flag_fields

    parser = build_parser()
    for title, kinds in GROUPS:
        group = next(g for g in parser._action_groups if g.title == title)
        fields_ = [f for kind in kinds for f in flag_fields(kind)]
        assert list(dict.fromkeys(a.dest for a in group._group_actions)) == [f.name for f in fields_]
        for f in fields_:
            default = f.default_factory() if f.default is MISSING else f.default
            assert parser.get_default(f.name) == default, f.name
    config = TrainConfig.from_args(parser.parse_args(
        ["--seq-length", "32", "--use-megatron-fsdp", "--log-interval", "3", "--num-experts", "4",
         "--train-samples", "80", "--global-batch-size", "8", "--split", "90,10,0"]))
    assert (config.training.seq_length, config.parallel.use_megatron_fsdp,
            config.logging.log_interval, config.moe.num_experts, config.data.split) == (
        32, True, 3, 4, "90,10,0")
    assert config.training.train_iters == 10  # 80 samples / 8 per iteration
    with pytest.raises(SystemExit, match="^--save-interval needs --save DIR$"):
        TrainConfig.from_args(parser.parse_args(["--save-interval", "2"]))


def test_a_flag_is_declared_once_its_docstring_is_its_help():
    """A flag field names neither its flag nor its help: the flag is the field's name with dashes
    (or the names it gives), the ``--help`` line its docstring, with the default added where the
    flag takes a value."""
    from mfsdp.trainer.config import GROUPS, flag_fields
    from mfsdp.trainer.config.flags import field_docs

    parser = build_parser()
    by_dest = {}
    for action in parser._actions:
        by_dest.setdefault(action.dest, action)
    for _, kinds in GROUPS:
        for kind in kinds:
            docs = field_docs(kind)
            for f in flag_fields(kind):
                action = by_dest[f.name]
                assert f.name in docs, f"{kind.__name__}.{f.name} has no docstring"
                assert action.help.startswith(docs[f.name]), f.name
                if not f.metadata["names"]:
                    assert action.option_strings[0] == "--" + f.name.replace("_", "-")
    assert by_dest["micro_batch_size"].help.endswith("(default: %(default)s)")
    assert by_dest["use_megatron_fsdp"].nargs == 0 and "default" not in by_dest[
        "use_megatron_fsdp"].help  # a bool field is a switch, its help shows no default
