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


def test_the_archive_holds_every_tracked_file_and_is_reproducible(tmp_path):
    """Every file git tracks, the executable bit kept, the same bytes twice; unpacked (no git
    there), the tree lists the same files, so a build from it ships the same archive."""
    first = source_archive.write_archive(ROOT, tmp_path / "a.tar.gz")
    second = source_archive.write_archive(ROOT, tmp_path / "b.tar.gz")
    assert first.read_bytes() == second.read_bytes()
    top = f"mfsdp-{source_archive.version(ROOT)}/"
    with tarfile.open(first) as tar:
        members = tar.getmembers()
        assert all(m.name.startswith(top) for m in members)
        names = {m.name.removeprefix(top) for m in members}
        modes = {m.name.removeprefix(top): m.mode for m in members}
        tar.extractall(tmp_path / "unpacked", filter="data")
    tracked = _git_files()
    assert names == {n for n in tracked if (ROOT / n).is_file()}
    assert {"Makefile", "tests/conftest.py", ".ci/run"} <= names
    assert any(n.startswith("tests/fixtures/megatron_lm/") for n in names)
    assert modes[".ci/run"] == (0o755 if (ROOT / ".ci/run").stat().st_mode & 0o100 else 0o644)
    unpacked = tmp_path / "unpacked" / top
    assert source_archive.members(unpacked) == source_archive.members(ROOT)


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


def test_outside_git_the_archive_leaves_out_what_git_ignores(tmp_path):
    """Outside a git checkout the archive reads .gitignore; on a tree with a file for each of its
    patterns, at the root and one level down, it keeps exactly the files that git itself (a
    repository made there) reports as not ignored."""
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / ".gitignore").write_bytes((ROOT / ".gitignore").read_bytes())
    files = ["keep.py", "Makefile", ".venv/bin/python", "build/html/index.html",
             "mfsdp/__pycache__/x.cpython-311.pyc", "mfsdp/y.pyc", "mfsdp_x.egg-info/PKG-INFO",
             "docs/recipes/plot_a.py", "docs/generated/a.rst", "sg_execution_times.rst",
             "sub/sg_execution_times.rst", "sub/docs/recipes/kept.py", "sub/build/also.txt",
             ".pytest_cache/v", "sub/.hypothesis/x", "docs/recipes.md", "buildings/kept.txt"]
    for name in files:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(name)
    ours = {p.as_posix() for p in source_archive.members(tree)}
    try:
        subprocess.run(["git", "init", "-q", str(tree)], check=True, capture_output=True)
        out = subprocess.run(["git", "ls-files", "--others", "--exclude-standard"], cwd=tree,
                             check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("git is needed as the reference")
    assert ours == set(out.split())
    assert "sub/docs/recipes/kept.py" in ours and "docs/recipes/plot_a.py" not in ours
