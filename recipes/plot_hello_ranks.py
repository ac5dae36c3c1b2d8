"""
Hello, ranks: two real processes in one process group
======================================================

Start two gloo ranks on the CPU, all-reduce across them, and look at what each rank saw.

**What you will learn**

* how :func:`mfsdp.launch.launch` starts ranks and returns their results in rank order;
* that the ranks are separate processes talking through ``torch.distributed``.

The code
--------
``mfsdp/examples/hello.py``: what every rank runs.

.. literalinclude:: ../../mfsdp/examples/hello.py
   :language: python
   :pyobject: rank_info
"""

# %%
# Launch two ranks
# ----------------
# :func:`mfsdp.examples.hello.rank_info` runs on every rank. Each rank adds ``rank + 1`` to an
# all-reduce (a sum over all ranks), so with two ranks every rank must see ``1 + 2 = 3``.
from mfsdp.launch import launch
from mfsdp.examples.hello import rank_info

results = launch(rank_info, world_size=2)

print(f"{'rank':>4} | {'world':>5} | {'backend':>7} | {'pid':>8} | all-reduce sum")
for r in results:
    print(f"{r['rank']:>4} | {r['world_size']:>5} | {r['backend']:>7} | "
          f"{r['pid']:>8} | {r['all_reduce_sum']:g}")

# %%
# The process ids differ: these are two processes, not two threads.
assert len({r["pid"] for r in results}) == 2
assert all(r["all_reduce_sum"] == 3.0 for r in results)

# %%
# Scale it up
# -----------
# The same call with more ranks: the sum is ``1 + 2 + ... + N = N (N + 1) / 2``.
import matplotlib.pyplot as plt

sizes = [1, 2, 4]
sums = [launch(rank_info, world_size=n)[0]["all_reduce_sum"] for n in sizes]
fig, ax = plt.subplots(figsize=(5, 3))
ax.plot(sizes, sums, "o-", label="measured all-reduce sum")
ax.plot(sizes, [n * (n + 1) / 2 for n in sizes], "k:", label="N (N + 1) / 2")
ax.set_xlabel("world size (ranks)")
ax.set_ylabel("sum")
ax.legend()
fig.tight_layout()
