"""Upstream Megatron-FSDP's README Quick Start, run verbatim (import and device changed) under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "upstream" / "quickstart.py"


@pytest.mark.slow
@pytest.mark.extended  # 30 s: make test's 25-minute budget
def test_readme_quick_start_trains_saves_and_loads(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--standalone", str(SCRIPT)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "QUICKSTART OK" in proc.stdout
    assert (tmp_path / "ckpt" / ".metadata").exists()
