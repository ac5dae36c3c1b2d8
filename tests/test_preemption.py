"""Preemption under any launcher: the grace the trainer reads (torchrun's ``--shutdown-timeout``,
Slurm's ``--signal`` lead), the line it prints when a save does not fit it, and a real SIGTERM to
``torchrun`` (the Kubernetes, ``scancel`` and Ctrl-C case) with a save inside the grace (it
completes, the marker is written, torchrun exits 1) and one past it (the ranks are killed, the
previous checkpoint stays the latest).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slow_save import slowed_save_env

from mfsdp.trainer.preemption import (MARKER_ENV, SAVE_TIME_FILE, SaveBudget, grace, needed,
                                      torchrun_shutdown_timeout)

BASE = ["--use-megatron-fsdp", "--global-batch-size", "4", "--micro-batch-size", "1",
        "--log-interval", "1", "--exit-signal-handler", "--lr-decay-iters", "100000"]


@pytest.mark.parametrize("cmdline, env, want", [
    (["/usr/bin/python", "-m", "torch.distributed.run", "--nproc-per-node", "2",
      "--shutdown-timeout", "90", "-m", "mfsdp.train", "--train-iters", "3"], {}, 90),
    (["/usr/bin/torchrun", "--shutdown_timeout=75", "train.py"], {}, 75),
    # the script's own --shutdown-timeout is not torchrun's
    (["/usr/bin/torchrun", "train.py", "--shutdown-timeout", "9"], {}, 30),
    (["/usr/bin/torchrun", "train.py"], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "45"}, 45),
    (["/usr/bin/torchrun", "--shutdown-timeout", "60", "train.py"],
     {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "45"}, 60),
], ids=["module-form", "equals-form", "script-flag-ignored", "env", "flag-beats-env"])
def test_torchrun_shutdown_timeout_is_read_as_torchrun_reads_it(cmdline, env, want):
    """The flag is parsed by torchrun's own argument parser, the variable is the launcher's
    default (torch.distributed.launcher.api)."""
    from torch.distributed.launcher.api import LaunchConfig

    assert torchrun_shutdown_timeout(cmdline, env) == want
    if not any("shutdown" in t for t in cmdline[1:3] + cmdline[3:6]):
        old = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
        os.environ.update(env)
        try:  # torchrun's own default, read the way torchrun reads it
            assert LaunchConfig(1, 1, 1).shutdown_timeout == want
        finally:
            os.environ.pop("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", None)
            if old is not None:
                os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = old


def test_the_slow_save_line_names_the_grace_and_the_fix(tmp_path):
    """A save of 41 s against Slurm's 30 s lead: one line (once per job), naming the time and
    the value to render with; a fast save says nothing; a bad grace value is refused in one
    line."""
    lines: list[str] = []
    budget = SaveBudget(str(tmp_path), lambda s, **k: lines.append(s),
                        env={"MFSDP_PREEMPTION_GRACE_S": "30"})
    budget.after_save(10, 2.0)
    assert lines == [] and json.loads((tmp_path / SAVE_TIME_FILE).read_text())["seconds"] == 2.0
    budget.after_save(20, 41.0)
    budget.after_save(30, 45.0)
    assert lines == [
        "mfsdp train: warning: saving iteration 20 took 41.0 s, more than 80% of the 30 s "
        "between Slurm's --signal and the time limit (MFSDP_PREEMPTION_GRACE_S): a save on "
        "SIGTERM would be killed before it completes (the previous checkpoint would stay the "
        f"latest); render the script with --set signal_seconds={needed(41.0)} (#SBATCH "
        f"--signal=B:TERM@{needed(41.0)})"]
    # a new job reads what the last one recorded
    lines.clear()
    SaveBudget(str(tmp_path), lambda s, **k: lines.append(s),
               env={"TORCHELASTIC_RUN_ID": "x", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "30"}
               ).at_start()
    assert len(lines) == 1 and lines[0].startswith(
        f"mfsdp train: warning: the last save into {tmp_path} (iteration 30) took 45.0 s, more "
        "than 80% of the 30 s torchrun waits after SIGTERM"), lines
    assert lines[0].endswith(f"start torchrun with --shutdown-timeout {needed(45.0)} (or "
                             f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={needed(45.0)})")
    assert needed(45.0) >= 45.0 * 1.5
    with pytest.raises(SystemExit, match="MFSDP_PREEMPTION_GRACE_S='2m' is not a number"):
        grace({"MFSDP_PREEMPTION_GRACE_S": "2m"})
    assert grace({}) is None  # a plain process: no launcher fixes a grace, nothing is said


def _torchrun(args: list[str], log: Path, shutdown_s: int, delay_s: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "--shutdown-timeout", str(shutdown_s), "-m", "mfsdp.train", *BASE, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", **slowed_save_env(delay_s))
    env[MARKER_ENV] = str(log.parent / "saved-on-sigterm")
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def _wait(predicate, what: str, job: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert job.poll() is None, f"the job ended (status {job.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _sigterm_torchrun_after(job: subprocess.Popen, log: Path, iteration: int) -> None:
    """SIGTERM to torchrun alone (it forwards it to the ranks) once ``iteration`` is logged, then
    wait for torchrun to end (the timeout is a safety net)."""
    try:
        _wait(lambda: f"iteration {iteration:>5}/" in log.read_text(), f"iteration {iteration}",
              job)
        os.kill(job.pid, signal.SIGTERM)
        job.wait(timeout=180)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.extended
def test_sigterm_to_torchrun_saves_within_its_shutdown_timeout(tmp_path):
    """torchrun --shutdown-timeout 40 gets SIGTERM; the save (slowed to 4 s) completes, rank 0
    writes the marker naming the iteration, ``latest`` names it, the lock is released; torchrun
    itself exits 1 (its SignalException): the status the job script maps with the marker."""
    save = tmp_path / "ckpt"
    log = tmp_path / "job.log"
    job = _torchrun(["--train-iters", "100000", "--save", str(save), "--save-interval", "100000"],
                    log, shutdown_s=40, delay_s=4)
    _sigterm_torchrun_after(job, log, 3)
    out = log.read_text()
    assert job.returncode == 1, out[-3000:]  # torchrun's own status after a forwarded signal
    marker = json.loads((tmp_path / "saved-on-sigterm").read_text())
    it = marker["iteration"]
    assert it >= 3 and marker["save"] == str(save)
    assert (save / "latest").read_text().strip() == f"iter_{it:07d}"
    assert f"saved iteration {it} to {save}" in out and not (save / ".lock").exists()
    assert "warning" not in out  # 4 s fits 40 s: nothing said


@pytest.mark.slow
@pytest.mark.extended
def test_a_save_past_torchruns_shutdown_timeout_is_announced_and_loses_nothing(tmp_path):
    """Saves slowed to 6 s under --shutdown-timeout 4: the first save says, in one line, that it
    does not fit and what to set; the next job says so at start-up (from save_time.json); its
    save on SIGTERM is killed by torchrun, and ``latest`` still names the complete earlier
    checkpoint, which loads."""
    save = tmp_path / "ckpt"
    first = _torchrun(["--train-iters", "2", "--save", str(save), "--save-interval", "2"],
                      tmp_path / "first.log", shutdown_s=4, delay_s=6)
    first.wait(timeout=180)
    out = (tmp_path / "first.log").read_text()
    assert first.returncode == 0, out[-3000:]
    said = [line for line in out.splitlines() if "warning" in line]
    assert len(said) == 1 and said[0].startswith("mfsdp train: warning: saving iteration 2 took "
                                                 "6."), said
    assert "more than 80% of the 4 s torchrun waits after SIGTERM" in said[0]
    log = tmp_path / "second.log"
    job = _torchrun(["--train-iters", "100000", "--save", str(save), "--save-interval", "100000",
                     "--load", str(save)], log, shutdown_s=4, delay_s=6)
    _sigterm_torchrun_after(job, log, 4)
    out = log.read_text()
    said = [line for line in out.splitlines() if "warning" in line]
    assert len(said) == 1 and said[0].startswith(
        f"mfsdp train: warning: the last save into {save} (iteration 2) took 6."), said
    assert out.index(said[0]) < out.index("iteration     3/")  # at start-up
    assert job.returncode != 0 and not (tmp_path / "saved-on-sigterm").exists()
    assert (save / "latest").read_text().strip() == "iter_0000002"
    from mfsdp.checkpoint.manifest import read_manifest, resolve_checkpoint, verify_checksums

    ckpt = resolve_checkpoint(save)
    assert verify_checksums(ckpt, read_manifest(ckpt)) > 0  # complete, every byte as written
