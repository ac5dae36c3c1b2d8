"""The ``mfsdp`` command as a user meets it: help without markup, one-line errors with status 2,
``--debug`` for the traceback, one name for options the commands share."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

COMMANDS = ["convert", "plan", "train", "sbatch", "bench", "preprocess", "check"]


def _mfsdp(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mfsdp.cli", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("command", [None] + COMMANDS)
def test_help_reads_cleanly(command):
    out = _mfsdp(*([command] if command else []), "--help")
    assert out.returncode == 0, out.stderr
    for markup in ("``", ":func:", ":class:", ":mod:", ":meth:", ":doc:"):
        assert markup not in out.stdout, (markup, out.stdout)


@pytest.mark.parametrize("args, message", [
    (["convert", "--from", "hf", "--to", "fsdp_dtensor", "/nonexistent/model", "/tmp/x"],
     "/nonexistent/model has no config.json"),
    (["convert", "--from", "fsdp_dtensor", "--to", "hf", "/nonexistent/ckpt", "/tmp/x"],
     "no checkpoint at /nonexistent/ckpt"),
    (["convert", "--from", "fsdp_dtensor", "--to", "hf", "--max-shard-size", "lots", "a", "b"],
     "--max-shard-size 'lots' is not a size"),
    (["sbatch", "render", "llama3-8b", "--set", "nodes=3"], "not divisible"),
])
def test_user_errors_are_one_line_with_status_2(args, message):
    out = _mfsdp(*args)
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert message in out.stderr
    assert "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_debug_shows_the_traceback():
    out = _mfsdp("--debug", "convert", "--from", "hf", "--to", "fsdp_dtensor",
                 "/nonexistent/model", "/tmp/x")
    assert out.returncode != 0
    assert "Traceback" in out.stderr and "FileNotFoundError" in out.stderr


def test_shared_options_have_one_name():
    """``--micro-batch-size`` and ``--seq-length`` are spelled as the trainer spells them in
    ``plan``; the recompute flags too."""
    out = _mfsdp("plan", "llama3-8b", "--world-size", "16", "--micro-batch-size", "2",
                 "--seq-length", "4096", "--recompute-granularity", "selective")
    assert out.returncode == 0, out.stderr
    assert "llama3-8b" in out.stdout


def test_the_megatron_defaults_table_compares_real_defaults():
    """The migrating page's table: our parser against the committed Megatron-LM snapshot."""
    import json

    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    from cli_reference import default_differences

    from mfsdp.train import build_parser

    snapshot = json.loads((ROOT / "docs" / "megatron_lm_defaults.json").read_text())
    assert len(snapshot["commit"]) == 40 and len(snapshot["defaults"]) > 500
    rows, agree = default_differences(build_parser(), snapshot)
    differ = {flag: (theirs, ours) for flag, theirs, ours in rows}
    assert differ["--lr"] == (None, 0.003)  # a bare `mfsdp train` runs on a laptop
    assert differ["--ckpt-format"] == ("torch_dist", "fsdp_dtensor")
    for same in ("--adam-beta2", "--lr-decay-style", "--log-interval", "--optimizer",
                 "--sgd-momentum"):
        assert same not in differ, same
    assert "--seed" not in differ and "--clip-grad" not in differ  # 1234 and 1.0 on both sides
    assert agree >= 30


def test_shared_options_have_the_trainers_names():
    """An option that plan or bench shares with the trainer is spelled as the trainer (Megatron-LM)
    spells it; the older short names stay as aliases."""
    from mfsdp.tools.benchmark import build_parser as bench_parser
    from mfsdp.tools.plan_cli import build_parser as plan_parser
    from mfsdp.train import build_parser as train_parser

    def flags(parser):
        return {o for a in parser._actions for o in a.option_strings}

    train = flags(train_parser())
    shared = {
        plan_parser: ["--data-parallel-sharding-strategy", "--num-distributed-optimizer-instances",
                      "--outer-dp-sharding-strategy", "--expert-model-parallel-size",
                      "--micro-batch-size", "--seq-length", "--recompute-granularity",
                      "--recompute-method", "--recompute-num-layers"],
        bench_parser: ["--micro-batch-size", "--seq-length", "--hidden-size", "--ffn-hidden-size",
                       "--num-layers", "--num-attention-heads", "--num-query-groups",
                       "--vocab-size", "--data-path", "--bf16"],
    }
    for make, names in shared.items():
        mine = flags(make())
        for name in names:
            assert name in train and name in mine, (make.__module__, name)
    args = plan_parser().parse_args(["llama3-8b", "--num-distributed-optimizer-instances", "2",
                                     "--expert-model-parallel-size", "1", "--dp-outer", "2"])
    assert args.dp_outer == 2
    args = bench_parser().parse_args(["--num-layers", "3", "--micro-batch-size", "5"])
    assert (args.blocks, args.local_batch) == (3, 5)


def test_the_cli_reference_covers_every_subcommand_with_its_parser():
    """docs/cli.md has a section for every subcommand of ``mfsdp --help`` (mfsdp.cli.COMMANDS),
    rendered from the parser that subcommand runs with, and no section for one that is gone."""
    import re

    from mfsdp.cli import COMMANDS

    page = (ROOT / "docs" / "cli.md").read_text()
    sections = re.findall(r"^## `mfsdp (\w+)`\n+(?:.*\n)*?```\{mfsdp-argparse\} ([\w.]+):build_parser\n"
                          r":prog: mfsdp (\w+)", page, re.M)
    assert sorted((name, module) for name, module, prog in sections if name == prog) == \
        sorted((name, module) for name, (module, _, _) in COMMANDS.items()), sections


@pytest.mark.parametrize("command", sorted(__import__("mfsdp.cli").cli.COMMANDS))
def test_the_cli_reference_of_each_command_is_valid_restructuredtext(command):
    """The guide's CLI reference (docs/_ext/cli_reference.py) renders each command's parser as
    reStructuredText; docutils must accept it at the docs build's strictness (an empty default
    once rendered as an empty literal, which stopped the build)."""
    from docutils.core import publish_doctree

    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    import cli_reference

    from mfsdp.cli import COMMANDS

    module = COMMANDS[command][0]
    text = "\n".join(cli_reference._rst(cli_reference._load(f"{module}:build_parser"),
                                         f"mfsdp {command}"))
    publish_doctree(text, settings_overrides={"report_level": 2, "halt_level": 2})


def test_the_megatron_defaults_table_is_valid_restructuredtext():
    """The migration page's table of defaults that differ from Megatron-LM's renders through
    docutils at the build's strictness, whatever the defaults are (an empty string included)."""
    import json

    from docutils.core import publish_doctree

    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    import cli_reference

    from mfsdp.train import build_parser

    parser = build_parser()
    parser.add_argument("--an-empty-default", default="")
    snapshot = json.loads((ROOT / "docs" / "megatron_lm_defaults.json").read_text())
    snapshot["defaults"]["--an-empty-default"] = None
    rows, _ = cli_reference.default_differences(parser, snapshot)
    assert ("--an-empty-default", None, "") in rows
    text = "\n".join(cli_reference.defaults_rst(parser, snapshot))
    publish_doctree(text, settings_overrides={"report_level": 2, "halt_level": 2})
