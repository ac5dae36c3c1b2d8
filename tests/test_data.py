"""Real data: Megatron indexed datasets, GPT samples in Megatron-LM's order, tokenizers,
``mfsdp preprocess`` and the trainer on indexed data.

The reference is megatron-core 0.19.2 itself: ``tests/fixtures/megatron_data/make_fixture.py``
wrote ``a``/``b`` (``.bin``/``.idx``) with megatron-core's ``IndexedDatasetBuilder`` and recorded
the samples its ``BlendedMegatronDatasetBuilder(GPTDataset, ...)`` draws for four cases.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy
import pytest

from mfsdp.data.gpt_dataset import build_gpt_datasets, parse_data_path
from mfsdp.data.indexed import IndexedDataset, IndexedDatasetBuilder

FIXTURES = Path(__file__).parent / "fixtures" / "megatron_data"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
ROOT = Path(__file__).resolve().parents[1]


def test_reads_the_files_megatron_core_wrote():
    for name, dtype in (("a", numpy.uint16), ("b", numpy.int32)):
        ds = IndexedDataset(FIXTURES / name)
        written = EXPECTED["written"][name]
        assert ds.dtype is dtype
        assert numpy.concatenate([ds[i] for i in range(len(ds))]).tolist() == \
            [t for doc in written for t in doc]
        # documents: one sequence each, except b's document 3 (two sequences)
        assert len(ds.document_indices) == len(written) + 1
        assert len(ds) == len(written) + (name == "b")
    b = IndexedDataset(FIXTURES / "b")
    assert b.document_indices[3:6].tolist() == [3, 5, 6]
    assert numpy.concatenate([b[3], b[4]]).tolist() == EXPECTED["written"]["b"][3]


def test_the_writer_is_byte_identical_to_megatron_core(tmp_path):
    for name, dtype in (("a", numpy.uint16), ("b", numpy.int32)):
        builder = IndexedDatasetBuilder(tmp_path / f"{name}.bin", dtype=dtype)
        for i, doc in enumerate(EXPECTED["written"][name]):
            lengths = [len(doc) // 2, len(doc) - len(doc) // 2] if (name, i) == ("b", 3) else None
            builder.add_document(doc, lengths)
        builder.finalize(tmp_path / f"{name}.idx")
        for ext in ("bin", "idx"):
            assert (tmp_path / f"{name}.{ext}").read_bytes() == \
                (FIXTURES / f"{name}.{ext}").read_bytes(), f"{name}.{ext}"
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize("case", sorted(EXPECTED["cases"]))
def test_samples_equal_megatron_core(case):
    c = EXPECTED["cases"][case]
    paths = [p if p.replace(".", "").isdigit() else str(FIXTURES / p) for p in c["data_path"]]
    got = build_gpt_datasets(paths, c["split"], c["sizes"], c["seq_length"], c["seed"])
    for split, ds in zip(("train", "valid", "test"), got):
        want = c["samples"][split]
        if want is None:
            assert ds is None
            continue
        assert len(ds) == len(want), split
        for i, w in enumerate(want):
            dataset_id, tokens = ds[i]
            assert (dataset_id, tokens.tolist()) == (w["dataset"], w["tokens"]), (split, i)


def test_the_index_cache_gives_the_same_samples(tmp_path):
    c = EXPECTED["cases"]["blend"]
    paths = [p if p.replace(".", "").isdigit() else str(FIXTURES / p) for p in c["data_path"]]
    args = (paths, c["split"], c["sizes"], c["seq_length"], c["seed"])
    first = build_gpt_datasets(*args, cache_dir=str(tmp_path))[0]
    files = sorted(os.listdir(tmp_path))
    assert files and all(f.endswith(".npy") for f in files)
    again = build_gpt_datasets(*args, cache_dir=str(tmp_path))[0]
    assert sorted(os.listdir(tmp_path)) == files
    assert all(first[i][1].tolist() == again[i][1].tolist() for i in range(len(first)))


def test_user_errors_name_the_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="without .bin/.idx"):
        IndexedDataset(str(FIXTURES / "a.bin"))
    with pytest.raises(FileNotFoundError, match="no .*missing.idx"):
        IndexedDataset(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="too few"):  # a split with no documents
        build_gpt_datasets([str(FIXTURES / "a")], "999,1,0", [10, 10, 0], 16, 1)
    (tmp_path / "t.idx").write_bytes(b"not an index at all, really")
    (tmp_path / "t.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a Megatron index"):
        IndexedDataset(str(tmp_path / "t"))
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])


def _hf_tokenizer(directory: Path) -> Path:
    """A word-level tokenizer trained on the bundled notes, saved like a hub tokenizer."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    corpus = (ROOT / "mfsdp" / "data" / "sample_corpus.txt").read_text().split("\n")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(corpus, tokenizers.trainers.WordLevelTrainer(
        special_tokens=["<unk>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>",
                            unk_token="<unk>").save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The bundled notes as JSONL, tokenized by ``mfsdp preprocess`` with two workers."""
    root = tmp_path_factory.mktemp("corpus")
    tok = _hf_tokenizer(root / "tok")
    lines = [x for x in (ROOT / "mfsdp" / "data" / "sample_corpus.txt").read_text().split("\n")
             if x.strip()]
    with open(root / "notes.jsonl", "w") as f:
        for line in lines:
            f.write(json.dumps({"text": line}) + "\n")
    out = subprocess.run(
        [sys.executable, "-m", "mfsdp.cli", "preprocess", "--input", str(root / "notes.jsonl"),
         "--output-prefix", str(root / "data" / "notes"), "--tokenizer-type",
         "HuggingFaceTokenizer", "--tokenizer-model", str(tok), "--append-eod", "--workers", "2"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "MB/s" in out.stderr
    return {"root": root, "tok": tok, "lines": lines, "prefix": str(root / "data" / "notes_text_document")}


def test_preprocess_writes_the_tokenized_documents(corpus):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(corpus["tok"])
    ds = IndexedDataset(corpus["prefix"])
    assert ds.dtype is numpy.uint16  # a vocabulary below 65,500
    assert len(ds) == len(corpus["lines"])
    for i in (0, 5, len(ds) - 1):
        assert ds[i].tolist() == tok(corpus["lines"][i]).input_ids + [tok.eos_token_id]


def test_preprocess_with_the_null_tokenizer(tmp_path):
    from mfsdp.data.preprocess import build_parser, preprocess

    (tmp_path / "ids.jsonl").write_text('{"text": "1 2 3"}\n{"text": ""}\n{"text": "70000 4"}\n')
    args = build_parser().parse_args(
        ["--input", str(tmp_path / "ids.jsonl"), "--output-prefix", str(tmp_path / "ids"),
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "100000", "--append-eod"])
    prefix = preprocess(args, log=lambda *a, **k: None)["text"]
    ds = IndexedDataset(prefix)
    assert ds.dtype is numpy.int32
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3, 99999], [70000, 4, 99999]]
    assert ds.document_indices.tolist() == [0, 1, 1, 2]  # the empty document has no sequence


def _train(argv: list[str]) -> list[dict]:
    from mfsdp.train import run_in_rank

    return run_in_rank(argv)


def _argv(corpus, *extra) -> list[str]:
    return ["--use-megatron-fsdp", "--data-path", corpus["prefix"], "--split", "90,10,0",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(corpus["tok"]),
            "--seq-length", "32", "--global-batch-size", "4", "--micro-batch-size", "2",
            "--eval-interval", "2", "--eval-iters", "2", "--log-interval", "100", *extra]


@pytest.mark.slow
@pytest.mark.extended  # `make test`'s 25-minute budget
def test_trainer_on_indexed_data_resumes_on_the_same_samples(corpus, tmp_path):
    from mfsdp.launch import launch

    whole = launch(_train, 2, args=(_argv(corpus, "--train-iters", "4"),))[0]
    assert [r["iteration"] for r in whole] == [1, 2, 3, 4]
    assert all("valid_loss" in r for r in whole if r["iteration"] % 2 == 0)
    assert whole[-1]["valid_loss"] < whole[1]["valid_loss"]
    # the tokens each iteration trained on are the samples Megatron's order gives
    train = build_gpt_datasets([corpus["prefix"]], "90,10,0", [16, 12, 8], 32, 1234)[0]
    assert whole[0]["tokens"] == sum(len(train[i][1]) for i in range(4))
    ckpt = str(tmp_path / "ckpt")
    # stopped at 2 of 4 iterations (the sample counts, so the order, depend on --train-iters)
    launch(_train, 2, args=(_argv(corpus, "--train-iters", "4", "--exit-interval", "2",
                                  "--save", ckpt),))
    resumed = launch(_train, 2, args=(_argv(corpus, "--train-iters", "4", "--load", ckpt),))[0]
    assert [r["iteration"] for r in resumed] == [3, 4]
    for a, b in zip(whole[2:], resumed):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert ("valid_loss" in b) == ("valid_loss" in a)
        if "valid_loss" in a:
            assert b["valid_loss"] == pytest.approx(a["valid_loss"], rel=1e-6)


def _train_counting_reads(argv: list[str]) -> dict:
    """This rank's training records and every sample it read from the dataset."""
    from mfsdp.data.batches import MegatronData
    from mfsdp.train import run_in_rank

    reads, original = [], MegatronData.sample

    def counted(self, split, i):
        reads.append(("train" if split is self.train else "valid", i))
        return original(self, split, i)

    MegatronData.sample = counted
    try:
        return {"records": run_in_rank(argv), "reads": reads}
    finally:
        MegatronData.sample = original


@pytest.mark.slow
@pytest.mark.extended  # (22 s; every TP trainer test of make test runs the same path)
def test_a_replica_reads_its_samples_once_whatever_its_tensor_parallel_size(corpus):
    """#29: at TP 2 x DP 2 each data-parallel replica's first TP rank reads its share of every
    global batch and sends it to its TP partner, which reads nothing (as Megatron-LM's TP rank 0
    reads and broadcasts); the two replicas read disjoint samples, every one of the global batch
    once, and the losses are the DP 2 run's (the vocabulary padded to the same 256: Megatron-LM
    pads to a multiple of 128 x TP)."""
    from mfsdp.launch import launch

    argv = _argv(corpus, "--train-iters", "2", "--model-preset", "llama-tiny")
    four = launch(_train_counting_reads, 4, args=(argv + ["--tensor-model-parallel-size", "2"],))
    reads = [r["reads"] for r in four]
    assert reads[1] == reads[3] == []  # the second TP rank of each replica
    train = [sorted(i for kind, i in r if kind == "train") for r in (reads[0], reads[2])]
    assert train == [[0, 1, 4, 5], [2, 3, 6, 7]]  # iteration 1: samples 0-3, iteration 2: 4-7
    assert sum(kind == "valid" for kind, _ in reads[0] + reads[2]) == 2 * 4  # eval: 2 x GBS
    two = launch(_train, 2, args=(argv + ["--make-vocab-size-divisible-by", "256"],))[0]
    assert [r["loss"] for r in four[0]["records"]] == pytest.approx(
        [r["loss"] for r in two], rel=1e-5)


def test_packing_cuts_indexed_samples_at_eod(corpus):
    from mfsdp.launch import launch

    recs = launch(_train, 1, args=(_argv(corpus, "--train-iters", "1", "--sequence-packing",
                                         "--eval-iters", "0"),))[0]
    from transformers import AutoTokenizer

    eod = AutoTokenizer.from_pretrained(corpus["tok"]).eos_token_id
    train = build_gpt_datasets([corpus["prefix"]], "90,10,0", [4, 0, 0], 32, 1234)[0]
    pieces = 0
    for i in range(4):
        t = train[i][1]
        cuts = numpy.split(t, numpy.flatnonzero(t == eod) + 1)
        pieces += sum(1 for c in cuts if len(c) > 1)
    n = sum(len(train[i][1]) for i in range(4))
    dropped = sum(1 for i in range(4) for c in numpy.split(train[i][1], numpy.flatnonzero(
        train[i][1] == eod) + 1) if len(c) == 1)
    assert recs[0]["tokens"] == n - dropped  # every document packed with its boundary
    assert recs[0]["tokens"] > 0 and pieces > 4


def test_trainer_refuses_what_it_cannot_read(corpus, tmp_path):
    def err(*argv):
        out = subprocess.run([sys.executable, "-m", "mfsdp.cli", "train", *argv,
                              "--train-iters", "1"], capture_output=True, text=True, timeout=300)
        assert out.returncode == 2, out.stderr
        return out.stderr

    assert "pass --data-path " + corpus["prefix"] in err("--data-path", corpus["prefix"] + ".bin")
    assert "neither" in err("--data-path", str(tmp_path / "nothing"))
    assert "beyond the model's vocabulary" in err(  # ids of a 1,000-word vocabulary, model of 256
        "--data-path", corpus["prefix"], "--vocab-size", "64", "--split", "1,0,0")
