"""Tokenize JSONL into Megatron indexed datasets: ``mfsdp preprocess`` (Megatron-LM's
``tools/preprocess_data.py`` counterpart, with its flag names).

Each input line is a JSON object; for each of ``--json-keys`` (default ``text``) the value is
tokenized, ``--append-eod`` ends every non-empty document with the tokenizer's EOD id, and the
documents are written to ``{--output-prefix}_{key}_document.bin`` / ``.idx`` in Megatron's format
(uint16 tokens when the vocabulary is below 65,500, else int32), readable by megatron-core and
by ``mfsdp train --data-path {prefix}_{key}_document``. ``--workers N`` tokenizes in N processes;
progress goes to standard error every ``--log-interval`` documents. Outputs appear only when
complete.

Example::

    mfsdp preprocess --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model ./tokenizer \\
        --append-eod --workers 4
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

__all__ = ["build_parser", "preprocess", "run"]

_TOKENIZER = None
_ARGS = None


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add ``mfsdp preprocess``'s options to ``parser`` (a new one if None)."""
    from mfsdp.data.tokenizers import TOKENIZER_TYPES

    p = parser or argparse.ArgumentParser(prog="mfsdp preprocess", description=__doc__)
    p.add_argument("--input", required=True, help="JSONL file, one document per line")
    p.add_argument("--output-prefix", required=True,
                   help="writes PREFIX_KEY_document.bin and .idx per JSON key")
    p.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys to tokenize (default: text)")
    p.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    p.add_argument("--tokenizer-model", help="HuggingFaceTokenizer: local tokenizer directory")
    p.add_argument("--vocab-size", type=int, help="NullTokenizer: vocabulary size")
    p.add_argument("--append-eod", action="store_true", help="end each document with EOD")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes (default: 1)")
    p.add_argument("--log-interval", type=int, default=1000,
                   help="report progress every N documents (default: 1000)")
    return p


def _init(args) -> None:
    global _TOKENIZER, _ARGS
    from mfsdp.data.tokenizers import build_tokenizer

    _ARGS = args
    _TOKENIZER = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)


def _encode(line: str):
    import numpy

    data = json.loads(line)
    out = {}
    for key in _ARGS.json_keys:
        if key not in data:
            raise KeyError(f"a line of {_ARGS.input} has no key {key!r} (its keys: "
                           f"{sorted(data)}); pass --json-keys")
        text = data[key]
        sentences = text if isinstance(text, list) else [text]
        ids, lens = [], []
        for sentence in sentences:
            s = _TOKENIZER.tokenize(sentence)
            if s:
                ids.extend(s)
                lens.append(len(s))
        if ids and _ARGS.append_eod:
            ids.append(_TOKENIZER.eod)
            lens[-1] += 1
        out[key] = (numpy.asarray(ids, dtype=numpy.int64), lens)  # arrays pickle fast
    return out, len(line)


def preprocess(args: argparse.Namespace, log=print) -> dict[str, str]:
    """Tokenize ``args.input`` into one indexed dataset per key; returns ``{key: prefix}``."""
    import numpy

    from mfsdp.data.indexed import IndexedDatasetBuilder, optimal_dtype

    if not os.path.isfile(args.input):
        raise FileNotFoundError(f"--input {args.input}: no such file")
    if args.workers < 1:
        raise ValueError(f"--workers {args.workers}: at least 1")
    _init(args)
    dtype = optimal_dtype(_TOKENIZER.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    prefixes = {k: f"{args.output_prefix}_{k}_document" for k in args.json_keys}
    builders = {k: IndexedDatasetBuilder(p + ".bin", dtype=dtype) for k, p in prefixes.items()}
    total_bytes = os.path.getsize(args.input)
    t0 = time.perf_counter()
    done_bytes = docs = tokens = 0
    pool = multiprocessing.get_context("spawn").Pool(args.workers, _init, (args,)) \
        if args.workers > 1 else None
    try:
        with open(args.input, encoding="utf-8") as f:
            lines = (line for line in f if line.strip())
            results = pool.imap(_encode, lines, chunksize=256) if pool else map(_encode, lines)
            for out, nbytes in results:
                for key, (ids, lens) in out.items():
                    builders[key].add_document(ids, lens)
                    tokens += len(ids)
                docs += 1
                done_bytes += nbytes
                if docs % args.log_interval == 0:
                    dt = time.perf_counter() - t0
                    log(f"[preprocess] {docs:,} documents, {tokens:,} tokens, "
                        f"{done_bytes / 2**20 / dt:.3g} MB/s, {100 * done_bytes / total_bytes:.0f}%",
                        file=sys.stderr, flush=True)
        for key, b in builders.items():
            b.finalize(prefixes[key] + ".idx")
    except BaseException:
        for b in builders.values():
            b.abort()
        raise
    finally:
        if pool:
            pool.close()
            pool.join()
    dt = time.perf_counter() - t0
    log(f"[preprocess] wrote {', '.join(prefixes.values())}: {docs:,} documents, {tokens:,} tokens "
        f"({dtype.__name__}) in {dt:.1f} s, {total_bytes / 2**20 / max(dt, 1e-9):.3g} MB/s",
        file=sys.stderr, flush=True)
    return prefixes


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``mfsdp preprocess`` command."""
    preprocess(args)
    return 0
