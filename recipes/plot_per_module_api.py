"""
The per-module API: upstream's v2 ``fully_shard`` on CPU ranks
===============================================================

Train one model twice, as HSDP on four gloo ranks: once with the per-module API
(``mfsdp.experimental``, upstream Megatron-FSDP's "v2"), once with the model-level API.
Then compare the curves.

**What you will learn**

* how ``fully_shard_context``, ``fully_shard`` per module, ``Placements``, ``microbatch`` and
  ``fully_shard_optimizer`` fit together in a training loop;
* how the same model reads under the model-level API (``fully_shard_model``);
* that both front doors drive one engine: the two runs agree to the last bit.

The code
--------
This is ``mfsdp/examples/per_module.py``. To run it as a script:
``torchrun --nproc-per-node 4 -m mfsdp.examples.per_module --dp-outer 2``. The model:

.. literalinclude:: ../../mfsdp/examples/per_module.py
   :language: python
   :pyobject: Net

The per-module API shards each block, then the model, in place, as HSDP. The optimizer state
and gradients are sharded over the ``shard`` axis and replicated over ``outer``:

.. literalinclude:: ../../mfsdp/examples/per_module.py
   :language: python
   :pyobject: train_v2

The model-level API, for comparison:

.. literalinclude:: ../../mfsdp/examples/per_module.py
   :language: python
   :pyobject: train_v1

Both on the same ranks:

.. literalinclude:: ../../mfsdp/examples/per_module.py
   :language: python
   :pyobject: compare
"""

# %%
# Train both ways
# ---------------
# Four gloo ranks as a ``(outer 2, shard 2)`` mesh, 12 steps of 2 micro-batches each. The
# outer all-reduce runs once per step, in the last micro-batch's backward.
from mfsdp.launch import launch

losses = launch("mfsdp.examples.per_module:compare", 4,
                kwargs=dict(steps=12, dp_outer=2), timeout=600)[0]
print(f"{'step':>4} | {'model-level (v1)':>16} | {'per-module (v2)':>15}")
for step, (a, b) in enumerate(zip(losses["v1"], losses["v2"]), 1):
    print(f"{step:>4} | {a:16.6f} | {b:15.6f}")
worst = max(abs(a - b) for a, b in zip(losses["v1"], losses["v2"]))
print(f"largest loss difference: {worst:.1e}")
assert worst == 0.0

# %%
# Plot
# ----
# One curve over the other: the per-module API is a second way in, not a second engine.
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(7, 3.6))
steps = range(1, len(losses["v1"]) + 1)
ax.plot(steps, losses["v1"], "o-", lw=3, alpha=0.5,
        label="model-level API (fully_shard_model)")
ax.plot(steps, losses["v2"], "kx--", ms=9,
        label="per-module API (experimental.fully_shard)")
ax.set_xlabel("step")
ax.set_ylabel("loss (mean over ranks)")
ax.set_title("HSDP on 4 CPU ranks, both front doors")
ax.legend()
fig.tight_layout()
