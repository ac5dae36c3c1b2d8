"""
Memory per rank for each sharding strategy
==========================================

Measure what every rank really holds under each ``zero_dp_strategy``, on 1, 2 and 4 ranks.
Then plot it against the theory of the strategy table.

**What you will learn**

* how many bytes per parameter each strategy keeps on a rank (fp32 weights, AdamW);
* which kind of state (weights, gradients, optimizer moments) each strategy shards;
* that the measurement matches the theory to within the padding (under 1%).

The code
--------
``mfsdp/examples/memory.py`` shards the model and takes one step. Then it reads what the
buffers hold (``model.fsdp_state().memory_by_kind()``) and the optimizer state
(``optimizer.local_state_bytes()``).

.. literalinclude:: ../../mfsdp/examples/memory.py
   :language: python
   :pyobject: measure
"""

# %%
# Measure
# -------
# ``measure`` on the toy MLP (0.55M parameters), for each strategy on 1, 2 and 4 gloo ranks.
from mfsdp.launch import launch

strategies = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
worlds = [1, 2, 4]
measured = {n: [launch("mfsdp.examples.memory:measure", n, args=(s,))[0]
                for s in strategies]
            for n in worlds}


def theory(strategy, n):
    """Bytes per parameter on one rank, fp32 AdamW (weights are the main weights)."""
    return {"no_shard": 16, "optim": 4 + 4 + 4 / n + 8 / n,
            "optim_grads": 4 + 4 / n + 8 / n, "optim_grads_params": 16 / n}[strategy]


print(f"{'strategy':>18} | {'N':>2} | {'measured B/param':>16} | {'theory':>6} | pad")
for s_i, s in enumerate(strategies):
    for n in worlds:
        r = measured[n][s_i]
        per_param = sum(r["bytes"].values()) / r["numel"]
        pad = r["padded_numel"] / r["numel"] - 1
        print(f"{s:>18} | {n:>2} | {per_param:16.3f} | {theory(s, n):6.2f} | {pad:.2%}")

# %%
# Where the bytes go
# ------------------
# On 4 ranks, by kind:
#
# * ``model_weights``: the full compute copy, under the replicated strategies;
# * ``model_shard``: the local slice, under ZeRO-3;
# * ``grad_full``: the full gradient buffer, which only ``optim`` keeps;
# * ``main_grads``: the reduced gradient shard.
import matplotlib.pyplot as plt
import numpy as np

kinds = ["model_weights", "model_shard", "grad_full", "main_grads", "optimizer_state"]
fig, ax = plt.subplots(figsize=(8, 4))
bottom = np.zeros(len(strategies))
for kind in kinds:
    vals = np.array([measured[4][i]["bytes"][kind] / measured[4][i]["numel"]
                     for i in range(len(strategies))])
    ax.bar(range(len(strategies)), vals, bottom=bottom, label=kind)
    bottom += vals
ax.set_xticks(range(len(strategies)), [s.replace("_", "\n") for s in strategies])
ax.set_ylabel("bytes per parameter on one rank")
ax.set_title("4 ranks, by kind (measured)")
# the legend beside the bars, not over them (the no_shard bar reaches the top)
ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
fig.tight_layout()

# %%
# Against the theory
# ------------------
# Dots are measurements, lines the strategy table: they coincide.
fig, ax = plt.subplots(figsize=(8, 4))
xs = np.linspace(1, 4, 50)
for s_i, s in enumerate(strategies):
    (line,) = ax.plot(xs, [theory(s, x) for x in xs], lw=1)
    ax.plot(worlds, [sum(measured[n][s_i]["bytes"].values()) / measured[n][s_i]["numel"]
                     for n in worlds], "o", color=line.get_color(), label=s)
ax.set_xlabel("ranks in the shard group (N)")
ax.set_ylabel("bytes per parameter on one rank")
ax.set_xticks(worlds)
ax.set_title("measured (dots) vs theory (lines)")
ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
fig.tight_layout()
