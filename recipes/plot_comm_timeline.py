"""
A communication timeline, with and without a separate all-gather group
======================================================================

Record when each collective of a ZeRO-3 step was launched and when it was found complete.
Do it for the same model twice: with one process group, and with a separate all-gather
group. Then draw both.

**What you will learn**

* how prefetching all-gathers and per-bucket reduce-scatters overlap with compute in one step;
* how much communication stays exposed (the training thread waiting) in each configuration,
  measured on this machine.

The code
--------
``mfsdp/examples/comm_timeline.py`` builds a layout's groups with a second group for
all-gathers (``create_groups(all_gather_groups=True)``), and passes it as ``fsdp_group_ag``.
``model.fsdp_state().comms.log`` records every collective's launch and completion.

.. literalinclude:: ../../mfsdp/examples/comm_timeline.py
   :language: python
   :pyobject: timeline
"""

# %%
# Measure
# -------
# ``timeline`` runs on 2 gloo ranks, both variants side by side, in alternating steps. It
# reports the median step time and the median exposed wait over the measured steps.
from mfsdp.launch import launch

result = launch("mfsdp.examples.comm_timeline:timeline", 2,
                kwargs=dict(steps=6, dim=512, hidden=2048, local_batch=64))[0]
print(f"{'variant':<28} | {'step (ms)':>9} | {'exposed comm (ms)':>17} | spread (ms)")
for name, r in result.items():
    print(f"{name:<28} | {1e3 * r['step_s']:9.1f} | {1e3 * r['exposed_s']:17.1f} | "
          f"{1e3 * r['step_spread_s']:.1f}")

# %%
# Draw the last step of each
# --------------------------
# One row per kind of collective. A bar spans launch to completion, as the training thread
# saw them.
import matplotlib.pyplot as plt

fig, axes = plt.subplots(2, 1, figsize=(9, 4.5), sharex=True)
colors = {"all_gather": "tab:blue", "reduce_scatter": "tab:orange",
          "all_reduce": "tab:green"}
for ax, (name, r) in zip(axes, result.items()):
    lanes = sorted({(op, group) for op, group, _, _ in r["timeline"]})
    for y, lane in enumerate(lanes):
        bars = [(1e3 * s, 1e3 * (e - s))
                for op, g, s, e in r["timeline"] if (op, g) == lane]
        ax.broken_barh(bars, (y - 0.35, 0.7), color=colors.get(lane[0], "gray"),
                       alpha=0.7)
    ax.set_yticks(range(len(lanes)), [f"{op} ({g})" for op, g in lanes])
    step_ms, exposed_ms = 1e3 * r["step_s"], 1e3 * r["exposed_s"]
    ax.set_title(f"{name}: step {step_ms:.0f} ms, exposed {exposed_ms:.0f} ms")
axes[-1].set_xlabel("ms since the start of the step")
fig.tight_layout()

# %%
# Reading the result
# ------------------
# On a GPU, NCCL runs each process group on its own stream. So an all-gather on its own group
# does not wait for a reduce-scatter launched before it.
#
# On this CPU machine both groups share two cores and the loopback interface, so the gain, if
# any, is small. The numbers above are what was measured when this page was built.
