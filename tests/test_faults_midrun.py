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
    """SIGKILL to rank 1 after iteration 3: rank 0's collective fails; the one line names rank
    1, its pid and where it was (from the progress board), and says the checkpoints are
    complete; rank 0 prints no traceback."""
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
    assert said[0].endswith("stopped (killed, out of memory, or its node failed): rank 0 lost "
                            "its connection in a collective and the job ends; the checkpoints "
                            "in --save are complete: resume from the latest (torchrun "
                            "--max-restarts restarts the ranks by itself)"), said[0]
    assert _worker_tracebacks(out) == 0, out[-4000:]
    latest = (tmp_path / "ckpt" / "latest").read_text().strip()
    assert (tmp_path / "ckpt" / latest / "manifest.json").exists()
