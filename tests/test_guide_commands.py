"""Every complete ``torchrun ... -m mfsdp.train ...`` command in the guide starts.

A command is complete when it has no ``...`` and no placeholder (``$DATA``, ``<dir>``): those
are sketches. Each complete one is parsed by the trainer's own parser and validated by the
trainer's own start-up check (:func:`mfsdp.trainer.arguments.checked_config`) for the world size
its torchrun flags give (``--nproc-per-node`` x ``--nnodes``), so a command the guide shows is
not refused at start. Nothing is launched; the device's rules (CUDA present) are left out.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^\s*(`{3,}|~{3,})(.*)$")
CODE_LANGUAGES = {"", "bash", "sh", "shell", "console", "text"}


def guide_commands(text: str) -> list[tuple[int, str]]:
    """``(line number, command)`` of every torchrun command running ``mfsdp.train`` in the
    page's code blocks (bash, console, text or unlabelled fences), continuation lines joined
    (a console block's ``$ `` prompt dropped)."""
    out: list[tuple[int, str]] = []
    fence: str | None = None  # the fence that closes the block we are in
    code = False  # whether that block is a command block
    pending: list[str] = []
    start = 0
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if fence is None:
            if match:
                fence, code = match.group(1), match.group(2).strip() in CODE_LANGUAGES
            continue
        if match and match.group(1) == fence and not match.group(2).strip():
            fence, pending = None, []
            continue
        if not code:
            continue
        if not pending:
            start = number
        if not pending and line.startswith("$ "):  # a console block's prompt
            line = line[2:]
        pending.append(line.strip().removesuffix("\\").strip())
        if line.rstrip().endswith("\\"):
            continue
        command = " ".join(pending)
        pending = []
        if command.startswith("torchrun ") and re.search(r"-m mfsdp\.train(\s|$)", command):
            out.append((start, command))
    return out


def is_complete(command: str) -> bool:
    """A command with nothing left for the reader to fill in."""
    return "..." not in command and not re.search(r"[$<>]", command)


def world_and_args(command: str) -> tuple[int, list[str]]:
    """The world size a torchrun command starts and the arguments it passes to the trainer."""
    words = shlex.split(command)
    at = words.index("-m")
    launcher, trainer = words[1:at], words[at + 2:]
    sizes = {"--nproc-per-node": 1, "--nproc_per_node": 1, "--nnodes": 1}
    for i, word in enumerate(launcher):
        name, _, value = word.partition("=")
        if name in sizes:
            sizes[name] = int(value or launcher[i + 1])
    world = max(sizes["--nproc-per-node"], sizes["--nproc_per_node"]) * sizes["--nnodes"]
    return world, trainer


def start_check(command: str) -> str | None:
    """None when the trainer accepts ``command`` at start, else the trainer's one-line refusal."""
    from mfsdp.train import build_parser
    from mfsdp.trainer.arguments import checked_config

    world, argv = world_and_args(command)
    try:
        args = build_parser().parse_args(argv)
        checked_config(args, world)
    except SystemExit as exc:
        return str(exc.code)
    return None


COMMANDS = [(page.name, number, command)
            for page in sorted((ROOT / "docs").glob("*.md"))
            for number, command in guide_commands(page.read_text())
            if is_complete(command)]


def test_the_extractor_joins_lines_and_skips_sketches():
    page = ("```bash\ntorchrun --nproc-per-node 4 --nnodes 2 -m mfsdp.train \\\n"
            "    --bf16\n$T --lr 1\ntorchrun --nproc-per-node 2 -m mfsdp.train ...\n```\n"
            "```python\ntorchrun --nproc-per-node 2 -m mfsdp.train\n```\n"
            "```bash\ntorchrun --nproc-per-node 3 -m mfsdp.train\n```\n"
            "```console\n$ torchrun --nproc-per-node 2 -m mfsdp.train \\\n    --bf16\nloss 1\n```\n")
    found = guide_commands(page)
    assert found == [(2, "torchrun --nproc-per-node 4 --nnodes 2 -m mfsdp.train --bf16"),
                     (5, "torchrun --nproc-per-node 2 -m mfsdp.train ..."),
                     (11, "torchrun --nproc-per-node 3 -m mfsdp.train"),
                     (14, "torchrun --nproc-per-node 2 -m mfsdp.train --bf16")]
    assert [is_complete(c) for _, c in found] == [True, False, True, True]
    assert world_and_args(found[0][1]) == (8, ["--bf16"])


def test_the_guide_has_complete_commands_to_check():
    # the trainer reference's "Speed on GPU" command is one of them: the list cannot go empty
    # unseen
    speed = [c for page, _, c in COMMANDS
             if page == "trainer-reference.md" and "--compile" in c]
    assert speed and world_and_args(speed[0])[0] == 8


def test_a_command_the_trainer_refuses_is_caught():
    # the Speed on GPU command as it was: default batch (8 over micro 2 x 8 ranks) is refused
    old = ("torchrun --standalone --nproc-per-node 8 -m mfsdp.train --use-megatron-fsdp "
           "--model-preset llama3-8b --bf16 --compile --fused-adam")
    refusal = start_check(old)
    assert refusal is not None and "--global-batch-size 8 is not divisible" in refusal
    assert start_check(old.replace("8 -m", "2 -m")) is None  # 8 over 2 x 2 is fine


@pytest.mark.parametrize("page,line,command", COMMANDS,
                         ids=[f"{p}:{n}" for p, n, _ in COMMANDS])
def test_every_complete_trainer_command_starts(page, line, command):
    refusal = start_check(command)
    assert refusal is None, f"{page}:{line}: `{command}` is refused at start: {refusal}"
