"""Spelling of the guide, the recipes, the docstrings and the README (codespell)."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_codespell_finds_nothing():
    exe = shutil.which("codespell") or str(Path(sys.executable).with_name("codespell"))
    proc = subprocess.run([exe, "docs", "recipes", "mfsdp", "README.md", "example-scripts"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
