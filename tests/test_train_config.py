"""A config built in code meets every rule the command line meets, with the same message.

What these tests prove: for each rule across the flag groups (the list is
:func:`mfsdp.trainer.config.rules.examples`, read from the one place the rules live, so a rule
added later is walked here without an edit), a :class:`~mfsdp.trainer.config.TrainConfig` built
in code from the rule's example is refused with a ``ValueError`` (at construction, or by
``validate(world_size, model=...)``), and the same example given as ``mfsdp train`` flags is
refused by the command line's check with the very same line. A group's own rules (its
``__post_init__``) are walked too: each has an example, and a rule added without one fails
``test_every_rule_of_a_group_has_an_example``. The groups are frozen, a config that breaks
nothing validates, and every parameter in ``mfsdp/trainer`` has a type.
"""

from __future__ import annotations

import dataclasses

import pytest

from mfsdp.trainer.arguments import build_parser, checked_config
from mfsdp.trainer.build import model_config
from mfsdp.trainer.config import TrainConfig, TrainingConfig, rules

RULES = rules.examples(TrainConfig)


def _refusal_in_code(rule: rules.Rule) -> str:
    """The ValueError's line for the rule's example built in code."""
    with pytest.raises(ValueError) as refused:
        config = TrainConfig.from_fields(**rule.example)
        config.validate(rule.world, model=model_config(config), device="cpu")
    return str(refused.value)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_a_code_built_config_is_refused_as_the_command_line_is(rule):
    assert rule.example, f"rule {rule.name} has no example: give it one in rules.py"
    said = _refusal_in_code(rule)
    assert "\n" not in said
    # the rule itself said it (not another rule the example happens to break)
    view = rules.View(_bypass(rule.example))
    own = (rule.check(view, rule.world, model_config(_bypass(rule.example)), "cpu")
           if rule.name in _LAYOUT else rule.check(view))
    assert own == said, (rule.name, own, said)
    args = build_parser().parse_args(rules.command_line(TrainConfig, rule.example))
    with pytest.raises(SystemExit) as cli:
        checked_config(args, rule.world, "cpu")
    assert cli.value.code == said


def _bypass(example: dict) -> TrainConfig:
    """The example's config without the checks across groups (to ask one rule alone)."""
    groups = {}
    for name, kind in _GROUPS.items():
        names = {f.name for f in dataclasses.fields(kind)}
        groups[name] = kind(**{k: v for k, v in example.items() if k in names})
    config = object.__new__(TrainConfig)
    for name, group in groups.items():
        object.__setattr__(config, name, group)
    return config


_LAYOUT = {r.name for r in rules.LAYOUT_RULES}
_GROUPS = {g.name: type(getattr(TrainConfig(), g.name)) for g in dataclasses.fields(TrainConfig)}


def test_every_refusal_of_the_command_line_has_a_rule():
    """The lists hold every NEEDS and ALWAYS entry once, and every rule has a distinct name."""
    names = [r.name for r in RULES]
    assert len(names) == len(set(names))
    assert {n.dest for n in rules.NEEDS} | set(rules.ALWAYS) <= set(names)


def test_the_measured_cases_are_refused_in_code():
    """The review's cases: a global batch of 5 in micro-batches of 2 no longer trains on 4
    samples, and --fsdp-double-buffer without the engine is no longer ignored."""
    config = TrainConfig.from_fields(global_batch_size=5, micro_batch_size=2)
    with pytest.raises(ValueError, match=r"^--global-batch-size 5 is not divisible"):
        config.validate(1, model=model_config(config))
    with pytest.raises(ValueError, match=r"^--fsdp-double-buffer needs --use-megatron-fsdp"):
        TrainConfig.from_fields(fsdp_double_buffer=True)


def test_groups_are_frozen_and_a_good_config_validates():
    config = TrainConfig(training=TrainingConfig(train_iters=3))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.training.train_iters = 4  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.training = TrainingConfig()  # type: ignore[misc]
    config.validate(2, model=model_config(config))
    assert config.micro_batches(2) == 2  # 8 sequences = 2 x 2 ranks x 2 micro-batches
    with pytest.raises(TypeError, match="no field nonsense"):
        TrainConfig.from_fields(nonsense=1)


def test_train_samples_sets_the_iterations_in_code_as_on_the_command_line():
    code = TrainConfig.from_fields(train_samples=80, global_batch_size=8)
    cli = TrainConfig.from_args(build_parser().parse_args(["--train-samples", "80"]))
    assert code.training.train_iters == cli.training.train_iters == 10


def test_the_parsed_flags_are_copied_not_kept():
    """LoggingConfig records a copy of the parsed flags: changing the Namespace later changes
    nothing in the config."""
    args = build_parser().parse_args(["--lr", "0.5"])
    config = TrainConfig.from_args(args)
    args.lr = 7.0
    assert config.logging.run_config["lr"] == 0.5 and config.training.lr == 0.5


def _untyped_parameters() -> list[str]:
    """``file:function(parameter)`` for every parameter without a type in ``mfsdp/trainer``
    (``self`` and ``cls`` of methods excepted; lambdas cannot carry types)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    found = []
    for file in sorted((root / "mfsdp" / "trainer").rglob("*.py")):
        tree = ast.parse(file.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs,
                      *([a.vararg] if a.vararg else []), *([a.kwarg] if a.kwarg else [])]
            for p in params:
                if p.annotation is None and p.arg not in ("self", "cls"):
                    found.append(f"{file.relative_to(root)}:{node.name}({p.arg})")
    return found


def test_every_parameter_of_the_trainer_has_a_type():
    untyped = _untyped_parameters()
    assert not untyped, f"{len(untyped)} untyped parameters: {untyped[:20]}"



# A group's own rules live in its __post_init__; each has an example here (cli: whether the
# command line reaches the rule, or its parser refuses the value first).
GROUP_REFUSALS: list[tuple[dict, bool]] = [
    ({"distributed_timeout_minutes": -1.0}, False),
    ({**{"use_megatron_fsdp": True, "load": "somewhere"}, "override_opt_param_scheduler": True,
      "use_checkpoint_opt_param_scheduler": True}, True),
    ({"save_interval": 2}, True),
    ({"log_interval": 0}, False),
    ({"wandb_exp_name": "e"}, True),
    ({"wandb_project": "p"}, True),
    ({"profile": True, "use_pytorch_profiler": True, "tensorboard_dir": "tb",
      "profile_step_end": 3}, True),
    ({"use_pytorch_profiler": True}, True),
    ({"group_query_attention": True}, True),
    ({"use_megatron_fsdp": True, "outer_dp_sharding_strategy": "optim"}, True),
    ({"lr_decay_style": "WSD"}, True),
    ({"lr_warmup_iters": 30}, True),
    ({"clip_grad": -1.0}, False),
    ({"tokenizer_model": "somewhere"}, True),
]
# rules no example can reach here: LoggingConfig's "needs the wandb package" (it is installed)
UNREACHABLE = 1


def test_every_rule_of_a_group_has_an_example():
    """Each ``raise ValueError`` in a group's ``__post_init__`` is one rule: a rule added later
    without an example above fails here."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "mfsdp" / "trainer" / "config"
    raises = 0
    for file in ("job.py", "model.py", "parallel.py", "training.py"):
        for node in ast.walk(ast.parse((root / file).read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "__post_init__":
                raises += sum(isinstance(n, ast.Raise) for n in ast.walk(node))
    assert raises == len(GROUP_REFUSALS) + UNREACHABLE


@pytest.mark.parametrize("example, cli", GROUP_REFUSALS,
                         ids=lambda v: "-".join(v) if isinstance(v, dict) else str(v))
def test_a_groups_own_rule_refuses_in_code_as_on_the_command_line(example, cli):
    with pytest.raises(ValueError) as code:
        TrainConfig.from_fields(**example)
    args = rules.command_line(TrainConfig, example)
    with pytest.raises(SystemExit) as line:
        checked_config(build_parser().parse_args(args), 1, "cpu")
    if cli:
        assert line.value.code == str(code.value)
    else:  # the parser's type refuses the value first (status 2, its own message)
        assert line.value.code == 2
