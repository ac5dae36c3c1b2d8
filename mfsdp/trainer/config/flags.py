"""How a config field becomes a command-line flag: :func:`flag` declares a field of a config
class as a flag, and :func:`add_flags` adds every such field of a class to an argparse group (the
parser of ``mfsdp train`` is generated this way).

A flag field is written once, as torchtitan writes its config (the docstring under a field is its
documentation and its ``--help`` line)::

    micro_batch_size: int = flag(default=2, type=positive_int)
    \"\"\"sequences per micro-batch per rank\"\"\"

What the declaration leaves out is derived:

- the flag's name is the field's, with dashes: ``--micro-batch-size`` (Megatron-LM's names are
  its argument names); a field spelled otherwise names its flags;
- a ``bool`` field is a switch (``store_true``) unless it names another action;
- the help line is the field's docstring, with ``(default: X)`` added where the flag takes a
  value, its default is not None and the docstring does not already speak of it."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
from dataclasses import MISSING, field, fields
from typing import Any, Callable


# actions that take no value: their help never shows a default
_SWITCHES = ("store_true", "store_false", "store_const", "count")


def flag(*names: str, default: Any = None, default_factory: Callable[[], Any] | None = None,
         also: tuple[tuple[str, ...], dict] | None = None, **argparse_kw: Any) -> Any:
    """A config field that is a flag: ``names`` where they are not the field's name with dashes,
    argparse's ``add_argument`` keywords in ``argparse_kw`` (``choices`` may be a function, called
    when the parser is built); ``also``: a second spelling with its own keywords writing the same
    field (an "off" switch)."""
    for key in ("help", "doc"):
        if key in argparse_kw:
            raise TypeError(f"flag() takes no {key}=: write the help as the field's docstring, "
                            "on the line under the field")
    meta = {"names": names, "kw": argparse_kw, "also": also}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def flag_fields(cls) -> list[dataclasses.Field]:
    """The fields of config class ``cls`` that are flags, in the parser's order."""
    return [f for f in fields(cls) if "names" in f.metadata]


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of class ``cls`` (read from its source, as Sphinx and
    torchtitan's parser read them), whitespace folded to single spaces."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (a frozen build): no help lines
        return {}
    body = ast.parse(source).body[0].body
    return {st.target.id: " ".join(nxt.value.value.split())
            for st, nxt in zip(body, body[1:])
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)
            and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)}


def flag_arguments(cls, f: dataclasses.Field) -> tuple[tuple[str, ...], dict[str, Any]]:
    """The names and ``add_argument`` keywords of flag field ``f`` of config class ``cls``."""
    names = f.metadata["names"] or ("--" + f.name.replace("_", "-"),)
    kw = dict(f.metadata["kw"])
    if callable(kw.get("choices")):
        kw["choices"] = kw["choices"]()
    default = f.default_factory() if f.default is MISSING else f.default
    if str(f.type).startswith("bool") and "action" not in kw:
        kw["action"] = "store_true"
    doc = field_docs(cls).get(f.name)
    if doc is not None:
        if (default is not None and kw.get("action") not in _SWITCHES
                and "default" not in doc):
            doc += " (default: %(default)s)"
        kw["help"] = doc
    return names, dict(kw, dest=f.name, default=default)


def add_flags(group: Any, cls: type) -> None:
    """Add a flag per flag field of config class ``cls`` to ``group`` (an argparse parser or
    argument group; the field's name is the destination, its default the flag's default)."""
    for f in flag_fields(cls):
        names, kw = flag_arguments(cls, f)
        group.add_argument(*names, **kw)
        if f.metadata["also"] is not None:
            names, also_kw = f.metadata["also"]
            group.add_argument(*names, dest=f.name, **also_kw)


def from_namespace(cls, args: argparse.Namespace, **extra: Any):
    """An instance of config class ``cls`` holding its flags' values in ``args`` (its
    ``__post_init__`` checks them), ``extra`` setting other fields or replacing values."""
    return cls(**{**{f.name: getattr(args, f.name) for f in flag_fields(cls)}, **extra})
