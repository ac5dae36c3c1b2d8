"""
Check a transformers model with ``mfsdp check`` before a cluster run
====================================================================

Before booking GPUs for a long run, check on your own machine that the model trains the same
sharded as in one process. ``mfsdp check`` runs each layout on two CPU ranks, next to a
single-process reference, and compares every step.

The model here is a tiny random Llama that ``transformers`` builds from a config; nothing is
downloaded. It is a miniature of the architecture you will train.

**What you will learn**

* the command and the one call that check a Hugging Face model, layout by layout;
* how to read the report: gradient-norm and update-norm ratios, worst parameter, verdict;
* what a scale fault looks like in it, next to a healthy model.
"""

# %%
# A miniature of the model
# ------------------------
# ``mfsdp check`` takes a directory with ``config.json`` and builds the model with
# ``AutoModelForCausalLM.from_config``: same classes, tiny sizes.
import tempfile
from pathlib import Path

import transformers

work = Path(tempfile.mkdtemp())
transformers.LlamaConfig(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
).save_pretrained(work / "tiny-llama")
print(sorted(p.name for p in (work / "tiny-llama").iterdir()))

# %%
# Check it
# --------
# The command line is::
#
#     mfsdp check ./tiny-llama --nproc 2 --steps 3 --layouts optim_grads_params bf16 \
#         --json check.json --plot check.png
#
# It exits 0 when every layout passes, and 1 when one fails. From Python it is one call;
# each layout prints a line as it finishes.
#
# Without ``layouts``, every layout that fits ``nproc`` runs: ZeRO 0-3, bf16, bf16
# communication, and a resume into another strategy.
from mfsdp.check import check

report = check(str(work / "tiny-llama"), nproc=2, steps=3,
               layouts=["optim_grads_params", "bf16"])
print(report.table())

# %%
# The FSDP units are the model's repeated blocks: the modules in the ``nn.ModuleList`` that
# holds most of its parameters. ``--units`` chooses others.
print("units:", report.units, "| passed:", report.passed)
assert report.passed and report.units == ["LlamaDecoderLayer"]

# %%
# What a fault looks like
# -----------------------
# ``mfsdp.check.faults.loss_averaged_twice`` divides its loss by the world size, although
# the engine already averages gradients over ranks. So at two ranks every update is half the
# reference's: the class of upstream's NVIDIA/Megatron-LM#5974.
#
# With SGD (the default) it shows in the update-norm ratio from the first step.
faulty = check("mfsdp.check.faults:loss_averaged_twice", nproc=2, steps=3,
               layouts=["optim_grads_params"])
print(faulty.layouts[0].reason)
ratio = faulty.layouts[0].steps[0].update_norm_ratio
assert not faulty.passed and abs(ratio - 0.5) < 1e-3

# %%
# The ratios per step
# -------------------
# A healthy layout sits on 1 (bf16 within its tolerance); the fault sits near 0.5.
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(6, 3.4))
for name, result in [(f"llama {r.name}", r) for r in report.layouts] + \
                    [("fault: loss averaged twice", faulty.layouts[0])]:
    steps = [s.step for s in result.steps]
    ax.plot(steps, [s.update_norm_ratio for s in result.steps],
            "o-" if result.passed else "s--", label=name)
ax.axhline(1.0, color="k", lw=0.8, ls=":")
ax.set_xlabel("step")
ax.set_ylabel("update-norm ratio\n(sharded / reference)")
ax.set_xticks([1, 2, 3])
ax.legend(fontsize=10)
fig.tight_layout()
