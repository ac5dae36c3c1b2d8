"""
FSDP over tensor parallelism: a Llama with its Hugging Face TP plan
===================================================================

Make a Hugging Face Llama tensor-parallel, with PyTorch's ``parallelize_module`` and the
model's own published plan. Shard it with ``fully_shard`` over the data-parallel dimension of
a ``(dp 2, tp 2)`` mesh. Train it on four CPU ranks, and check it against the same model
without TP.

**What you will learn**

* the three calls: ``init_device_mesh`` with TP fastest, ``parallelize_module`` over
  ``mesh["tp"]``, ``fully_shard(..., dp_shard_dim="dp", tp_dim="tp")``;
* what a parameter looks like afterwards (a DTensor over the 2-D ``(dp, tp)`` mesh);
* that TP changes what each rank holds, not what the model learns.

The code
--------
This is ``mfsdp/examples/tensor_parallel.py``. Run it with
``torchrun --nproc-per-node 4 -m mfsdp.examples.tensor_parallel``.

.. literalinclude:: ../../mfsdp/examples/tensor_parallel.py
   :language: python
   :pyobject: apply_tp_plan

.. literalinclude:: ../../mfsdp/examples/tensor_parallel.py
   :language: python
   :pyobject: train
"""

# %%
# Train with and without the plan
# -------------------------------
# Four gloo ranks each time. First, two data-parallel replicas of a two-way tensor-parallel
# model. Then the same four ranks, with the model whole on both TP ranks of a replica.
from mfsdp.launch import launch

run = "mfsdp.examples.tensor_parallel:train"
tp = launch(run, 4, kwargs=dict(dp=2, tp=2, steps=12), timeout=600)[0]
whole = launch(run, 4, kwargs=dict(dp=2, tp=2, steps=12, tp_plan=False), timeout=600)[0]
print("q_proj with the plan:", tp["q_proj"])
print("q_proj without it:   ", whole["q_proj"])

# %%
# What each rank keeps
# --------------------
# The projections are split over TP. The embeddings and the output layer are not: the plan
# leaves them alone. FSDP shards both kinds over the data-parallel ranks.
print(f"main-weight bytes per rank: {tp['bytes']:,} with TP, {whole['bytes']:,} "
      f"without ({tp['bytes'] / whole['bytes']:.2f}x)")

# %%
# The same training
# -----------------
# Same data, same initial weights: the loss curves lie on each other.
import matplotlib.pyplot as plt

diff = max(abs(a - b) for a, b in zip(tp["losses"], whole["losses"]))
print(f"largest loss difference over {len(tp['losses'])} steps: {diff:.1e}")
assert diff < 1e-5
fig, ax = plt.subplots(figsize=(5.5, 3.2))
steps = range(1, len(tp["losses"]) + 1)
ax.plot(steps, whole["losses"], "o-", label="dp 2, model whole on each rank", lw=3,
        alpha=0.5)
ax.plot(steps, tp["losses"], "k.--", label="dp 2 x tp 2 (Hugging Face TP plan)")
ax.set_xlabel("step")
ax.set_ylabel("loss (mean over replicas)")
ax.legend()
fig.tight_layout()
