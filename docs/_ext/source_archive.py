"""The source of the mfsdp package this guide was built from, as a download on the quickstart.

The guide has no public repository address to give, so the build ships what a reader needs to
install mfsdp: ``docs/generated/mfsdp-source.tar.gz`` holds ``pyproject.toml``, ``README.md``
and the ``mfsdp`` package (its templates and data files included) under ``mfsdp-VERSION/``.
``pip install mfsdp-source.tar.gz`` (or ``pip install -e .`` in the unpacked directory)
installs it. The archive is byte-for-byte the same for the same sources: sorted names, no
timestamps, no owners. The quickstart links it with ``{download}``.
"""

from __future__ import annotations

import gzip
import io
import re
import tarfile
from pathlib import Path

ARCHIVE = Path("docs") / "generated" / "mfsdp-source.tar.gz"
TOP_FILES = ("pyproject.toml", "README.md")


def version(root: Path) -> str:
    """The package's ``__version__``, read from its source (the build need not import it)."""
    text = (root / "mfsdp" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


def members(root: Path) -> list[Path]:
    """The files the archive holds, relative to ``root``: the top files and every file of the
    ``mfsdp`` package except caches and compiled files, sorted."""
    package = [p.relative_to(root) for p in (root / "mfsdp").rglob("*")
               if p.is_file() and "__pycache__" not in p.parts
               and p.suffix not in (".pyc", ".pyo")]
    return [Path(name) for name in TOP_FILES] + sorted(package)


def write_archive(root: Path, out: Path) -> Path:
    """Write the source archive of the package under ``root`` to ``out`` and return ``out``."""
    top = f"mfsdp-{version(root)}"
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in members(root):
            data = (root / rel).read_bytes()
            info = tarfile.TarInfo(f"{top}/{rel.as_posix()}")
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0,
                                                filename="") as gz:
        gz.write(buffer.getvalue())
    return out


def _on_builder_inited(app) -> None:
    write_archive(Path(app.srcdir), Path(app.srcdir) / ARCHIVE)


def setup(app):
    """Write the archive before the pages are read (the quickstart's download needs it)."""
    app.connect("builder-inited", _on_builder_inited)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
