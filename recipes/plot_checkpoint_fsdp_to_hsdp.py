"""
Resume an FSDP+EP run as HSDP+EP from a checkpoint
==================================================

Train a small MoE model with expert parallelism under FSDP, save an ``fsdp_dtensor`` checkpoint
halfway, resume it with HSDP (an outer replica dimension) and the same EP size, and compare the loss
and gradient-norm curves with a run that was never interrupted.

**What you will learn**

* how a checkpoint written by one layout is read by another (the load reshards);
* how to validate a new layout against an old one: the curves must coincide.
"""

# %%
# Run
# ---
# Four ranks. FSDP+EP: one shard group of 4, experts over EP groups of 2. HSDP+EP: shard groups of
# 2, an outer dimension of 2, the same EP groups. The global batch is the same in both.
import tempfile

from mfsdp.launch import launch
from mfsdp.testing import train_sharded, train_sharded_many

steps, save_at = 12, 6
cfg = dict(model="moe", blocks=4, num_experts=4, ep=2, optimizer="adamw", lr=0.2,
           global_batch=32, steps=steps, grad_norms=True, return_params=False)
root = tempfile.mkdtemp()
uninterrupted, _ = launch(train_sharded_many, 4, args=(
    [cfg, dict(cfg, steps=save_at, save_at=save_at, save_dir=root)],))[0]
resumed = launch(train_sharded, 4, args=(dict(cfg, dp_outer=2, load_dir=root),))[0]

print(f"{'step':>4} | {'loss FSDP+EP':>12} | {'loss resumed HSDP+EP':>20} | grad norm (both)")
for i in range(save_at, steps):
    j = i - save_at
    print(f"{i + 1:>4} | {uninterrupted['losses'][i]:12.6f} | {resumed['losses'][j]:20.6f} | "
          f"{uninterrupted['grad_norms'][i]:.6f} / {resumed['grad_norms'][j]:.6f}")
worst = max(abs(a - b) / a for a, b in zip(uninterrupted["losses"][save_at:], resumed["losses"]))
print(f"largest relative loss difference after the resume: {worst:.1e}")

# %%
# Plot
# ----
import matplotlib.pyplot as plt

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
xs = range(1, steps + 1)
for ax, key, title in ((ax1, "losses", "loss"), (ax2, "grad_norms", "gradient norm")):
    ax.plot(xs, uninterrupted[key], "o-", label="FSDP+EP, uninterrupted")
    ax.plot(range(save_at + 1, steps + 1), resumed[key], "x--", ms=9,
            label="resumed as HSDP+EP")
    ax.axvline(save_at + 0.5, color="gray", lw=0.8, ls=":")
    ax.set_xlabel("step")
    ax.set_title(title)
ax1.legend(fontsize=8)
fig.tight_layout()
