"""Old import paths that keep working for one release (see CHANGELOG.md)."""

from __future__ import annotations

import importlib
import sys
import warnings

# old module path -> where it lives now
MOVED = {
    "mfsdp.plan": "mfsdp.tools.plan",
    "mfsdp.plan_time": "mfsdp.tools.plan_time",
    "mfsdp.benchmark": "mfsdp.tools.benchmark",
    "mfsdp.benchmark_systems": "mfsdp.tools.benchmark_systems",
    "mfsdp.sbatch": "mfsdp.tools.sbatch",
}


def alias(old: str, submodules: tuple[str, ...] = ()) -> None:
    """Make ``old`` (and ``old.<sub>`` for each of ``submodules``) the module it moved to, with a
    one-line ``DeprecationWarning`` naming the new path."""
    new = MOVED[old]
    warnings.warn(f"{old} moved to {new}; import it from there ({old} goes away in the next "
                  f"release)", DeprecationWarning, stacklevel=3)
    sys.modules[old] = importlib.import_module(new)
    for sub in submodules:
        sys.modules[f"{old}.{sub}"] = importlib.import_module(f"{new}.{sub}")
