"""
mfsdp against DDP and PyTorch FSDP2, side by side
==================================================

Train the same model on the same data with DDP, PyTorch FSDP2 (with and without resharding after
forward) and mfsdp under each strategy. All run in one run on 2 ranks, taking turns step by step.

This is the small configuration that runs inside the docs build. The full benchmark (about 9M
parameters, 2 and 4 ranks) is the same command with its defaults; its results are on the
performance page.

**What you will learn**

* the command that runs the comparison, and what its JSON report holds;
* how the step times compare, and how much they vary from step to step on a busy machine;
* how many bytes each system really sends per step (loopback interface counters), next to the
  bytes mfsdp's collectives were asked to move.

The command
-----------
.. code-block:: bash

    mfsdp bench --world-sizes 2 --hidden-size 256 --ffn-hidden-size 704 \\
        --num-layers 6 --rounds 6 --no-memory --json bench.json

``--device cuda`` runs it with NCCL on one GPU per rank; ``mfsdp bench --help`` lists the models
and systems.
"""

# %%
# Run
# ---
# The command above, from Python (it starts its own ranks). Its first line says what it ran.
import json
import subprocess
import sys
import tempfile
from pathlib import Path

report = Path(tempfile.mkdtemp()) / "bench.json"
cmd = [sys.executable, "-m", "mfsdp.cli", "bench", "--world-sizes", "2",
       "--hidden-size", "256", "--ffn-hidden-size", "704", "--num-layers", "6",
       "--rounds", "6", "--no-memory", "--json", str(report)]
out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
print(next(line for line in out.splitlines() if "ranks," in line))

# %%
# The report
# ----------
# One entry per world size; under ``time.systems`` each system's median, fastest and slowest
# step (seconds), the bytes per rank it put on the wire and asked its collectives to move, and
# its loss after the last step. All systems train the same model on the same batches, so their
# final losses agree.
results = json.loads(report.read_text())["2"]["time"]
model_bytes = 4 * results["numel"]
print(f"{'system':<25} {'median ms':>9} {'wire/model':>10} {'final loss':>10}")
for name, v in results["systems"].items():
    wire = v["wire_bytes_per_rank"] / model_bytes
    print(f"{name:<25} {1e3 * v['median_s']:9.1f} {wire:10.2f} {v['final_loss']:10.6f}")

# %%
# Plot
# ----
# Median step time with the fastest and slowest step, and bytes on the wire per step, both
# relative to the model's size in fp32 (``numel`` parameters).
import matplotlib.pyplot as plt

systems = results["systems"]
names = list(systems)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
med = [1e3 * systems[n]["median_s"] for n in names]
low = [m - 1e3 * systems[n]["min_s"] for m, n in zip(med, names)]
high = [1e3 * systems[n]["max_s"] - m for m, n in zip(med, names)]
ax1.barh(names, med, xerr=[low, high], color="tab:blue", alpha=0.8)
ax1.invert_yaxis()
ax1.set_xlabel("ms per step (median; bars: fastest to slowest)")
ax2.barh(names, [systems[n]["wire_bytes_per_rank"] / model_bytes for n in names],
         color="tab:orange", alpha=0.8)
ax2.invert_yaxis()
ax2.set_yticks([])
ax2.set_xlabel("bytes on the wire per rank per step / model bytes")
fig.suptitle(f"2 ranks, {results['numel'] / 1e6:.2f}M parameters, AdamW")
fig.tight_layout()
