"""The rendered sbatch scripts under a real single-node Slurm (see ``slurm_cluster.py``).

The CPU smoke script runs to the end with ``sbatch --wait`` (2 gloo ranks): its log shows the
loss going down, and it writes per-rank logs and the provenance dump; an empty DATA_PATH stops a
job at once with one line; a save slowed past torchrun's 30 s completes after the time-limit
signal, with either launcher, and the requeued job resumes on the loss curve of an uninterrupted
run; the GPU scripts of both trainers pass ``sbatch --test-only`` against a node with fake GPUs.
Where Slurm cannot be started the tests skip and say why; in CI they fail instead.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, skip_or_fail
from slow_save import SAVE_DELAY_ENV, SHIM_DIR
from slurm_cluster import Cluster, why_not

from mfsdp.tools.sbatch import render, scripts

pytestmark = pytest.mark.slow
SCRIPTS = ROOT / "example-scripts"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = why_not()
    if reason:
        skip_or_fail(reason)
    c = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        c.start()
    except Exception as exc:  # noqa: BLE001 - report why the cluster did not come up
        c.stop()
        skip_or_fail(f"Slurm did not start: {exc}")
    yield c
    c.stop()


# The jobs run this checkout's mfsdp with the test's Python.
EXPORT = f"--export=ALL,PYTHON={sys.executable},PYTHONPATH={ROOT}"
# ... with each save slowed to 45 s by the test-only shim (tests/slow_save/sitecustomize.py)
SLOW_SAVE_EXPORT = (f"--export=ALL,PYTHON={sys.executable},PYTHONPATH={SHIM_DIR}:{ROOT},"
                    f"{SAVE_DELAY_ENV}=45")


def _submit(cluster: Cluster, script: Path, workdir: Path, export: str = EXPORT) -> tuple[int, str]:
    proc = cluster.run("sbatch", "--wait", f"--chdir={workdir}", export, str(script), timeout=600)
    logs = sorted(workdir.glob("*.log"))
    text = "\n".join(p.read_text() for p in logs)
    return proc.returncode, proc.stdout + proc.stderr + "\n" + text


@pytest.mark.extended
def test_cpu_smoke_script_trains_under_slurm(cluster, tmp_path):
    rc, log = _submit(cluster, SCRIPTS / "cpu-smoke.sbatch", tmp_path)
    assert rc == 0, f"job failed:\n{log[-4000:]}\n{cluster.log_tail()}"
    losses = [float(x) for x in re.findall(r"iteration +\d+/\d+ \| loss ([0-9.]+)", log)]
    assert len(losses) == 10, log[-3000:]
    assert losses[-1] < losses[0], losses
    assert "2 ranks (gloo)" in log
    assert "MOCK DATA" in log  # the preset trains on synthetic data, and says so
    job_dir = next((tmp_path / "logs" / "mfsdp-cpu-smoke").glob("*/attempt-0"))
    # per-rank logs: each rank's output in its own file (torchrun --log-dir)
    ranks = {p.parent.name: p for p in (job_dir / "ranks").rglob("stdout.log")}
    assert sorted(ranks) == ["0", "1"], list((job_dir / "ranks").rglob("*"))
    assert "iteration    10/10" in ranks["0"].read_text()
    # the provenance dump: the script as submitted, the code, the packages, GPUs, environment
    prov = job_dir / "provenance"
    assert (prov / "job.sbatch").read_text() == (SCRIPTS / "cpu-smoke.sbatch").read_text()
    assert re.search(r"^[0-9a-f]{40}$", (prov / "code.txt").read_text(), re.M)
    assert "torch==" in (prov / "pip-freeze.txt").read_text()
    assert "SLURM_JOB_ID=" in (prov / "env.txt").read_text()
    assert (prov / "nvidia-smi.txt").read_text().strip()
    assert list((tmp_path / "logs" / "mfsdp-cpu-smoke" / "tensorboard").glob("events.*"))


@pytest.mark.extended
def test_bandwidth_script_measures_under_slurm(cluster, tmp_path):
    """The bandwidth preset rendered for CPU (one node, 4 gloo ranks) and submitted: rank 0's
    table in the log, the ``mfsdp plan`` line with the node group's busbw, and the JSON file
    beside the log with the same rows and flags."""
    script = tmp_path / "bandwidth.sbatch"
    script.write_text(render("bandwidth", {"nodes": "1", "gpus_per_node": "0",
                                           "ranks_per_node": "4", "cpus_per_task": "2",
                                           "exclusive": "false", "size_mib": "1 4"}))
    rc, log = _submit(cluster, script, tmp_path)
    assert rc == 0, f"job failed:\n{log[-4000:]}\n{cluster.log_tail()}"
    job_id = next(tmp_path.glob("mfsdp-bandwidth-*.log")).stem.rsplit("-", 1)[1]
    path = tmp_path / f"mfsdp-bandwidth-{job_id}.json"
    assert f"mfsdp sbatch: the measurements are in {path}\n" in log
    result = json.loads(path.read_text())
    assert result["environment"]["world_size"] == 4 and result["environment"]["backend"] == "gloo"
    # the table (torchrun --tee puts the local rank in front): one node group of 4 ranks, both
    # collectives at 1 and 4 MiB, as in the JSON
    rows = re.findall(r"^\[default0\]:node +4 +(\w+) +([\d.]+) +[\d.]+ +[\d.e-]+ +([\d.e-]+)$",
                      log, re.M)
    assert sorted((op, float(size)) for op, size, _ in rows) == sorted(
        (r["op"], r["size_bytes"] / 2**20) for r in result["rows"]), log[-3000:]
    assert len(rows) == 4 and {r["group"] for r in result["rows"]} == {"node"}
    # the plan line: the lower collective's busbw at 4 MiB, the JSON's flags
    busbw = min(float(b) for op, size, b in rows if float(size) == 4)
    flags = re.search(r"^\[default0\]:mfsdp plan \.\.\. (--nvlink-gbps (\S+))$", log, re.M)
    assert flags, log[-3000:]
    assert flags.group(1) == result["plan_flags"]
    assert float(flags.group(2)) == pytest.approx(busbw, rel=1e-2)
    # and again at the end, without torchrun's prefix, for copying
    assert f"\nmfsdp sbatch: plan with the measured links: mfsdp plan ... {flags.group(1)}\n" in log
    ranks = {p.parent.name for p in (tmp_path / "logs" / "mfsdp-bandwidth" / job_id
                                     / "ranks").rglob("stdout.log")}
    assert ranks == {"0", "1", "2", "3"}


def test_an_empty_data_path_stops_the_job_at_once_with_one_line(cluster, tmp_path):
    script = tmp_path / "nodata.sbatch"
    script.write_text(render("cpu-smoke", {"mock_data": "false"}))
    t0 = time.monotonic()
    proc = cluster.run("sbatch", "--wait", f"--chdir={tmp_path}", EXPORT, str(script), timeout=120)
    log = "".join(p.read_text() for p in tmp_path.glob("*.log"))
    assert proc.returncode != 0
    assert log.startswith("mfsdp sbatch: error: DATA_PATH is empty") and log.count("\n") == 1, log
    assert time.monotonic() - t0 < 60
    # mock data asked for explicitly: the job goes on, with the banner
    assert "MOCK DATA" in (SCRIPTS / "cpu-smoke.sbatch").read_text()


def test_a_failing_job_is_reported(cluster, tmp_path):
    script = tmp_path / "broken.sbatch"
    script.write_text(render("cpu-smoke", {"extra_args": "--no-such-flag"}))
    rc, log = _submit(cluster, script, tmp_path)
    assert rc != 0
    # the job's log, or the rank's own log (srun may end the step before the job log has the
    # rank's last lines: seen once on a loaded machine)
    ranks = "\n".join(p.read_text() for p in tmp_path.rglob("ranks/**/*.log"))
    assert "unrecognized arguments: --no-such-flag" in log + ranks, log[-3000:] + ranks[-3000:]


@pytest.mark.parametrize("rel", [rel for name, _, rel in scripts() if name != "cpu-smoke"])
def test_gpu_scripts_pass_test_only_on_a_fake_gpu_node(cluster, rel):
    # One node with 8 (fake) GPUs: the multi-node request is narrowed to it, everything else in the
    # script (GPUs per node, CPUs, time, exclusivity, signal, requeue, singleton) is validated by
    # the real controller.
    proc = cluster.run("sbatch", "--test-only", "--nodes=1", str(SCRIPTS / rel))
    assert proc.returncode == 0, proc.stderr
    assert "to start at" in proc.stderr
    if "--gpus-per-node" in (SCRIPTS / rel).read_text():
        too_many = cluster.run("sbatch", "--test-only", "--nodes=1", "--gpus-per-node=9",
                               str(SCRIPTS / rel))
        assert too_many.returncode != 0  # the check is real: 9 GPUs do not exist on the node


def test_container_script_stops_without_the_mfsdp_source(cluster, tmp_path):
    script = tmp_path / "container.sbatch"
    script.write_text(render("llama3-8b-container", {"nodes": "1", "gpus_per_node": "0",
                                                     "ranks_per_node": "1", "cpus_per_task": "1",
                                                     "global_batch_size": "1", "cp": "1",
                                                     "mock_data": "true"}))
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = cluster.run("sbatch", "--wait", f"--chdir={tmp_path}",
                       f"--export=ALL,MFSDP_SRC={empty}", str(script), timeout=120)
    log = "\n".join(p.read_text() for p in tmp_path.glob("*.log"))
    assert proc.returncode != 0
    assert f"MFSDP_SRC={empty} holds no mfsdp/__init__.py" in log, log



def _wait_for(path_glob, workdir: Path, text: str, timeout: float = 400,
              cluster: Cluster | None = None, job: str | None = None) -> str:
    """The job's logs once ``text`` is in them; with ``cluster`` and ``job``, fail at once (with
    the job's record and the daemons' logs) when the job ends without writing it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = sorted(workdir.glob(path_glob))
        body = "\n".join(p.read_text() for p in logs)
        if text in body:
            return body
        if job is not None and _job_field(cluster, job, "JobState") in _ENDED:
            body = "\n".join(p.read_text() for p in sorted(workdir.glob(path_glob)))
            if text in body:
                return body
            record = cluster.run("scontrol", "show", "job", job).stdout
            raise AssertionError(f"job {job} ended before {text!r} appeared:\n{record}\n"
                                 f"{cluster.log_tail()}\nlog:\n{body[-3000:]}")
        time.sleep(0.3)
    raise AssertionError(f"{text!r} never appeared; log:\n{body[-3000:]}")


_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
          "DEADLINE"}


def _workers(marker: str) -> list[int]:
    """Training processes (not the torchrun agent, not srun) whose command line names
    ``marker``."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        python = b"python" in argv[0].rsplit(b"/", 1)[-1]  # not srun, not the bash -c wrapper
        if python and marker.encode() in argv and b"mfsdp.train" in argv and \
                b"torch.distributed.run" not in argv:
            pids.append(int(cmdline.parent.name))
    return sorted(pids)


@pytest.mark.extended
def test_preemption_and_a_lost_rank_under_slurm(cluster, tmp_path):
    """The cpu-smoke script with checkpoints, as a cluster treats a long job: one rank is killed
    without warning (torchrun restarts both, they resume from the last checkpoint and repeat the
    lost iterations exactly), then Slurm signals the job as before its time limit (the ranks save
    and stop), and a resubmitted job resumes from that checkpoint."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "train.jsonl"
    script = tmp_path / "long.sbatch"
    values = {"save": str(ckpt), "save_interval": "2", "max_restarts": "1",
              "log_jsonl": str(log), "train_iters": "100000", "requeue": "false"}
    script.write_text(render("cpu-smoke", values))
    sub = cluster.run("sbatch", "--parsable", f"--chdir={tmp_path}", EXPORT, str(script))
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    try:
        _wait_for("*.log", tmp_path, "iteration     5/")
        workers = _workers(str(ckpt))
        assert len(workers) == 2, workers
        os.kill(workers[-1], signal.SIGKILL)
        body = _wait_for("*.log", tmp_path, "resumed from iteration")
        resumed = int(re.search(r"resumed from iteration (\d+)", body).group(1))
        _wait_for("*.log", tmp_path, f"iteration {resumed + 3:5d}/")
        # what #SBATCH --signal=B:TERM@120 does before the time limit: SIGTERM to the batch shell
        assert cluster.run("scancel", "--batch", "--signal=TERM", job).returncode == 0
        body = _wait_for("*.log", tmp_path, "exiting after iteration")
    finally:
        deadline = time.monotonic() + 120
        while cluster.run("squeue", "-h", "-j", job).stdout.strip() and \
                time.monotonic() < deadline:
            time.sleep(0.5)
        cluster.run("scancel", job)
    stopped = int(re.search(r"saved iteration (\d+)", body.split("SIGTERM received")[1]).group(1))
    records = [json.loads(x) for x in log.read_text().splitlines()]
    first, repeated = {}, 0
    for r in records:
        if r["iteration"] in first:
            assert r["loss"] == pytest.approx(first[r["iteration"]], rel=1e-6), r
            repeated += 1
        first[r["iteration"]] = r["loss"]
    # the iterations the killed rank's job logged after its last checkpoint are repeated, each
    # with its loss; none when the kill came right after a save (a race the test cannot steer)
    its = [r["iteration"] for r in records]
    drop = next((i for i in range(1, len(its)) if its[i] <= its[i - 1]), None)
    lost = (its[drop - 1] if drop is not None else resumed) - resumed
    assert repeated == lost and sorted(first) == list(range(1, stopped + 1)), (its, resumed)

    values["extra_args"] = f"--exit-interval {stopped + 2}"  # same schedule, two more iterations
    script.write_text(render("cpu-smoke", values))
    for old in tmp_path.glob("*.log"):
        old.unlink()
    rc, out = _submit(cluster, script, tmp_path)
    assert rc == 0, f"{out[-4000:]}\n{cluster.log_tail()}"
    assert f"resumed from iteration {stopped}" in out
    its = [json.loads(x)["iteration"] for x in log.read_text().splitlines()]
    assert its[-2:] == [stopped + 1, stopped + 2]


def _wait_gone(cluster: Cluster, job: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while cluster.run("squeue", "-h", "-j", job).stdout.strip():
        if time.monotonic() > deadline:
            cluster.run("scancel", job)
            raise AssertionError(f"job {job} still in the queue after {timeout} s")
        time.sleep(1)


def _job_field(cluster: Cluster, job: str, field: str) -> str:
    out = cluster.run("scontrol", "show", "job", job).stdout
    return re.search(rf"\b{field}=(\S+)", out).group(1)


def _check_slow_save(body: str, ckpt: Path, delay: float) -> int:
    """The signal's save completed although it took ``delay`` s (> torchrun's 30 s): the ranks
    stopped, saved that iteration and exited; the lock is gone; nothing was SIGKILLed."""
    stopped = int(re.search(r"stopping after iteration (\d+)", body).group(1))
    assert f"saved iteration {stopped} to {ckpt}" in body, body[-3000:]
    assert f"exiting after iteration {stopped}" in body
    assert (ckpt / "latest").read_text().strip() == f"iter_{stopped:07d}"
    assert not (ckpt / ".lock").exists()
    for bad in ("SIGKILL", "exiting via 9", "SignalException", "Traceback"):
        assert bad not in body, body[-3000:]
    return stopped


@pytest.mark.extended
def test_a_save_longer_than_30s_completes_after_the_time_limit_signal(cluster, tmp_path):
    """launcher=srun under a real time limit: #SBATCH --time=4 with --signal=B:TERM@120 signals
    the batch shell 60 to 120 s after the start (Slurm's timer may be a minute early; the ranks
    train from about 15 s), the shell passes SIGTERM to the ranks, whose save is slowed to 45 s;
    the job step and the job exit 0."""
    ckpt = tmp_path / "ckpt"
    script = tmp_path / "limit.sbatch"
    script.write_text(render("cpu-smoke", {"launcher": "srun", "save": str(ckpt),
                                           "save_interval": "100000", "train_iters": "100000",
                                           "time": "00:04:00", "requeue": "false"}))
    rc, out = _submit(cluster, script, tmp_path, SLOW_SAVE_EXPORT)
    job_dir = next((tmp_path / "logs" / "mfsdp-cpu-smoke").glob("*/attempt-0"))
    rank0 = (job_dir / "ranks" / "rank-0.log").read_text()
    assert rc == 0, f"{out[-3000:]}\n{rank0[-3000:]}\n{cluster.log_tail()}"
    assert "SIGTERM ahead of the time limit" in out
    assert (job_dir / "ranks" / "rank-1.log").exists()
    _check_slow_save(rank0, ckpt, 45)


@pytest.mark.extended
def test_a_preempted_job_saves_requeues_and_resumes_on_the_uninterrupted_curve(cluster,
                                                                                 tmp_path):
    """launcher=torchrun (the default): SIGTERM to the batch shell as --signal=B:TERM sends it,
    a save slowed to 45 s completes (torchrun would SIGKILL the ranks after 30 s if it got the
    signal), the job requeues itself, and its second attempt resumes from that checkpoint with
    the losses of an uninterrupted run of the same script."""
    iters = 60
    runs = {}
    for name in ("preempted", "reference"):
        d = tmp_path / name
        d.mkdir()
        values = {"save": str(d / "ckpt"), "save_interval": "100000",
                  "train_iters": str(iters), "log_jsonl": str(d / "train.jsonl")}
        (d / "job.sbatch").write_text(render("cpu-smoke", values))
        runs[name] = d
    d = runs["preempted"]
    sub = cluster.run("sbatch", "--parsable", f"--chdir={d}", SLOW_SAVE_EXPORT,
                      str(d / "job.sbatch"))
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    try:
        _wait_for("*.log", d, "iteration     5/")
        t0 = time.monotonic()
        assert cluster.run("scancel", "--batch", "--signal=TERM", job).returncode == 0
        body = _wait_for("*.log", d, f"requeueing job {job}", timeout=300)
        assert time.monotonic() - t0 > 40  # the 45 s save was waited for
        stopped = _check_slow_save(body, d / "ckpt", 45)
        assert stopped < iters
        # Slurm holds a requeued job back for a while (BeginTime); let it start sooner, but not
        # in the second its first attempt ended: slurmd revokes that attempt's credential with
        # one-second resolution and kills a relaunch in the same second ("Job credential
        # revoked"), which is why Slurm itself delays requeued jobs.
        deadline = time.monotonic() + 60
        while _job_field(cluster, job, "JobState") != "PENDING" and time.monotonic() < deadline:
            time.sleep(0.5)
        cluster.run("scontrol", "update", f"jobid={job}", "StartTime=now+5")
        body = _wait_for("*.log", d, f"resumed from iteration {stopped}", timeout=300,
                         cluster=cluster, job=job)
        _wait_gone(cluster, job)
    finally:
        cluster.run("scancel", job)
    assert _job_field(cluster, job, "ExitCode") == "0:0"
    assert _job_field(cluster, job, "Restarts") == "1"
    assert (d / "logs" / "mfsdp-cpu-smoke" / job / "attempt-1" / "provenance").is_dir()
    resumed = [json.loads(x) for x in (d / "train.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in resumed] == list(range(1, iters + 1))

    ref = runs["reference"]
    rc, out = _submit(cluster, ref / "job.sbatch", ref)
    assert rc == 0, out[-3000:]
    reference = [json.loads(x) for x in (ref / "train.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in reference],
                                                          rel=1e-6)
