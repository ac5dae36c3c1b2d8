"""
Memory per rank for each sharding strategy
==========================================

Measure what every rank really holds for each ``zero_dp_strategy`` on 1, 2 and 4 ranks, and plot it
against the theory of the strategy table.

**What you will learn**

* how many bytes per parameter each strategy keeps on a rank (fp32 weights, AdamW);
* which kind of state (weights, gradients, optimizer moments) each strategy shards;
* that the measurement matches the theory to within the padding (under 1%).
"""

# %%
# Measure
# -------
# :func:`mfsdp.testing.train_sharded` trains the toy MLP (0.55M parameters) for one step on each
# rank and reads the bytes held by every bucket buffer (from the tensors' storages) and by the
# optimizer state. One launch per world size runs all four strategies.
from mfsdp.launch import launch
from mfsdp.testing import train_sharded_many

strategies = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
worlds = [1, 2, 4]
cfgs = [dict(strategy=s, dim=128, hidden=512, blocks=4, optimizer="adamw", steps=1,
             track_memory=True, return_params=False) for s in strategies]
measured = {n: launch(train_sharded_many, n, args=(cfgs,))[0] for n in worlds}


def theory(strategy, n):
    """Bytes per parameter on one rank, fp32 AdamW (weights are the main weights)."""
    return {"no_shard": 16, "optim": 4 + 4 + 4 / n + 8 / n, "optim_grads": 4 + 4 / n + 8 / n,
            "optim_grads_params": 16 / n}[strategy]


print(f"{'strategy':>18} | {'N':>2} | {'measured B/param':>16} | {'theory':>6} | padding")
for s_i, s in enumerate(strategies):
    for n in worlds:
        r = measured[n][s_i]
        per_param = sum(r["memory"][-1].values()) / r["numel"]
        pad = r["padded_numel"] / r["numel"] - 1
        print(f"{s:>18} | {n:>2} | {per_param:16.3f} | {theory(s, n):6.2f} | {pad:.2%}")

# %%
# Where the bytes go
# ------------------
# On 4 ranks, by kind. ``model_weights`` is the full compute copy (replicated strategies),
# ``model_shard`` the local slice under ZeRO-3; gradients are the full buffer (``grad_full``,
# kept by ``optim`` only) and the reduced shard (``main_grads``).
import matplotlib.pyplot as plt
import numpy as np

kinds = ["model_weights", "model_shard", "grad_full", "main_grads", "optimizer_state"]
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
bottom = np.zeros(len(strategies))
for kind in kinds:
    vals = np.array([measured[4][i]["memory"][-1][kind] / measured[4][i]["numel"]
                     for i in range(len(strategies))])
    ax1.bar(range(len(strategies)), vals, bottom=bottom, label=kind)
    bottom += vals
ax1.set_xticks(range(len(strategies)), [s.replace("_", "\n") for s in strategies])
ax1.set_ylabel("bytes per parameter on one rank")
ax1.set_title("4 ranks, by kind (measured)")
ax1.legend(fontsize=8)

# %%
# Against the theory
# ------------------
# Dots are measurements, lines the strategy table: they coincide.
xs = np.linspace(1, 4, 50)
for s_i, s in enumerate(strategies):
    (line,) = ax2.plot(xs, [theory(s, x) for x in xs], lw=1)
    ax2.plot(worlds, [sum(measured[n][s_i]["memory"][-1].values()) / measured[n][s_i]["numel"]
                      for n in worlds], "o", color=line.get_color(), label=s)
ax2.set_xlabel("ranks in the shard group (N)")
ax2.set_ylabel("bytes per parameter on one rank")
ax2.set_xticks(worlds)
ax2.set_title("measured (dots) vs theory (lines)")
ax2.legend(fontsize=8)
fig.tight_layout()
