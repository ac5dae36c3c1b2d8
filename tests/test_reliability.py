"""The trainer's guards, with the faults injected for real: a second job on the same --save, a
launcher killed with SIGKILL, a rank stopped with SIGSTOP, bytes zeroed in a checkpoint file,
and user errors under torchrun (one line, printed once).

Every case runs ``torchrun -m mfsdp.train`` on 2 gloo ranks, as a user would.
"""

from __future__ import annotations

import json
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


def _cmd(args: list[str], nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--standalone", "-m", "mfsdp.train", *BASE, *args]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1")


def _run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(args), capture_output=True, text=True, timeout=timeout, env=_env())


def _start(args: list[str], log: Path) -> subprocess.Popen:
    f = open(log, "w")
    return subprocess.Popen(_cmd(args), stdout=f, stderr=subprocess.STDOUT, env=_env(),
                            start_new_session=True)


def _wait_for(predicate, timeout: float = 120, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return [int(x) for x in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its reparented parent) counts as gone
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def _ours(text: str) -> list[str]:
    """The lines mfsdp printed (torchrun's own failure summary left out)."""
    return [line for line in text.splitlines() if line.startswith("mfsdp train")]


@pytest.mark.parametrize("flags, message", [
    (["--num-experts", "6", "--expert-model-parallel-size", "4"],
     "mfsdp train: error: --expert-model-parallel-size 4 does not divide the 6 experts"),
    (["--load", "{afile}"], "mfsdp train: --load: {afile} is a file, not a checkpoint directory"),
    (["--lr", "-1"], "mfsdp train: error: argument --lr: -1 is not a finite number of at least 0"),
], ids=["ep-does-not-divide-experts", "load-a-file", "negative-lr"])
def test_a_user_error_is_one_line_printed_once(flags, message, tmp_path):
    """Under torchrun on 2 ranks: the message once, no Python traceback from any rank; with
    --debug the traceback is there (a parse error has none to show)."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    flags = [f.format(afile=afile) for f in flags]
    message = message.format(afile=afile)
    proc = _run(["--train-iters", "2", *flags])
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert out.count(message) == 1, out[-3000:]
    assert "[rank0]: Traceback" not in out and "[rank1]: Traceback" not in out, out[-3000:]
    if "--lr" not in flags:
        proc = _run(["--train-iters", "2", "--debug", *flags])
        assert "Traceback" in proc.stdout + proc.stderr


@pytest.mark.extended  # 17 s: make test's 25-minute budget
def test_a_second_job_cannot_save_into_a_locked_directory(tmp_path):
    """Job A holds --save's lock while it runs; job B with the same --save stops at once naming
    A's pid, and A's checkpoints are untouched. A's SIGTERM (--exit-signal-handler) saves,
    exits 0 and releases the lock; then a lock left by a dead process on this host is taken
    over, and the unfinished saves it left are removed and named."""
    save = tmp_path / "ckpt"
    a = _start(["--train-iters", "100000", "--save", str(save), "--save-interval", "2",
                "--exit-signal-handler"], tmp_path / "a.log")
    try:
        _wait_for(lambda: (save / "latest").exists(), what="job A's first save")
        holder = json.loads((save / ".lock").read_text())
        assert holder["pid"] in _children(a.pid)  # A's rank 0
        before = {p.name: p.stat().st_mtime_ns for p in save.iterdir() if p.name.startswith("iter_")}
        proc = _run(["--train-iters", "4", "--save", str(save), "--save-interval", "1"])
        assert proc.returncode != 0
        said = _ours(proc.stdout + proc.stderr)
        assert len(said) == 1 and f"pid {holder['pid']} on {holder['host']}" in said[0], said
        assert a.poll() is None  # A trains on
        after = {p.name: p.stat().st_mtime_ns for p in save.iterdir() if p.name.startswith("iter_")}
        assert all(after.get(k) == v for k, v in before.items() if k in after)
    finally:  # the ranks' preemption warning (Slurm's --signal reaches the job's processes)
        for r in _children(a.pid):
            os.kill(r, signal.SIGTERM)
        a.wait(timeout=120)
    log = (tmp_path / "a.log").read_text()
    assert a.returncode == 0, log[-3000:]
    assert "SIGTERM received" in log and not (save / ".lock").exists()
    # a dead process's lock and its unfinished save
    dead = subprocess.Popen(["true"])
    dead.wait()
    (save / ".lock").write_text(json.dumps({"host": os.uname().nodename, "pid": dead.pid,
                                            "job": "", "started": "earlier"}))
    (save / ".tmp-iter_0000099-ab12").mkdir()
    proc = _run(["--train-iters", "1", "--save", str(save)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"its process {dead.pid} on this host is gone" in proc.stdout
    assert "removed 1 unfinished save(s)" in proc.stdout and ".tmp-iter_0000099-ab12" in proc.stdout
    assert not (save / ".tmp-iter_0000099-ab12").exists() and not (save / ".lock").exists()


def test_ranks_stop_when_their_launcher_is_killed(tmp_path):
    """SIGKILL to torchrun leaves its ranks running (PyTorch's design); mfsdp's ranks notice that
    their launcher is gone and stop without saving again. Read from what the ranks wrote, not
    from a clock: the first reason a rank gives for stopping is that its launcher is gone and it
    stops without saving (the watch acted, not a failing store or a timeout; the other rank may
    then stop because its peer did), and ``latest`` names a complete checkpoint. (The wait for
    the ranks to end is a safety net, not a bound.)"""
    save = tmp_path / "ckpt"
    log = tmp_path / "job.log"
    job = _start(["--train-iters", "100000", "--save", str(save), "--save-interval", "3"], log)
    _wait_for(lambda: (save / "latest").exists(), what="the first save")
    ranks = _children(job.pid)
    assert len(ranks) == 2
    os.kill(job.pid, signal.SIGKILL)
    job.wait()
    try:
        _wait_for(lambda: not any(_alive(r) for r in ranks), timeout=120,
                  what="the orphaned ranks to stop")
    finally:
        for r in ranks:
            if _alive(r):
                os.kill(r, signal.SIGKILL)
    said = _ours(log.read_text())
    stops = [line for line in said if " stop" in line]  # (why a rank stopped, in order)
    assert stops and "the launcher that started this process" in stops[0], said[-5:]
    assert re.match(r"mfsdp train: rank [01]: .* is gone; stopping now, without saving",
                    stops[0]), stops[0]
    latest = (save / "latest").read_text().strip()
    assert (save / latest / "manifest.json").exists()  # what it names was written whole


@pytest.mark.extended  # 17 s: make test's 25-minute budget
def test_a_stalled_rank_is_named_before_the_timeout(tmp_path):
    """Rank 1 stopped with SIGSTOP: within --distributed-timeout-minutes (0.25 here) one line
    says rank 1 is behind and where rank 0 waits; the job then ends with an error, not a hang.
    "Within" is the report's own figure (rank 0's time without progress, under the 15 s timeout),
    and no timeout error precedes it in the log; the test's waits are safety nets only."""
    job = _start(["--train-iters", "100000", "--distributed-timeout-minutes", "0.25"],
                 tmp_path / "job.log")
    log = tmp_path / "job.log"
    try:
        _wait_for(lambda: "iteration     3/" in log.read_text(), what="iteration 3")
        rank1 = next(r for r in _children(job.pid)
                     if b"\0RANK=1\0" in b"\0" + Path(f"/proc/{r}/environ").read_bytes())
        os.kill(rank1, signal.SIGSTOP)
        _wait_for(lambda: "no progress for" in log.read_text(), timeout=120, what="the report")
        os.kill(rank1, signal.SIGKILL)
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    text = log.read_text()
    said = _ours(text)
    report = [s for s in said if "no progress for" in s]
    assert job.returncode != 0
    assert len(report) == 1, said
    waited = int(re.search(r"no progress for (\d+) s \(--distributed-timeout-minutes 0.25\)",
                           report[0])[1])
    assert waited < 15, report[0]  # rank 0's own count, under the 15 s timeout
    assert not re.search(r"timed out|Timeout|timeout error", text[:text.index(report[0])],
                         re.IGNORECASE), text[:text.index(report[0])][-2000:]
    assert "rank(s) 1 unresponsive for" in report[0], report[0]
    assert "(the process is stopped or its host is gone); rank(s) 0 wait at 'iteration" in report[0]


def test_rank_lists_in_reports_stay_one_short_line():
    from mfsdp.trainer.guard import _ranks

    assert _ranks([1]) == "1" and _ranks([3, 0, 1, 2]) == "0-3"
    assert _ranks(list(range(13)) + [14, 15]) == "0-12,14-15"
    assert _ranks(list(range(0, 4096, 2))) == "0,2,4,6,8,10,12,14,... (2048 ranks)"


def test_every_test_the_reliability_page_names_exists():
    """The page lists, per guarantee, the test that injects the fault: each must exist."""
    import re

    root = Path(__file__).resolve().parents[1]
    page = (root / "docs" / "reliability.md").read_text()
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)(?:\[[^\]]*\])?`", page)
    assert len(named) >= 12
    for path, name in named:
        assert f"def {name}(" in (root / path).read_text(), (path, name)


def test_load_checks_the_checksums_unless_no_ckpt_verify(tmp_path):
    """--load of a checkpoint with 1 KiB zeroed in place stops naming the file; with
    --no-ckpt-verify the same bytes load and training goes on (what the flag promises)."""
    from mfsdp.launch import RankError, launch

    save = tmp_path / "ckpt"
    base = BASE + ["--save", str(save), "--load", str(save)]
    launch("mfsdp.train:run_in_rank", 2,
           args=(base + ["--train-iters", "4", "--exit-interval", "2"],))
    ckpt = save / "iter_0000002"
    # 1 KiB zeroed in the middle of the largest tensor's bytes: the file keeps its size and
    # still reads (no format check notices), only the values change
    from torch.distributed.checkpoint import FileSystemReader

    item = max(FileSystemReader(str(ckpt)).read_metadata().storage_data.values(),
               key=lambda i: i.length)
    victim = ckpt / item.relative_path
    data = bytearray(victim.read_bytes())
    middle = item.offset + item.length // 2
    data[middle:middle + 1024] = bytes(1024)
    victim.write_bytes(bytes(data))
    with pytest.raises(RankError, match=f"{victim} does not match the SHA-256"):
        launch("mfsdp.train:run_in_rank", 2, args=(base + ["--train-iters", "4"],))
    records = launch("mfsdp.train:run_in_rank", 2,
                     args=(base + ["--train-iters", "4", "--no-ckpt-verify"],))[0]
    assert [r["iteration"] for r in records] == [3, 4]


def _plain_optimizer_norms() -> dict:
    """On each of 2 ranks: 3 steps of SGD (momentum) and of AdamW built after ``fully_shard``
    over the returned model's parameters (FSDP2's pattern), under three strategies, with
    ``zero_grad()`` setting the gradients to None or zeroing them in place; and one process's
    plain PyTorch on the whole batch. Returns every run's gradient norms and final weights."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from mfsdp import fully_shard

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                             nn.Linear(16, 4))

    def batch(step):
        g = torch.Generator().manual_seed(100 + step)
        return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)

    optimizers = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                  "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01)}
    rank, world = dist.get_rank(), dist.get_world_size()

    def train(model, opt, sharded, set_to_none=True):
        norms = []
        for step in range(3):
            x, y = batch(step)
            if sharded:
                x, y = x[rank::world], y[rank::world]
            opt.zero_grad(set_to_none=set_to_none)
            ((model(x) - y) ** 2).mean().backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
            opt.step()
        weights = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
                   for p in model.parameters()]
        return norms, weights

    out = {}
    for name, build in optimizers.items():
        model = make()
        out[(name, "one process")] = train(model, build(model.parameters()), False)
        for strategy in ("no_shard", "optim", "optim_grads_params"):
            for set_to_none in (True, False):
                model, _ = fully_shard(make(), zero_dp_strategy=strategy)
                out[(name, strategy, set_to_none)] = train(
                    model, build(model.parameters()), True, set_to_none)
    # a forward through the original module instead of the returned model
    module = make()
    model, _ = fully_shard(module)
    try:
        module(torch.randn(2, 8))
        out["original"] = "ran"
    except RuntimeError as exc:
        out["original"] = str(exc)
    # an optimizer over the parameters from before fully_shard, not handed to it
    module = make()
    early = torch.optim.SGD(module.parameters(), lr=0.1)
    model, _ = fully_shard(module)
    try:
        early.step()
        out["early"] = "stepped"
    except RuntimeError as exc:
        out["early"] = str(exc)
    return out


def test_an_optimizer_built_after_fully_shard_never_steps_on_stale_gradients():
    """FSDP2's pattern, ``model, _ = fully_shard(model)`` then ``torch.optim.AdamW(
    model.parameters())``: its ``zero_grad()`` (to None or in place) clears what the next
    backward accumulates into, and its step reaches the model's weights, under no_shard, optim
    and optim_grads_params; gradient norms and weights over 3 steps equal one process's plain
    PyTorch (they used to grow: 1.47 -> 1.63 -> 1.96 instead of 1.47 -> 1.02 -> 1.23 with SGD).
    An optimizer still holding the parameters from before fully_shard is refused at its first
    step with one line naming the fix; a forward through the original module says to call the
    returned model."""
    import torch

    from mfsdp.launch import launch

    out = launch(_plain_optimizer_norms, 2, timeout=240)[0]
    early, original = out.pop("early"), out.pop("original")
    assert original.startswith("Sequential was sharded by fully_shard: outside the returned "
                               "model's forward its parameters are this rank's shards"), original
    assert "call the model fully_shard returned" in original
    for name in ("sgd", "adamw"):
        ref_norms, ref_weights = out[(name, "one process")]
        assert ref_norms[1] != ref_norms[0]
        for key, (norms, weights) in out.items():
            if key[0] != name or key[1] == "one process":
                continue
            assert norms == pytest.approx(ref_norms, rel=1e-5), (key, norms, ref_norms)
            for w, r in zip(weights, ref_weights):
                torch.testing.assert_close(w, r, rtol=1e-5, atol=1e-6, msg=str(key))
    assert early.startswith("mfsdp: this SGD holds param_groups[0]['params'][0] "
                                   "(shape (16, 8)), a parameter of the module from before "
                                   "fully_shard"), early
    assert "pass the optimizer to fully_shard(model, optimizer)" in early


# mfsdp train with a file-system fault in the save whose path contains MFSDP_FAULT_AT: enospc:
# every rank's tensor files (inside torch.distributed.checkpoint); erofs: rank 0's manifest, and
# the lock cannot be removed either.
FAULT = '''
import contextlib, errno, os, pathlib, sys

import torch.distributed.checkpoint.filesystem as fs

from mfsdp.train import main

kind, at = os.environ["MFSDP_FAULT"], os.environ["MFSDP_FAULT_AT"]
code = {"enospc": errno.ENOSPC, "erofs": errno.EROFS}[kind]


def fail(path):
    raise OSError(code, os.strerror(code), str(path))


if kind == "enospc":
    real = fs.FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if at in str(path) and "w" in mode:
            fail(path)
        with real(self, path, mode) as stream:
            yield stream

    fs.FileSystem.create_stream = create_stream
else:
    write_text, unlink = pathlib.Path.write_text, pathlib.Path.unlink

    def guarded_write(self, *a, **k):
        if at in str(self) and self.name == "manifest.json":
            fail(self)
        return write_text(self, *a, **k)

    def guarded_unlink(self, *a, **k):
        if self.name == ".lock":
            fail(self)
        return unlink(self, *a, **k)

    pathlib.Path.write_text, pathlib.Path.unlink = guarded_write, guarded_unlink

sys.exit(main())
'''


def _no_rank_traceback(out: str) -> bool:
    """Whether the only traceback is torchrun's own (its summary of a failed job)."""
    return out.count("Traceback (most recent call last)") <= out.count("ChildFailedError:") + \
        out.count("SignalException:")


@pytest.mark.parametrize("fault, what", [
    ("enospc", "no space left on device"), ("erofs", "read-only file system")],
    ids=["full-disk-every-rank", "read-only-rank-0-and-the-lock"])
def test_a_save_the_file_system_refuses_is_one_line_naming_the_previous_checkpoint(
        fault, what, tmp_path):
    """The save of iteration 4 fails (a full disk in every rank's DCP writer; a read-only file
    system at rank 0's manifest, where releasing the lock fails too): one line naming the path
    and iteration 2, which latest still names; no traceback of any rank, no .tmp-* left, the
    lock's failed release hides nothing."""
    script = tmp_path / "fault.py"
    script.write_text(FAULT)
    save = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", str(script), *BASE, "--train-iters", "6", "--save-interval", "2",
           "--save", str(save)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=dict(_env(), MFSDP_FAULT=fault, MFSDP_FAULT_AT="iter_0000004"))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    said = [line for line in _ours(out) if "error" in line or "failed" in line]
    assert len(said) == 1, out[-4000:]
    assert said[0].startswith(f"mfsdp train: saving iteration 4 into --save {save} failed: "
                              f"{what} ({save}/.tmp-iter_0000004-"), said[0]
    assert (f"the previous checkpoint, {save}/iter_0000002 (named by latest), is untouched and "
            "is what --load reads") in said[0]
    assert _no_rank_traceback(out), out[-4000:]
    assert "lock" not in said[0] and "CheckpointException" not in out
    assert (save / "latest").read_text().strip() == "iter_0000002"
    assert not list(save.glob(".tmp-*")) and not list(save.glob(".latest-*"))
    assert (save / ".lock").exists() == (fault == "erofs")


def test_a_damaged_checkpoint_index_is_one_line(tmp_path):
    """Bytes of a checkpoint's .metadata (DCP's index of its files) zeroed, loaded with
    --no-ckpt-verify on 2 ranks: every rank raises the same CheckpointError naming the file
    (a user error: one line, see test_a_user_error_is_one_line_printed_once), not the
    reader's unpickling errors."""
    from mfsdp.launch import RankError, launch

    save = tmp_path / "ckpt"
    base = BASE + ["--save", str(save), "--load", str(save)]
    launch("mfsdp.train:run_in_rank", 2, args=(base + ["--train-iters", "1"],))
    meta = save / "iter_0000001" / ".metadata"
    data = bytearray(meta.read_bytes())
    data[10:40] = bytes(30)
    meta.write_bytes(bytes(data))
    with pytest.raises(RankError) as err:
        launch("mfsdp.train:run_in_rank", 2, args=(base + ["--train-iters", "2",
                                                           "--no-ckpt-verify"],))
    assert (f"CheckpointError: {meta} cannot be read (UnpicklingError: invalid load key, "
            "'\\x00'.): the checkpoint's index of its files is damaged; restore it from a copy "
            "or load another iteration") in str(err.value), str(err.value)[-3000:]


def test_a_bad_token_id_is_named_once_by_the_rank_that_read_it(tmp_path):
    """An int32 dataset with one negative token id: the rank that reads it names the sample,
    the iteration and itself in one line; the other rank, whose collective then fails, says
    nothing."""
    import numpy

    from mfsdp.data.indexed import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(tmp_path / "d.bin", dtype=numpy.int32)
    rng = numpy.random.default_rng(0)
    for i in range(64):
        doc = rng.integers(0, 200, 40)
        if i == 5:
            doc[3] = -7
        builder.add_document(doc)
    builder.finalize(tmp_path / "d.idx")
    proc = _run(["--train-iters", "30", "--data-path", str(tmp_path / "d"), "--split", "1,0,0",
                 "--seq-length", "16", "--vocab-size", "256"])
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    said = [line for line in _ours(out) if "token id" in line]
    assert len(said) == 1 and len(_ours(out)) == 2, out[-3000:]  # (and the start-up line)
    assert re.match(r"mfsdp train: --data-path: training sample \d+ \(iteration \d+, read by "
                    r"rank [01]\) holds token id -7; token ids are at least 0", said[0]), said[0]
    assert _no_rank_traceback(out) and "IndexError" not in out, out[-3000:]


@pytest.mark.extended
def test_sigint_ends_the_job_with_one_line(tmp_path):
    """Ctrl-C at the terminal (SIGINT to the whole process group): the ranks stop with one line
    between them and no KeyboardInterrupt traceback (torchrun prints its own summary)."""
    log = tmp_path / "job.log"
    job = _start(["--train-iters", "100000"], log)
    try:
        _wait_for(lambda: "iteration     3/" in log.read_text(), what="iteration 3")
        os.killpg(job.pid, signal.SIGINT)
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    out = log.read_text()
    said = [line for line in _ours(out) if "interrupted" in line]
    assert said == ["mfsdp train: interrupted (SIGINT, Ctrl-C): stopped without saving; the "
                    "checkpoints already in --save are complete (a save under way is "
                    "discarded)"], out[-3000:]
    assert "KeyboardInterrupt" not in out, out[-3000:]


def test_convert_onto_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    """mfsdp convert whose writes fail with ENOSPC: one line naming the path, status 2, and no
    OUTPUT or .tmp-* directory left beside it."""
    import contextlib
    import errno

    import torch.distributed.checkpoint.filesystem as fs

    from mfsdp.checkpoint.dcp import write_full
    from mfsdp.cli import main

    import torch

    src = write_full(tmp_path / "in", {"model.w": torch.arange(64.0)}, {"extra": {"iteration": 1}},
                     fmt="fsdp_dtensor")
    real = fs.FileSystem.create_stream

    @contextlib.contextmanager
    def full_disk(self, path, mode):
        if "w" in mode:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        with real(self, path, mode) as stream:
            yield stream

    monkeypatch.setattr(fs.FileSystem, "create_stream", full_disk)
    before = sorted(p.name for p in tmp_path.iterdir())
    code = main(["convert", "--from", "fsdp_dtensor", "--to", "mfsdp_full", str(src),
                 str(tmp_path / "full")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert re.fullmatch(rf"mfsdp convert: writing {tmp_path}/full failed: no space left on device "
                        rf"\({tmp_path}/\.tmp-full-\w+/__0_0\.distcp\); nothing was left behind; "
                        r"free space there or choose another OUTPUT", err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_messages_say_what_is_true(tmp_path):
    """The latest tracker quoted as it is (empty, or a path leading out of the root, which is
    never followed); a .bin without its .idx names the .idx; an odd weighted --data-path list
    explains the pairing."""
    from mfsdp.checkpoint import CheckpointError
    from mfsdp.checkpoint.manifest import resolve_checkpoint
    from mfsdp.train import build_parser, check_args, model_config

    root = tmp_path / "ckpt"
    root.mkdir()
    other = tmp_path / "other"
    other.mkdir()
    (other / "manifest.json").write_text("{}")
    for text in ("", "\n", "../other", str(other)):
        (root / "latest").write_text(text)
        with pytest.raises(CheckpointError) as err:
            resolve_checkpoint(root)
        assert str(err.value).startswith(f"{root}/latest holds {text!r}, not the name of a "
                                         "checkpoint directory beside it"), str(err.value)
    (root / "latest").write_text("iter_0000009\n")
    with pytest.raises(CheckpointError, match="names 'iter_0000009', which has no manifest"):
        resolve_checkpoint(root)

    (tmp_path / "d.bin").write_bytes(b"x")

    def refused(*flags):
        args = build_parser().parse_args(list(flags))
        with pytest.raises(SystemExit) as stop:
            check_args(args, 1, model_config(args))
        return str(stop.value.code)

    assert refused("--data-path", str(tmp_path / "d")) == (
        f"--data-path {tmp_path}/d: {tmp_path}/d.bin exists but {tmp_path}/d.idx does not (a "
        "Megatron indexed dataset is a .bin/.idx pair); put the .idx beside it, or write both "
        "again with mfsdp preprocess")
    assert refused("--data-path", "0.3", str(tmp_path / "d"), "0.7") == (
        f"--data-path 0.3 {tmp_path}/d 0.7: 3 entries, of which 0.3, 0.7 are numbers and no "
        "dataset: a weighted list pairs each weight with the prefix after it (WEIGHT PREFIX "
        "WEIGHT PREFIX ...), an unweighted one names prefixes only; add the missing weight or "
        "prefix")
