"""The source this guide was built from, as a download on the quickstart.

The guide has no public repository address to give, so the build ships the repository itself:
``docs/generated/mfsdp-source.tar.gz`` holds every file git tracks (the ``mfsdp`` package, the
tests and their Megatron-LM checkpoints, the recipes, the example scripts, the guide's sources,
the Makefile) under ``mfsdp-VERSION/``. Outside a git checkout (a build from the unpacked
archive) it holds the tree less what ``.gitignore`` leaves out. ``pip install
mfsdp-source.tar.gz`` installs the package; in the unpacked directory ``make test`` and ``make
docs`` run as in a clone. The archive is byte-for-byte the same for the same sources: sorted
names, no timestamps, no owners. The quickstart links it with ``{download}``.
"""

from __future__ import annotations

import fnmatch
import gzip
import re
import subprocess
import tarfile
from pathlib import Path

ARCHIVE = Path("docs") / "generated" / "mfsdp-source.tar.gz"


def version(root: Path) -> str:
    """The package's ``__version__``, read from its source (the build need not import it)."""
    text = (root / "mfsdp" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


def _ignore_rules(root: Path) -> list[tuple[str, bool, bool]]:
    """``root/.gitignore``'s patterns as ``(pattern, anchored, directories_only)``: the subset
    of git's rules this repository's file uses (no negation, no ``**``)."""
    rules = []
    gitignore = root / ".gitignore"
    lines = gitignore.read_text().splitlines() if gitignore.is_file() else []
    for line in [".git/", *lines]:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("!") or "**" in line:
            raise ValueError(f"{gitignore}: {line!r} needs more of git's rules than this reads")
        directories_only = line.endswith("/")
        line = line.rstrip("/")
        rules.append((line.lstrip("/"), "/" in line, directories_only))
    return rules


def _ignored(rel: Path, rules: list[tuple[str, bool, bool]]) -> bool:
    """Whether git would leave ``rel`` (a file's path from the root) out under ``rules``: a
    pattern with a slash matches the path from the root, one without matches any name in it;
    a directory's pattern matches the directories above the file only."""
    parts = rel.parts
    for pattern, anchored, directories_only in rules:
        for depth in range(1, len(parts) + 1):
            if directories_only and depth == len(parts):
                break
            name = "/".join(parts[:depth]) if anchored else parts[depth - 1]
            if fnmatch.fnmatchcase(name, pattern):
                return True
    return False


def members(root: Path) -> list[Path]:
    """The files the archive holds, relative to ``root``, sorted: git's tracked files (those
    present), or in a tree that is not a git checkout every file ``.gitignore`` keeps."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True,
                             check=True).stdout.decode()
        names = [Path(n) for n in out.split("\0") if n and (root / n).is_file()]
    except (OSError, subprocess.CalledProcessError):
        rules = _ignore_rules(root)
        names = [p.relative_to(root) for p in root.rglob("*")
                 if p.is_file() and not _ignored(p.relative_to(root), rules)]
    return sorted(names)


def write_archive(root: Path, out: Path) -> Path:
    """Write the source archive of the package under ``root`` to ``out`` and return ``out``."""
    top = f"mfsdp-{version(root)}"
    out.parent.mkdir(parents=True, exist_ok=True)
    # streamed: the tar is written into the gzip stream, one file at a time
    with open(out, "wb") as raw, \
            gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, compresslevel=6, filename="") as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in members(root):
            stat = (root / rel).stat()
            info = tarfile.TarInfo(f"{top}/{rel.as_posix()}")
            info.size, info.mtime = stat.st_size, 0
            info.mode = 0o755 if stat.st_mode & 0o100 else 0o644
            with open(root / rel, "rb") as f:
                tar.addfile(info, f)
    return out


def _on_builder_inited(app) -> None:
    write_archive(Path(app.srcdir), Path(app.srcdir) / ARCHIVE)


def setup(app):
    """Write the archive before the pages are read (the quickstart's download needs it)."""
    app.connect("builder-inited", _on_builder_inited)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
