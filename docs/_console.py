"""Runs the guide's shell commands: ``sh(COMMAND)`` for doctests, and ``console`` code blocks.

A ``console`` block is what a terminal shows, so a reader can paste its commands::

    $ export MLM=tests/fixtures/megatron_lm
    $ export WORK=$(mktemp -d)
    $ mfsdp convert --from torch_dist --to fsdp_dtensor \\
        $MLM/optim/adam-ddp $WORK/imported
    wrote fsdp_dtensor checkpoint $WORK/imported
    ...

A line starting with ``$ `` is a command (a trailing backslash continues it onto the next
line, as in bash); the lines after it, up to the next command, are what it prints, compared
with doctest's ELLIPSIS and NORMALIZE_WHITESPACE. Each command is one example, run in order
through the page's :class:`GuideShell`: ``mfsdp`` in this process from the repository root,
``torchrun`` with this interpreter, ``$MLM`` the committed Megatron-LM fixtures, ``$WORK`` a
fresh directory of the page, shown as ``$WORK`` in the output. ``export MLM=...`` and
``export WORK=$(mktemp -d)`` are checked against those values and change nothing; ``export
NAME="VALUE"`` with another name sets ``$NAME`` for the page's later commands (quotes removed,
``$VARIABLES`` in the value expanded, as bash does). A command
that fails must be followed by ``$ echo $?``, which prints its exit status.
"""

from __future__ import annotations

import contextlib
import doctest
import io
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterable, NamedTuple

from sybil import Document, Example, Region
from sybil.parsers.myst import CodeBlockParser

ROOT = Path(__file__).resolve().parent.parent
# what the installed console scripts run
PROGRAMS = {"mfsdp": ["-m", "mfsdp.cli"], "torchrun": ["-m", "torch.distributed.run"]}
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
MLM = "tests/fixtures/megatron_lm"
# what a reader types to get a fresh $WORK (the page keeps its own temporary directory)
MKTEMP = "$(mktemp -d)"
STATUS = "echo $?"


class _Tee(io.StringIO):
    """A stream that also writes into ``both`` (stdout and stderr in the order written)."""

    def __init__(self, both: io.StringIO) -> None:
        super().__init__()
        self.both = both

    def write(self, text: str) -> int:
        self.both.write(text)
        return super().write(text)


def _in_process(argv: list[str]) -> tuple[int, str, str, str]:
    """``mfsdp ARGV`` through ``mfsdp.cli.main`` in this process, from the repository root:
    its exit status, standard output, standard error, and both in the order written."""
    from mfsdp.cli import main

    both = io.StringIO()
    out, err, here = _Tee(both), _Tee(both), os.getcwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        os.chdir(here)
    return code, out.getvalue(), err.getvalue(), both.getvalue()


_BAR = re.compile(r"\d+%\|")  # a tqdm progress bar's line
_VAR = re.compile(r"\$(?:(\w+)|\{([^}]*)\})")


class GuideShell:
    """One page's shell: its environment (``$MLM``, ``$WORK``) and the last exit status.

    Called with a command line (``sh("mfsdp convert ...")`` in a doctest), it prints the
    command's standard output and, when it fails, the last line of its standard error and
    ``(exit status N)``.
    """

    def __init__(self) -> None:
        self.env = {**os.environ, "MLM": MLM, "OMP_NUM_THREADS": "1",
                    "WORK": tempfile.mkdtemp(prefix="mfsdp-guide-"),
                    "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.status = 0  # what `echo $?` prints: the last command's exit status
        self.shown = ""  # what the last command showed on the terminal

    def expand(self, word: str) -> str:
        """``$NAME`` and ``${NAME}`` replaced from this shell's environment, as the shell does
        (a name it does not hold stays as written, as in ``os.path.expandvars``)."""
        return _VAR.sub(lambda m: self.env.get(m.group(1) or m.group(2), m.group(0)), word)

    def run(self, command: str) -> tuple[int, str, str]:
        """Run one command line: its exit status, standard output and the last line of its
        standard error, with the page's directory written ``$WORK`` (and in :attr:`shown`,
        what the terminal showed)."""
        if command.strip() == STATUS:
            self.shown = str(self.status)
            return 0, f"{self.status}\n", ""
        argv = [self.expand(a) for a in shlex.split(command)]
        if argv[0] == "mfsdp":  # in this process: the same entry point, without a start-up
            code, out, err, both = _in_process(argv[1:])
        else:
            if argv[0] in PROGRAMS:
                argv = [sys.executable, *PROGRAMS[argv[0]], *argv[1:]]
            done = subprocess.run(argv, capture_output=True, text=True, env=self.env, cwd=ROOT,
                                  timeout=600)
            code, out, err = done.returncode, done.stdout, done.stderr
            both = out + err  # (another program's standard error comes after its output)
        self.status = code
        work = self.env["WORK"]
        # What the terminal showed: the output with what a command that succeeds writes to
        # standard error (notes, warnings), less its progress bars, whose rates change from
        # run to run; for a failure, its output and its error's last line (not a traceback).
        last = err.rstrip().splitlines()[-1] if err.strip() else ""
        shown = (out.rstrip() + (f"\n{last}" if last else "") if code else
                 "\n".join(line for line in both.rstrip().splitlines() if not _BAR.search(line)))
        self.shown = shown.replace(work, "$WORK")
        return code, out.rstrip().replace(work, "$WORK"), last.replace(work, "$WORK")

    def __call__(self, command: str) -> None:
        code, out, err = self.run(command)
        print(out)
        if code:
            print(err)
            print(f"(exit status {code})")


class Command(NamedTuple):
    """One ``$ `` command of a console block and the output expected from it."""

    first: int  # the block's line (from 0) where the command starts
    last: int  # the block's last line of this command and its output
    text: str  # the command, continuation lines joined as bash joins them
    expected: str
    checked: bool  # the next command is `echo $?`: a failure is expected


def parse_console(source: str) -> list[Command]:
    """The commands of a console block's text, each with its expected output."""
    lines = source.splitlines()
    starts = []  # (first line, last line, command)
    i = 0
    while i < len(lines):
        if not re.match(r"\$( |$)", lines[i]):
            i += 1
            continue
        first, text = i, lines[i][2:]
        while text.endswith("\\"):  # bash drops the backslash and the newline, nothing else
            i += 1
            if i == len(lines):
                raise ValueError(f"`$ {lines[first][2:]}`: the block ends inside the command "
                                 "(its last line ends with a backslash); finish the command")
            text = text[:-1] + lines[i]
        if not text.strip():
            raise ValueError(f"line {first + 1} of the block is an empty `$` command; "
                             "write the command after `$ `")
        starts.append((first, i, text.strip()))
        i += 1
    commands = []
    for n, (first, end, text) in enumerate(starts):
        stop = starts[n + 1][0] if n + 1 < len(starts) else len(lines)
        checked = n + 1 < len(starts) and starts[n + 1][2] == STATUS
        commands.append(Command(first, stop - 1, text, "\n".join(lines[end + 1:stop]),
                                checked))
    return commands


def _export(command: str, shell: GuideShell) -> str | None:
    """Set ``NAME`` in the page's shell, or refuse an ``export`` of ``MLM`` or ``WORK`` that
    does not set what the page's shell already has."""
    m = re.fullmatch(r"export\s+(\w+)=(.*)", command, flags=re.S)
    if not m:
        return f"`$ {command}`: write `export NAME=VALUE`, one per line"
    name, value = m.group(1), m.group(2).strip()
    quote = value[0] if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"" else ""
    if quote:
        value = value[1:-1]
    wanted = {"MLM": MLM, "WORK": MKTEMP}
    if name not in wanted:
        if not quote and re.search(r"\s", value):
            return (f"`$ {command}`: a value with spaces needs quotes: "
                    f"`export {name}=\"{value}\"`")
        shell.env[name] = value if quote == "'" else shell.expand(value)  # '...' expands nothing
        return None
    if value != wanted[name]:
        return (f"`$ {command}`: the guide's commands run with {name}={wanted[name]}; "
                f"write `export {name}={wanted[name]}`")
    return None


def check_command(command: Command, shell: GuideShell) -> str | None:
    """Run one command of a console block; None when it prints what the block shows and
    succeeds (or its failure is checked with ``echo $?``), else what went wrong."""
    if command.text.split()[0] == "export":  # sets nothing, prints nothing
        if refusal := _export(command.text, shell):
            return refusal
        code, got, err = 0, "", ""
    else:
        code, _, err = shell.run(command.text)
        got = shell.shown
    checker = doctest.OutputChecker()
    if not checker.check_output(command.expected + "\n", got + "\n", FLAGS):
        example = doctest.Example(command.text, command.expected + "\n")
        return (f"`$ {command.text}` printed something else.\n"
                + checker.output_difference(example, got + "\n", FLAGS))
    if code and not command.checked:
        return (f"`$ {command.text}` exited with status {code} ({err}); follow a command "
                "that is meant to fail with `$ echo $?` and its status")
    return None


class ConsoleParser:
    """A Sybil parser for MyST ``console`` code blocks: one example per ``$ `` command.

    The page's namespace must hold its :class:`GuideShell` as ``sh``.
    """

    def __init__(self) -> None:
        self.blocks = CodeBlockParser(language="console", evaluator=lambda example: None)

    def __call__(self, document: Document) -> Iterable[Region]:
        for block in self.blocks(document):
            source = block.lexemes["source"]
            # where each of the block's lines starts in the page
            starts = [block.start + source.offset]
            while len(starts) <= source.count("\n"):
                starts.append(document.text.index("\n", starts[-1]) + 1)
            try:
                commands = parse_console(source)
            except ValueError as exc:
                yield Region(starts[0], starts[0] + 1, str(exc), _refuse)
                continue
            for command in commands:
                end = starts[command.last + 1] - 1 if command.last + 1 < len(starts) \
                    else block.end
                yield Region(starts[command.first], end, command, _evaluate)


def _refuse(example: Example) -> str:
    return f"this console block cannot run: {example.parsed}"


def _evaluate(example: Example) -> str | None:
    shell = example.namespace.get("sh")
    if not isinstance(shell, GuideShell):
        return "the page's namespace has no GuideShell `sh` (docs/conftest.py gives it one)"
    return check_command(example.parsed, shell)
