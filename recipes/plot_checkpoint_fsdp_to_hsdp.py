"""
Resume an FSDP+EP run as HSDP+EP from a checkpoint
==================================================

Train a small MoE model with expert parallelism under FSDP, and save an ``fsdp_dtensor``
checkpoint halfway. Resume it with HSDP (an outer replica dimension) and the same EP size.
Then compare the loss and gradient-norm curves with a run that was never interrupted.

**What you will learn**

* how a checkpoint written by one layout is read by another (the load reshards, experts included);
* how to validate a new layout against an old one: the curves must coincide.

The code
--------
The training script of :ref:`sphx_glr_docs_recipes_plot_training_script.py`
(``mfsdp/examples/train_script.py``), with ``moe=True``. Every second block is a mixture of
4 experts, and ``ep=2`` keeps 2 of them on each rank. The layout and the sharding:

.. literalinclude:: ../../mfsdp/examples/train_script.py
   :language: python
   :pyobject: build

The same from a shell:

.. code-block:: bash

    torchrun --nproc-per-node 4 -m mfsdp.examples.train_script --moe --ep 2 \\
        --steps 12 --save-at 6 --save ckpt
    torchrun --nproc-per-node 4 -m mfsdp.examples.train_script --moe --ep 2 \\
        --dp-outer 2 --steps 12 --load ckpt
"""

# %%
# Run
# ---
# Four ranks, with the same global batch in both runs:
#
# * FSDP+EP: one shard group of 4, the experts over EP groups of 2;
# * HSDP+EP: shard groups of 2, an outer dimension of 2, the same EP groups.
import tempfile

from mfsdp.launch import launch

run = "mfsdp.examples.train_script:train"
steps, save_at = 12, 6
root = tempfile.mkdtemp()
moe = dict(moe=True, ep=2, steps=steps)
uninterrupted = launch(run, 4, kwargs=dict(moe, save=root, save_at=save_at),
                       timeout=600)[0]
resumed = launch(run, 4, kwargs=dict(moe, load=root, dp_outer=2), timeout=600)[0]

print(f"{'step':>4} | {'loss FSDP+EP':>12} | {'resumed HSDP+EP':>15} | grad norms")
for a, b in zip(uninterrupted[save_at:], resumed):
    print(f"{a['step']:>4} | {a['loss']:12.6f} | {b['loss']:15.6f} | "
          f"{a['grad_norm']:.6f} / {b['grad_norm']:.6f}")
pairs = zip(uninterrupted[save_at:], resumed)
worst = max(abs(a["loss"] - b["loss"]) / a["loss"] for a, b in pairs)
print(f"largest relative loss difference after the resume: {worst:.1e}")
assert worst < 1e-5

# %%
# Plot
# ----
import matplotlib.pyplot as plt

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
xs = range(1, steps + 1)
for ax, key, title in ((ax1, "loss", "loss"), (ax2, "grad_norm", "gradient norm")):
    ax.plot(xs, [r[key] for r in uninterrupted], "o-", label="FSDP+EP, uninterrupted")
    ax.plot(range(save_at + 1, steps + 1), [r[key] for r in resumed], "x--", ms=9,
            label="resumed as HSDP+EP")
    ax.axvline(save_at + 0.5, color="gray", lw=0.8, ls=":")
    ax.set_xlabel("step")
    ax.set_title(title)
ax1.legend()
fig.tight_layout()
