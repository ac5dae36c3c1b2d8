"""Snapshot Megatron-LM's command-line defaults into ``docs/megatron_lm_defaults.json``.

Reads ``megatron/training/arguments.py`` of a Megatron-LM checkout and the config dataclasses
that its ``ArgumentGroupFactory`` turns into flags (no import: parsed with ``ast``) and records,
for every ``--flag`` whose default is a literal, that default; ``add_argument`` defaults that are
expressions are recorded as ``"(computed)"``. The guide's migrating
page compares the snapshot with ``mfsdp train``'s parser when it is built::

    python tools/megatron_lm_defaults.py PATH/TO/Megatron-LM [COMMIT]
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "docs" / "megatron_lm_defaults.json"


def defaults(source: str) -> dict[str, object]:
    """``{flag: default}`` of every ``add_argument("--flag", ...)`` call in ``source``."""
    found: dict[str, object] = {}
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"):
            continue
        flags = [a.value for a in node.args if isinstance(a, ast.Constant)
                 and isinstance(a.value, str) and a.value.startswith("--")]
        if not flags:
            continue
        kw = {k.arg: k.value for k in node.keywords}
        action = kw.get("action")
        action = action.value if isinstance(action, ast.Constant) else None
        if "default" in kw:
            try:
                value = ast.literal_eval(kw["default"])
            except ValueError:
                value = "(computed)"
        else:
            value = {"store_true": False, "store_false": True}.get(action)
        for flag in flags:
            found.setdefault(flag, value)
    return found


def dataclass_defaults(source: str) -> dict[str, object]:
    """``{--field-name: default}`` of the literal defaults of dataclass fields in ``source``
    (Megatron-LM's ``ArgumentGroupFactory`` turns config dataclasses into flags so)."""
    found: dict[str, object] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) \
                    and item.value is not None:
                try:
                    value = ast.literal_eval(item.value)
                except ValueError:
                    continue
                found.setdefault("--" + item.target.id.replace("_", "-"), value)
    return found


CONFIG_FILES = ["megatron/training/config/*.py", "megatron/core/transformer/transformer_config.py",
                "megatron/core/model_parallel_config.py"]


def main(checkout: str, commit: str = "") -> None:
    root = Path(checkout)
    found = defaults((root / "megatron" / "training" / "arguments.py").read_text())
    for pattern in CONFIG_FILES:
        for path in sorted(root.glob(pattern)):
            for flag, value in dataclass_defaults(path.read_text()).items():
                found.setdefault(flag, value)
    data = {"source": "NVIDIA/Megatron-LM: megatron/training/arguments.py and the config "
                      "dataclasses its ArgumentGroupFactory turns into flags", "commit": commit,
            "defaults": dict(sorted(found.items()))}
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{len(data['defaults'])} flags -> {OUT}")


if __name__ == "__main__":
    main(*sys.argv[1:])
