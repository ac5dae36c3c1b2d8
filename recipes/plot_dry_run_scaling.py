"""
Dry run: memory per rank from 8 to 4,096 GPUs, measured on one CPU
===================================================================

Build Llama-3-70B with the real engine at every world size from 8 to 4,096
ranks, all in this one process. torch's fake process group stands in for the
ranks, and every tensor lives on the meta device, so nothing is allocated.
Then plot what one rank holds next to what ``mfsdp plan`` predicts.

**What you will learn**

* how to run the engine at a world size you do not have (``mfsdp plan
  --dry-run``, or :func:`mfsdp.tools.dry_run.dry_run` from Python);
* how weights, gradients and optimizer state per rank fall as ranks are added,
  under ZeRO-3 and under ZeRO-1, and what stays: ZeRO-1 keeps the full bf16
  weights and fp32 gradients on every rank, whatever the world size;
* that the planner's bytes match the engine's at every size (within 2%).

The same from the shell, for one world size::

    mfsdp plan llama3-70b --world-size 1024 --dry-run --json dry.json
"""

# %%
# Measure
# -------
# One dry run per world size and strategy. ``ranks=[0]`` builds rank 0 only,
# since every rank of a dense model holds the same shapes. (The command line
# builds the first and last rank of each group.)
import time

from mfsdp.tools.dry_run import dry_run
from mfsdp.tools.plan import Layout

worlds = [8, 32, 128, 512, 1024, 4096]
strategies = {"ZeRO-3 (optim_grads_params)": "optim_grads_params",
              "ZeRO-1 (optim)": "optim"}
state = ("params", "grads", "optimizer")
rows = []
start = time.perf_counter()
for label, strategy in strategies.items():
    for world in worlds:
        layout = Layout(world_size=world, strategy=strategy)
        r = dry_run("llama3-70b", layout, ranks=[0], progress=False)
        measured = sum(r.measured[k] for k in state) / 2**30
        planned = sum(r.planned[k] for k in state) / 2**30
        rows.append((label, world, measured, planned, r.peak_rss / 2**30))
seconds = time.perf_counter() - start

print(f"{'strategy':<28} {'world':>6} {'engine GiB':>11} {'plan GiB':>9} {'diff':>7}")
for label, world, measured, planned, _ in rows:
    print(f"{label:<28} {world:>6} {measured:11.2f} {planned:9.2f} "
          f"{measured / planned - 1:+7.2%}")
peak = max(r[4] for r in rows)
print(f"{len(rows)} dry runs in {seconds:.0f} s; peak RSS {peak:.2f} GiB")

# %%
# Plot
# ----
# Weights, main weights, gradients and optimizer state per rank (GiB, log
# scale) against world size; lines are the engine, markers the plan.
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(8, 4))
for label in strategies:
    mine = [r for r in rows if r[0] == label]
    xs = [r[1] for r in mine]
    line, = ax.plot(xs, [r[2] for r in mine], label=f"{label}: engine")
    ax.plot(xs, [r[3] for r in mine], "o", color=line.get_color(),
            fillstyle="none", label=f"{label}: plan")
ax.axhline(76, color="grey", linestyle="--", linewidth=1)
ax.text(worlds[0], 80, "80 GiB H100, 4 GiB kept free", fontsize=10,
        color="grey")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("world size (ranks)")
ax.set_ylabel("GiB per rank (state)")
ax.set_title("Llama-3-70B: model state per rank, measured by a dry run")
ax.legend(loc="lower left", fontsize=10)
fig.tight_layout()

# %%
# What the numbers say
# --------------------
# Under ZeRO-3 everything divides by the world size. State per rank falls from
# hundreds of GiB to a fraction of one.
#
# Under ZeRO-1 only the main weights and the optimizer state divide. The bf16
# weights (2 bytes per parameter) and the fp32 gradients (4) stay whole on
# every rank: about 395 GiB for 70B parameters. So no world size makes ZeRO-1
# fit an 80 GiB GPU.
#
# Activations are not in this plot: they do not depend on the world size (see
# :doc:`../planner`).
