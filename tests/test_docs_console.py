"""The guide's ``console`` blocks (docs/_console.py): what runs, what is compared, what is refused,
and that the page shows and copies the commands the tests run.

Pages are written to a temporary directory and run through Sybil with the console parser, as
docs/conftest.py runs the guide; the commands are real programs (``echo``, ``printf``, ``ls``).
The rendering checks use the references the built page uses: Pygments' ``console`` lexer for
which lines show a prompt, and sphinx-copybutton's own JavaScript (under Node) for what its
copy button copies with conf.py's settings.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from conftest import skip_or_fail  # noqa: E402
from docs._console import MLM, ConsoleParser, GuideShell, parse_console  # noqa: E402

FENCE = re.compile(r"^(`{3,})console\n(.*?)^\1$", re.MULTILINE | re.DOTALL)


def run_page(tmp_path: Path, block: str) -> tuple[list[str | None], GuideShell]:
    """Run a page holding one console block: per command, None or the failure's message."""
    from sybil import Sybil

    page = tmp_path / "page.md"
    page.write_text(f"Some prose.\n\n```console\n{block}```\n\nMore prose.\n")
    document = Sybil(parsers=[ConsoleParser()]).parse(page)
    shell = document.namespace["sh"] = GuideShell()
    results = []
    for example in document:
        try:
            example.evaluate()
            results.append(None)
        except AssertionError as failure:  # SybilFailure
            results.append(str(failure))
    return results, shell


def test_a_block_whose_output_matches_passes(tmp_path):
    block = (f"$ export MLM={MLM}\n$ export WORK=$(mktemp -d)\n"
             "$ echo one two\none two\n$ printf 'a\\nb\\n'\na\nb\n")
    results, _ = run_page(tmp_path, block)
    assert results == [None, None, None, None]


def test_a_block_whose_output_differs_fails_naming_the_command(tmp_path):
    results, _ = run_page(tmp_path, "$ echo hello\ngoodbye\n$ echo next\nnext\n")
    assert results[1] is None  # the next command still runs and passes
    message = results[0]
    assert message is not None and "page.md, line 4" in message
    assert "`$ echo hello` printed something else" in message
    assert re.search(r"Expected:\s+goodbye\s+Got:\s+hello", message), message


def test_a_continuation_line_is_joined_as_bash_joins_it():
    # bash drops the backslash and the newline, and keeps the next line's indentation
    [first, second] = parse_console("$ echo one \\\n    two\none two\n$ echo ab\\\ncd\nabcd\n")
    assert first.text == "echo one     two" and first.expected == "one two"
    assert (first.first, first.last) == (0, 2)
    assert second.text == "echo abcd" and second.expected == "abcd"
    joined = subprocess.run(["bash", "-c", "echo ab\\\ncd"], capture_output=True, text=True)
    assert joined.stdout == "abcd\n"  # what bash itself makes of the second command


def test_continued_commands_run_joined(tmp_path):
    block = "$ printf '%s|' one \\\n    two \\\n    three\none|two|three|\n"
    assert run_page(tmp_path, block)[0] == [None]


def test_an_ellipsis_matches_any_text(tmp_path):
    lines = "$ printf 'first\\nsecond\\nthird\\n'\n"
    assert run_page(tmp_path, lines + "first\n...\nthird\n")[0] == [None]
    assert run_page(tmp_path, lines + "f...d\n")[0] == [None]
    [failure] = run_page(tmp_path, lines + "first\n...\nfourth\n")[0]
    assert failure is not None and "fourth" in failure


@pytest.mark.parametrize("export,refusal", [
    ("export MLM=/elsewhere",
     f"the guide's commands run with MLM={MLM}; write `export MLM={MLM}`"),
    ("export WORK=/tmp/mine",
     "the guide's commands run with WORK=$(mktemp -d); write `export WORK=$(mktemp -d)`"),
    ("export FLAGS=--a --b", 'a value with spaces needs quotes: `export FLAGS="--a --b"`'),
    ("export MLM", "write `export NAME=VALUE`"),
])
def test_an_export_of_another_value_is_refused(tmp_path, export, refusal):
    [message] = run_page(tmp_path, f"$ {export}\n")[0]
    assert message is not None and f"`$ {export}`: {refusal}" in message


def test_an_export_sets_a_variable_for_the_later_commands_as_bash_does(tmp_path):
    page = ("$ export FLAGS=\"--num-layers 2 \\\n    --hidden-size 64\"\n"
            "$ export MORE=\"$FLAGS --seq 8\"\n$ export RAW='$FLAGS'\n"
            "$ printf '%s|' \"$MORE\" $RAW\n")
    bash = subprocess.run(["bash", "-c", "\n".join(
        line[2:] for line in page.replace("\\\n", "").splitlines() if line.startswith("$ "))],
        capture_output=True, text=True, check=True).stdout
    assert bash == "--num-layers 2     --hidden-size 64 --seq 8|$FLAGS|"
    assert run_page(tmp_path, page + bash + "\n")[0] == [None] * 4


def test_a_quoted_export_is_accepted(tmp_path):
    assert run_page(tmp_path, f"$ export WORK=\"$(mktemp -d)\"\n$ export MLM='{MLM}'\n")[0] \
        == [None, None]


def test_work_is_the_pages_directory_and_is_shown_as_work(tmp_path):
    results, shell = run_page(tmp_path, "$ mkdir $WORK/made\n$ ls $WORK\nmade\n"
                                        "$ echo $WORK/made $MLM\n$WORK/made " + MLM + "\n")
    assert results == [None, None, None]
    assert os.listdir(shell.env["WORK"]) == ["made"]


def test_a_failure_must_be_checked_with_its_status(tmp_path):
    fail = "$ sh -c 'echo oops >&2; exit 3'\noops\n"
    assert run_page(tmp_path, fail + "$ echo $?\n3\n")[0] == [None, None]
    unchecked, _ = run_page(tmp_path, fail)
    assert unchecked[0] is not None and "exited with status 3 (oops)" in unchecked[0]
    wrong, _ = run_page(tmp_path, fail + "$ echo $?\n0\n")
    assert wrong[0] is None and wrong[1] is not None and "Got:\n    3" in wrong[1]


def test_a_block_that_cannot_run_is_refused(tmp_path):
    [message] = run_page(tmp_path, "$ echo one \\\n")[0]
    assert message is not None and "the block ends inside the command" in message


# What the built page shows and copies -----------------------------------------------------------

def console_blocks() -> list[tuple[str, str]]:
    """``(page, block text)`` of every console block of the guide."""
    return [(page.name, m.group(2)) for page in sorted((ROOT / "docs").glob("*.md"))
            for m in FENCE.finditer(page.read_text())]


def prompt_lines(block: str) -> list[int]:
    """The lines (from 0) on which Pygments' console lexer, as the built page uses it, shows
    a prompt."""
    from pygments.lexers import get_lexer_by_name
    from pygments.token import Error, Generic

    lines, line = set(), 0
    for token, text in get_lexer_by_name("console").get_tokens(block):
        # Sphinx warns on a block its lexer cannot read, which fails the strict build
        assert token not in Error, f"Pygments cannot lex {text!r} in:\n{block}"
        if token in Generic.Prompt:
            lines.add(line)
        line += text.count("\n")
    return sorted(lines)


def test_the_guide_has_console_blocks():
    pages = {page for page, _ in console_blocks()}
    assert {"from-megatron-lm.md", "conversion.md"} <= pages


def test_a_continuation_starting_with_a_variable_shows_a_prompt():
    # why the guide's continuation lines start with a flag: Pygments would show `$` as a prompt
    assert prompt_lines("$ mfsdp convert \\\n    $MLM/x $WORK/y\n") == [0, 1]
    assert prompt_lines("$ mfsdp convert \\\n    --to hf $MLM/x\nwrote\n") == [0]
    # and an output line starting with a parenthesis shows as a virtualenv's prompt
    assert prompt_lines("$ mfsdp convert\nerror: no\n(run with --debug)\n") == [0, 2]


@pytest.mark.parametrize("page,block", console_blocks(),
                         ids=[f"{p}:{i}" for i, (p, _) in enumerate(console_blocks())])
def test_the_page_shows_a_prompt_exactly_on_the_commands(page, block):
    commands = [c.first for c in parse_console(block)]
    assert prompt_lines(block) == commands, (
        f"docs/{page}: Pygments shows a prompt on block lines {prompt_lines(block)}, the tests "
        f"run commands starting on {commands}; start a continuation line with a flag, not `$`, "
        "and no output line with a parenthesis (read as a virtualenv's name)")


def copied(blocks: list[str], tmp_path: Path) -> list[str]:
    """What sphinx-copybutton's copy button copies from each block, with conf.py's settings
    (its own ``formatCopyText``, run by Node, called as its template calls it)."""
    node = shutil.which("node")
    if node is None:
        skip_or_fail("node is not installed: sphinx-copybutton's JavaScript cannot run")
    import sphinx_copybutton

    spec = importlib.util.spec_from_file_location("mfsdp_docs_conf", ROOT / "conf.py")
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    funcs = Path(sphinx_copybutton.__file__).parent / "_static" / "copybutton_funcs.js"
    shutil.copy(funcs, tmp_path / "funcs.mjs")  # an ES module: Node reads .mjs as one
    args = ", ".join([
        repr(conf.copybutton_prompt_text), str(conf.copybutton_prompt_is_regexp).lower(),
        str(getattr(conf, "copybutton_only_copy_prompt_lines", True)).lower(),
        str(getattr(conf, "copybutton_remove_prompts", True)).lower(),
        str(getattr(conf, "copybutton_copy_empty_lines", True)).lower(),
        repr(getattr(conf, "copybutton_line_continuation_character", "")),
        repr(getattr(conf, "copybutton_here_doc_delimiter", ""))])
    script = tmp_path / "copy.mjs"
    script.write_text("import { formatCopyText } from './funcs.mjs';\n"
                      f"const blocks = {json.dumps(blocks)};\n"
                      f"const copy = b => formatCopyText(b, {args});\n"
                      "console.log(JSON.stringify(blocks.map(copy)));\n")
    done = subprocess.run([node, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def command_lines(block: str) -> str:
    """A console block's command lines, prompts dropped: what a reader pastes."""
    lines, out = block.splitlines(), []
    for command in parse_console(block):
        i = command.first
        out.append(lines[i].removeprefix("$ "))
        while lines[i].endswith("\\"):
            i += 1
            out.append(lines[i])
    return "\n".join(out)


def test_the_copy_button_copies_the_commands_and_no_output(tmp_path):
    example = "$ echo one \\\n    two\none two\n$ ls\nfile\n"
    blocks = [("example", example), *console_blocks()]
    texts = copied([b for _, b in blocks], tmp_path)
    assert texts[0] == command_lines(example) == "echo one \\\n    two\nls"
    for (page, block), text in zip(blocks, texts):
        assert text == command_lines(block), f"docs/{page}: the copy button copies\n{text}"


@pytest.mark.parametrize("word", ["$MLM/iter_0000002", "${WORK}/ckpt", "$WORK$MLM", "$NOPE/x",
                                  "${NOPE}", "plain", "a$", "$1", "--dir=$WORK/a_b"])
def test_the_shell_expands_words_as_os_path_expandvars_does_in_its_environment(word):
    """Expansion over the shell's own environment, not the process's (unchanged after it)."""
    shell = GuideShell()
    before = dict(os.environ)
    saved = os.environ.copy()
    os.environ.clear()
    os.environ.update({k: v for k, v in shell.env.items() if k != "NOPE"})
    try:
        reference = os.path.expandvars(word)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert shell.expand(word) == reference
    assert dict(os.environ) == before


def test_what_a_command_writes_to_standard_error_is_shown_below_its_output(tmp_path):
    """As a terminal shows it: a succeeding command's notes on standard error after its
    output (its progress bars left out), a failing one's last line of standard error."""
    ok = "$ bash -c \"echo out; echo note >&2; echo 'x: 50%|##  | 1/2' >&2\"\n"
    assert run_page(tmp_path, ok + "out\nnote\n")[0] == [None]
    [failure] = run_page(tmp_path, ok + "out\n")[0]
    assert failure is not None and "note" in failure
    bad = "$ bash -c \"echo out; echo trace >&2; echo 'error: no' >&2; exit 3\"\n"
    assert run_page(tmp_path, bad + "out\nerror: no\n$ echo $?\n3\n")[0] == [None, None]
