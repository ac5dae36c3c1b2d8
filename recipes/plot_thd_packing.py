"""
THD packing with uneven ranks: padding and trimming
===================================================

Pack variable-length sequences into one token stream per rank, with a different number of
tokens on each of two ranks (17 and 70). Then run an MoE layer with the ``flex`` dispatcher's
static-shape ``torch`` backend. It pads both ranks to the same count, and trims the padding
off afterwards.

**What you will learn**

* what ``cu_seqlens`` and the block-diagonal causal mask of a packed batch look like;
* how the static-shape contract pads (MAX over the EP group, rounded up to 64) and that the padded
  rows route nowhere and disappear from the output.

The code
--------
The MoE layer of :ref:`sphx_glr_docs_recipes_plot_moe_dispatchers.py` (``mfsdp/examples/moe_dispatch.py``)
with ``dispatcher="flex"``:

.. literalinclude:: ../../mfsdp/examples/moe_dispatch.py
   :language: python
   :pyobject: run_layer
"""

# %%
# A packed batch
# --------------
import torch

from mfsdp.models.gpt import pack_sequences, thd_attention_mask

lengths = [5, 3, 9]
tokens, cu_seqlens = pack_sequences([torch.arange(n) for n in lengths])
mask = thd_attention_mask(cu_seqlens)
print("cu_seqlens:", cu_seqlens.tolist())

# %%
# Uneven ranks through the flex dispatcher
# ----------------------------------------
from mfsdp.launch import launch

counts = [17, 70]
run = "mfsdp.examples.moe_dispatch:run_layer"
results = launch(run, 2, args=("flex", counts),
                 kwargs=dict(flex_backend="torch", steps=1))
exact = launch(run, 2, args=("alltoall", counts), kwargs=dict(steps=1))  # no padding
for rank, (r, a) in enumerate(zip(results, exact)):
    diff = (r["output"] - a["output"]).abs().max().item()
    rows = r["output"].shape[0]
    print(f"rank {rank}: {counts[rank]} tokens, padded to {r['padded_tokens']}; "
          f"a padding row routed to an expert: {r['padding_routed']}")
    print(f"        output rows {rows}, max |out - alltoall's| = {diff:.1e}")
    assert rows == counts[rank] and not r["padding_routed"] and diff < 1e-5

# %%
# Plot
# ----
import matplotlib.pyplot as plt

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.2), layout="constrained")
ax1.imshow(mask.int(), cmap="Blues")
ax1.set_title(f"attention mask of sequences {lengths}")
ax1.set_xlabel("key token")
ax1.set_ylabel("query token")
padded = results[0]["padded_tokens"]
ax2.barh([f"rank {r}" for r in range(2)], counts, label="real tokens", color="tab:blue")
ax2.barh([f"rank {r}" for r in range(2)], [padded - c for c in counts], left=counts,
         label="padding (routes nowhere, trimmed)", color="tab:gray", alpha=0.5)
ax2.axvline(max(counts), color="k", ls=":", label=f"MAX over EP = {max(counts)}")
ax2.set_xlabel(f"rows exchanged per slot (padded to {padded}, a multiple of 64)")
# the legend above the bars, not over them
ax2.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
plt.show()
