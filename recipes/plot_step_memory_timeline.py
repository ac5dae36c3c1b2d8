"""
The memory of one ZeRO-3 step, event by event
=============================================

Record what a real training step holds in its two passing buffers, after every allocation
and release: the *gathered weights* of the units and their *full gradient buffers*. Then
draw them over the step, against the planner's bounds for the same model.

**What you will learn**

* when gathered weights and gradient buffers rise and fall, in forward and in backward;
* why the root unit (embedding, final norm, output layer) stays through the whole backward;
* that the step reaches the planner's two peak terms, and stays under them.

The code
--------
``mfsdp/examples/memory_timeline.py`` shards a 6-layer Llama-style GPT (fp32, one unit per
layer) with ``fully_shard``, runs one step, then records the next one with
``mfsdp.tools.memory_timeline.record_memory_timeline(model)``. Each sample is
``(label, gathered bytes, grad bytes, phase, root's gathered, root's grads)``, read off the
buffers' storages. The bounds come from ``mfsdp.tools.plan.plan(...)`` for the same model
(``ModelConfig.from_gpt``) and layout.

.. literalinclude:: ../../mfsdp/examples/memory_timeline.py
   :language: python
   :pyobject: step_timeline
"""

# %%
# Measure
# -------
# ``step_timeline`` on 2 gloo ranks; rank 0's timeline (rank 1's holds the same buffers).
from mfsdp.launch import launch

r = launch("mfsdp.examples.memory_timeline:step_timeline", 2)[0]
samples, bounds = r["samples"], r["bounds"]
MiB = 2**20
print(f"{len(samples)} samples: {samples[1][0]!r} ... {samples[-1][0]!r}")
# the engine's own counters: the non-root units' gathered weights, every unit's grads
print(f"{'MiB on rank 0':<13} | {'planner':>7} | {'peak':>5} | {'root at peak':>12} | "
      f"engine counter")
for term, total, root in (("gathered", 1, 4), ("grad_buffers", 2, 5)):
    at_peak = max(samples, key=lambda s: s[total])
    print(f"{term:<13} | {bounds[term] / MiB:7.2f} | {at_peak[total] / MiB:5.2f} | "
          f"{at_peak[root] / MiB:12.2f} | {r['engine'][term] / MiB:.2f}")

# %%
# Draw the step
# -------------
# One panel per buffer. The darker band is the root unit's share; the dashed line is the
# planner's bound. The shaded span is the backward.
import matplotlib.pyplot as plt

x = range(len(samples))
phases = [s[3] for s in samples]
back = (phases.index("backward"), len(phases) - 1 - phases[::-1].index("backward"))
fig, axes = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
panels = [("gathered", 1, 4, "gathered weights", "tab:blue"),
          ("grad_buffers", 2, 5, "full gradient buffers", "tab:orange")]
for ax, (term, total, root, title, color) in zip(axes, panels):
    ys = [s[total] / MiB for s in samples]
    roots = [s[root] / MiB for s in samples]
    ax.fill_between(x, 0, ys, step="post", color=color, alpha=0.35, label="all units")
    ax.fill_between(x, 0, roots, step="post", color=color, alpha=0.9,
                    label="root unit's share")
    ax.axhline(bounds[term] / MiB, color="black", linestyle="--", linewidth=1,
               label="planner's bound")
    ax.axvspan(back[0], back[1], color="gray", alpha=0.12, linewidth=0)
    top = 1.3 * bounds[term] / MiB
    ax.set_ylim(0, top)
    ax.text(back[0] / 2, 0.92 * top, "forward", ha="center", va="center")
    ax.text((back[0] + back[1]) / 2, 0.92 * top, "backward", ha="center", va="center")
    ax.set_ylabel("MiB on rank 0")
    ax.set_title(title, loc="left")
    # the legend beside the panel, not over the data
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
axes[-1].set_xlabel("event (allocation or release) in the step")
fig.tight_layout()

# %%
# Reading the result
# ------------------
# In forward the gathered weights rise by one layer at its all-gather and fall at its
# release: the layer computing and the one prefetched are held at once. The root's weights
# stay from its forward through the whole backward, since its backward (loss, output layer)
# runs first and its embedding's last. In backward the gradient buffers follow: the root's
# from the first gradient to the last, plus the layers whose reduce-scatters are in flight.
#
# The gathered weights reach the planner's term to within the shard padding. The gradient
# buffers reach it only when ``max_inflight_reduce`` reductions are still running as the next
# layer's gradients arrive; a reduction found complete is finished and its buffer freed
# earlier, so their peak varies from run to run, below the bound.
