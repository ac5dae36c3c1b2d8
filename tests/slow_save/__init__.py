"""The environment that slows the trainer's checkpoint save in a child process (see
``tests/slow_save/sitecustomize.py``, the test-only shim it puts first on ``PYTHONPATH``)."""
from __future__ import annotations

import os
from pathlib import Path

SHIM_DIR = Path(__file__).resolve().parent
SAVE_DELAY_ENV = "MFSDP_TEST_SAVE_DELAY_S"  # (the name sitecustomize.py reads)


def slowed_save_env(delay_s: float, pythonpath: str | None = None) -> dict[str, str]:
    """Variables for a child process whose trainer sleeps ``delay_s`` seconds in each save:
    the delay and ``PYTHONPATH`` with the shim first (then ``pythonpath``, default this
    process's ``$PYTHONPATH``)."""
    rest = os.environ.get("PYTHONPATH", "") if pythonpath is None else pythonpath
    return {SAVE_DELAY_ENV: str(delay_s),
            "PYTHONPATH": os.pathsep.join(p for p in (str(SHIM_DIR), rest) if p)}
