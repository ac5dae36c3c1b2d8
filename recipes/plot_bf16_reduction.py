"""
bf16 gradient reduction at 2 to 1,024 ranks, bit for bit
=========================================================

Reducing gradients in bf16 halves the bytes of the reduce-scatter. What it costs depends on
*where* the sums are rounded:

* mfsdp's gloo path sends bf16 values and sums them in fp32: one rounding;
* NCCL's ring reduce-scatter adds one rank per hop, and rounds every partial sum to bf16.

This recipe computes the gradients of a Llama-style model on 1,024 different micro-batches. It
reduces them as each path does, bit for bit and in the ring's real order, for 2 to 1,024 ranks,
and compares with the exact mean. Nothing is extrapolated.

**What you will learn**

* that fp32 reductions are exact for training purposes (relative error below 1e-6 at 1,024 ranks);
* that bf16 values summed in fp32 cost about 0.2% whatever the number of ranks;
* that a bf16 ring's error grows with the ranks in the reduce-scatter group: small partial sums
  are swamped by the growing accumulator, until at 1,024 ranks a third of the gradient is lost;
* which path each backend and flag gives, and what to choose at which scale.

The code
--------
The two reductions, as they round (``mfsdp/examples/numerics.py``; ``tests/test_numerics.py``
checks the ring against a per-element loop and the fp32-accumulated sum against the engine's
own reduce-scatter on real ranks, every bit):

.. literalinclude:: ../../mfsdp/examples/numerics.py
   :language: python
   :pyobject: ring_reduce

.. literalinclude:: ../../mfsdp/examples/numerics.py
   :language: python
   :pyobject: fp32_accum_reduce

The gradients, one backward per simulated rank, and the comparison with the exact mean:

.. literalinclude:: ../../mfsdp/examples/numerics.py
   :language: python
   :pyobject: rank_gradients

.. literalinclude:: ../../mfsdp/examples/numerics.py
   :language: python
   :pyobject: simulate_reduction

The engine's own reduce-scatter on real ranks, for the bit-for-bit check below:

.. literalinclude:: ../../mfsdp/examples/numerics.py
   :language: python
   :pyobject: engine_reduce_scatter

The training comparison runs the complete training script of
:ref:`sphx_glr_docs_recipes_plot_training_script.py` with
``MixedPrecisionPolicy(grad_comm_dtype=torch.bfloat16)``, the engine's real gloo path:

.. code-block:: bash

    torchrun --nproc-per-node 4 -m mfsdp.examples.train_script --grad-comm-dtype bf16
"""

# %%
# Gradients of a Llama-style model on 1,024 micro-batches
# -------------------------------------------------------
# ``llama-tiny`` (RMSNorm, RoPE, grouped-query attention, SwiGLU; 125 thousand parameters), one
# backward per simulated rank, each on its own 64-token window of the bundled text.
import time

from mfsdp.examples.numerics import SCALE_METHODS, rank_gradients, simulate_reduction

t0 = time.perf_counter()
grads = rank_gradients(1024)
print(f"gradients: {tuple(grads.shape)} in {time.perf_counter() - t0:.1f} s")

# %%
# Reduce them as each path does
# -----------------------------
# :func:`mfsdp.examples.numerics.ring_reduce` follows NCCL's ring reduce-scatter (chunk ``c`` starts at
# rank ``c + 1`` and rounds after every hop), :func:`mfsdp.examples.numerics.fp32_accum_reduce` mfsdp's gloo
# path. Powers of two keep NCCL's average (a pre-multiplication by ``1 / N``) exact.
worlds = [2 ** k for k in range(1, 11)]
t0 = time.perf_counter()
errors = simulate_reduction(grads, worlds)
print(f"simulated in {time.perf_counter() - t0:.1f} s\n")
print(f"{'ranks':>5} | " + " | ".join(f"{m:>15}" for m in SCALE_METHODS))
for n in worlds:
    print(f"{n:>5} | " + " | ".join(f"{errors[n][m]:15.2e}" for m in SCALE_METHODS))

# %%
# The simulation is the engine
# ----------------------------
# On 4 real gloo ranks, mfsdp's own reduce-scatter (the path ``grad_comm_dtype=torch.bfloat16``
# takes) gives exactly the simulated fp32-accumulated sum, every bit.
import torch

from mfsdp.launch import launch
from mfsdp.examples.numerics import engine_reduce_scatter, fp32_accum_reduce

chunks = launch(engine_reduce_scatter, 4, args=(grads[:4],))
simulated = fp32_accum_reduce(grads[:4], torch.bfloat16)
print("engine == simulation:", torch.equal(torch.cat(chunks), simulated))

# %%
# Effect on training
# ------------------
# 4 ranks train the same model for 12 steps with the gradient reduce-scatter in fp32 and in bf16
# (``MixedPrecisionPolicy(grad_comm_dtype=torch.bfloat16)``, the engine's real gloo path), with
# the training script above.
import torch

run = "mfsdp.examples.train_script:train"
fp32_run = launch(run, 4, kwargs=dict(steps=12), timeout=600)[0]
bf16_run = launch(run, 4, kwargs=dict(steps=12, grad_comm_dtype=torch.bfloat16),
                  timeout=600)[0]
fp32_losses = [r["loss"] for r in fp32_run]
bf16_losses = [r["loss"] for r in bf16_run]
gap = max(abs(a - b) / a for a, b in zip(fp32_losses, bf16_losses))
print(f"final loss fp32 {fp32_losses[-1]:.5f}, bf16 {bf16_losses[-1]:.5f}; "
      f"largest relative gap over 12 steps {gap:.1e}")

# %%
# Plot
# ----
import matplotlib.pyplot as plt

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
labels = {"fp32_ring": "fp32 ring (NCCL or gloo, fp32)",
          "bf16_fp32_accum": "bf16 values, fp32 sums (gloo)",
          "bf16_ring": "bf16 ring (NCCL, bf16)"}
for m, color in zip(SCALE_METHODS, ["tab:green", "tab:blue", "tab:red"]):
    ax1.plot(worlds, [errors[n][m] for n in worlds], "o-", color=color, label=labels[m])
ax1.axhline(0.01, color="0.6", lw=0.8, ls=":")
ax1.text(2, 0.012, "1%", color="0.4")
ax1.set_xscale("log", base=2)
ax1.set_yscale("log")
ax1.set_xlabel("ranks in the reduce-scatter group (simulated bit for bit)")
ax1.set_ylabel("relative L2 error of the mean gradient")
ax1.legend()
ax2.plot(range(1, 13), fp32_losses, label="fp32 reduction")
ax2.plot(range(1, 13), bf16_losses, "--", label="bf16 reduction (gloo)")
ax2.set_xlabel("step")
ax2.set_ylabel("loss")
ax2.set_title("4 ranks, AdamW")
ax2.legend()
fig.tight_layout()
plt.show()
