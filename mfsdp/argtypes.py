"""argparse value types shared by the command lines (``mfsdp train``, ``mfsdp plan``): each turns
the text of one flag into a number or refuses it with a line that says what the flag needs.

    >>> positive_int("3"), non_negative_float("0")
    (3, 0.0)
    >>> positive_int("0")
    Traceback (most recent call last):
      ...
    argparse.ArgumentTypeError: 0 is not a positive integer
"""

from __future__ import annotations

import argparse
import math
from typing import Callable


def checked(cast: Callable, ok: Callable, what: str, name: str | None = None) -> Callable:
    """An argparse type: ``cast(value)`` where ``ok`` accepts it, else an
    :class:`argparse.ArgumentTypeError` saying ``{value} is not {what}``; ``name`` is the type's
    name in argparse's own messages."""
    def parse(value: str):
        try:
            x = cast(value)
        except ValueError:
            kind = "an integer" if cast is int else "a number"
            raise argparse.ArgumentTypeError(f"{value!r} is not {kind}") from None
        if not ok(x):
            raise argparse.ArgumentTypeError(f"{value} is not {what}")
        return x
    parse.__name__ = parse.__qualname__ = name or what
    parse.__doc__ = f"argparse type: {what}."
    return parse


positive_int = checked(int, lambda n: n >= 1, "a positive integer", "positive_int")
non_negative_int = checked(int, lambda n: n >= 0, "an integer of at least 0", "non_negative_int")
positive_float = checked(float, lambda x: 0 < x < math.inf, "a finite number above 0",
                         "positive_float")
non_negative_float = checked(float, lambda x: 0 <= x < math.inf,
                             "a finite number of at least 0", "non_negative_float")
# one of Adam's betas, in [0, 1) (torch.optim refuses others)
adam_beta = checked(float, lambda x: 0 <= x < 1,
                    "in [0, 1): a beta is the decay rate of one of Adam's moving averages "
                    "(Megatron-LM's defaults: --adam-beta1 0.9, --adam-beta2 0.999)", "adam_beta")
# the fraction of a GPU's peak that the kernels reach (mfsdp plan)
fraction = checked(float, lambda x: 0 < x <= 1, "in (0, 1]: it is the fraction of the peak the "
                   "kernels reach (0.4 by default)", "fraction")

MIN_TIMEOUT_MINUTES = 0.1


def timeout_minutes(value: str) -> float:
    """argparse type: ``--distributed-timeout-minutes``, at least 0.1 (6 s): a shorter wait
    times out while a healthy rank is still reading its data or writing its shard."""
    x = float(value)
    if not MIN_TIMEOUT_MINUTES <= x < math.inf:
        raise argparse.ArgumentTypeError(
            f"{value} minutes is too short a wait: at least {MIN_TIMEOUT_MINUTES} (6 s), or a "
            "healthy rank that is still reading data or saving times out (Megatron-LM's "
            "default: 10)")
    return x
