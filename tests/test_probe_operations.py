"""Faults and bad inputs from the operations of a real cluster (the round-3 probe): a network
file system slow to show a manifest, a save directory that refuses the lock at start-up, a
requeued job given an old --load over a newer --save, records and markers that cannot be
written after a complete save, a planner search that can never succeed, and a SIGTERM to ranks
that do not save on it. Each is handled (nothing lost) and says so in one line.
"""

from __future__ import annotations

import errno
import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from mfsdp.checkpoint import manifest
from mfsdp.checkpoint.manifest import CheckpointError, resolve_checkpoint
from mfsdp.trainer.checkpointing import check_save_not_newer, latest_iteration
from mfsdp.trainer.guard import SaveLock
from mfsdp.trainer.preemption import MARKER_ENV, SAVE_TIME_FILE, SaveBudget, write_marker


def test_nfs_slow_to_show_the_manifest_is_waited_for(tmp_path, monkeypatch):
    """``latest`` and its directory are visible but manifest.json is not yet (an NFS client's
    cached listing): the load waits for it instead of failing; a directory that never shows
    one fails in one line saying how long it waited."""
    monkeypatch.setattr(manifest, "NFS_SETTLE_S", 1.5)
    (tmp_path / "iter_0000004").mkdir()
    (tmp_path / "latest").write_text("iter_0000004\n")
    timer = threading.Timer(0.3, (tmp_path / "iter_0000004" / "manifest.json").write_text,
                            args=("{}",))
    timer.start()
    try:
        assert resolve_checkpoint(tmp_path) == tmp_path / "iter_0000004"
    finally:
        timer.cancel()
    (tmp_path / "iter_0000004" / "manifest.json").unlink()
    start = time.monotonic()
    with pytest.raises(CheckpointError) as err:
        resolve_checkpoint(tmp_path)
    assert 1.4 < time.monotonic() - start < 10
    assert str(err.value) == (f"{tmp_path}/latest names 'iter_0000004', which has no "
                              "manifest.json (incomplete or deleted checkpoint); waited 1.5 s for "
                              "a network file system to show it")


@pytest.mark.parametrize("code, fix", [
    (errno.ENOSPC, "free space there"), (errno.EROFS, "make the file system writable again"),
    (errno.EDQUOT, "free space within your quota")], ids=["full", "read-only", "quota"])
def test_a_save_directory_that_refuses_the_lock_stops_before_training(tmp_path, monkeypatch,
                                                                      code, fix):
    """The file system refuses the lock file at start-up: one line naming the path, the fix,
    and that nothing was trained (no run trains for hours and then cannot save)."""
    real = Path.write_text

    def refuse(self, *a, **k):
        if self.name.startswith(".lock-"):
            raise OSError(code, os.strerror(code), str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", refuse)
    with pytest.raises(SystemExit) as stop:
        SaveLock(tmp_path / "ckpt").acquire()
    text = str(stop.value.code)
    assert text.startswith(f"mfsdp train: --save {tmp_path}/ckpt: cannot take its lock before "
                           f"training: {os.strerror(code)[:1].lower()}"), text
    assert text.endswith(f"; {fix} or choose another --save (nothing was trained, nothing is "
                         "lost)"), text


def _ckpt_config(save, load):
    return SimpleNamespace(save=str(save) if save else "", load=str(load) if load else "")


def test_an_old_load_over_a_newer_save_is_refused(tmp_path):
    """A requeued job started with the original --load (iteration 0, or an older run) while its
    --save already holds iteration 500: refused in one line before any step, instead of
    overwriting iteration 500's history; the same directory (also through a symlink), an
    empty --save, or an older --save are fine; Megatron-LM's tracker is read too."""
    save, load = tmp_path / "run", tmp_path / "pretrained"
    save.mkdir()
    load.mkdir()
    check_save_not_newer(_ckpt_config(save, load), 0)  # empty --save: a fresh fine-tune
    (save / "latest").write_text("iter_0000500\n")
    with pytest.raises(SystemExit) as stop:
        check_save_not_newer(_ckpt_config(save, load), 0)
    assert stop.value.code == (
        f"mfsdp train: --save {save} already holds iteration 500, newer than iteration 0 "
        f"resumed from --load {load}: training on would replace its checkpoints with another "
        f"history. Resume from it (--load {save}), or choose a new --save")
    check_save_not_newer(_ckpt_config(save, load), 500)
    (tmp_path / "link").symlink_to(save)
    check_save_not_newer(_ckpt_config(save, tmp_path / "link"), 0)
    (save / "latest").unlink()
    (save / "latest_checkpointed_iteration.txt").write_text("700")
    assert latest_iteration(save) == 700
    with pytest.raises(SystemExit, match="already holds iteration 700, newer than iteration 600"):
        check_save_not_newer(_ckpt_config(save, load), 600)


def test_save_records_that_cannot_be_read_or_written_lose_nothing(tmp_path, monkeypatch,
                                                                   capsys):
    """save_time.json damaged (a half-written copy): ignored, no line; the record or the
    preemption marker unwritable after a complete save: the save stands, the marker's failure
    is one note naming the path, and nothing raises."""
    (tmp_path / SAVE_TIME_FILE).write_text('{"seconds": ')
    lines: list[str] = []
    budget = SaveBudget(str(tmp_path), lambda s, **k: lines.append(s),
                        env={"MFSDP_PREEMPTION_GRACE_S": "10"})
    assert budget.recorded() is None
    budget.at_start()
    assert lines == []
    real = Path.write_text

    def read_only(self, *a, **k):
        if self.name.startswith(".latest-save-time") or self.name == "marker":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", read_only)
    budget.after_save(3, 1.0)
    assert not list(tmp_path.glob(".latest-save-time*"))
    write_marker(3, "ck", env={MARKER_ENV: str(tmp_path / "marker")})
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"mfsdp train: note: saved iteration 3 on SIGTERM, but {MARKER_ENV}="
                   f"{tmp_path}/marker cannot be written (Read-only file system): the job "
                   "script sees only the launcher's exit status"]


def test_a_planner_search_that_can_never_fit_ends_at_once():
    """DeepSeek-V3 on 40 GiB devices: no TP/CP size makes the gathered weights and activations
    fit, so no number of nodes can; the search says so after the first node counts instead of
    trying all 4096 (about 9 hours before)."""
    from mfsdp.tools.plan import PRESETS, Layout, smallest_layout

    buf = io.StringIO()
    start = time.monotonic()
    assert smallest_layout(PRESETS["deepseek-v3"], Layout(8, seq_length=4096),
                           device_gib=40.0, progress=buf) is None
    assert time.monotonic() - start < 20
    assert "smallest layout with TP/CP" in buf.getvalue()


@pytest.mark.slow
@pytest.mark.extended
def test_sigterm_to_ranks_without_a_handler_is_one_line(tmp_path):
    """SIGTERM to the whole job without --exit-signal-handler (a preemption the job did not
    ask to save on): the ranks stop with one line between them, saying nothing was saved and
    how to save next time; no traceback; status 143 from the ranks."""
    log = tmp_path / "job.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "-m", "mfsdp.train", "--use-megatron-fsdp", "--global-batch-size", "4",
           "--micro-batch-size", "1", "--log-interval", "1", "--train-iters", "100000"]
    job = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                           env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while "iteration     3/" not in log.read_text():
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        os.killpg(job.pid, signal.SIGTERM)
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    out = log.read_text()
    said = [line for line in out.splitlines() if line.startswith("mfsdp train: SIGTERM")]
    assert said == ["mfsdp train: SIGTERM: stopped without saving (start with "
                    "--exit-signal-handler to save first); the checkpoints already in --save "
                    "are complete (a save under way is discarded)"], out[-3000:]
    assert "exitcode  : 143" in out or "exitcode: 143" in out or job.returncode != 0
    assert out.count("Traceback (most recent call last)") <= out.count("SignalException:")


def _lock_of(root: Path, host: str, pid: int, job: str, age_s: float) -> Path:
    import json

    root.mkdir(parents=True, exist_ok=True)
    lock = root / ".lock"
    lock.write_text(json.dumps({"host": host, "pid": pid, "job": job, "started": "earlier"}))
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_a_lock_that_looks_stale_after_a_clock_jump_is_not_taken_over(tmp_path, monkeypatch):
    """A lock held on another host whose modification time is 400 s old (the holder's clock,
    or ours, jumped): before taking it over the job watches one heartbeat period; the live
    holder touches it, and the job refuses instead of saving into a directory in use. A
    really dead holder's lock is taken over after that period."""
    from mfsdp.trainer import guard

    monkeypatch.setattr(guard, "HEARTBEAT_S", 1.0)
    lock = _lock_of(tmp_path / "ck", "other-node", 4242, "", 400)
    toucher = threading.Timer(0.5, os.utime, args=(lock,))
    toucher.start()
    try:
        with pytest.raises(SystemExit) as stop:
            SaveLock(tmp_path / "ck").acquire()
    finally:
        toucher.cancel()
    assert str(stop.value.code).startswith(f"mfsdp train: --save {tmp_path}/ck is in use by pid "
                                           "4242 on other-node"), stop.value.code
    _lock_of(tmp_path / "ck", "other-node", 4242, "", 400)
    taken = SaveLock(tmp_path / "ck")
    taken.acquire()
    assert taken.held and taken.notes == [f"took over the lock of {tmp_path}/ck (its heartbeat "
                                          "stopped 400 s ago)"]
    taken.release()


def test_a_requeued_attempt_does_not_take_the_lock_of_its_live_predecessor(tmp_path,
                                                                           monkeypatch):
    """The same Slurm job, requeued onto the same node while its previous attempt's rank 0
    still runs (still saving): the job id matches, but the live pid wins and the new attempt
    refuses; once that process is gone the lock is taken over at once."""
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _lock_of(tmp_path / "ck", os.uname().nodename, holder.pid, "777", 5)
        with pytest.raises(SystemExit) as stop:
            SaveLock(tmp_path / "ck").acquire()
        assert f"is in use by job 777, pid {holder.pid}" in str(stop.value.code)
    finally:
        holder.kill()
        holder.wait()
    taken = SaveLock(tmp_path / "ck")
    taken.acquire()
    assert taken.notes == [f"took over the lock of {tmp_path}/ck (its process {holder.pid} on "
                           "this host is gone)"]
    taken.release()


def test_data_tokenized_with_a_larger_vocabulary_is_refused_at_start(tmp_path):
    """A corpus written with a 128k-token tokenizer, trained with a 32k-vocabulary model: the
    first tokens of the .bin already hold ids past the vocabulary, so the run stops at start-up
    in one line naming the .bin (not hours later at the first such sample); ids within the
    vocabulary pass."""
    import numpy

    from mfsdp.data.batches import read_data
    from mfsdp.data.indexed import IndexedDatasetBuilder
    from mfsdp.train import build_parser
    from mfsdp.trainer.config import TrainConfig

    builder = IndexedDatasetBuilder(tmp_path / "c.bin", dtype=numpy.int32)
    rng = numpy.random.default_rng(0)
    for _ in range(64):
        builder.add_document(rng.integers(0, 128000, 40))
    builder.finalize(tmp_path / "c.idx")
    args = build_parser().parse_args(["--use-megatron-fsdp", "--data-path", str(tmp_path / "c"),
                                      "--split", "1,0,0", "--seq-length", "16",
                                      "--train-iters", "2", "--global-batch-size", "2"])
    config = TrainConfig.from_args(args)
    high = int(numpy.fromfile(tmp_path / "c.bin", dtype=numpy.int32).max())
    with pytest.raises(SystemExit) as stop:
        read_data(config.data, config.training, 32000)
    assert stop.value.code == (
        f"mfsdp train: --data-path {tmp_path}/c.bin holds token id {high} among its first 2560 "
        "tokens, beyond the model's vocabulary of 32000: it was tokenized with a larger "
        "vocabulary than this run's; pass the tokenizer it was written with "
        "(--tokenizer-model, --vocab-size), or write it again with mfsdp preprocess and this "
        "run's tokenizer")
    assert read_data(config.data, config.training, 128256) is not None


def test_a_damaged_data_index_cache_is_rebuilt_with_one_line(tmp_path, capsys):
    """A --data-cache-path file truncated (a purge or a half-finished copy of the cache
    directory) or holding indices of another dataset: the sample index is built again, the
    same as the first time, with one line naming the files; training never reads it."""
    import numpy

    from mfsdp.data.gpt_dataset import GPTSamples
    from mfsdp.data.indexed import IndexedDataset

    data = IndexedDataset(str(Path(__file__).parent / "fixtures" / "megatron_data" / "a"))
    docs = numpy.arange(len(data.sequence_lengths))
    cache = tmp_path / "cache"

    def build():
        s = GPTSamples(data, docs, 8, 16, 1234, cache_dir=str(cache))
        return [numpy.asarray(s[i]).tolist() for i in range(len(s))]

    first = build()
    assert capsys.readouterr().err == ""
    shuffle = next(cache.glob("*-shuffle_index.npy"))
    shuffle.write_bytes(shuffle.read_bytes()[:60])
    assert build() == first
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(shuffle) in err[0] and "building the sample index again" in err[0]
    index = next(cache.glob("*-document_index.npy"))
    numpy.save(index, numpy.full_like(numpy.load(index), len(docs) + 7))
    assert build() == first
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "its indices do not fit this dataset" in err[0]
    assert build() == first and capsys.readouterr().err == ""  # repaired for the next job
