"""How a config field becomes a command-line flag: :func:`flag` declares the field with its
Megatron-LM spelling, type, choices and help, and :func:`add_flags` adds every such field of a
config class to an argparse group (the parser of ``mfsdp train`` is generated this way).

A field's ``help`` is both its documentation and its ``--help`` line; a field the parser shows
without help carries a ``doc`` instead, for readers of the class."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import MISSING, field, fields
from typing import Any


def flag(*names: str, default: Any = None, default_factory=None, doc: str | None = None,
         also: tuple[tuple[str, ...], dict] | None = None, **argparse_kw: Any):
    """A config field that is the flag ``names`` (argparse's ``add_argument`` keywords in
    ``argparse_kw``; ``choices`` may be a function, called when the parser is built);
    ``also``: a second spelling with its own keywords writing the same field (an "off" switch)."""
    meta = {"names": names, "kw": argparse_kw, "also": also, "doc": doc or argparse_kw.get("help")}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def flag_fields(cls) -> list[dataclasses.Field]:
    """The fields of config class ``cls`` that are flags, in the parser's order."""
    return [f for f in fields(cls) if "names" in f.metadata]


def add_flags(group, cls) -> None:
    """Add a flag per flag field of config class ``cls`` to ``group`` (the field's name is the
    destination, its default the flag's default)."""
    for f in flag_fields(cls):
        kw = dict(f.metadata["kw"])
        if callable(kw.get("choices")):
            kw["choices"] = kw["choices"]()
        default = f.default_factory() if f.default is MISSING else f.default
        group.add_argument(*f.metadata["names"], dest=f.name, default=default, **kw)
        if f.metadata["also"] is not None:
            names, also_kw = f.metadata["also"]
            group.add_argument(*names, dest=f.name, **also_kw)


def from_namespace(cls, args: argparse.Namespace, **extra: Any):
    """An instance of config class ``cls`` holding its flags' values in ``args`` (its
    ``__post_init__`` checks them), ``extra`` setting other fields or replacing values."""
    return cls(**{**{f.name: getattr(args, f.name) for f in flag_fields(cls)}, **extra})
