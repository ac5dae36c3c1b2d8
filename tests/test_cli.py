"""The ``mfsdp`` command as a user meets it: help without markup, one-line errors with status 2,
``--debug`` for the traceback, one name for options the commands share."""

from __future__ import annotations

import subprocess
import sys

import pytest

COMMANDS = ["convert", "plan", "train", "sbatch", "bench"]


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
