"""
A complete training script: accumulate, clip, schedule, save, resume
=====================================================================

Everything a real run has, in one script you can copy:

* the process group and device, from ``torchrun``'s environment, and a ``ParallelLayout``;
* meta-device initialisation;
* ``fully_shard`` with a ``MixedPrecisionPolicy``: bf16 compute, fp32 main weights and
  gradients;
* gradient accumulation with ``no_sync``, and clipping by the global norm;
* a warm-up + cosine LR schedule;
* ``save_checkpoint`` and ``load_checkpoint``, and a resume on a different layout.

**What you will learn**

* the order of the calls, from ``init_process_group`` to the last ``optimizer.step()``;
* what a checkpoint must carry besides the model and optimizer (the scheduler, in ``extra``);
* that a resumed run, even on another layout, continues the curve of the run it resumes.

The code
--------
This is ``mfsdp/examples/train_script.py``. Run it with ``torchrun`` on CPUs or GPUs:

.. code-block:: bash

    torchrun --nproc-per-node 4 -m mfsdp.examples.train_script --steps 12 \\
        --save-at 6 --save ckpt
    torchrun --nproc-per-node 4 -m mfsdp.examples.train_script --steps 12 \\
        --load ckpt --dp-outer 2

The process group and the device:

.. literalinclude:: ../../mfsdp/examples/train_script.py
   :language: python
   :pyobject: setup

The model, sharded, with its optimizer and schedule:

.. literalinclude:: ../../mfsdp/examples/train_script.py
   :language: python
   :pyobject: build

The loop: accumulation, clipping, the schedule, checkpoints:

.. literalinclude:: ../../mfsdp/examples/train_script.py
   :language: python
   :pyobject: train
"""

# %%
# Train, save, resume on another layout
# -------------------------------------
# Four gloo ranks, two runs of ``train``:
#
# 1. 12 steps straight, as plain FSDP (one shard group of 4). On the way, it saves a
#    checkpoint after step 6.
# 2. A resume of that checkpoint as HSDP, up to step 12. ``dp_outer=2`` makes two replicas
#    of a 2-rank shard group.
import tempfile

from mfsdp.launch import launch

run = "mfsdp.examples.train_script:train"
ckpt = tempfile.mkdtemp()
straight = launch(run, 4, kwargs=dict(steps=12, save=ckpt, save_at=6), timeout=600)[0]
resumed = launch(run, 4, kwargs=dict(steps=12, load=ckpt, dp_outer=2), timeout=600)[0]

print(f"{'step':>4} | {'loss, straight':>14} | {'loss, resumed as HSDP':>21} | lr")
by_step = {r["step"]: r for r in resumed}
for r in straight:
    other = f"{by_step[r['step']]['loss']:21.6f}" if r["step"] in by_step else " " * 21
    print(f"{r['step']:>4} | {r['loss']:14.6f} | {other} | {r['lr']:.2e}")
worst = max(abs(by_step[r["step"]]["loss"] - r["loss"]) / r["loss"]
            for r in straight if r["step"] in by_step)
print(f"largest relative loss difference after the resume: {worst:.1e}")
assert worst < 1e-5

# %%
# Plot
# ----
# The resumed run starts where the checkpoint left the straight one, and follows it. The
# learning rate it restored from the checkpoint continues the schedule.
import matplotlib.pyplot as plt

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
panels = ((ax1, "loss", "loss (mean over ranks)"), (ax2, "lr", "learning rate"))
for ax, key, title in panels:
    ax.plot([r["step"] for r in straight], [r[key] for r in straight], "o-", lw=3,
            alpha=0.5, label="12 steps straight (FSDP)")
    ax.plot([r["step"] for r in resumed], [r[key] for r in resumed], "kx--", ms=9,
            label="resumed at step 6 as HSDP")
    ax.axvline(6.5, color="gray", lw=0.8, ls=":")
    ax.set_xlabel("step")
    ax.set_title(title)
ax1.legend()
fig.tight_layout()
