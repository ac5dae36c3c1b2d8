"""GPT training samples from Megatron indexed datasets, in the order Megatron-LM draws them.

Given the same files, ``--data-path``, ``--split``, ``--seed``, ``--seq-length`` and sample counts,
:func:`build_gpt_datasets` yields exactly the samples megatron-core's
``BlendedMegatronDatasetBuilder(GPTDataset, ...)`` yields, sample for sample (checked against
megatron-core 0.19 in ``tests/fixtures/megatron_data``):

- ``--split 969,30,1`` is normalised and cut into contiguous ranges of each file's documents
  (sequences), rounded as Megatron rounds.
- Each split's documents are repeated for as many epochs as the requested samples need, shuffled
  with ``numpy.random.RandomState(seed)``; when the last epoch is needed for less than 80% of
  its samples it is shuffled apart, so those samples come last.
- The documents are concatenated and cut into samples of ``seq_length + 1`` tokens (inputs and
  the last label) that overlap by one token; documents' EOD tokens stay in the stream, samples
  cross document boundaries, and a partial last sample is dropped.
- The samples are shuffled (a second permutation from the same random state).
- Several files with weights (``0.3 a 0.7 b``) are blended greedily so each prefix of the blend
  follows the weights as closely as possible; each file contributes its share plus a 0.5%
  margin. Without weights, files are blended in proportion to their sample counts.

Only the index arrays are computed (one int32 per document per epoch and one uint32 per
sample); tokens are read from the memory-mapped ``.bin`` when a sample is asked for. With
``cache_dir`` the index arrays are stored as ``.npy`` files and reused.

>>> import tempfile, os, numpy
>>> from mfsdp.data.indexed import IndexedDatasetBuilder
>>> d = tempfile.mkdtemp(); b = IndexedDatasetBuilder(os.path.join(d, "t.bin"), numpy.uint16)
>>> for n in range(20): b.add_document(list(range(1, n % 7 + 3)) + [0])
>>> b.finalize(os.path.join(d, "t.idx"))
>>> train, valid, test = build_gpt_datasets([os.path.join(d, "t")], "90,10,0", [8, 2, 0],
...                                         seq_length=6, seed=1234)
>>> dataset_id, tokens = train[0]
>>> len(train), len(tokens), tokens.dtype, test
(16, 7, dtype('int64'), None)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path

import numpy

from mfsdp.data.indexed import IndexedDataset

__all__ = ["BlendedSamples", "GPTSamples", "blending_indices", "build_gpt_datasets",
           "parse_data_path", "parse_split", "split_matrix"]

SPLITS = ("train", "valid", "test")
MID_LEVEL_SURPLUS = 0.005  # megatron-core's default margin per blended file


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` -> the normalised train/valid/test fractions (missing parts are 0).

    >>> parse_split("969,30,1")
    [0.969, 0.03, 0.001]
    """
    pieces = re.split(r"[,/]", split)
    try:
        parts = [float(x) for x in pieces]
    except ValueError:
        parts = None
    if (parts is None or len(parts) > 3 or not all(0 <= x < math.inf for x in parts)
            or sum(parts) <= 0):
        bad = next((x for x in pieces if not re.fullmatch(r"\s*(\d+\.?\d*|\.\d+)\s*", x)),
                   None)
        raise ValueError(f"--split {split!r}: give up to three non-negative weights separated "
                         "by commas, train,valid,test, e.g. 969,30,1"
                         + (f" ({bad!r} is not a non-negative number)" if bad is not None else ""))
    parts += [0.0] * (3 - len(parts))
    total = float(numpy.sum(numpy.array(parts, dtype=numpy.float64)))
    return (numpy.array(parts, dtype=numpy.float64) / total).tolist()


def split_matrix(fractions: list[float]) -> list[tuple[float, float] | None]:
    """Book-ends of each split in [0, 1], or None for an empty split.

    >>> split_matrix([0.9, 0.1, 0.0])
    [(0, 0.9), (0.9, 1.0), None]
    """
    ends = [0]
    for f in fractions:
        ends.append(ends[-1] + f)
    return [(a, b) if b > a else None for a, b in zip(ends[:-1], ends[1:])]


def parse_data_path(items: list[str]) -> tuple[list[str], list[float] | None]:
    """Megatron's ``--data-path``: prefixes, or alternating weights and prefixes.

    >>> parse_data_path(["30", "a", "70", "b"])
    (['a', 'b'], [30.0, 70.0])
    >>> parse_data_path(["a", "b"])
    (['a', 'b'], None)
    >>> parse_data_path(["0.3", "a", "0.7"])
    Traceback (most recent call last):
    ...
    ValueError: --data-path 0.3 a 0.7: 3 entries, of which 0.3, 0.7 are numbers and no dataset: a weighted list pairs each weight with the prefix after it (WEIGHT PREFIX WEIGHT PREFIX ...), an unweighted one names prefixes only; add the missing weight or prefix
    """
    if len(items) % 2 == 0:
        try:
            weights = [float(w) for w in items[0::2]]
        except ValueError:
            weights = None
        if weights is not None:
            if any(w < 0 for w in weights) or sum(weights) <= 0:
                raise ValueError(f"--data-path {' '.join(items)}: weights must be positive")
            return [p.strip() for p in items[1::2]], weights
    numbers = [x for x in items if _is_number(x) and not os.path.isfile(x.strip() + ".idx")]
    if numbers and len(items) > 1:
        raise ValueError(
            f"--data-path {' '.join(items)}: {len(items)} entries, of which {', '.join(numbers)} "
            f"{'is a number' if len(numbers) == 1 else 'are numbers'} and no dataset: a weighted "
            "list pairs each weight with the prefix after it (WEIGHT PREFIX WEIGHT PREFIX ...), "
            "an unweighted one names prefixes only; add the missing weight or prefix")
    return [p.strip() for p in items], None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _normalize(weights):
    w = numpy.array(weights, dtype=numpy.float64)
    return (w / numpy.sum(w)).tolist()


def _document_index(documents: numpy.ndarray, epochs: int, rs: numpy.random.RandomState,
                    separate_final_epoch: bool) -> numpy.ndarray:
    if not separate_final_epoch or epochs == 1:
        index = numpy.tile(documents.astype(numpy.int32), epochs)
        rs.shuffle(index)
        return index
    first = _document_index(documents, epochs - 1, rs, False)
    last = _document_index(documents, 1, rs, False)
    return numpy.concatenate((first, last))


def _shuffle_index(num_samples: int, total: int, rs: numpy.random.RandomState) -> numpy.ndarray:
    dtype = numpy.uint32 if total < numpy.iinfo(numpy.uint32).max - 1 else numpy.int64
    first = numpy.arange(num_samples, dtype=dtype)
    rs.shuffle(first)
    if num_samples == total:
        return first
    last = numpy.arange(num_samples, total, dtype=dtype)
    rs.shuffle(last)
    return numpy.concatenate((first, last))


class GPTSamples:
    """The samples of one split of one indexed dataset (megatron-core's ``GPTDataset``).

    ``samples[i]`` is an int64 array of ``seq_length + 1`` tokens; ``len(samples)`` counts every
    whole sample of the epochs built (at least ``num_samples``).
    """

    def __init__(self, dataset: IndexedDataset, documents: numpy.ndarray, num_samples: int | None,
                 seq_length: int, seed: int, split: str = "train", cache_dir: str | None = None):
        self.dataset, self.seq_length, self.split = dataset, seq_length, split
        lengths = dataset.sequence_lengths
        tokens_per_epoch = int(numpy.sum(lengths[documents], dtype=numpy.int64))
        if tokens_per_epoch <= 1:
            raise ValueError(f"the {split} split of {dataset.prefix} holds {len(documents)} "
                             f"documents and {tokens_per_epoch} tokens: too few to draw samples "
                             "from; change --split or add data")
        extra = 1
        epochs = 1
        if num_samples is not None:
            needed = num_samples * seq_length + extra
            epochs = max(1, -(-needed // tokens_per_epoch))
        separate = False
        sans_final = None
        if epochs > 1:
            sans_final = ((epochs - 1) * tokens_per_epoch - extra) // seq_length
            per_epoch = (tokens_per_epoch - extra) // seq_length
            separate = (num_samples - sans_final) < int(0.80 * per_epoch)
        total = (epochs * tokens_per_epoch - extra) // seq_length
        key = json.dumps([os.path.abspath(dataset.prefix), os.path.getsize(dataset.prefix + ".idx"),
                          os.path.getmtime(dataset.prefix + ".idx"), int(documents[0]) if
                          len(documents) else 0, len(documents), num_samples, seq_length, seed])
        cached = _cache_load(cache_dir, key, ("document_index", "shuffle_index"))
        if cached is not None and not _cache_fits(cached, documents, epochs, total):
            _cache_damaged(cache_dir, key, "its indices do not fit this dataset")
            cached = None
        if cached is not None:
            self.document_index, self.shuffle_index = cached
        else:
            rs = numpy.random.RandomState(seed)
            self.document_index = _document_index(documents, epochs, rs, separate)
            self.shuffle_index = _shuffle_index(sans_final if separate else total, total, rs)
            _cache_save(cache_dir, key, {"document_index": self.document_index,
                                         "shuffle_index": self.shuffle_index})
        # Where each document of the epochs starts in the concatenated token stream.
        self._starts = numpy.zeros(len(self.document_index) + 1, dtype=numpy.int64)
        numpy.cumsum(lengths[self.document_index], out=self._starts[1:])
        self._len = total
        self.epochs = epochs

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> numpy.ndarray:
        if not 0 <= i < self._len:
            raise IndexError(f"sample {i} of {self._len} ({self.split})")
        begin = int(self.shuffle_index[i]) * self.seq_length
        end = begin + self.seq_length + 1
        d = int(numpy.searchsorted(self._starts, begin, side="right")) - 1
        parts, pos = [], begin
        while pos < end:
            doc_start, doc_end = int(self._starts[d]), int(self._starts[d + 1])
            if doc_end > pos:
                take = min(end, doc_end) - pos
                parts.append(self.dataset.get(int(self.document_index[d]), pos - doc_start, take))
                pos += take
            d += 1
        return numpy.concatenate(parts).astype(numpy.int64)


def blending_indices(weights: list[float], size: int) -> tuple[numpy.ndarray, numpy.ndarray]:
    """For each of ``size`` samples, which dataset it comes from and that dataset's sample index:
    each time the dataset furthest below its weighted share (the first on ties), as Megatron's
    ``build_blending_indices`` does.

    >>> blending_indices([0.25, 0.75], 8)[0].tolist()
    [1, 0, 1, 1, 0, 1, 1, 1]
    """
    n = len(weights)
    current = [0] * n
    dataset_index = numpy.zeros(size, dtype=numpy.int16)
    sample_index = numpy.zeros(size, dtype=numpy.int64)
    w = [float(x) for x in weights]
    for i in range(size):
        x = max(float(i), 1.0)
        best, best_err = 0, w[0] * x - current[0]
        for k in range(1, n):
            err = w[k] * x - current[k]
            if err > best_err:
                best, best_err = k, err
        dataset_index[i] = best
        sample_index[i] = current[best]
        current[best] += 1
    return dataset_index, sample_index


class BlendedSamples:
    """Several :class:`GPTSamples` blended by weight (megatron-core's ``BlendedDataset``).

    ``samples[i]`` is ``(dataset_id, tokens)``.
    """

    def __init__(self, datasets: list[GPTSamples], weights: list[float], size: int, split: str):
        self.datasets, self.weights, self.size = datasets, _normalize(weights), size
        self.dataset_index, self.sample_index = blending_indices(self.weights, size)
        counts = numpy.bincount(self.dataset_index, minlength=len(datasets))
        for k, (ds, n) in enumerate(zip(datasets, counts)):
            if len(ds) < n:
                raise ValueError(f"the {split} blend asks {n} samples of {ds.dataset.prefix}, which "
                                 f"has {len(ds)}: add data or lower its weight")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[int, numpy.ndarray]:
        k = int(self.dataset_index[i])
        return k, self.datasets[k][int(self.sample_index[i])]


class _Single:
    """One file's samples with the ``(dataset_id, tokens)`` interface of a blend."""

    def __init__(self, samples: GPTSamples):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[int, numpy.ndarray]:
        return 0, self.samples[i]


def build_gpt_datasets(data_path: list[str], split: str, sizes: list[int | None], seq_length: int,
                       seed: int, cache_dir: str | None = None) -> list:
    """Train, valid and test samples (or None for an empty split) from Megatron's ``--data-path``.

    Each split supports ``len`` and indexing; an item is ``(dataset_id, tokens)`` with
    ``seq_length + 1`` int64 tokens. ``sizes`` are the samples each split must provide (Megatron-LM
    asks ``train_iters x global_batch_size`` for training, ``(train_iters // eval_interval + 1) x
    eval_iters x global_batch_size`` for validation and ``eval_iters x global_batch_size`` for test).
    """
    prefixes, weights = parse_data_path(list(data_path))
    if weights is not None:
        weights = _normalize(weights)
    matrix = split_matrix(parse_split(split))
    files = {p: IndexedDataset(p) for p in dict.fromkeys(prefixes)}

    def samples(prefix: str, i: int, num: int | None) -> GPTSamples:
        ds = files[prefix]
        begin = int(round(matrix[i][0] * float(len(ds))))
        end = int(round(matrix[i][1] * float(len(ds))))
        return GPTSamples(ds, numpy.arange(begin, end, dtype=numpy.int32), num, seq_length, seed,
                          SPLITS[i], cache_dir)

    out: list = [None, None, None]
    for i in range(3):
        if matrix[i] is None:
            continue
        if len(prefixes) == 1 and weights is None:
            out[i] = _Single(samples(prefixes[0], i, sizes[i]))
            continue
        if weights is not None:
            if sizes[i] is None:
                raise ValueError("blending with weights needs a sample count per split")
            target = [math.ceil(sizes[i] * w) for w in weights]
            buffer = [math.ceil(math.ceil(sizes[i] * w) * (1 + MID_LEVEL_SURPLUS)) for w in weights]
            parts = [samples(p, i, n) for p, n in zip(prefixes, buffer)]
            out[i] = BlendedSamples(parts, weights, sum(target), SPLITS[i])
        else:
            parts = [samples(p, i, None) for p in prefixes]
            counts = [len(s) for s in parts]
            size = sum(counts) if sizes[i] is None else min(sizes[i], sum(counts))
            out[i] = BlendedSamples(parts, counts, size, SPLITS[i])
    return out


def _cache_paths(cache_dir: str, key: str, names) -> dict[str, Path]:
    h = hashlib.sha256(key.encode()).hexdigest()[:24]
    return {n: Path(cache_dir) / f"{h}-{n}.npy" for n in names}


def _cache_load(cache_dir: str | None, key: str, names):
    if not cache_dir:
        return None
    paths = _cache_paths(cache_dir, key, names)
    if not all(p.is_file() for p in paths.values()):
        return None
    try:
        return tuple(numpy.load(paths[n], mmap_mode="r") for n in names)
    except (OSError, ValueError, EOFError) as exc:  # truncated, zeroed, half-copied
        _cache_damaged(cache_dir, key, f"{exc}")
        return None


def _cache_fits(cached, documents: numpy.ndarray, epochs: int, total: int) -> bool:
    """Whether cached sample indices can belong to this dataset: a document index over its
    documents, ``epochs`` times, and a shuffle of at most ``total`` samples."""
    doc_index, shuffle = cached
    if doc_index.ndim != 1 or shuffle.ndim != 1 or len(doc_index) != epochs * len(documents):
        return False
    if len(shuffle) and (shuffle.min() < 0 or shuffle.max() >= total):
        return False
    return bool(numpy.isin(numpy.unique(doc_index), documents).all())


def _cache_damaged(cache_dir: str, key: str, why: str) -> None:
    """Say once (rank 0) that a cache file is unusable; the caller builds the indices again and
    overwrites it, so nothing is lost."""
    import sys

    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        names = ", ".join(str(p) for p in _cache_paths(cache_dir, key,
                                                       ("document_index", "shuffle_index"))
                          .values())
        print(f"mfsdp train: --data-cache-path: {names} cannot be used ({why}); building the "
              "sample index again and replacing it", file=sys.stderr, flush=True)


def _cache_save(cache_dir: str | None, key: str, arrays: dict) -> None:
    if not cache_dir:
        return
    os.makedirs(cache_dir, exist_ok=True)
    for name, path in _cache_paths(cache_dir, key, arrays).items():
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
        numpy.save(tmp, arrays[name])
        os.replace(tmp, path)
