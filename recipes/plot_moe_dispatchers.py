"""
MoE token dispatchers side by side
==================================

Run one MoE layer (8 experts, top-2) on 4 ranks, with expert parallelism 4 and uneven token
counts per rank, once per dispatcher. Then compare what each does:

* how many rows each expert computed;
* how many bytes each rank sent;
* how long a forward plus backward took.

``tests/test_moe.py`` also checks each dispatcher against a dense single-process reference,
token by token.

**What you will learn**

* that all dispatchers compute the same thing (the same rows per expert, outputs within 1e-5);
* that ``alltoall`` sends only the rows routed off-rank while ``allgather`` and the static-shape
  ``flex``/``torch`` backend send every (padded) token to every rank.

The code
--------
``mfsdp/examples/moe_dispatch.py`` builds an ``MoELayer`` from one seed on every rank. It
calls ``shard_experts`` to keep this rank's experts, then runs forward and backward on this
rank's tokens.

.. literalinclude:: ../../mfsdp/examples/moe_dispatch.py
   :language: python
   :pyobject: run_layer
"""

# %%
# Run
# ---
from mfsdp.launch import launch

counts = [40, 64, 23, 90]  # tokens on each rank: packed batches are uneven
runs = {"allgather": dict(dispatcher="allgather"),
        "alltoall": dict(dispatcher="alltoall"),
        "flex/torch": dict(dispatcher="flex", flex_backend="torch")}
layer = "mfsdp.examples.moe_dispatch:run_layer"
by_name = {name: launch(layer, 4, args=(kw["dispatcher"], counts),
                        kwargs={k: v for k, v in kw.items() if k != "dispatcher"})
           for name, kw in runs.items()}
names = list(runs)
# results[rank][dispatcher]
results = [[by_name[name][rank] for name in names] for rank in range(4)]

print(f"{'dispatcher':<11} | {'max |out - alltoall|':>20} | {'KiB sent/rank':>13} | "
      f"{'ms/call':>7}")
for i, name in enumerate(names):
    err = max((r[i]["output"] - r[1]["output"]).abs().max().item() for r in results)
    kib = sum(sum(r[i]["bytes_sent"].values()) for r in results) / len(results) / 1024
    ms = max(r[i]["seconds"] for r in results) * 1e3
    print(f"{name:<11} | {err:20.1e} | {kib:13.1f} | {ms:7.2f}")
    assert err < 1e-5
print("(KiB: the mean over ranks; ms: the median call on the slowest rank)")

# %%
# Tokens per expert
# -----------------
# Rank ``r`` holds experts ``2r`` and ``2r + 1``. Its ``tokens_per_expert`` are the rows
# they computed. The dispatchers agree row for row.
per_expert = {name: [n for r in results for n in r[i]["tokens_per_expert"]]
              for i, name in enumerate(names)}
for name, rows in per_expert.items():
    print(f"{name:<11}", rows)
assert len({tuple(v) for v in per_expert.values()}) == 1

# %%
# Plot
# ----
import matplotlib.pyplot as plt

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
ax1.bar(range(8), per_expert["alltoall"], color="tab:blue")
ax1.set_xlabel("expert")
ax1.set_ylabel("rows computed")
ax1.set_title(f"{sum(counts)} tokens x top-2 over 8 experts")
width = 0.27
for i, name in enumerate(names):
    sent = [sum(r[i]["bytes_sent"].values()) / 1024 for r in results]
    ax2.bar([x + (i - 1) * width for x in range(4)], sent, width, label=name)
ax2.set_xticks(range(4), [f"rank {r}\n{c} tokens" for r, c in enumerate(counts)])
ax2.set_ylabel("KiB sent per layer call")
ax2.set_title("bytes each rank sent (dispatch + combine)")
ax2.legend()
fig.tight_layout()
plt.show()
