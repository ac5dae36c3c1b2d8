"""A job survives the cluster: SIGTERM saves and exits cleanly, the run resumes; logging users read.

Real processes under ``torchrun`` (gloo), real signals: Slurm's ``--signal=TERM@120`` delivers
SIGTERM to the tasks before the time limit; here one rank gets it, as happens when signals
reach ranks at slightly different times.
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

TRAIN = ["--use-megatron-fsdp", "--seq-length", "32", "--global-batch-size", "4",
         "--micro-batch-size", "2", "--log-interval", "1"]


def _torchrun(*argv, nproc=2):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nproc), "-m", "mfsdp.train", *TRAIN, *argv]


def _children(pid: int) -> list[int]:
    """Child processes of ``pid``, from /proc (no procps needed)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:  # the field after the state is the parent's pid
            kids.append(int(stat.parent.name))
    return sorted(kids)


@pytest.mark.slow
def test_sigterm_saves_and_the_run_resumes(tmp_path):
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(_torchrun("--train-iters", "100000", "--exit-signal-handler",
                                      "--save", str(ckpt), "--log-jsonl", str(log)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "iteration     3/" in line:
            break
    workers = _children(proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[-1], signal.SIGTERM)  # one rank only: the ranks agree to stop together
    rest, _ = proc.communicate(timeout=300)
    out = "".join(lines) + rest
    assert proc.returncode == 0, out[-3000:]
    assert "SIGTERM received" in out
    stopped = json.loads(log.read_text().splitlines()[-1])["iteration"]
    assert (ckpt / "latest").read_text().strip().endswith(str(stopped)) or \
        str(stopped) in (ckpt / "latest").read_text()
    # the same schedule (--train-iters), stopped two iterations later
    resumed = subprocess.run(_torchrun("--train-iters", "100000", "--exit-interval",
                                       str(stopped + 2), "--load", str(ckpt),
                                       "--save", str(ckpt), "--log-jsonl", str(tmp_path / "b.jsonl")),
                             capture_output=True, text=True, timeout=300, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from iteration {stopped}" in resumed.stdout
    its = [json.loads(x)["iteration"] for x in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert its == [stopped + 1, stopped + 2]


def test_exit_duration_stops_the_run(tmp_path):
    out = subprocess.run(_torchrun("--train-iters", "100000", "--exit-duration-in-mins", "0.001",
                                   "--save", str(tmp_path / "ckpt"), nproc=1),
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--exit-duration-in-mins 0.001 reached" in out.stdout
    assert (tmp_path / "ckpt" / "latest").exists()


def test_tensorboard_and_throughput(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = subprocess.run(_torchrun("--train-iters", "3", "--tensorboard-dir", str(tmp_path / "tb"),
                                   "--log-throughput", "--log-jsonl", str(tmp_path / "log.jsonl"),
                                   nproc=1),
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "TFLOP/s per rank" in out.stdout
    log = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    losses = [e.value for e in events.Scalars("lm loss")]
    assert losses == pytest.approx([r["loss"] for r in log], rel=1e-6)
    assert [e.step for e in events.Scalars("learning-rate")] == [1, 2, 3]
    # TFLOP/s = FLOPs per token x tokens/s: the model's 6 N + attention estimate
    from mfsdp.models.gpt import GPT, GPT_PRESETS

    cfg = GPT_PRESETS["gpt-tiny"]  # the trainer's default model; lookups are not FLOPs
    model = GPT(cfg)
    weights = sum(p.numel() for p in model.parameters()) - cfg.vocab_size * cfg.hidden_size \
        - model.position_embedding.weight.numel()
    want = 6 * weights + 6 * cfg.num_layers * 32 * cfg.hidden_size  # seq 32
    r = log[-1]
    assert r["tflops_per_rank"] * 1e12 / r["tokens_per_s"] == pytest.approx(want, rel=1e-9)




def test_wandb_logs_the_scalars_tensorboard_gets(tmp_path):
    """--wandb-project with the real wandb package, offline: the run W&B wrote (read back from its
    own .wandb file, see wandb_records.py) has Megatron-LM's name, project and config, and per
    iteration the loss, learning rate and gradient norm of the trainer's JSON log."""
    pytest.importorskip("wandb", reason="the wandb package is not installed")
    from wandb_records import read_run

    out = subprocess.run(_torchrun("--train-iters", "3", "--wandb-project", "parity",
                                   "--wandb-exp-name", "run-1", "--wandb-save-dir",
                                   str(tmp_path / "wb"), "--log-jsonl", str(tmp_path / "log.jsonl")),
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline",
                                  WANDB_SILENT="true"))
    assert out.returncode == 0, out.stderr[-3000:]
    log = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    run = read_run(tmp_path / "wb")
    assert (run["project"], run["name"]) == ("parity", "run-1")
    assert run["config"]["wandb_exp_name"] == "run-1" and run["config"]["train_iters"] == 3
    assert sorted(run["history"]) == [1, 2, 3]
    for rec in log:
        row = run["history"][rec["iteration"]]
        assert [row["lm loss"], row["learning-rate"], row["grad-norm"]] == pytest.approx(
            [rec["loss"], rec["lr"], rec["grad_norm"]], rel=1e-12)


@pytest.mark.parametrize("argv, said", [
    (["--wandb-project", "p"], "--wandb-project needs --wandb-exp-name NAME"),
    (["--wandb-project", "p", "--wandb-exp-name", "e"], "--wandb-project needs --wandb-save-dir"),
    (["--wandb-exp-name", "e"], "--wandb-exp-name has no effect without --wandb-project"),
])
def test_wandb_flags_that_cannot_act_are_refused_at_start(argv, said):
    from mfsdp.trainer.arguments import build_parser
    from mfsdp.trainer.config import TrainConfig

    with pytest.raises(SystemExit, match=said):
        TrainConfig.from_args(build_parser().parse_args(argv))


@pytest.mark.slow
def test_sigterm_while_the_run_starts_is_kept_and_the_run_saves(tmp_path):
    """--exit-signal-handler catches SIGTERM from the moment the arguments are parsed: a signal
    sent while the run starts (here when --save's lock appears, before the model is built and
    the loop's own handler would exist) does not kill the rank; it trains one iteration, saves
    it and exits 0."""
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-m", "mfsdp.train", *TRAIN, "--train-iters", "50",
                             "--exit-signal-handler", "--save", str(ckpt)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT="0"))
    try:
        deadline = time.monotonic() + 120
        while not (ckpt / ".lock").exists() and proc.poll() is None:
            assert time.monotonic() < deadline, "the run never took --save's lock"
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert "SIGTERM received (--exit-signal-handler): stopping after iteration 1" in out, out
    assert (ckpt / "latest").read_text().strip() == "iter_0000001"
