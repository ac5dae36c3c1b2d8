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

# old module path -> {name: the module it moved to}, for names that left a module that stays
MOVED_NAMES = {
    "mfsdp.launch": {"init_from_env": "mfsdp.runtime", "shutdown": "mfsdp.runtime",
                     "rank_info": "mfsdp.runtime"},
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


def moved_name(old: str, name: str):
    """``old.name`` for a name that moved to another module (a module's ``__getattr__``), with a
    one-line ``DeprecationWarning`` naming the new path; ``AttributeError`` for any other name."""
    new = MOVED_NAMES.get(old, {}).get(name)
    if new is None:
        raise AttributeError(f"module {old!r} has no attribute {name!r}")
    warnings.warn(f"{old}.{name} moved to {new}.{name}; import it from there ({old}.{name} goes "
                  f"away in the next release)", DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(new), name)
