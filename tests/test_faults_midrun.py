"""Mid-run faults under ``torchrun`` on 2 gloo ranks, injected for real: one line, printed once,
naming the rank or file and the fix, and no traceback of any rank (torchrun's own summary of
the failed workers is torchrun's)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
BASE = ["--use-megatron-fsdp", "--global-batch-size", "4", "--micro-batch-size", "1",
        "--log-interval", "1"]


def _start(args: list[str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "-m", "mfsdp.train", *BASE, *args]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)


def _rank_pid(job: subprocess.Popen, rank: int) -> int:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(job.pid)], capture_output=True,
                         text=True).stdout
    for pid in (int(x) for x in out.split()):
        env = Path(f"/proc/{pid}/environ").read_bytes()
        if f"\0RANK={rank}\0".encode() in b"\0" + env:
            return pid
    raise AssertionError(f"rank {rank} not found among torchrun's children")


def _worker_tracebacks(out: str) -> int:
    """Tracebacks other than torchrun's own ChildFailedError summary."""
    return out.count("Traceback (most recent call last)") - out.count("ChildFailedError:")


def test_kill_9_of_a_rank_is_one_line_naming_it(tmp_path):
    """SIGKILL to rank 1 after iteration 3: rank 0's collective fails, or torchrun's SIGTERM
    reaches it first; either way the one line names rank 1, its pid and where it last posted
    (the progress board), and says the checkpoints are complete; rank 0 prints no traceback."""
    log = tmp_path / "job.log"
    job = _start(["--train-iters", "100000", "--save", str(tmp_path / "ckpt"),
                  "--save-interval", "2"], log)
    try:
        deadline = time.monotonic() + 180
        while "iteration     3/" not in log.read_text():
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        victim = _rank_pid(job, 1)
        os.kill(victim, signal.SIGKILL)
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    out = log.read_text()
    said = [line for line in out.splitlines() if line.startswith("mfsdp train") and
            "stopped" in line]
    assert job.returncode != 0
    assert len(said) == 1, out[-4000:]
    assert re.match(rf"mfsdp train: rank 1 \(pid {victim} on {os.uname().nodename}, last "
                    r"posted at '[^']+'\) stopped", said[0]), said[0]
    assert said[0].endswith("stopped (killed, out of memory, or its node failed), so the other "
                            "ranks stop too; the checkpoints in --save are complete: resume "
                            "from the latest (torchrun --max-restarts restarts the ranks by "
                            "itself)"), said[0]
    assert _worker_tracebacks(out) == 0, out[-4000:]
    latest = (tmp_path / "ckpt" / "latest").read_text().strip()
    assert (tmp_path / "ckpt" / latest / "manifest.json").exists()


# ---- files named in one line (one process, fast) ---------------------------------------------

def _dataset(tmp_path: Path) -> Path:
    import numpy

    from mfsdp.data.indexed import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(tmp_path / "d.bin", dtype=numpy.uint16)
    for i in range(6):
        builder.add_document(list(range(1, 5 + i)))
    builder.finalize(tmp_path / "d.idx")
    return tmp_path / "d"


@pytest.mark.parametrize("damage, words", [
    ("count", "its header counts 1000006 sequences and 7 document boundaries, which take "),
    ("truncated", "less than a Megatron index's 34-byte header"),
    ("pointer", "sequence 0 starts at byte 8, not 0"),
    ("documents", "its document boundaries run from 0 to 5, not from 0 to its 6 sequences"),
], ids=["sequence-count", "truncated-header", "first-pointer", "document-boundaries"])
def test_a_damaged_idx_is_named(tmp_path, damage, words):
    """An .idx whose sequence count (bytes 18-25) is off, cut inside its header, whose first
    pointer or last document boundary is wrong: the message names the .idx and the fix, and
    the trainer's data reader turns it into its one line (a user error)."""
    import struct

    from mfsdp.data.indexed import IndexedDataset

    prefix = _dataset(tmp_path)
    idx = Path(f"{prefix}.idx")
    raw = bytearray(idx.read_bytes())
    count = struct.unpack_from("<Q", raw, 18)[0]
    if damage == "count":
        struct.pack_into("<Q", raw, 18, count + 1000000)
    elif damage == "truncated":
        raw = raw[:20]
    elif damage == "pointer":
        struct.pack_into("<q", raw, 34 + 4 * count, 8)
    else:
        struct.pack_into("<q", raw, len(raw) - 8, count - 1)
    idx.write_bytes(bytes(raw))
    with pytest.raises(ValueError) as err:
        IndexedDataset(prefix)
    assert str(err.value).startswith(f"{idx}"), str(err.value)
    assert words in str(err.value) and "mfsdp preprocess" in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("text, words", [
    ('{"metadata": {"total_size": 1}}', "has no 'weight_map'"),
    ('{"weight_map": ', "is not JSON (Expecting value at line 1 column 16)"),
    ('{"weight_map": {}}', "has an empty or malformed 'weight_map'"),
    ('{"weight_map": {"a": "../x.safetensors"}}', "maps 'a' to '../x.safetensors'"),
    ("\udcff", "is not JSON text"),
], ids=["no-weight-map", "cut-short", "empty-map", "path-outside", "not-utf8"])
def test_a_damaged_hugging_face_index_is_named(tmp_path, text, words):
    """model.safetensors.index.json without weight_map, cut short, empty, pointing outside the
    directory, or not text: one line naming the index, through mfsdp convert too."""
    from mfsdp.checkpoint.safetensors import SafetensorsReader

    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ValueError) as err:
        SafetensorsReader(tmp_path)
    assert str(err.value).startswith(f"{index}"), str(err.value)
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.extended  # (transformers' import and save: the reader's message is tested above)
def test_convert_names_a_damaged_index_in_one_line(tmp_path, capsys):
    """mfsdp convert --from hf of a transformers checkpoint whose index lost its weight_map:
    status 2, one line naming the index, nothing written."""
    import transformers

    from mfsdp.cli import main

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2)
    model_dir = tmp_path / "hf"
    transformers.LlamaForCausalLM(cfg).save_pretrained(model_dir, max_shard_size="20KB")
    index = model_dir / "model.safetensors.index.json"
    assert index.exists()
    index.write_text('{"metadata": {}}')
    capsys.readouterr()  # (transformers' own progress bars)
    code = main(["convert", "--from", "hf", "--to", "fsdp_dtensor", str(model_dir),
                 str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"mfsdp convert: error: {index} has no 'weight_map'"), err
    assert not (tmp_path / "out").exists()


def test_plan_searches_show_a_progress_bar():
    """smallest_world / smallest_layout with a stream: a tqdm bar of the node counts tried,
    with the same answer as without."""
    import io

    from mfsdp.tools.plan import PRESETS, Layout, smallest_layout, smallest_world

    layout = Layout(8, seq_length=8192)
    buf = io.StringIO()
    best = smallest_layout(PRESETS["llama3-70b"], layout, progress=buf)
    assert best == smallest_layout(PRESETS["llama3-70b"], layout)  # the bar changes nothing
    assert best.tp * best.cp > 1  # 70B at 8K tokens needs TP or CP (docs/layouts.md)
    assert "smallest layout with TP/CP" in buf.getvalue() and "/4096" in buf.getvalue()
    buf = io.StringIO()
    assert smallest_world(PRESETS["llama3-8b"], layout, progress=buf) == \
        smallest_world(PRESETS["llama3-8b"], layout)
    assert "smallest world" in buf.getvalue()
