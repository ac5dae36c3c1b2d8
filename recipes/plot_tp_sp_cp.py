"""
Tensor, sequence and context parallelism in the trainer: the same loss curve
============================================================================

Train the same Llama-style model (RMSNorm, SwiGLU, grouped-query attention, RoPE) with
``mfsdp train`` on four CPU ranks under four layouts, with Megatron-LM's flags:

* data parallel only (FSDP over 4 ranks);
* ``--tensor-model-parallel-size 2 --sequence-parallel`` (TP 2 + SP, 2 replicas);
* ``--context-parallel-size 2`` (each sequence split over 2 ranks, 2 replicas);
* TP 2 x CP 2 + SP (one replica).

Same data, same initial weights: the loss curves must lie on each other.

**What you will learn**

* the flags, and which ranks they group (TP fastest, then CP, then DP, as Megatron-LM);
* that TP, SP and CP change where the work happens, not what the model learns.
"""

# %%
# The commands
# ------------
# Each run is the command you would launch with ``torchrun``. Here it runs from Python, to
# collect the logs. ``--log-jsonl`` writes one JSON line per iteration.
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

work = Path(tempfile.mkdtemp())
common = ["--use-megatron-fsdp", "--model-preset", "llama-tiny", "--train-iters", "12",
          "--global-batch-size", "8", "--micro-batch-size", "1", "--sequence-packing",
          "--lr", "3e-3", "--log-interval", "12"]
layouts = {
    "DP 4": [],
    "TP 2 + SP, DP 2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "CP 2, DP 2": ["--context-parallel-size", "2"],
    "TP 2 x CP 2 + SP": ["--tensor-model-parallel-size", "2",
                         "--context-parallel-size", "2", "--sequence-parallel"],
}
curves = {}
for name, flags in layouts.items():
    log = work / f"{len(curves)}.jsonl"
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "4", "-m", "mfsdp.train",
           *common, *flags, "--log-jsonl", str(log)]
    print("$", " ".join(cmd[:6] + flags))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", *cmd[1:]],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = out.stdout.splitlines()
    print("  " + next(line for line in lines if line.startswith("mfsdp train")))
    curves[name] = [json.loads(line)["loss"] for line in log.read_text().splitlines()]

# %%
# The same curve
# --------------
# The largest difference between any layout and data parallelism alone, over all iterations:
base = curves["DP 4"]
for name, losses in curves.items():
    diff = max(abs(a - b) / b for a, b in zip(losses, base))
    print(f"{name:<18} final loss {losses[-1]:.5f}   largest relative difference "
          f"{diff:.1e}")
    assert diff < 1e-4

import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(6, 3.4))
styles = ["o-", "s--", "^:", "x-."]
for (name, losses), style in zip(curves.items(), styles):
    ax.plot(range(1, len(losses) + 1), losses, style, label=name, alpha=0.8)
ax.set_xlabel("iteration")
ax.set_ylabel("loss")
ax.set_title("llama-tiny on 4 CPU ranks")
ax.legend()
fig.tight_layout()
