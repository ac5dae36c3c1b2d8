"""
Train on Megatron indexed data: tokenize, preprocess, train sharded, validate
=============================================================================

Turn text into the ``.bin``/``.idx`` datasets Megatron-LM trains on, and train on them with
``mfsdp train`` exactly as on a cluster. The steps: a tokenizer, ``mfsdp preprocess``, then
ZeRO-3 on two CPU ranks with ``--data-path``, ``--split`` and validation.

The corpus is this guide's own pages, one paragraph per document. The tokenizer is a
word-level Hugging Face tokenizer trained on them, so nothing is downloaded.

**What you will learn**

* the commands: ``mfsdp preprocess`` and ``mfsdp train --data-path PREFIX --split ...``;
* what a sample is (``--seq-length + 1`` tokens crossing documents at EOD) and where the
  validation loss comes from.
"""

# %%
# A corpus as JSONL
# -----------------
# One JSON object per line with a ``text`` field, as ``preprocess_data.py`` expects.
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt

import mfsdp

work = Path(tempfile.mkdtemp())
pages = sorted((Path(mfsdp.__file__).resolve().parents[1] / "docs").glob("*.md"))
paragraphs = [p.strip().replace("\n", " ") for page in pages
              for p in page.read_text().split("\n\n")
              if len(p.split()) > 8
              and not p.lstrip().startswith(("```", "|", ">>>", "#"))]
with open(work / "guide.jsonl", "w") as f:
    for text in paragraphs:
        f.write(json.dumps({"text": text}) + "\n")
print(f"{len(paragraphs)} documents from {len(pages)} pages")

# %%
# A tokenizer
# -----------
# Any local Hugging Face tokenizer directory works (``--tokenizer-model``). Here it is a
# word-level one trained on the corpus. Its EOS, ``</s>``, is the EOD token that ends every
# document.
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
trainer = trainers.WordLevelTrainer(vocab_size=2000, min_frequency=2,
                                    special_tokens=["<unk>", "</s>"])
tok.train_from_iterator(paragraphs, trainer)
PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>",
                        unk_token="<unk>").save_pretrained(work / "tokenizer")

# %%
# Preprocess
# ----------
# ``mfsdp preprocess`` takes Megatron-LM's ``preprocess_data.py`` flags and writes
# ``{prefix}_text_document.bin/.idx``, which megatron-core reads too.
out = subprocess.run(
    [sys.executable, "-m", "mfsdp.cli", "preprocess",
     "--input", str(work / "guide.jsonl"),
     "--output-prefix", str(work / "data" / "guide"),
     "--tokenizer-type", "HuggingFaceTokenizer",
     "--tokenizer-model", str(work / "tokenizer"), "--append-eod", "--workers", "2"],
    capture_output=True, text=True, check=True)
print(out.stderr.strip().splitlines()[-1])
prefix = str(work / "data" / "guide_text_document")

from mfsdp.data.gpt_dataset import build_gpt_datasets

train, valid, _ = build_gpt_datasets([prefix], "95,5,0", [8, 8, 0], seq_length=64,
                                     seed=1234)
tokenizer = PreTrainedTokenizerFast.from_pretrained(work / "tokenizer")
print(f"train: {len(train)} samples, valid: {len(valid)}")
print("sample 0 (65 tokens, crossing a document's end):")
print(tokenizer.decode(train[0][1][:40].tolist()), "...")

# %%
# Train sharded, with validation
# ------------------------------
# The flags are Megatron-LM's: ``--data-path``, ``--split``, ``--tokenizer-*``,
# ``--eval-interval`` and ``--eval-iters``. On a cluster this is
# ``torchrun --nproc-per-node 2 -m mfsdp.train ...``. Here it runs as two gloo processes.
from mfsdp.launch import launch

argv = ["--use-megatron-fsdp",
        "--data-parallel-sharding-strategy", "optim_grads_params",
        "--data-path", prefix, "--split", "95,5,0",
        "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", str(work / "tokenizer"), "--seq-length", "64",
        "--global-batch-size", "16", "--micro-batch-size", "4", "--train-iters", "60",
        "--lr", "3e-3", "--eval-interval", "10", "--eval-iters", "2",
        "--log-interval", "20"]
records = launch("mfsdp.train:run_in_rank", 2, args=(argv,))[0]
valid_points = [(r["iteration"], r["valid_loss"]) for r in records if "valid_loss" in r]
print(f"training loss {records[0]['loss']:.2f} -> {records[-1]['loss']:.2f}; "
      "validation loss "
      f"{valid_points[0][1]:.2f} -> {valid_points[-1][1]:.2f} "
      f"(perplexity {records[-1]['valid_ppl']:.0f})")

# %%
# The curves
# ----------
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot([r["iteration"] for r in records], [r["loss"] for r in records],
        label="training")
ax.plot(*zip(*valid_points), "o-", label="validation (held-out 5% of documents)")
ax.set_xlabel("iteration")
ax.set_ylabel("loss (nats per token)")
ax.set_title("gpt-tiny on the guide's pages, ZeRO-3 on 2 CPU ranks")
ax.legend()
fig.tight_layout()
plt.show()
