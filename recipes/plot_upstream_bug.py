"""
Catch an upstream bug before it costs a run
===========================================

A sharding bug rarely crashes. The loss goes down, a little slower, and a week of GPU
time trains a worse model.

megatron-fsdp 0.6.1, the newest release on PyPI, has such a bug:
`NVIDIA/Megatron-LM#5974 <https://github.com/NVIDIA/Megatron-LM/issues/5974>`__. Its AdamW
update is about 1.34 times too small in the first steps. The fix,
`NVIDIA/Megatron-LM#5976 <https://github.com/NVIDIA/Megatron-LM/pull/5976>`__, is merged but
not released.

``mfsdp check --engine megatron_fsdp`` runs upstream's own ``fully_shard`` on two CPU ranks,
next to a single-process reference. It flags the bug at step 1.

**What you will learn**

* how to point the parity doctor at the engine you train with (``--engine megatron_fsdp``,
  ``--engine fsdp2``);
* what the 0.6.1 AdamW under-update looks like in the report;
* how to check a workaround before you ship it (``--after-shard``), and why SGD hides the bug.
"""

# %%
# The engine you train with
# -------------------------
# The model is a small transformer of attention and MLP blocks,
# ``mfsdp.check.faults:attention``. For your own model, write its
# ``package.module:factory`` instead. The command line is::
#
#     mfsdp check mfsdp.check.faults:attention --engine megatron_fsdp --optimizer adamw \
#         --steps 5 --layouts optim_grads_params
#
# ``megatron_fsdp`` is upstream's package (``pip install 'mfsdp[upstream]'``). The check
# calls it as its README does:
# ``fully_shard(module, optimizer, device_mesh=..., zero_dp_strategy=...)``.
#
# These ranks run on the CPU, so the check replaces upstream's CUDA stream and event calls
# for the run. The report lists each replacement.
from mfsdp.check import check

settings = dict(engine="megatron_fsdp", steps=5, layouts=["optim_grads_params"])
bug = check("mfsdp.check.faults:attention", optimizer="adamw", **settings)
print(bug.table())
assert bug.engine_version == "megatron-fsdp 0.6.1" and not bug.passed

# %%
# The gradient-norm ratio is 1.0000: upstream reduces the gradients right. The update-norm
# ratio is not 1.
#
# Why: ``fully_shard_optimizer`` built the optimizer state by stepping once on zero
# gradients. So AdamW's step count started at 1, and the first updates get the bias
# correction of step 2. The gap closes as the correction fades, which is why the loss curve
# looks fine.
first = bug.layouts[0].steps[0]
print(f"step 1: gradient-norm ratio {first.grad_norm_ratio:.4f}, "
      f"update-norm ratio {first.update_norm_ratio:.4f}")

# %%
# Check the workaround before you ship it
# ---------------------------------------
# Until you run a release with the fix (NVIDIA/Megatron-LM#5976), reset the optimizer
# right after ``fully_shard``. Your script calls the function below.
#
# ``--after-shard`` (``after_shard=``) runs it inside the check, on every rank, once
# upstream's engine has sharded the model. So you check the exact lines you ship.
import inspect

from mfsdp.check.engines.upstream import reset_optimizer_step

print(inspect.getsource(reset_optimizer_step))
workaround = "mfsdp.check.engines.upstream:reset_optimizer_step"
fixed = check("mfsdp.check.faults:attention", optimizer="adamw",
              after_shard=workaround, **settings)
print(fixed.table())
assert fixed.passed

# %%
# Why SGD hides it
# ----------------
# SGD keeps no step count, so the same engine passes with it. A check with SGD alone would
# have missed the bug.
#
# So check with the optimizer you train with, and with SGD for scale faults.
sgd = check("mfsdp.check.faults:attention", optimizer="sgd", **settings)
worst = max(s.worst_param_error for s in sgd.layouts[0].steps)
print("SGD:", "PASS" if sgd.passed else "FAIL", f"(worst parameter error {worst:.1e})")
assert sgd.passed

# %%
# The update-norm ratio per step
# ------------------------------
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(6, 3.4))
for label, report in [("AdamW, megatron-fsdp 0.6.1", bug),
                      ("AdamW, reset_optimizer_step", fixed), ("SGD", sgd)]:
    steps = report.layouts[0].steps
    ax.plot([s.step for s in steps], [s.update_norm_ratio for s in steps],
            "o-" if report.passed else "s--", label=label)
ax.axhline(1.0, color="k", lw=0.8, ls=":")
ax.set_xlabel("step")
ax.set_ylabel("update norm, sharded / reference")
ax.set_title("ZeRO-3 on 2 ranks, upstream Megatron-FSDP")
ax.legend(fontsize=10)
fig.tight_layout()
