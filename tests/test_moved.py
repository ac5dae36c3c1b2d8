"""Import paths that moved keep working for one release, with a one-line deprecation message."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT

from mfsdp._moved import MOVED

_PROBE = """
import importlib, json, sys, warnings
out = {}
for old, new in json.loads(sys.argv[1]).items():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        moved = importlib.import_module(old)
    out[old] = {"same": moved is importlib.import_module(new),
                "said": [str(w.message) for w in seen if w.category is DeprecationWarning]}
from mfsdp.sbatch.presets import PRESETS as a
from mfsdp.tools.sbatch.presets import PRESETS as b
import mfsdp.sbatch.checks, mfsdp.tools.sbatch.checks
out["submodules"] = a is b and mfsdp.sbatch.checks is mfsdp.tools.sbatch.checks
print(json.dumps(out))
"""


def test_old_import_paths_are_the_moved_modules_and_say_where_they_went():
    """In a fresh process: each old path imports the moved module itself (also the sbatch
    submodules), and warns once, naming the new path."""
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(MOVED)], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out.pop("submodules") is True
    assert out == {old: {"same": True, "said": [f"{old} moved to {new}; import it from there "
                                                f"({old} goes away in the next release)"]}
                   for old, new in MOVED.items()}
