"""Snapshot Megatron-LM's argument parser into ``tests/fixtures/megatron_lm_parser.json``.

Builds the real parser of a Megatron-LM checkout (``megatron.training.arguments.
add_megatron_arguments``, the function ``pretrain_gpt.py`` parses its command line with, config
dataclasses included) and records, for every option string, what argparse would accept: the
``dest``, ``nargs``, the action (``store``, ``store_true``, ...), the type's name and the
``choices``. Optional packages the parser's modules import (Transformer Engine, triton, ...)
are replaced by stubs that only exist: the parser's flags never depend on them.
``tests/test_sbatch.py`` checks every flag a rendered Megatron-LM script passes against the
snapshot (unknown flag, wrong number of values, value outside the choices or of the wrong type)::

    git -C Megatron-LM archive COMMIT megatron tools/checkpoint | tar -x -C megatron-lm-src
    python tools/megatron_lm_parser.py megatron-lm-src COMMIT
"""

from __future__ import annotations

import argparse
import ast
import importlib.abc
import importlib.machinery
import importlib.util
import json
import sys
import types
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "megatron_lm_parser.json"


class _Anything(type):
    """A class (so it can be subclassed, called, used as a decorator) whose every attribute is
    another such class."""

    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator
        return _Anything(cls.__name__, (), {})

    def __getitem__(cls, item):
        return cls

    def __iter__(cls):
        return iter(())

    def __bool__(cls):
        return False

    def __or__(cls, other):
        return cls

    __ror__ = __or__


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of ``packages`` that are not installed give stub modules."""

    def __init__(self, packages: set[str]):
        self.packages = packages

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] not in self.packages:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0"
        return module

    def exec_module(self, module):
        pass


def build_parser(checkout: Path) -> argparse.ArgumentParser:
    """Megatron-LM's own parser, as ``megatron.training.arguments.parse_args`` builds it.

    A package that an import fails on (megatron/core imports triton, for one, without a guard) is
    stubbed and the import tried again; packages that Megatron-LM imports under ``try`` stay
    missing, so it takes the paths it takes where they are not installed."""
    sys.path.insert(0, str(checkout))
    import typing

    if not hasattr(typing, "override"):  # Python 3.12's; Megatron-LM imports it from typing
        typing.override = lambda f: f
    finder = _StubFinder(set())
    sys.meta_path.insert(0, finder)
    while True:
        try:
            from megatron.training.arguments import add_megatron_arguments
            break
        except ModuleNotFoundError as exc:
            top = (exc.name or "").split(".")[0]
            if not top or top == "megatron" or top in finder.packages:
                raise
            finder.packages.add(top)
            for name in [m for m in sys.modules if m.split(".")[0] in ("megatron", top)]:
                del sys.modules[name]
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    parser = add_megatron_arguments(parser) or parser
    parser.stubbed = sorted(finder.packages)
    return parser


def _type_name(t) -> str | None:
    if t is None:
        return None
    return getattr(t, "__name__", type(t).__name__)


def _jsonable(x):
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def snapshot(parser: argparse.ArgumentParser) -> dict[str, dict]:
    """``{option string: {dest, action, nargs, type, choices}}`` for every optional argument."""
    flags: dict[str, dict] = {}
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        kind = type(action).__name__.lstrip("_").removesuffix("Action").lower() or "store"
        entry = {"dest": action.dest, "action": kind,
                 "nargs": action.nargs if action.nargs is not None else
                 (0 if kind in ("storetrue", "storefalse", "storeconst", "count", "appendconst",
                                "booleanoptional") else None),
                 "type": _type_name(action.type),
                 "choices": (None if action.choices is None
                             else [_jsonable(c) for c in action.choices])}
        for option in action.option_strings:
            flags[option] = entry
    return dict(sorted(flags.items()))


def click_command(source: str, function: str) -> dict[str, dict]:
    """``{option: {"flag": bool}}`` and the positional ``arguments`` of the click command defined
    by ``function`` in ``source`` (read from its decorators with ``ast``: the converter's module
    needs GPUs to import)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            options, arguments = {}, []
            for dec in node.decorator_list:
                if not isinstance(dec, ast.Call):
                    continue
                kind = getattr(dec.func, "attr", "")
                names = [a.value for a in dec.args if isinstance(a, ast.Constant)]
                kw = {k.arg: k.value for k in dec.keywords}
                if kind == "option":
                    flag = isinstance(kw.get("is_flag"), ast.Constant) and kw["is_flag"].value
                    for name in names:
                        options[name] = {"flag": bool(flag)}
                elif kind == "argument":
                    arguments.extend(names)
            return {"arguments": arguments, "options": options}
    raise SystemExit(f"no function {function} in the converter")


def main(checkout: str, commit: str) -> None:
    parser = build_parser(Path(checkout))
    inspector = (Path(checkout) / "tools" / "checkpoint" / "checkpoint_inspector.py").read_text()
    data = {"source": "NVIDIA/Megatron-LM: megatron.training.arguments.add_megatron_arguments "
                      "(the parser of pretrain_gpt.py), built by tools/megatron_lm_parser.py",
            "commit": commit, "stubbed_imports": parser.stubbed, "flags": snapshot(parser),
            "checkpoint_inspector": {"convert-torch-dist-to-fsdp-dtensor": click_command(
                inspector, "convert_torch_dist_to_fsdp_dtensor")}}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{len(data['flags'])} option strings -> {OUT}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(*sys.argv[1:])
