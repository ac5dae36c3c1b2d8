"""The rendered sbatch scripts under a real single-node Slurm (see ``slurm_cluster.py``).

The CPU smoke script runs to the end with ``sbatch --wait`` (2 gloo ranks) and its log must show
the loss going down; the GPU scripts must pass ``sbatch --test-only`` against a node with fake
GPUs. Where Slurm cannot be started the tests skip and say why; in CI they fail instead.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from conftest import ROOT, skip_or_fail
from slurm_cluster import Cluster, why_not

from mfsdp.sbatch import render

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


def _submit(cluster: Cluster, script: Path, workdir: Path) -> tuple[int, str]:
    proc = cluster.run("sbatch", "--wait", f"--chdir={workdir}",
                       f"--export=ALL,PYTHON={sys.executable}", str(script), timeout=600)
    logs = sorted(workdir.glob("*.log"))
    text = "\n".join(p.read_text() for p in logs)
    return proc.returncode, proc.stdout + proc.stderr + "\n" + text


def test_cpu_smoke_script_trains_under_slurm(cluster, tmp_path):
    rc, log = _submit(cluster, SCRIPTS / "cpu-smoke.sbatch", tmp_path)
    assert rc == 0, f"job failed:\n{log[-4000:]}\n{cluster.log_tail()}"
    losses = [float(x) for x in re.findall(r"iteration +\d+/\d+ \| loss ([0-9.]+)", log)]
    assert len(losses) == 10, log[-3000:]
    assert losses[-1] < losses[0], losses
    assert "2 ranks (gloo)" in log


def test_a_failing_job_is_reported(cluster, tmp_path):
    script = tmp_path / "broken.sbatch"
    script.write_text(render("cpu-smoke", {"extra_args": "--no-such-flag"}))
    rc, log = _submit(cluster, script, tmp_path)
    assert rc != 0
    assert "unrecognized arguments: --no-such-flag" in log


@pytest.mark.parametrize("name", ["llama3-8b", "deepseek-v3"])
def test_gpu_scripts_pass_test_only_on_a_fake_gpu_node(cluster, name):
    # One node with 8 (fake) GPUs: the multi-node request is narrowed to it, everything else in the
    # script (GPUs per node, CPUs, time, exclusivity) is validated by the real controller.
    proc = cluster.run("sbatch", "--test-only", "--nodes=1", str(SCRIPTS / f"{name}.sbatch"))
    assert proc.returncode == 0, proc.stderr
    assert "to start at" in proc.stderr
    too_many = cluster.run("sbatch", "--test-only", "--nodes=1", "--gpus-per-node=9",
                           str(SCRIPTS / f"{name}.sbatch"))
    assert too_many.returncode != 0  # the check is real: 9 GPUs do not exist on the node


def test_convert_script_passes_test_only(cluster):
    proc = cluster.run("sbatch", "--test-only", str(SCRIPTS / "convert.sbatch"))
    assert proc.returncode == 0, proc.stderr
