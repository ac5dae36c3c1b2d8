"""
HSDP and HFSDP: bytes per step on each group
=============================================

Train the same model on 4 ranks three ways, and measure what each process group carries in
one step:

* FSDP: one shard group of 4;
* HSDP: shard over 2, replicate over 2;
* HFSDP: shard over 2, with the main weights also sharded over the outer 2.

**What you will learn**

* that HSDP keeps the model-sized traffic inside the shard group (inside a node) and sends only
  shard-sized gradients across the outer group (between nodes);
* what HFSDP adds on the outer group (a reduce-scatter and an all-gather of the shard) and what it
  saves (main weights and optimizer state split over 4 ranks instead of 2).

The code
--------
``mfsdp/examples/hsdp_bytes.py`` builds a ``ParallelLayout`` with ``dp_outer`` replicas and
passes its groups to ``fully_shard``. It reads the bytes of each collective from
``model.fsdp_state().comms.log``.

.. literalinclude:: ../../mfsdp/examples/hsdp_bytes.py
   :language: python
   :pyobject: bytes_per_group
"""

# %%
# Measure
# -------
# ``bytes_per_group`` on 4 gloo ranks, once per layout.
from mfsdp.launch import launch

layouts = {
    "FSDP (shard 4)": dict(),
    "HSDP (shard 2 x outer 2)": dict(dp_outer=2),
    "HFSDP (shard 2 x outer 2, outer optim)": dict(dp_outer=2, outer_strategy="optim"),
}
rows = []
for name, kw in layouts.items():
    run = launch("mfsdp.examples.hsdp_bytes:bytes_per_group", 4, kwargs=kw)[0]
    rows.append((name, {g: b / 2**20 for g, b in run["sent_bytes"].items()},
                 4 * run["numel"] / 2**20, run["grad_and_optimizer_bytes"] / 2**20))

print(f"{'layout':<40} | {'dp_shard':>8} | {'dp_outer':>8} | grads+optim per rank")
for name, sent, model_mib, state_mib in rows:
    shard, outer = sent.get("dp_shard", 0), sent.get("dp_outer", 0)
    print(f"{name:<40} | {shard:8.3f} | {outer:8.3f} | {state_mib:.3f}")
print("(MiB sent per rank and step by each group; MiB of state per rank)")
print(f"(model: {rows[0][2]:.3f} MiB of fp32 weights)")

# %%
# Plot
# ----
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(8, 3.8), layout="constrained")
names = [r[0] for r in rows]
inner = [r[1].get("dp_shard", 0) for r in rows]
outer = [r[1].get("dp_outer", 0) for r in rows]
ax.barh(names, inner, label="shard group (inside a node)")
ax.barh(names, outer, left=inner, label="outer group (between nodes)")
ax.set_xlabel("MiB sent per rank per step")
# room right of the longest bar (a stacked bar of width 0 would pin the axis to its end)
ax.set_xlim(0, 1.05 * max(i + o for i, o in zip(inner, outer)))
ax.invert_yaxis()
# the legend above the axes: inside, it would cover the longest bars
fig.legend(loc="outside upper center", ncols=2, frameon=False)
