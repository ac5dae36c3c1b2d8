"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Scripts run as programs by the tests (under torchrun), not imported: --doctest-modules would
# import them and start their code.
collect_ignore_glob = ["upstream/*.py", "fixtures/*/*.py"]  # scripts run by others, not tests


@pytest.fixture(scope="session")
def built_site(tmp_path_factory):
    """Build the guide once per session with ``-W --keep-going`` (offline) and return the HTML dir."""
    out = ROOT / "build" / "test-html"
    env = dict(os.environ, MFSDP_DOCS_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-q", "-E",
         str(ROOT), str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, f"docs build failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return out


def skip_or_fail(reason: str) -> None:
    """Skip with ``reason`` on a developer machine; fail in CI (``CI=true``), where it must run."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"required in CI: {reason}")
    pytest.skip(reason)
