"""The quickstart's download: the package's source archive, written at every docs build."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

import source_archive  # noqa: E402


def _git_files(*paths: str) -> set[str]:
    try:
        out = subprocess.run(["git", "ls-files", *paths], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of tracked files to compare with")
    return {line for line in out.splitlines() if line}


def test_the_archive_holds_every_tracked_file_of_the_package_and_is_reproducible(tmp_path):
    first = source_archive.write_archive(ROOT, tmp_path / "a.tar.gz")
    second = source_archive.write_archive(ROOT, tmp_path / "b.tar.gz")
    assert first.read_bytes() == second.read_bytes()
    top = f"mfsdp-{source_archive.version(ROOT)}/"
    with tarfile.open(first) as tar:
        names = {name.removeprefix(top) for name in tar.getnames()}
        assert all(name.startswith(top) for name in tar.getnames())
    assert names == _git_files("mfsdp", "pyproject.toml", "README.md")


def test_the_unpacked_source_runs_the_cli(tmp_path):
    archive = source_archive.write_archive(ROOT, tmp_path / "mfsdp-source.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path, filter="data")
    src = tmp_path / f"mfsdp-{source_archive.version(ROOT)}"
    elsewhere = tmp_path / "work"
    elsewhere.mkdir()
    env = {"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"}
    where = subprocess.run([sys.executable, "-c", "import mfsdp; print(mfsdp.__file__)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert Path(where.stdout.strip()).resolve() == (src / "mfsdp" / "__init__.py").resolve()
    run = subprocess.run([sys.executable, "-m", "mfsdp.cli", "sbatch", "render", "cpu-smoke"],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "#SBATCH --job-name=mfsdp-cpu-smoke" in run.stdout  # the templates came along
