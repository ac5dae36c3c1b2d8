"""
Fine-tune a Hugging Face model sharded, and give it back to ``transformers``
============================================================================

Take a model in Hugging Face format and convert it to a sharded ``fsdp_dtensor`` checkpoint.
Fine-tune it with ``mfsdp train`` on two CPU ranks (ZeRO-3, expert parallelism 2). Then export
the result to Hugging Face format, and run it with ``transformers``.

The model is a tiny random Qwen2-MoE built by ``transformers`` itself: nothing is downloaded. The
commands are the ones you would run on a real checkpoint, such as ``Qwen/Qwen1.5-MoE-A2.7B`` or
``meta-llama/Llama-3.1-8B``.

**What you will learn**

* the three commands: ``mfsdp convert --from hf``, ``mfsdp train --load``, ``mfsdp convert --to hf``;
* that the imported model is the ``transformers`` model (same logits) and that the export loads
  with no missing or unexpected keys and gives the fine-tuned model's logits.
"""

# %%
# A Hugging Face model
# --------------------
# Any directory with ``config.json`` and safetensors files (one file or shards with an index).
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers

transformers.utils.logging.disable_progress_bar()  # a page shows results, not bars
work = Path(tempfile.mkdtemp())
torch.manual_seed(0)
config = transformers.Qwen2MoeConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=64, max_position_embeddings=128)
transformers.AutoModelForCausalLM.from_config(config).save_pretrained(work / "qwen-moe")
print(sorted(p.name for p in (work / "qwen-moe").iterdir()))

# %%
# Import
# ------
# ``mfsdp convert --from hf`` streams the tensors into an ``fsdp_dtensor`` checkpoint (one tensor
# in memory at a time) and stores the model's configuration with it.


def mfsdp(*args: str) -> str:
    """Run an ``mfsdp`` command; return what it printed."""
    out = subprocess.run([sys.executable, "-m", "mfsdp.cli", *args],
                         capture_output=True, text=True, check=True,
                         env={"OMP_NUM_THREADS": "1", **__import__("os").environ})
    return out.stdout


print(mfsdp("convert", "--from", "hf", "--to", "fsdp_dtensor", "--no-progress",
            str(work / "qwen-moe"), str(work / "imported")))
saved = json.loads((work / "imported" / "model_config.json").read_text())
print({k: saved[k] for k in ("num_experts", "moe_shared_expert_gate", "add_qkv_bias",
                             "moe_router_pre_softmax", "num_query_groups")})

# %%
# The imported model is the ``transformers`` model: the same logits on the same tokens.
from mfsdp.checkpoint.hf_format import load_hf

reference = transformers.AutoModelForCausalLM.from_pretrained(work / "qwen-moe").eval()
ours = load_hf(work / "qwen-moe").eval()
tokens = torch.randint(0, 256, (2, 32))
with torch.no_grad():
    want = reference(input_ids=tokens).logits.reshape(-1, 256)
    err = ((ours(tokens) - want).norm() / want.norm()).item()
print(f"relative logits difference, mfsdp vs transformers: {err:.1e}")

# %%
# Fine-tune
# ---------
# ``mfsdp train --load`` reads the model's configuration from the checkpoint, so no model flag is
# needed; two ranks, ZeRO-3 (the default), the experts split over EP 2.
out = subprocess.run(
    [sys.executable, "-m", "torch.distributed.run", "--standalone",
     "--nproc-per-node", "2", "-m", "mfsdp.train", "--use-megatron-fsdp",
     "--load", str(work / "imported"), "--save", str(work / "finetuned"),
     "--expert-model-parallel-size", "2", "--train-iters", "30", "--mock-data",
     "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
     "--lr", "3e-3", "--lr-warmup-iters", "3", "--lr-decay-style", "cosine",
     "--log-jsonl", str(work / "log.jsonl")],
    capture_output=True, text=True, check=True,
    env={"OMP_NUM_THREADS": "1", **__import__("os").environ})
print("\n".join(out.stdout.splitlines()[:3]))
log = [json.loads(line) for line in (work / "log.jsonl").read_text().splitlines()]
print(f"loss {log[0]['loss']:.3f} -> {log[-1]['loss']:.3f} in {len(log)} iterations")

# %%
# Export and run with ``transformers``
# ------------------------------------
print(mfsdp("convert", "--from", "fsdp_dtensor", "--to", "hf", "--no-progress",
            str(work / "finetuned"), str(work / "exported")))
model, info = transformers.AutoModelForCausalLM.from_pretrained(
    work / "exported", output_loading_info=True)
print("missing:", sorted(info["missing_keys"]),
      "unexpected:", sorted(info["unexpected_keys"]))
finetuned = load_hf(work / "exported").eval()
with torch.no_grad():
    got = model.eval()(input_ids=tokens).logits.reshape(-1, 256)
    err = ((got - finetuned(tokens)).norm() / got.norm()).item()
    moved = ((got - want).norm() / want.norm()).item()
print(f"fine-tuned: transformers vs mfsdp logits differ by {err:.1e}; "
      f"they moved {moved:.1%} from the original model's")

# %%
# Plot
# ----
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot([r["iteration"] for r in log], [r["loss"] for r in log], "o-", ms=3)
ax.set_xlabel("iteration")
ax.set_ylabel("training loss")
ax.set_title("Qwen2-MoE (tiny) fine-tuned on 2 CPU ranks, ZeRO-3 + EP 2")
fig.tight_layout()
plt.show()
