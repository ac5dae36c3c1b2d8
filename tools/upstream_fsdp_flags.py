"""Write tests/fixtures/megatron_fsdp_guide_flags.json: the flags upstream's Megatron-FSDP
example scripts pass (``examples/megatron_fsdp/*.sh`` of a Megatron-LM checkout).

Per script: the flags of its ``if [ "${USE_MEGATRON_FSDP}" = 1 ]`` block (uncommented lines) and,
anywhere in the script, the data-parallel flags ``--use-distributed-optimizer``,
``--overlap-grad-reduce`` and ``--overlap-param-gather``. ``tests/test_sbatch.py`` checks that
every Megatron-LM render carries the flags all the scripts share.

    python tools/upstream_fsdp_flags.py /path/to/Megatron-LM
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

SCRIPTS = ("examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh",
           "examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh")
DATA_PARALLEL = ("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather")
FLAG = re.compile(r"^\s*(--[a-z0-9-]+)")


def flags(text: str) -> list[str]:
    """The Megatron-FSDP block's flags and the data-parallel flags of one script."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    start = next(i for i, line in enumerate(lines) if 'USE_MEGATRON_FSDP}" = 1' in line)
    end = next(i for i in range(start, len(lines)) if lines[i].strip() == "fi")
    found = [m.group(1) for line in lines[start:end] if (m := FLAG.match(line))]
    found += [f for f in DATA_PARALLEL if any(FLAG.match(line) and FLAG.match(line).group(1) == f
                                              for line in lines)]
    return sorted(set(found))


def main(checkout: str) -> None:
    root = Path(checkout)
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()
    out = {"source": "NVIDIA/Megatron-LM", "commit": commit,
           "scripts": {s: flags((root / s).read_text()) for s in SCRIPTS}}
    path = Path(__file__).resolve().parents[1] / "tests/fixtures/megatron_fsdp_guide_flags.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1])
