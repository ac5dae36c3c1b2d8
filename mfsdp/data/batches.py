"""The trainer's data path: Megatron indexed datasets (or the bundled text, or mock data) read
once, and the global batch of an iteration split over the data-parallel ranks (``global_batch``).

The functions take the trainer's typed groups (``data``: a
:class:`~mfsdp.trainer.config.DataConfig`, ``training``: a
:class:`~mfsdp.trainer.config.TrainingConfig`), or anything with their fields: this package sits
below the trainer and does not import it."""

from __future__ import annotations

from pathlib import Path

import torch


DATA_FILE = Path(__file__).parent / "sample_corpus.txt"  # the bundled text (--data-path bundled)


class MegatronData:
    """Train/valid/test samples of Megatron indexed datasets and the tokenizer's EOD id."""

    def __init__(self, splits, eod: int | None):
        self.train, self.valid, self.test = splits
        self.eod = eod

    def sample(self, split, i: int) -> torch.Tensor:
        """Sample ``i`` (``seq_length + 1`` tokens) of ``split``."""
        return torch.from_numpy(split[i][1])


def tokenizer_of(data, vocab_size: int | None = None):
    """The tokenizer ``data.tokenizer_type`` names (None: bytes), for its EOD token
    (``vocab_size``: ``--vocab-size``, which the NullTokenizer needs)."""
    if not data.tokenizer_type:
        return None
    from mfsdp.data.tokenizers import build_tokenizer

    try:
        return build_tokenizer(data.tokenizer_type, data.tokenizer_model, vocab_size)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"mfsdp train: {e}") from None


def read_data(data, training, vocab_size: int | None = None
              ) -> "torch.Tensor | MegatronData | None":
    """None (mock data: ``--mock-data``, or no ``--data-path``), a byte tensor (one text file),
    or :class:`MegatronData` (its samples sized by the ``training`` group's batch, iterations
    and sequence length)."""
    from mfsdp.data.indexed import MAGIC, is_indexed_prefix

    paths = data.data_path
    if data.mock_data or not paths:  # (--mock-data with --data-path is refused at start)
        return None
    if len(paths) == 1 and not is_indexed_prefix(paths[0]):
        path = paths[0]
        if path.endswith((".bin", ".idx")) and is_indexed_prefix(path[:-4]):
            raise SystemExit(f"--data-path {path}: a Megatron dataset is named by its prefix; "
                             f"pass --data-path {path[:-4]}")
        file = DATA_FILE if path == "bundled" else Path(path)
        half = half_pair(path)
        if half:
            raise SystemExit(f"--data-path {path}: {half}")
        if not file.is_file():
            raise SystemExit(f"--data-path {path}: neither {path}.bin/.idx (a Megatron indexed "
                             "dataset) nor a text file exists")
        raw = file.read_bytes()
        if raw.startswith(MAGIC):
            raise SystemExit(f"--data-path {path} is a Megatron index without its .bin; pass the "
                             "prefix of a complete .bin/.idx pair")
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    from mfsdp.data.gpt_dataset import build_gpt_datasets

    gbs, iters = training.global_batch_size, training.train_iters
    sizes = [iters * gbs, (iters // data.eval_interval + 1) * data.eval_iters * gbs,
             data.eval_iters * gbs]
    try:
        splits = build_gpt_datasets(paths, data.split, sizes, training.seq_length, training.seed,
                                    data.data_cache_path)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"mfsdp train: {e}") from None
    if splits[0] is None:
        raise SystemExit(f"--split {data.split} leaves no training documents")
    if vocab_size:
        from mfsdp.data.indexed import first_tokens_range

        for prefix in dict.fromkeys(p for p in paths if is_indexed_prefix(p)):
            _check_vocabulary(prefix, first_tokens_range(prefix), vocab_size)
    tok = tokenizer_of(data, vocab_size)
    if data.sequence_packing and tok is None:
        raise SystemExit("--sequence-packing with indexed datasets cuts samples at EOD tokens: "
                         "name the tokenizer (--tokenizer-type) so its EOD id is known")
    return MegatronData(splits, tok.eod if tok is not None else None)


def _check_vocabulary(prefix: str, found: tuple[int, int, int], vocab_size: int) -> None:
    """At start-up: stop (every rank, one line) when the first tokens of ``prefix.bin`` already
    hold an id beyond the vocabulary, the sign of data tokenized with another tokenizer than
    this run's, instead of failing at the first such sample hours later."""
    low, high, n = found
    if n and high >= vocab_size:
        raise SystemExit(f"mfsdp train: --data-path {prefix}.bin holds token id {high} among its "
                         f"first {n} tokens, beyond the model's vocabulary of {vocab_size}: it "
                         "was tokenized with a larger vocabulary than this run's; pass the "
                         "tokenizer it was written with (--tokenizer-model, --vocab-size), or "
                         "write it again with mfsdp preprocess and this run's tokenizer")


def _check_token_ids(seqs, rows, base: int, iteration: int, vocab_size: int) -> None:
    """Stop (this rank, which names what it read; the others stay quiet) at a token id the
    embedding cannot look up: negative, or beyond the vocabulary."""
    for j, t in zip(rows, seqs):
        low, high = int(t.min()), int(t.max())
        if low >= 0 and high < vocab_size:
            continue
        import torch.distributed as dist

        where = (f"training sample {base + j} (iteration {iteration}"
                 + (f", read by rank {dist.get_rank()}" if dist.is_initialized() else "") + ")")
        if low < 0:
            raise SystemExit(f"mfsdp train: --data-path: {where} holds token id {low}; token ids "
                             "are at least 0: the .bin is damaged or was written with another "
                             "dtype than its .idx says; rewrite it with mfsdp preprocess")
        raise SystemExit(f"mfsdp train: --data-path: {where} holds token id {high}, beyond the "
                         f"model's vocabulary of {vocab_size}: pass --tokenizer-type/"
                         "--tokenizer-model (or a larger --vocab-size)")


def documents(sample: torch.Tensor, eod: int) -> list[torch.Tensor]:
    """Cut a sample after each EOD token into its documents (pieces of one token are dropped:
    they predict nothing)."""
    ends = (sample == eod).nonzero().flatten() + 1
    pieces = torch.tensor_split(sample, ends.tolist())
    return [p for p in pieces if len(p) > 1]


def global_batch(training, iteration: int, vocab_size: int,
                 data: torch.Tensor | MegatronData | None = None, rows: range | None = None, *,
                 packing: bool = False) -> list[torch.Tensor]:
    """The ``--global-batch-size`` sequences of ``iteration`` (1-based): a function of the seed only
    (``training``: the batch size, seed and sequence length; ``packing``: ``--sequence-packing``).

    Mock sequences are arithmetic progressions modulo the vocabulary (learnable from two tokens of
    context); with ``--sequence-packing`` lengths vary between a quarter of and the full
    ``--seq-length``. ``rows``: only those sequences of the batch (an indexed dataset reads only
    them; generated ones are drawn in order and sliced, so they are the same either way).
    """
    if isinstance(data, MegatronData):  # Megatron-LM's order: consumed samples = (iteration-1) x GBS
        base = (iteration - 1) * training.global_batch_size
        wanted = range(training.global_batch_size) if rows is None else rows
        seqs = [data.sample(data.train, base + j) for j in wanted]
        _check_token_ids(seqs, wanted, base, iteration, vocab_size)
        if packing:
            return [documents(t, data.eod) for t in seqs]
        return seqs
    g = torch.Generator().manual_seed(training.seed * 1_000_003 + iteration)
    vocab, S = vocab_size, training.seq_length
    seqs = []
    for _ in range(training.global_batch_size):
        n = int(torch.randint(max(2, S // 4), S + 1, (1,), generator=g)) if packing else S
        if data is None:
            start = int(torch.randint(vocab, (1,), generator=g))
            step = int(torch.randint(1, 8, (1,), generator=g))
            seqs.append((start + step * torch.arange(n)) % vocab)
        else:
            if len(data) <= n:
                raise SystemExit(f"--data-path holds {len(data)} bytes; --seq-length {n} needs more")
            off = int(torch.randint(len(data) - n, (1,), generator=g))
            seqs.append(data[off:off + n].clone())
    return seqs if rows is None else seqs[rows.start:rows.stop]


def half_pair(prefix: str) -> str:
    """What is wrong when ``prefix`` names half of a Megatron indexed dataset (its ``.bin``
    without its ``.idx``, or the reverse); '' otherwise."""
    import os

    there = [s for s in (".bin", ".idx") if os.path.isfile(prefix + s)]
    if len(there) != 1:
        return ""
    missing = ".idx" if there[0] == ".bin" else ".bin"
    return (f"{prefix}{there[0]} exists but {prefix}{missing} does not (a Megatron indexed "
            f"dataset is a .bin/.idx pair); put the {missing} beside it, or write both again "
            "with mfsdp preprocess")


def is_indexed_prefix(path: str) -> bool:
    """Whether ``path`` is the prefix of a Megatron indexed dataset (``path.bin`` and ``path.idx``)."""
    from mfsdp.data.indexed import is_indexed_prefix

    return is_indexed_prefix(path)
