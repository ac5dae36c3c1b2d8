"""
HSDP and HFSDP: bytes per step on each group
=============================================

Train the same model on 4 ranks as FSDP (one shard group of 4), HSDP (shard over 2, replicate over
2) and HFSDP (shard over 2, main weights also sharded over the outer 2), and measure what each
process group carries in one step.

**What you will learn**

* that HSDP keeps the model-sized traffic inside the shard group (inside a node) and sends only
  shard-sized gradients across the outer group (between nodes);
* what HFSDP adds on the outer group (a reduce-scatter and an all-gather of the shard) and what it
  saves (main weights and optimizer state split over 4 ranks instead of 2).
"""

# %%
# Measure
# -------
# Every collective records its group and the bytes it sends; one launch runs the three layouts.
from mfsdp.launch import launch
from mfsdp.testing import train_sharded_many

layouts = {
    "FSDP (shard 4)": dict(strategy="optim_grads_params"),
    "HSDP (shard 2 x outer 2)": dict(strategy="optim_grads_params", dp_outer=2),
    "HFSDP (shard 2 x outer 2, outer optim)": dict(strategy="optim_grads_params", dp_outer=2,
                                                   outer_strategy="optim"),
}
common = dict(dim=128, hidden=512, blocks=4, optimizer="adamw", steps=2, track_memory=True,
              return_params=False)
runs = launch(train_sharded_many, 4, args=([dict(common, **c) for c in layouts.values()],))[0]

rows = []
for (name, _), run in zip(layouts.items(), runs):
    sent: dict[str, float] = {}
    for r in run["comm"][-1]:
        if r["op"] != "flags":
            sent[r["group"]] = sent.get(r["group"], 0) + r["sent_bytes"]
    model_mib = 4 * run["numel"] / 2**20
    state = run["memory"][-1]
    rows.append((name, {g: b / 2**20 for g, b in sent.items()}, model_mib,
                 (state["main_grads"] + state["optimizer_state"]) / 2**20))

print(f"{'layout':<40} | {'dp_shard MiB':>12} | {'dp_outer MiB':>12} | grads+optim MiB/rank")
for name, sent, model_mib, state_mib in rows:
    print(f"{name:<40} | {sent.get('dp_shard', 0):12.3f} | {sent.get('dp_outer', 0):12.3f} | "
          f"{state_mib:.3f}")
print(f"(model: {rows[0][2]:.3f} MiB of fp32 weights)")

# %%
# Plot
# ----
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(8, 3.5))
names = [r[0] for r in rows]
inner = [r[1].get("dp_shard", 0) for r in rows]
outer = [r[1].get("dp_outer", 0) for r in rows]
ax.barh(names, inner, label="shard group (inside a node)")
ax.barh(names, outer, left=inner, label="outer group (between nodes)")
ax.set_xlabel("MiB sent per rank per step")
ax.invert_yaxis()
ax.legend(loc="lower right", fontsize=8)
fig.tight_layout()
