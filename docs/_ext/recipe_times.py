"""Print the execution time of every recipe, as sphinx-gallery recorded it in the last build.

``make docs`` runs it after the build: ``python docs/_ext/recipe_times.py``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

TIMES = Path(__file__).resolve().parents[1] / "recipes" / "sg_execution_times.rst"


def recipe_times(path: Path = TIMES) -> list[tuple[str, float]]:
    """``(recipe file, seconds)`` pairs, slowest first."""
    text = path.read_text()
    rows = re.findall(r"\(``([\w./-]+\.py)``\)\s*\n\s*- (\d+):(\d+\.\d+)", text)
    return sorted(((name, int(m) * 60 + float(s)) for name, m, s in rows), key=lambda r: -r[1])


def main() -> int:
    """Print the table (nothing if the gallery has not been built)."""
    if not TIMES.exists():
        print("no recipe times yet: build the guide first", file=sys.stderr)
        return 0
    rows = recipe_times()
    print("recipe execution times (sphinx-gallery):")
    for name, seconds in rows:
        print(f"  {seconds:6.1f} s  {name}")
    print(f"  {sum(s for _, s in rows):6.1f} s  total")
    return 0


if __name__ == "__main__":
    sys.exit(main())
