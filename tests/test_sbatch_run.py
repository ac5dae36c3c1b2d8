"""The rendered sbatch scripts executed by bash, start to end, with stub ``srun``, ``scontrol``
and ``python`` on PATH: the argv the trainer would get (parsed by torchrun's own parser where
torchrun runs), and what the script does with the launcher's exit status after a save on
SIGTERM. Values with spaces, quotes, ``$``, ``*`` and backquotes arrive as written; newlines
are refused at render time.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from mfsdp.tools import sbatch

SRUN = """#!/bin/bash
# srun's options dropped; the command runs as task 0 of node 0
while [[ $# -gt 0 && "$1" == -* ]]; do shift; done
export SLURM_PROCID=0 SLURM_NTASKS=1 SLURM_LOCALID=0 SLURM_NODEID=0
exec "$@"
"""
SCONTROL = """#!/bin/bash
if [[ "$1 $2" == "show hostnames" ]]; then echo node1; exit 0; fi
echo "$*" >> "$STUB_OUT/scontrol.txt"
"""
# python: the script's find_spec checks pass (-c), pip freeze prints nothing; the launch records
# its argv and environment, writes the ranks' marker when asked, and exits with STUB_STATUS
PYTHON = """#!/bin/bash
if [[ "$1" == "-c" ]]; then echo /code; exit 0; fi
if [[ "$1 $2" == "-m pip" ]]; then exit 0; fi
printf '%s\\0' "$@" > "$STUB_OUT/argv.bin"
env -0 > "$STUB_OUT/env.bin"
if [[ -n "${STUB_MARKER:-}" ]]; then echo '{"iteration": 7}' > "$MFSDP_PREEMPTION_MARKER"; fi
exit "${STUB_STATUS:-0}"
"""


def _stubs(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("python", PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _execute(text: str, tmp_path: Path, **env) -> tuple[subprocess.CompletedProcess, dict]:
    """Run the script in ``tmp_path`` as Slurm would start it (job 123 on node1); return the
    process and what the launch received: ``argv`` (the stub python's), ``env``, ``scontrol``
    (the calls that were not ``show hostnames``)."""
    bin_dir = _stubs(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    base = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "STUB_OUT": str(out),
            "PYTHON": str(bin_dir / "python"), "SLURM_JOB_ID": "123", "SLURM_JOB_NAME": "j",
            "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "node1",
            "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_CPUS_PER_TASK": "2"}
    proc = subprocess.run(["bash", str(script)], cwd=tmp_path, env={**base, **env},
                          capture_output=True, text=True, timeout=60)
    got = {"argv": [], "env": {}, "scontrol": []}
    if (out / "argv.bin").exists():
        got["argv"] = (out / "argv.bin").read_text().split("\0")[:-1]
        got["env"] = dict(kv.split("=", 1) for kv in
                          (out / "env.bin").read_text().split("\0") if "=" in kv)
    if (out / "scontrol.txt").exists():
        got["scontrol"] = (out / "scontrol.txt").read_text().splitlines()
    return proc, got


def _trainer_argv(argv: list[str]) -> list[str]:
    """The trainer's arguments: what torchrun passes on (parsed by torchrun's own parser), or
    what follows ``-m mfsdp.train`` / the script under launcher=srun."""
    if argv[:2] == ["-m", "torch.distributed.run"]:
        from torch.distributed.run import get_args_parser

        args = get_args_parser().parse_args(argv[2:])
        return args.training_script_args
    return argv[2:] if argv[0] == "-m" else argv[1:]


NASTY = {"save": "ck dir/it's $HOME*", "load": "/data/with space/\"q\"/`x`/$(id)/*",
         "log_jsonl": "/logs/a b;$x.jsonl"}


@pytest.mark.parametrize("overrides", [
    {}, {"launcher": "srun"}, {"trainer": "megatron-lm", "megatron_lm_dir": "/opt/m lm"}],
    ids=["torchrun", "srun", "megatron-lm"])
def test_paths_arrive_intact_through_the_whole_script(tmp_path, overrides):
    """llama3-8b rendered with a --load path holding a space, quotes, backquotes, $(...) and *,
    and a --save of the same kind, run by bash end to end: the trainer's argv holds them as
    written (torchrun's parser reads its part), nothing was executed or globbed."""
    values = dict(NASTY, mock_data="true", **overrides)
    if overrides.get("trainer") == "megatron-lm":
        values.pop("log_jsonl")
        lm = Path(overrides["megatron_lm_dir"])
        overrides = dict(overrides, megatron_lm_dir=str(tmp_path / lm.name))
        values["megatron_lm_dir"] = overrides["megatron_lm_dir"]
        (tmp_path / lm.name).mkdir()
        (tmp_path / lm.name / "pretrain_gpt.py").write_text("")
    (tmp_path / "ck dir").mkdir()  # a glob that could match, were the value unquoted
    proc, got = _execute(sbatch.render("llama3-8b", values), tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    args = _trainer_argv(got["argv"])
    assert args[args.index("--load") + 1] == NASTY["load"]
    assert args[args.index("--save") + 1] == f"{tmp_path}/{NASTY['save']}"
    if "log_jsonl" in values:
        assert args[args.index("--log-jsonl") + 1] == NASTY["log_jsonl"]
    assert args.count("--load") == 1 and "" not in args
    assert not list(tmp_path.glob("x*")) and "uid=" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_a_relative_metrics_log_lands_beside_the_per_rank_logs(tmp_path, launcher):
    """llama3-8b's ``log_jsonl`` (a relative name, with a space and a ``$``) run by bash: the
    trainer's ``--log-jsonl`` is in the job's log directory, ``logs/JOB_NAME/JOB_ID/attempt-N``,
    beside ``ranks/``; an absolute one stays as given (test above)."""
    values = {"log_jsonl": "my $run.jsonl", "mock_data": "true", "launcher": launcher}
    proc, got = _execute(sbatch.render("llama3-8b", values), tmp_path, SLURM_RESTART_COUNT="2")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    args = _trainer_argv(got["argv"])
    job_dir = tmp_path / "logs" / "j" / "123" / "attempt-2"
    assert args[args.index("--log-jsonl") + 1] == f"{job_dir}/my $run.jsonl"
    assert (job_dir / "ranks").is_dir()


def test_convert_paths_arrive_intact(tmp_path):
    """The convert script's SRC and DST with spaces, quotes and *: mfsdp convert's argv."""
    src, dst = "/ckpt/a b/$c `d`", "/out/it's*"
    proc, got = _execute(sbatch.render("convert", {"src": src, "dst": dst}), tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    i = got["argv"].index("--to")
    assert got["argv"][i + 2:i + 4] == [src, dst], got["argv"]


@pytest.mark.parametrize("overrides, json_name, device", [
    ({}, "j-123.json", "cuda"),
    ({"output": "bw+1/%j-of-%x.out", "gpus_per_node": "0", "ranks_per_node": "2",
      "size_mib": "1"}, "bw+1/123-of-j.out.json", "cpu")], ids=["gpu", "cpu"])
def test_the_bandwidth_script_runs_the_tool_with_its_json_beside_the_log(tmp_path, overrides,
                                                                          json_name, device):
    """The bandwidth script run by bash on node 1 of 2: torchrun's own parser reads the
    rendezvous of the training scripts and ``-m mfsdp.cli bandwidth``, whose own parser reads
    its flags; ``--json`` is the log's name (Slurm's %x and %j expanded) with ``.json``, in
    the job's working directory; NCCL_DEBUG is INFO unless the environment sets it."""
    from torch.distributed.run import get_args_parser

    from mfsdp.tools import bandwidth

    text = sbatch.render("bandwidth", dict(overrides, rdzv_port="29400"))
    for env, nccl in (({}, "INFO"), ({"NCCL_DEBUG": "WARN"}, "WARN")):
        where = tmp_path / nccl
        where.mkdir()
        proc, got = _execute(text, where, SLURM_JOB_NUM_NODES="2", **env)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert got["argv"][:2] == ["-m", "torch.distributed.run"]
        run = get_args_parser().parse_args(got["argv"][2:])
        assert (run.nnodes, run.rdzv_backend, run.rdzv_endpoint, run.rdzv_id) == (
            "2", "c10d", "node1:29400", "123")
        assert run.nproc_per_node == ("8" if device == "cuda" else "2")
        assert run.log_dir == f"{where}/logs/j/123/ranks/node-0"
        assert run.module and run.training_script == "mfsdp.cli"
        assert run.training_script_args[0] == "bandwidth"
        args = bandwidth.build_parser().parse_args(run.training_script_args[1:])
        assert args.device == device and args.json == f"{where}/{json_name}"
        assert f"mfsdp sbatch: the measurements are in {where}/{json_name}\n" in proc.stdout
        if device == "cuda":
            assert got["env"]["NCCL_DEBUG"] == nccl
        else:
            assert "NCCL_DEBUG" not in got["env"] or env
            assert got["env"]["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize("key", ["save", "load", "log_dir", "job_name", "data_path"])
def test_a_newline_in_a_value_is_refused_in_one_line(key):
    """A newline in a path or name cannot survive Slurm's #SBATCH lines, the job's log lines
    or DATA_PATH's split: refused at render time, naming the key."""
    with pytest.raises(sbatch.RenderError) as err:
        sbatch.render("llama3-8b", {key: "/a\nb"})
    assert str(err.value).startswith(f"{key}='/a\\nb': a newline or control character")


@pytest.mark.parametrize("status, marker, want", [
    (1, True, 0), (1, False, 1), (0, False, 0)],
    ids=["torchrun-1-after-a-clean-save", "a-real-failure", "success"])
def test_the_launchers_status_after_a_save_on_sigterm(tmp_path, status, marker, want):
    """torchrun exits 1 after a forwarded SIGTERM although its ranks saved: with the ranks'
    marker the script exits 0 and says why; without it, the failure stays a failure. The
    ranks are told the grace (the --signal lead) and torchrun its shutdown timeout."""
    env = {"STUB_STATUS": str(status)}
    if marker:
        env["STUB_MARKER"] = "1"
    proc, got = _execute(sbatch.render("llama3-8b", {"mock_data": "true"}), tmp_path, **env)
    assert proc.returncode == want, proc.stderr[-2000:]
    job_dir = tmp_path / "logs" / "j" / "123" / "attempt-0"
    assert got["env"]["MFSDP_PREEMPTION_MARKER"] == str(job_dir / "saved-on-sigterm")
    assert got["env"]["MFSDP_PREEMPTION_GRACE_S"] == "120"
    assert got["env"]["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "120"
    said = [line for line in proc.stdout.splitlines() if "saved on SIGTERM" in line]
    if marker:
        assert said == ["mfsdp sbatch: the ranks saved on SIGTERM ({\"iteration\": 7}); the "
                        "launcher's exit status 1 is read as 0"]
    else:
        assert said == []
    assert got["scontrol"] == []  # no time-limit signal came: nothing requeues


def test_a_stale_marker_of_an_earlier_attempt_is_removed(tmp_path):
    """A marker left in the job directory (the same attempt run again by hand) is removed
    before the launch: a later failure is not read as a clean save."""
    job_dir = tmp_path / "logs" / "j" / "123" / "attempt-0"
    job_dir.mkdir(parents=True)
    (job_dir / "saved-on-sigterm").write_text(json.dumps({"iteration": 1}))
    proc, _ = _execute(sbatch.render("llama3-8b", {"mock_data": "true"}), tmp_path,
                       STUB_STATUS="1")
    assert proc.returncode == 1 and not (job_dir / "saved-on-sigterm").exists()
    assert os.path.isdir(job_dir / "provenance")


def test_a_requeued_job_resumes_from_its_own_checkpoints_not_the_starting_load(tmp_path):
    """With load and save both set, the first attempt loads the starting checkpoint; once
    CHECKPOINT_DIR holds a checkpoint (a requeue, a resubmission), --load is CHECKPOINT_DIR,
    said in one line: no attempt trains again from the start over newer checkpoints."""
    text = sbatch.render("llama3-8b", {"mock_data": "true", "load": "/pre trained/ck",
                                       "save": "run ck"})
    first = tmp_path / "first"
    first.mkdir()
    proc, got = _execute(text, first)
    args = _trainer_argv(got["argv"])
    assert proc.returncode == 0 and args[args.index("--load") + 1] == "/pre trained/ck"
    again = tmp_path / "again"
    (again / "run ck").mkdir(parents=True)
    (again / "run ck" / "latest").write_text("iter_0000500\n")
    proc, got = _execute(text, again)
    args = _trainer_argv(got["argv"])
    assert proc.returncode == 0 and args[args.index("--load") + 1] == f"{again}/run ck"
    assert (f"mfsdp sbatch: {again}/run ck holds a checkpoint: resuming from it, not from the "
            "starting --load") in proc.stdout
