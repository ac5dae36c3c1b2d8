"""Sphinx directive ``mfsdp-argparse``: a command's reference generated from its argparse parser.

Usage in MyST::

    ```{mfsdp-argparse} mfsdp.train:build_parser
    :prog: mfsdp train
    ```

Each argument group becomes a table (flag, default, meaning); subcommands get their own section.
Generated at build time from the parser itself, so the reference and the CLI cannot disagree.
"""

from __future__ import annotations

import argparse
import importlib

from docutils import nodes
from docutils.core import publish_doctree
from docutils.parsers.rst import directives
from sphinx.util.docutils import SphinxDirective


def rst_nodes(text: str) -> list[nodes.Node]:
    """Docutils nodes of plain reStructuredText, parsed on its own (so a directive works the same
    in MyST and reST pages) at the build's strictness: an error stops the build."""
    tree = publish_doctree(text, settings_overrides={"report_level": 2, "halt_level": 2})
    return list(tree.children)


def _load(spec: str) -> argparse.ArgumentParser:
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)()


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|") or " "


def _flag(action: argparse.Action) -> str:
    names = ", ".join(f"``{o}``" for o in action.option_strings) or f"``{action.metavar or action.dest}``"
    if action.choices and not isinstance(action, argparse._SubParsersAction):
        names += " {" + ", ".join(f"``{c}``" for c in action.choices) + "}"
    elif action.nargs != 0 and action.option_strings:
        names += f" *{action.metavar or action.dest.upper()}*"
    return names


def _default(action: argparse.Action) -> str:
    if action.default in (None, False, "", argparse.SUPPRESS) or action.nargs == 0 and \
            not isinstance(action, argparse.BooleanOptionalAction):
        return ""
    return f"``{action.default}``"


def _literal(value) -> str:
    """A default as an inline literal; the empty string as ``''`` (an empty literal is invalid)."""
    return f"``{value!r}``" if value == "" else f"``{value}``"


def _help(action: argparse.Action) -> str:
    text = (action.help or "").replace("%(default)s", str(action.default))
    return "" if text == argparse.SUPPRESS else text


def _rst(parser: argparse.ArgumentParser, prog: str) -> list[str]:
    lines = [f"``{prog}``: {parser.description or ''}", ""]
    subparsers = []
    for group in parser._action_groups:
        rows = []
        for action in group._group_actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if isinstance(action, argparse._SubParsersAction):
                subparsers.append(action)
                continue
            rows.append((_flag(action), _default(action), _help(action)))
        if not rows:
            continue
        title = group.title if group.title not in ("options", "optional arguments") else "options"
        lines += [f".. rubric:: {prog}: {title}", "", ".. list-table::", "   :header-rows: 1",
                  "   :widths: 35 15 50", "", "   * - flag", "     - default", "     - meaning"]
        for flag, default, help_ in rows:
            lines += [f"   * - {_cell(flag)}", f"     - {_cell(default)}", f"     - {_cell(help_)}"]
        lines.append("")
    for action in subparsers:
        for name, sub in action.choices.items():
            lines += _rst(sub, f"{prog} {name}")
    return lines


class ArgparseDirective(SphinxDirective):
    """Render the parser returned by ``module:function`` as tables."""

    required_arguments = 1
    option_spec = {"prog": directives.unchanged}

    def run(self) -> list[nodes.Node]:
        parser = _load(self.arguments[0])
        prog = self.options.get("prog", parser.prog)
        # The tables are plain reStructuredText (rubric, list-table), parsed on their own so that
        # the directive works the same in MyST and reST pages.
        return rst_nodes("\n".join(_rst(parser, prog)))


def default_differences(parser: argparse.ArgumentParser, snapshot: dict) -> tuple[list, int]:
    """``([(flag, Megatron-LM default, mfsdp default)], agreeing)``: the flags of ``parser`` that
    Megatron-LM also has (per ``snapshot``, ``docs/megatron_lm_defaults.json``) whose defaults
    differ, and how many shared flags agree."""
    theirs = snapshot["defaults"]
    rows, agree = [], 0
    for action in parser._actions:
        for flag in action.option_strings:
            if flag not in theirs or flag in ("-h", "--help"):
                continue
            ours = action.default
            if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
                ours = bool(ours)
            if ours == theirs[flag] or (isinstance(ours, (int, float)) and
                                        isinstance(theirs[flag], (int, float)) and
                                        float(ours) == float(theirs[flag])):
                agree += 1
            else:
                rows.append((flag, theirs[flag], ours))
    return rows, agree


def defaults_rst(parser: argparse.ArgumentParser, snapshot: dict) -> list[str]:
    """The reStructuredText of the table of defaults that differ from Megatron-LM's."""
    rows, agree = default_differences(parser, snapshot)
    lines = [f"Generated from ``mfsdp train``'s parser and a snapshot of Megatron-LM's defaults "
             f"(commit ``{snapshot['commit'][:12]}``): {agree} shared flags have the same "
             f"default, {len(rows)} differ.", "",
             ".. list-table::", "   :header-rows: 1", "",
             "   * - flag", "     - Megatron-LM", "     - mfsdp"]
    for flag, theirs, ours in rows:
        lines += [f"   * - ``{flag}``", f"     - {_literal(theirs)}", f"     - {_literal(ours)}"]
    return lines


class MegatronDefaultsDirective(SphinxDirective):
    """Table of the ``mfsdp train`` flags whose defaults differ from Megatron-LM's snapshot."""

    required_arguments = 2  # module:function, snapshot JSON (relative to the source dir)

    def run(self) -> list[nodes.Node]:
        import json
        from pathlib import Path

        parser = _load(self.arguments[0])
        path = Path(self.env.srcdir) / self.arguments[1]
        self.env.note_dependency(str(path))
        snapshot = json.loads(path.read_text())
        return rst_nodes("\n".join(defaults_rst(parser, snapshot)))


def setup(app):
    """Register the directives."""
    app.add_directive("mfsdp-argparse", ArgparseDirective)
    app.add_directive("mfsdp-megatron-defaults", MegatronDefaultsDirective)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
