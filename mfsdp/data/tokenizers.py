"""Tokenizers by Megatron-LM's names: ``--tokenizer-type NullTokenizer`` and ``HuggingFaceTokenizer``.

- ``NullTokenizer --vocab-size N``: text is already token ids separated by spaces; the EOD id is
  ``N - 1`` (megatron-core's ``NullTokenizer``).
- ``HuggingFaceTokenizer --tokenizer-model PATH``: a local directory saved by
  ``save_pretrained`` (or holding ``tokenizer.json`` and ``tokenizer_config.json``), read with
  ``transformers``; ``tokenize`` returns ``input_ids`` with the tokenizer's special tokens (a
  Llama tokenizer adds BOS), and EOD is its EOS token, as Megatron-LM's wrapper does. Nothing is
  downloaded: a hub name that is not a local path is refused.

>>> tok = build_tokenizer("NullTokenizer", vocab_size=100)
>>> tok.tokenize("5 17 3"), tok.eod, tok.vocab_size
([5, 17, 3], 99, 100)
"""

from __future__ import annotations

import os

__all__ = ["HuggingFaceTokenizer", "NullTokenizer", "TOKENIZER_TYPES", "build_tokenizer"]

TOKENIZER_TYPES = ("NullTokenizer", "HuggingFaceTokenizer")


class NullTokenizer:
    """Space-separated ids in, ids out; EOD is ``vocab_size - 1``."""

    def __init__(self, vocab_size: int):
        if not vocab_size or vocab_size < 2:
            raise ValueError("NullTokenizer needs --vocab-size (at least 2)")
        self.vocab_size = int(vocab_size)
        self.eod = self.vocab_size - 1

    def tokenize(self, text: str) -> list[int]:
        """``"5 17 3"`` -> ``[5, 17, 3]``."""
        ids = [int(x) for x in text.split()]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"NullTokenizer: ids {bad[:3]} outside the vocabulary of "
                             f"{self.vocab_size}")
        return ids

    def detokenize(self, ids) -> str:
        """Ids back to their space-separated text."""
        return " ".join(str(int(i)) for i in ids)


class HuggingFaceTokenizer:
    """A local Hugging Face tokenizer (``transformers.AutoTokenizer``), Megatron-LM's wrapper."""

    def __init__(self, path: str):
        if not path or not os.path.exists(path):
            raise FileNotFoundError(f"--tokenizer-model {path!r}: no such local file or directory "
                                    "(nothing is downloaded: save the tokenizer with "
                                    "save_pretrained and pass its directory)")
        try:
            from transformers import AutoTokenizer, PreTrainedTokenizerFast
        except ImportError:
            raise SystemExit("HuggingFaceTokenizer needs the transformers package "
                             "(pip install transformers)") from None
        if os.path.isfile(path):  # a bare tokenizer.json
            directory = os.path.dirname(os.path.abspath(path))
            if os.path.isfile(os.path.join(directory, "tokenizer_config.json")):
                self._tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
            else:
                self._tok = PreTrainedTokenizerFast(tokenizer_file=path)
        else:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.path = path
        eos = self._tok.eos_token_id
        if eos is None:
            raise ValueError(f"--tokenizer-model {path}: the tokenizer has no EOS token to end "
                             "documents with; set eos_token in its tokenizer_config.json")
        self.eod = int(eos)
        self.vocab_size = len(self._tok)

    def tokenize(self, text: str) -> list[int]:
        """``input_ids`` of ``text``, special tokens included (as Megatron-LM's wrapper)."""
        return list(self._tok(text).input_ids)

    def detokenize(self, ids) -> str:
        """Text of ``ids``."""
        return self._tok.decode([int(i) for i in ids])


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | None = None,
                    vocab_size: int | None = None):
    """The tokenizer ``--tokenizer-type`` names (see the module doc)."""
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model PATH")
        return HuggingFaceTokenizer(tokenizer_model)
    raise ValueError(f"--tokenizer-type {tokenizer_type!r}: mfsdp has {', '.join(TOKENIZER_TYPES)} "
                     "(Megatron-LM's GPT2BPETokenizer, SentencePiece and Tiktoken types are not "
                     "implemented: save a Hugging Face tokenizer of the same vocabulary instead)")
