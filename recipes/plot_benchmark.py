"""
mfsdp against DDP and PyTorch FSDP2, side by side
==================================================

Train the same model on the same data with DDP, PyTorch FSDP2 (with and without resharding after
forward) and mfsdp under each strategy, in one run on 2 ranks, interleaving the systems step by
step. This is the small configuration that runs inside the docs build; the full benchmark (about 9M
parameters, 2 and 4 ranks) is ``mfsdp bench`` and its results are on the performance page.

**What you will learn**

* how the step times compare, and how much they vary from step to step on a busy machine;
* how many bytes each system really sends per step (loopback interface counters), next to the
  bytes mfsdp's collectives were asked to move.
"""

# %%
# Run
# ---
from mfsdp.benchmark import plot, run_benchmark, table

results = run_benchmark(world_sizes=(2,), cfg=dict(dim=256, hidden=704, blocks=6, rounds=6),
                        memory=False)
print(table(results))

# %%
# The losses agree
# ----------------
# All systems train the same model on the same batches, so their losses after the last step match.
for name, v in results[2]["time"]["systems"].items():
    print(f"{name:<26} final loss {v['final_loss']:.6f}")

# %%
# Plot
# ----
fig = plot(results)
