"""Import paths that moved keep working for one release, with a one-line deprecation message."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT

from mfsdp._moved import MOVED, MOVED_NAMES

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


_PROBE_NAMES = """
import importlib, json, sys, warnings
out = {}
for old, names in json.loads(sys.argv[1]).items():
    module = importlib.import_module(old)
    for name, new in names.items():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            moved = getattr(module, name)
        out[f"{old}.{name}"] = {
            "same": moved is getattr(importlib.import_module(new), name),
            "said": [str(w.message) for w in seen if w.category is DeprecationWarning]}
try:
    importlib.import_module("mfsdp.launch").no_such_name
except AttributeError as e:
    out["other"] = str(e)
print(json.dumps(out))
"""


def test_moved_names_are_the_moved_functions_and_say_where_they_went():
    """In a fresh process: ``mfsdp.launch.init_from_env`` (and the other names that left a module
    that stays) is the function at its new path, warns once naming it; other names still raise
    ``AttributeError``."""
    proc = subprocess.run([sys.executable, "-c", _PROBE_NAMES, json.dumps(MOVED_NAMES)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out.pop("other") == "module 'mfsdp.launch' has no attribute 'no_such_name'"
    assert out == {f"{old}.{name}": {"same": True, "said": [
        f"{old}.{name} moved to {new}.{name}; import it from there ({old}.{name} goes away in "
        "the next release)"]} for old, names in MOVED_NAMES.items() for name, new in names.items()}
    assert set(out) == {"mfsdp.launch.init_from_env", "mfsdp.launch.shutdown",
                        "mfsdp.launch.rank_info"}
