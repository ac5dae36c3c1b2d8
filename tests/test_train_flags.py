"""Every flag of ``mfsdp train --help`` is either read by the trainer or refused.

What these tests prove:

* ``test_every_flag_is_read_or_refused`` walks the parser's actions (all of them: a flag added
  later without an entry here fails it). For each flag it parses a command that sets the flag to a
  value other than its default and checks that the parsed field changed. Then the flag is either
  in :data:`READERS`, which names the modules that read its field, and a scan of those modules'
  syntax tree finds the field read there (``x.<field>``, ``getattr(x, "<field>")``; model flags:
  a field of ``GPTConfig``, which ``overridden_config`` copies from the flags by name, read by the
  model), or it is refused on its own, with a message naming it.
* ``test_a_flag_is_refused_where_it_would_do_nothing`` takes every rule of
  :data:`mfsdp.trainer.refusals.NEEDS` (again all of them): without the flags it works with, the
  flag is refused with a line that starts with its spelling; with them, it is accepted.
* The behaviour tests below check that the flags of the issue act: ``--mock-data`` selects
  synthetic data, ``--rope-scaling-factor`` reaches the model with ``--use-rope-scaling``, and
  ``--grad-reduce-in-bf16`` sets the gradient-communication dtype (with an agreeing
  ``--megatron-fsdp-grad-comm-dtype`` too); and a refusal is one line with exit status 2 at the CLI.

What they do not prove: that the code which reads a field changes the training result. That is
what each feature's own tests do (tests/test_train.py, tests/test_data.py, ...); a read that
leads nowhere would pass the scan.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from dataclasses import fields
from functools import cache
from pathlib import Path

import pytest

from mfsdp.trainer.arguments import build_parser, checked_config
from mfsdp.trainer.config import TrainConfig, rules
from mfsdp.trainer.refusals import ALWAYS, NEEDS, check_combinations, flag_of

ROOT = Path(__file__).resolve().parents[1]
T, D, C = "mfsdp/trainer", "mfsdp/data", "mfsdp/checkpoint"
MODEL = "GPTConfig"  # read through overridden_config: a GPTConfig field of the same name

# flag destination -> the modules (files, or folders) that read it; not the parser
READERS: dict[str, tuple[str, ...]] = {
    **{dest: (MODEL,) for dest in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size",
        "swiglu", "normalization", "norm_epsilon", "position_embedding_type", "rotary_base",
        "rotary_interleaved", "kv_channels", "add_qkv_bias", "qk_layernorm",
        "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
        "qk_pos_emb_head_dim", "v_head_dim", "init_method_std", "recompute_granularity",
        "recompute_method", "recompute_num_layers", "num_experts", "moe_router_topk",
        "moe_first_dense_layers", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
        "moe_router_score_function", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
        "moe_shared_expert_gate", "moe_router_num_groups", "moe_router_group_topk",
        "moe_router_enable_expert_bias", "moe_aux_loss_coeff", "moe_z_loss_coeff",
        "moe_expert_capacity_factor", "moe_token_drop_policy", "moe_pad_expert_input_to_capacity",
        "moe_token_dispatcher_type", "moe_flex_dispatcher_backend", "moe_grouped_gemm")},
    # model flags whose value means something else than the field of that name (build.py)
    **{dest: (f"{T}/build.py",) for dest in (
        "model_preset", "max_position_embeddings", "use_rope_scaling", "rope_scaling_factor",
        "num_query_groups", "disable_bias_linear",
        "untie_embeddings_and_output_weights", "make_vocab_size_divisible_by", "bf16",
        "grad_reduce_in_bf16", "megatron_fsdp_main_params_dtype",
        "megatron_fsdp_main_grads_dtype", "megatron_fsdp_grad_comm_dtype", "lr",
        "weight_decay", "optimizer", "sgd_momentum", "adam_beta1", "adam_beta2", "adam_eps")},
    # the learning-rate scheduler and Megatron-LM's rule for a loaded schedule
    **{dest: (f"{T}/state.py",) for dest in (
        "min_lr", "lr_warmup_iters", "lr_decay_style", "lr_decay_iters", "lr_warmup_init",
        "lr_wsd_decay_iters", "lr_wsd_decay_style", "override_opt_param_scheduler",
        "use_checkpoint_opt_param_scheduler")},
    # the sharding engine's options, handed to fully_shard by the trainer's model builder
    # (build_sharded_model, which mfsdp plan --dry-run calls too)
    **{dest: (f"{T}/parallel.py",) for dest in (
        "outer_dp_sharding_strategy", "fsdp_double_buffer", "init_model_with_meta_device",
        "overlap_grad_reduce", "overlap_param_gather", "seed")},
    # the Trainer's own
    **{dest: (f"{T}/trainer.py",) for dest in (
        "data_parallel_sharding_strategy", "calculate_per_token_loss", "micro_batch_size",
        "global_batch_size", "clip_grad", "check_for_nan_in_loss_and_grad",
        "moe_router_bias_update_rate", "eval_interval", "eval_iters", "exit_interval",
        "save_interval", "dump_param_to_param_group_map", "train_iters")},
    # the entry: the hang watch, error reports, and --save's lock (taken under mfsdp only)
    **{dest: (f"{T}/loop.py",) for dest in ("distributed_timeout_minutes", "debug")},
    **{dest: (f"{T}/loop.py", f"{T}/trainer.py") for dest in ("use_megatron_fsdp", "save")},
    **{dest: (f"{T}/parallel.py",) for dest in (
        "num_distributed_optimizer_instances", "expert_model_parallel_size",
        "tensor_model_parallel_size", "sequence_parallel", "context_parallel_size",
        "create_all_gather_group")},
    # only with --num-query-groups, which it asks for: checked by ModelConfig
    "group_query_attention": (f"{T}/config/model.py",),
    "expert_tensor_parallel_size": (f"{T}/config/rules.py",),  # only ever 1: checked there
    "train_samples": (f"{T}/config/__init__.py",),  # sets train_iters in TrainConfig
    **{dest: (f"{T}/checkpointing.py",) for dest in (
        "load", "exit_on_missing_checkpoint", "ckpt_verify", "ckpt_format")},
    **{dest: (f"{T}/signals.py",) for dest in ("exit_signal_handler", "exit_duration_in_mins")},
    # fields of LoggingConfig (config/job.py), which metrics.py and trainer.py are given
    **{dest: (f"{T}/metrics.py",) for dest in ("wandb_project", "wandb_exp_name", "wandb_entity")},
    **{dest: (f"{T}/trainer.py",) for dest in ("log_interval", "log_jsonl", "log_throughput")},
    "wandb_save_dir": (f"{T}/config/job.py",),  # (LoggingConfig.wandb_dir: it or --save/wandb)
    "tensorboard_dir": (f"{T}/metrics.py", f"{T}/profiling.py"),  # (--profile's trace too)
    **{dest: (f"{T}/profiling.py",) for dest in (
        "profile", "use_pytorch_profiler", "profile_step_start", "profile_step_end",
        "profile_ranks", "pytorch_profiler_collect_shapes", "pytorch_profiler_collect_callstack",
        "record_memory_history", "memory_snapshot_path")},
    **{dest: (f"{D}/batches.py",) for dest in (
        "mock_data", "data_path", "split", "data_cache_path", "tokenizer_type", "tokenizer_model",
        "sequence_packing", "seq_length")},
}
# the config's rules check these against the other flags; nothing else reads them
_CHECKED_IN_CONFIG = {"expert_tensor_parallel_size": f"{T}/config/rules.py",
                      "train_samples": f"{T}/config/__init__.py"}


@cache
def _reads(where: str) -> frozenset[str]:
    """Attribute names read (``x.name``, ``getattr(x, "name")``) in a module or package,
    the parser's ``build_parser`` left out."""
    path = ROOT / where
    names: set[str] = set()
    for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
        tree = ast.parse(file.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == "build_parser":
                node.body = []  # (add_argument's keywords are not reads)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                names.add(node.attr)
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr"
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
                names.add(node.args[1].value)
    return frozenset(names)


def _other_value(action: argparse.Action) -> list[str]:
    """Command-line words that set ``action`` to a value other than its default."""
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


def _flag_actions():
    return [a for a in build_parser()._actions if a.option_strings and a.dest != "help"]


@pytest.mark.parametrize("action", _flag_actions(), ids=lambda a: a.option_strings[0])
def test_every_flag_is_read_or_refused(action):
    parser = build_parser()
    if action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction) \
            and action.const == action.default:  # the "on" spelling of a default that is on
        assert any(a.dest == action.dest and a.const != a.default for a in parser._actions)
        return  # (its dest is walked with the spelling that turns it off)
    words = _other_value(action)
    args = parser.parse_args(words)
    assert getattr(args, action.dest) != parser.get_default(action.dest), words
    if action.dest in ALWAYS:
        assert action.dest not in READERS, action.dest
        with pytest.raises(SystemExit, match=f"^{flag_of(parser, action.dest)}: "):
            check_combinations(args, parser)
        return
    assert action.dest in READERS, (f"{words[0]} is neither read (add it to READERS with the "
                                     "module that reads it) nor refused")
    for where in READERS[action.dest]:
        if where == MODEL:
            from mfsdp.models.config import GPTConfig

            assert action.dest in {f.name for f in fields(GPTConfig)}, action.dest
            assert action.dest in _reads("mfsdp/models"), action.dest
        else:
            assert action.dest in _reads(where), (action.dest, where)
    if action.dest in _CHECKED_IN_CONFIG:
        assert READERS[action.dest] == (_CHECKED_IN_CONFIG[action.dest],)


def test_the_tables_name_only_real_flags():
    dests = {a.dest for a in _flag_actions()}
    assert set(READERS) | set(ALWAYS) == dests
    assert {rule.dest for rule in NEEDS} <= dests


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
    **{d: (["--optimizer", "sgd"], []) for d in ("adam_beta1", "adam_beta2", "adam_eps")},
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
