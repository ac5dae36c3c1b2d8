"""Megatron's indexed dataset format: a ``.bin`` of token ids and an ``.idx`` that indexes it.

Byte-compatible with what megatron-core's ``IndexedDatasetBuilder`` writes and its
``IndexedDataset`` reads (``tools/preprocess_data.py`` output), checked against files written by
megatron-core 0.19 (``tests/fixtures/megatron_data``).

The ``.idx`` layout, little-endian::

    b"MMIDIDX\\x00\\x00"            9 bytes, magic
    version                      uint64, 1
    dtype code                   uint8: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                                        6 float64, 7 float32, 8 uint16
    sequence count S             uint64
    document count D             uint64 (document boundaries, one more than documents)
    sequence lengths             int32[S]   tokens per sequence
    sequence pointers            int64[S]   byte offset of each sequence in the .bin
    document indices             int64[D]   0, then the sequence count after each document

The ``.bin`` holds the sequences' tokens back to back in that dtype. A GPT dataset treats each
sequence as a document (``preprocess_data.py`` writes one sequence per document unless it splits
sentences).

>>> import tempfile, os, numpy
>>> d = tempfile.mkdtemp()
>>> b = IndexedDatasetBuilder(os.path.join(d, "x.bin"), dtype=numpy.uint16)
>>> b.add_document([5, 6, 7, 0]); b.add_document([8, 0])
>>> b.finalize(os.path.join(d, "x.idx"))
>>> ds = IndexedDataset(os.path.join(d, "x"))
>>> len(ds), ds[1].tolist(), ds.get(0, offset=1, length=2).tolist(), ds.dtype.__name__
(2, [8, 0], [6, 7], 'uint16')
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy

__all__ = ["DTYPE_CODES", "IndexedDataset", "IndexedDatasetBuilder", "first_tokens_range",
           "is_indexed_prefix", "optimal_dtype"]

MAGIC = b"MMIDIDX\x00\x00"
DTYPE_CODES = {1: numpy.uint8, 2: numpy.int8, 3: numpy.int16, 4: numpy.int32, 5: numpy.int64,
               6: numpy.float64, 7: numpy.float32, 8: numpy.uint16}
_CODE_OF = {numpy.dtype(t): c for c, t in DTYPE_CODES.items()}
_HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8


def optimal_dtype(vocab_size: int | None):
    """The token dtype Megatron picks for a vocabulary: uint16 below 65,500 ids, else int32."""
    return numpy.uint16 if vocab_size is not None and vocab_size < 65500 else numpy.int32


def is_indexed_prefix(prefix: str | os.PathLike) -> bool:
    """Whether ``prefix.idx`` and ``prefix.bin`` both exist."""
    p = str(prefix)
    return os.path.isfile(p + ".idx") and os.path.isfile(p + ".bin")


def _check_prefix(prefix: str) -> None:
    if prefix.endswith((".bin", ".idx")) and is_indexed_prefix(prefix[:-4]):
        raise FileNotFoundError(f"{prefix}: pass the prefix without .bin/.idx: {prefix[:-4]}")
    missing = [p for p in (prefix + ".idx", prefix + ".bin") if not os.path.isfile(p)]
    if len(missing) == 1:
        there = prefix + (".bin" if missing[0].endswith(".idx") else ".idx")
        raise FileNotFoundError(f"indexed dataset {prefix!r}: {there} exists but {missing[0]} "
                                "does not (a Megatron dataset is a .bin/.idx pair); put it "
                                "beside the other, or write both again with `mfsdp preprocess`")
    if missing:
        raise FileNotFoundError(f"indexed dataset {prefix!r}: no {' and no '.join(missing)} "
                                "(a Megatron dataset is a .bin/.idx pair named by its prefix; "
                                "`mfsdp preprocess` writes one from JSONL)")


def _check_index_size(idx: str, nbytes: int, count: int, docs: int) -> None:
    """Refuse an ``.idx`` whose sequence or document count does not match its size (a damaged
    header or a truncated file), naming the ``.idx``."""
    expected = _HEADER_BYTES + 12 * count + 8 * docs
    if nbytes != expected:
        raise ValueError(f"{idx}: its header counts {count} sequences and {docs} document "
                         f"boundaries, which take {expected} bytes, but the file holds {nbytes} "
                         "(a damaged header or a truncated copy); write the .bin/.idx pair "
                         "again with mfsdp preprocess or copy it again")


def _check_index_arrays(idx: str, lengths, pointers, documents, itemsize: int) -> None:
    """Refuse an ``.idx`` whose arrays contradict each other, naming it: a negative length, a
    first or last pointer that is not where the lengths put it, document boundaries that do
    not run from 0 to the sequence count (checks that read each array once and allocate
    nothing: an index of a large corpus holds hundreds of millions of sequences)."""
    why = ""
    n = lengths.size
    if n and int(lengths.min()) < 0:
        why = f"sequence {int(numpy.argmin(lengths))} has a negative length"
    elif n and int(pointers[0]) != 0:
        why = f"sequence 0 starts at byte {int(pointers[0])}, not 0"
    elif n and (int(pointers[-1]) + int(lengths[-1]) * itemsize
                != int(lengths.sum(dtype=numpy.int64)) * itemsize):
        why = (f"the last sequence starts at byte {int(pointers[-1])}, not where the lengths "
               "before it end")
    elif documents.size and (int(documents[0]) != 0 or int(documents[-1]) != n):
        why = (f"its document boundaries run from {int(documents[0])} to "
               f"{int(documents[-1])}, not from 0 to its {n} sequences")
    if why:
        raise ValueError(f"{idx}: {why} (a damaged index); write the .bin/.idx pair again with "
                         "mfsdp preprocess or copy it again")


def first_tokens_range(prefix: str | os.PathLike, max_tokens: int = 1 << 22
                       ) -> tuple[int, int, int]:
    """``(smallest, largest, count)`` of the first ``max_tokens`` token ids of ``prefix.bin``
    (its dtype from the ``.idx`` header): a cheap look at what tokenizer wrote it, reading a
    few MiB whatever the corpus' size. ``(0, 0, 0)`` for an empty or unreadable pair."""
    prefix = str(prefix)
    try:
        with open(prefix + ".idx", "rb") as f:
            head = f.read(_HEADER_BYTES)
        if len(head) < _HEADER_BYTES or head[:len(MAGIC)] != MAGIC:
            return (0, 0, 0)
        dtype = DTYPE_CODES.get(head[len(MAGIC) + 8])
        size = os.path.getsize(prefix + ".bin") // numpy.dtype(dtype).itemsize if dtype else 0
        if not size:
            return (0, 0, 0)
        tokens = numpy.memmap(prefix + ".bin", dtype=dtype, mode="r",
                              shape=(min(size, max_tokens),))
        return (int(tokens.min()), int(tokens.max()), int(tokens.size))
    except OSError:
        return (0, 0, 0)


class IndexedDataset:
    """A memory-mapped Megatron indexed dataset (``prefix.bin`` + ``prefix.idx``), read-only.

    ``ds[i]`` is sequence ``i`` as a NumPy array (a view of the mapped file), ``ds.get(i, offset,
    length)`` a slice of it; ``sequence_lengths``, ``sequence_pointers`` and
    ``document_indices`` are the index arrays.
    """

    def __init__(self, prefix: str | os.PathLike):
        prefix = str(prefix)
        _check_prefix(prefix)
        self.prefix = prefix
        idx = prefix + ".idx"
        raw = Path(idx).read_bytes()
        if raw[:len(MAGIC)] != MAGIC:
            raise ValueError(f"{prefix}.idx is not a Megatron index (header {raw[:9]!r}, expected "
                             f"{MAGIC!r})")
        if len(raw) < _HEADER_BYTES:
            raise ValueError(f"{idx} holds {len(raw)} bytes, less than a Megatron index's "
                             f"{_HEADER_BYTES}-byte header (a truncated copy); write it again "
                             "with mfsdp preprocess or copy it again")
        version, = struct.unpack_from("<Q", raw, len(MAGIC))
        if version != 1:
            raise ValueError(f"{prefix}.idx: index version {version}; only version 1 exists")
        code, = struct.unpack_from("<B", raw, len(MAGIC) + 8)
        if code not in DTYPE_CODES:
            raise ValueError(f"{prefix}.idx: unknown dtype code {code}")
        self.dtype = DTYPE_CODES[code]
        count, docs = struct.unpack_from("<QQ", raw, len(MAGIC) + 9)
        _check_index_size(idx, len(raw), count, docs)
        offset = _HEADER_BYTES
        self.sequence_lengths = numpy.frombuffer(raw, numpy.int32, count, offset)
        offset += 4 * count
        self.sequence_pointers = numpy.frombuffer(raw, numpy.int64, count, offset)
        offset += 8 * count
        self.document_indices = numpy.frombuffer(raw, numpy.int64, docs, offset)
        _check_index_arrays(idx, self.sequence_lengths, self.sequence_pointers,
                            self.document_indices, numpy.dtype(self.dtype).itemsize)
        size = os.path.getsize(prefix + ".bin")
        itemsize = numpy.dtype(self.dtype).itemsize
        expected = int(self.sequence_lengths.sum(dtype=numpy.int64)) * itemsize
        if size != expected:
            raise ValueError(f"{prefix}.bin holds {size} bytes but its index describes {expected} "
                             "(a truncated or mismatched pair)")
        self._bin = (numpy.memmap(prefix + ".bin", dtype=self.dtype, mode="r") if size
                     else numpy.zeros(0, self.dtype))

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> numpy.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> numpy.ndarray:
        """Tokens ``offset : offset + length`` of sequence ``i`` (to its end without ``length``)."""
        n = int(self.sequence_lengths[i])
        if length is None:
            length = n - offset
        start = int(self.sequence_pointers[i]) // numpy.dtype(self.dtype).itemsize + offset
        return self._bin[start:start + length]

    @property
    def num_tokens(self) -> int:
        """Tokens in the whole file."""
        return int(self.sequence_lengths.sum(dtype=numpy.int64))


class IndexedDatasetBuilder:
    """Write a Megatron indexed dataset: ``add_document`` per document, then ``finalize``.

    The ``.bin`` is written to a temporary name and both files appear only when ``finalize``
    succeeds, so an interrupted run leaves no half-written dataset behind.
    """

    def __init__(self, bin_path: str | os.PathLike, dtype=numpy.int32):
        self.bin_path = str(bin_path)
        self.dtype = numpy.dtype(dtype).type
        if numpy.dtype(self.dtype) not in _CODE_OF:
            raise ValueError(f"dtype {dtype} has no Megatron code; use one of "
                             f"{sorted(t.__name__ for t in DTYPE_CODES.values())}")
        self._tmp = self.bin_path + ".partial"
        self._file = open(self._tmp, "wb")
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]

    def add_item(self, tokens) -> None:
        """Append one sequence (not closing a document)."""
        arr = numpy.asarray(tokens, dtype=self.dtype)
        self._file.write(arr.tobytes(order="C"))
        self.sequence_lengths.append(int(arr.size))

    def add_document(self, tokens, lengths: list[int] | None = None) -> None:
        """Append a document: its tokens, split into sequences of ``lengths`` (one by default)."""
        arr = numpy.asarray(tokens, dtype=self.dtype)
        lengths = [int(arr.size)] if lengths is None else [int(n) for n in lengths]
        if sum(lengths) != arr.size:
            raise ValueError(f"lengths {lengths} do not add up to the document's {arr.size} tokens")
        self._file.write(arr.tobytes(order="C"))
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def end_document(self) -> None:
        """Close the document made of the sequences added since the last one."""
        self.document_indices.append(len(self.sequence_lengths))

    def finalize(self, idx_path: str | os.PathLike) -> None:
        """Write the index and move both files into place."""
        self._file.close()
        itemsize = numpy.dtype(self.dtype).itemsize
        lengths = numpy.asarray(self.sequence_lengths, dtype=numpy.int32)
        pointers = numpy.zeros(len(lengths), dtype=numpy.int64)
        if len(lengths) > 1:
            pointers[1:] = numpy.cumsum(lengths[:-1], dtype=numpy.int64) * itemsize
        tmp_idx = str(idx_path) + ".partial"
        with open(tmp_idx, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", 1))
            f.write(struct.pack("<B", _CODE_OF[numpy.dtype(self.dtype)]))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(self.document_indices)))
            f.write(lengths.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(numpy.asarray(self.document_indices, dtype=numpy.int64).tobytes(order="C"))
        os.replace(self._tmp, self.bin_path)
        os.replace(tmp_idx, str(idx_path))

    def abort(self) -> None:
        """Drop what was written (the temporary ``.bin``)."""
        self._file.close()
        if os.path.exists(self._tmp):
            os.remove(self._tmp)
