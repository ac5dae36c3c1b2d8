"""Flags that a combination of ``mfsdp train``'s other flags would leave without effect: each is
refused at start with one line naming the flag and the fix, so no flag is accepted and ignored.

The rules are :data:`~mfsdp.trainer.config.rules.NEEDS` and
:data:`~mfsdp.trainer.config.rules.ALWAYS`, in :mod:`mfsdp.trainer.config.rules` with every other
rule across the flag groups: a :class:`~mfsdp.trainer.config.TrainConfig` checks them when it is
built, from the command line or in code. This module keeps the names the tests and the guide
import: :func:`check_combinations` and :func:`flag_of` on parsed arguments.
"""

from __future__ import annotations

import argparse
from typing import Any

from mfsdp.trainer.config import TrainConfig
from mfsdp.trainer.config.rules import ALWAYS, NEEDS, Needs, View

__all__ = ["ALWAYS", "NEEDS", "Needs", "check_combinations", "flag_of"]


def flag_of(parser: argparse.ArgumentParser | None, dest: str, value: Any = None) -> str:
    """The spelling of field ``dest`` on the command line that gives ``value`` (``--no-...``
    for a switched-off default, the first option string otherwise); ``parser`` is not needed
    (the config classes declare the flags) and is accepted for the older calls."""
    return View(TrainConfig()).flag(dest, value)


def check_combinations(args: argparse.Namespace,
                       parser: argparse.ArgumentParser | None = None) -> None:
    """Refuse (``SystemExit``, one line naming the flag and the fix) parsed arguments that break
    a rule of :class:`~mfsdp.trainer.config.TrainConfig` (its groups' own and those across
    groups): the config the command line would build."""
    TrainConfig.from_args(args)
