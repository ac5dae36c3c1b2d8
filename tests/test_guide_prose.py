"""The guide's prose, read from the sources (fast, no build): no paragraph over 120 words.

A paragraph is a run of non-blank lines of running text. Code blocks (``` and ~~~ fences),
directives (``:::`` and ```` ```{x} ```` fences, whose bodies are checked as text unless they are
code), tables, headings, list items' continuation into code, HTML comments and MyST comments are
not prose. A list item is its own paragraph.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 120

# Pages whose prose belongs to another piece of work in progress; the lead empties this list once
# they are rewritten. Every other page must pass.
ALLOWED_LONG: set[str] = set()

# fenced blocks whose body is not prose
CODE_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*(\{(?P<directive>[\w:-]+)\})?")
PROSE_DIRECTIVES = {"note", "tip", "warning", "important", "caution", "seealso", "admonition",
                    "dropdown", "attention", "hint", "danger", "error", "glossary"}


def paragraphs(text: str) -> list[tuple[int, str]]:
    """``(first line number, text)`` of every paragraph of running text in a MyST page."""
    out: list[tuple[int, str]] = []
    current: list[str] = []
    start = 0
    fence: str | None = None  # the closing fence of a code block being skipped
    in_comment = False

    def flush():
        if current:
            out.append((start, " ".join(current)))
            current.clear()

    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if fence is not None:
            if stripped.startswith(fence) and stripped.strip("`~") == "":
                fence = None
            continue
        if in_comment:
            in_comment = "-->" not in stripped
            continue
        if stripped.startswith("<!--"):
            flush()
            in_comment = "-->" not in stripped
            continue
        m = CODE_FENCE.match(line)
        if m:
            flush()
            directive = (m.group("directive") or "").lower()
            if directive not in PROSE_DIRECTIVES:
                fence = m.group(2)
            continue
        if (not stripped or stripped.startswith(("#", "|", ":::", "%", "+++", "---", ".. "))
                or re.match(r"^:[\w-]+:", stripped)   # a directive's option
                or stripped.startswith("```")):
            flush()
            continue
        if re.match(r"^([-*+]|\d+[.)])\s", stripped):  # a list item starts a paragraph
            flush()
        if not current:
            start = number
        current.append(stripped)
    flush()
    return out


def word_count(paragraph: str) -> int:
    """Words as a reader counts them: a literal or a link is one word."""
    text = re.sub(r"^([-*+]|\d+[.)])\s", "", paragraph)  # a list item's marker
    text = re.sub(r"`[^`]*`", "x", text)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return len(text.split())


def test_the_paragraph_splitter_skips_code_tables_and_directives():
    page = ("# Title\n\nOne two three.\nfour five.\n\n```python\n" + "word " * 200 + "\n```\n\n"
            "| a | b |\n|---|---|\n| " + "w " * 200 + "|\n\n```{doctest}\n>>> 1\n1\n```\n\n"
            ":::{note}\nsix seven\n:::\n\n- item one\n- item two\n")
    got = [(n, word_count(p)) for n, p in paragraphs(page)]
    assert got == [(3, 5), (20, 2), (23, 2), (24, 2)], got


def test_a_long_paragraph_is_found():
    assert [word_count(p) for _, p in paragraphs("x " * 121)] == [121]


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_no_paragraph_over_120_words(page):
    if page in ALLOWED_LONG:
        pytest.skip(f"{page}: rewritten separately (ALLOWED_LONG in {Path(__file__).name})")
    long = [f"docs/{page}:{n}: {word_count(p)} words: {p[:80]}..."
            for n, p in paragraphs((ROOT / "docs" / page).read_text()) if word_count(p) > LIMIT]
    assert not long, "\n".join(long)


# A code or output block shows this many characters without scrolling sideways in the content
# column at a 1280 px window (about 93 there; tests/test_browser.py measures the rendered page).
CODE_WIDTH = 88


def walk_blocks(text: str):
    """``(line number, line, kind)`` for every line of a MyST page but the code fences' own:
    ``kind`` is the code, output or doctest block's language or directive (``"python"``,
    ``"mermaid"``, ...) for a line inside one, ``None`` for prose (admonitions are prose)."""
    fence: str | None = None
    kind = None
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if fence is not None:
            if stripped.startswith(fence) and stripped.strip("`~") == "":
                fence = None
            else:
                yield number, line, kind
            continue
        m = CODE_FENCE.match(line)
        if m and (m.group("directive") or "").lower() not in PROSE_DIRECTIVES:
            fence, kind = m.group(2), (m.group("directive") or stripped.strip("`~ ")).lower()
            continue
        yield number, line, None


def long_code_lines(text: str) -> list[tuple[int, int]]:
    """``(line number, length)`` of every line of a fenced code, output or doctest block of a
    MyST page that is wider than ``CODE_WIDTH`` (diagrams excepted: they scale to the column)."""
    return [(number, len(line)) for number, line, kind in walk_blocks(text)
            if kind is not None and kind != "mermaid" and len(line) > CODE_WIDTH]


def recipe_code_lines(text: str) -> list[tuple[int, int]]:
    """The same for a sphinx-gallery recipe: its code lines (not the module docstring, nor the
    comment blocks after ``# %%`` that render as text)."""
    lines = text.splitlines()
    start = 0
    if lines and lines[0].startswith('"""'):
        start = next(i for i in range(1, len(lines)) if '"""' in lines[i]) + 1
    out, in_text = [], False
    for number in range(start, len(lines)):
        line = lines[number]
        if line.startswith("# %%"):
            in_text = True
            continue
        if in_text and line.startswith("#"):
            continue
        in_text = False
        if len(line) > CODE_WIDTH:
            out.append((number + 1, len(line)))
    return out


def test_long_code_lines_are_found():
    page = "a\n\n```bash\n" + "x" * 89 + "\n" + "y" * 88 + "\n```\n\n" + "z" * 200 + "\n"
    assert long_code_lines(page) == [(4, 89)]
    assert long_code_lines("```{mermaid}\n" + "m" * 120 + "\n```\n") == []
    recipe = '"""T\n' + "d" * 120 + '\n"""\n# %%\n# ' + "t" * 120 + "\nx = 1  # " + "c" * 90
    assert recipe_code_lines(recipe) == [(6, 99)]


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_code_blocks_fit_the_column(page):
    """Every line of a page's code, output and doctest blocks fits the column (CODE_WIDTH)."""
    wide = long_code_lines((ROOT / "docs" / page).read_text())
    assert not wide, "\n".join(f"docs/{page}:{n}: {w} characters" for n, w in wide)


@pytest.mark.parametrize("recipe", sorted(p.name for p in (ROOT / "recipes").glob("plot_*.py")))
def test_recipe_code_fits_the_column(recipe):
    """A recipe's code, shown on its page, fits the column too (CODE_WIDTH)."""
    wide = recipe_code_lines((ROOT / "recipes" / recipe).read_text())
    assert not wide, "\n".join(f"recipes/{recipe}:{n}: {w} characters" for n, w in wide)


def included_code() -> list[tuple[str, int, str]]:
    """``(file, line number, line)`` of every source line the guide and the recipes show with a
    ``literalinclude`` (``:pyobject:`` an object's lines, ``:start-at:`` from there to the end)."""
    import ast

    out = []
    sources = [*(ROOT / "docs").glob("*.md"), *(ROOT / "recipes").glob("plot_*.py")]
    include = re.compile(r"literalinclude:*\}?\s+(?P<path>\S+)\s*\n(?P<options>(?:\s*:[\w-]+:.*\n)*)")
    for source in sources:
        for m in include.finditer(source.read_text()):
            # a recipe's page is generated into docs/recipes/, where its paths start
            base = ROOT / "docs" / "recipes" if source.suffix == ".py" else source.parent
            path = (base / m["path"]).resolve()
            options = dict(re.findall(r":([\w-]+):\s*(.*)", m["options"]))
            lines = path.read_text().splitlines()
            first, last = 1, len(lines)
            if "pyobject" in options:
                node = next(n for n in ast.walk(ast.parse(path.read_text()))
                            if getattr(n, "name", None) == options["pyobject"].strip())
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                last = node.end_lineno
            elif "start-at" in options:
                needle = options["start-at"].strip().strip('"')
                first = next(i for i, line in enumerate(lines, 1) if needle in line)
            out += [(path.relative_to(ROOT).as_posix(), n, lines[n - 1])
                    for n in range(first, last + 1)]
    return sorted(set(out))


def test_included_source_fits_the_column():
    """The package source a page or recipe shows (``literalinclude``) fits the column too."""
    wide = [f"{f}:{n}: {len(line)} characters" for f, n, line in included_code()
            if len(line) > CODE_WIDTH]
    assert not wide, "\n".join(wide)


def test_recipe_docstring_commands_fit_the_column():
    """The commands in a recipe's introduction (indented blocks of its docstring) fit too."""
    wide = []
    for recipe in sorted((ROOT / "recipes").glob("plot_*.py")):
        lines = recipe.read_text().splitlines()
        end = next(i for i in range(1, len(lines)) if '"""' in lines[i])
        wide += [f"{recipe.name}:{i + 1}: {len(lines[i])} characters" for i in range(1, end)
                 if lines[i].startswith("    ") and len(lines[i]) > CODE_WIDTH]
        # a shell continuation is written "\\" in the docstring: a lone "\" would join the
        # two lines into one long line on the page
        wide += [f"{recipe.name}:{i + 1}: a lone backslash joins this line with the next"
                 for i in range(1, end)
                 if re.search(r"(?<!\\)(\\\\)*\\$", lines[i])]
    assert not wide, "\n".join(wide)


# An issue number with no repository ("#5976") is not turned into a link by
# docs/_ext/external_links.py; tests/test_browser.py finds it on the built page, this finds it
# in the source in a second.
BARE_ISSUE = re.compile(r"(?<![\w/.\-\]\[])#\d{3,}\b")
NOT_TEXT = re.compile(r"`[^`]*`|\[[^\]]*\]\([^)]*\)|<[^>]*>")


def bare_issue_refs(text: str) -> list[str]:
    """Issue numbers written without their repository in the running text of a page."""
    return [m.group(0) for _, p in paragraphs(text) for m in BARE_ISSUE.finditer(NOT_TEXT.sub("", p))]


def test_a_bare_issue_number_is_found():
    assert bare_issue_refs("until a release with #5976 ships") == ["#5976"]
    assert bare_issue_refs("NVIDIA/Megatron-LM#5976 and [#5976](https://x) and `#5976`") == []


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_issue_numbers_name_their_repository(page):
    bare = bare_issue_refs((ROOT / "docs" / page).read_text())
    assert not bare, f"docs/{page}: write OWNER/REPO#N (becomes a link): {bare}"


def test_recipe_comments_name_the_repository_of_an_issue():
    bare = {}
    for recipe in sorted((ROOT / "recipes").glob("*.py")):
        comments = "\n".join(line.lstrip("# ") for line in recipe.read_text().splitlines()
                             if line.lstrip().startswith("#"))
        if found := bare_issue_refs(comments):
            bare[recipe.name] = found
    assert not bare, f"write OWNER/REPO#N (becomes a link): {bare}"


# A {doc} reference without its own text renders the page's whole title. A title with "?" or
# ":" ("Will it fit? The memory planner") breaks the sentence it sits in, so such a reference
# gives short text: {doc}`the planner <planner>`.
BARE_DOC_REF = re.compile(r"\{doc\}`(?P<target>[^`<>]+)`")
# Pages being rewritten by other work in progress, which fixes their references; the lead
# empties this set once that work is merged. Every other page must pass.
DOC_REFS_REWRITTEN_ELSEWHERE: set[str] = set()


def page_titles() -> dict[str, str]:
    """The title each {doc} target renders: a page's first ``# `` heading, a recipe's first
    docstring line (its page is generated into docs/recipes/)."""
    import ast

    titles = {}
    for page in (ROOT / "docs").glob("*.md"):
        heading = next((line for line in page.read_text().splitlines()
                        if line.startswith("# ")), None)
        if heading:
            titles[page.stem] = heading[2:].strip()
    for recipe in (ROOT / "recipes").glob("plot_*.py"):
        doc = ast.get_docstring(ast.parse(recipe.read_text()))
        if doc:
            titles[f"recipes/{recipe.stem}"] = doc.splitlines()[0].strip()
    return titles


def bare_refs_to_punctuated_titles(text: str, titles: dict[str, str]) -> list[tuple[int, str]]:
    """``(line number, target)`` of each {doc} reference outside code blocks that has no text
    of its own and points to a page whose title holds "?" or ":"."""
    return [(number, ref["target"].strip().lstrip("/"))
            for number, line, kind in walk_blocks(text) if kind is None
            for ref in BARE_DOC_REF.finditer(line)
            if any(mark in titles.get(ref["target"].strip().lstrip("/"), "") for mark in "?:")]


def test_a_bare_ref_to_a_punctuated_title_is_found():
    titles = {"planner": "Will it fit? The memory planner", "data": "Data: datasets",
              "models": "Model families"}
    page = ("See {doc}`planner`, {doc}`the planner <planner>`, {doc}`models` and\n"
            "{doc}`/data`.\n\n```text\n{doc}`planner`\n```\n")
    assert bare_refs_to_punctuated_titles(page, titles) == [(1, "planner"), (2, "data")]


def test_page_titles_are_read():
    titles = page_titles()
    assert titles["planner-accuracy"] == "How accurate the planner is"
    assert titles["recipes/plot_hello_ranks"].startswith("Hello, ranks")


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_doc_refs_to_punctuated_titles_give_short_text(page):
    if page in DOC_REFS_REWRITTEN_ELSEWHERE:
        pytest.skip(f"{page}: rewritten separately (DOC_REFS_REWRITTEN_ELSEWHERE in "
                    f"{Path(__file__).name})")
    bare = bare_refs_to_punctuated_titles((ROOT / "docs" / page).read_text(), page_titles())
    assert not bare, "\n".join(
        f"docs/{page}:{n}: {{doc}}`{t}` renders {page_titles()[t]!r}; give it short text, "
        f"as {{doc}}`the planner <planner>`" for n, t in bare)
