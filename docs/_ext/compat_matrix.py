"""Sphinx directives ``mfsdp-compat-matrix``, ``mfsdp-compat-matrix-parallel``,
``mfsdp-compat-matrix-checkpoint`` and ``mfsdp-compat-matrix-engines``: the compatibility matrix
of :mod:`mfsdp.check.matrix` (and, in the engines table, the same matrix under PyTorch FSDP2 and
upstream Megatron-FSDP, ``mfsdp check --engine``, cached in
``build/compatibility-matrix-engines.json`` by the same digest and megatron-fsdp's version), its
table of tensor, sequence, context and expert parallelism (:mod:`mfsdp.check.matrix_parallel`)
and its table of checkpoint reloads and conversions (:mod:`mfsdp.check.matrix_checkpoint`),
measured when the docs are built and cached like the recipes.

Usage in MyST::

    ```{mfsdp-compat-matrix}
    ```

    ```{mfsdp-compat-matrix-parallel}
    ```

    ```{mfsdp-compat-matrix-checkpoint}
    ```

At ``builder-inited`` the extension computes a digest of everything the measurement depends on
(the ``mfsdp`` package source, which holds the matrix code, this file, the Python and torch
versions). The same digest as the cached data in ``build/compatibility-matrix.json``: the data is
reused; another digest or no cache: the matrix is measured (about 40 s of CPU, one launch of
4 gloo ranks) and the cache rewritten. The directive renders the cached data as a table. The
parallelism and checkpoint tables are cached the same way, by the same digest, in
``build/compatibility-matrix-parallel.json`` and ``build/compatibility-matrix-checkpoint.json``."""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

from docutils import nodes
from cli_reference import rst_nodes  # docs/_ext: the same strict rst parsing
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "build" / "compatibility-matrix.json"
CACHE_PARALLEL = ROOT / "build" / "compatibility-matrix-parallel.json"
CACHE_CHECKPOINT = ROOT / "build" / "compatibility-matrix-checkpoint.json"
CACHE_ENGINES = ROOT / "build" / "compatibility-matrix-engines.json"
UPSTREAM_ENGINES = ("fsdp2", "megatron_fsdp")
"""The engines measured next to mfsdp (``mfsdp check --engine``) in the engines table."""

logger = logging.getLogger(__name__)


def inputs_digest(root: Path = ROOT) -> str:
    """sha256 of the Python and torch versions, every file of the ``mfsdp`` package and this
    extension: what the measured matrix depends on."""
    import torch

    h = hashlib.sha256(f"{sys.version}|{torch.__version__}".encode())
    files = sorted(p for p in (root / "mfsdp").rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts)
    for path in [*files, Path(__file__).resolve()]:
        h.update(path.name.encode() if not path.is_relative_to(root)
                 else path.relative_to(root).as_posix().encode())
        h.update(b"\0" + path.read_bytes())
    return h.hexdigest()


def load_or_measure(cache: Path = CACHE, digest: str | None = None,
                    measure: Callable[[], dict[str, Any]] | None = None) -> tuple[dict, bool]:
    """``(data, measured)``: the cached matrix when ``cache`` holds one for ``digest`` (default:
    :func:`inputs_digest`), else a fresh ``measure()`` (default
    :func:`mfsdp.check.matrix.measure_matrix`), written to ``cache``."""
    digest = digest or inputs_digest()
    if cache.exists():
        cached = json.loads(cache.read_text())
        if cached.get("digest") == digest and "measured_on" in cached["data"]:
            return cached["data"], False
    if measure is None:
        from mfsdp.check.matrix import measure_matrix as measure
    from measured import this_machine  # docs/_ext: when, where and with what

    data = {**measure(), "measured_on": this_machine()}
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"digest": digest, "data": data}, indent=1) + "\n")
    return data, True


def engines_digest() -> str:
    """:func:`inputs_digest` and the installed megatron-fsdp's version: what the engines table
    depends on."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        upstream = version("megatron-fsdp")
    except PackageNotFoundError:
        upstream = "absent"
    return hashlib.sha256(f"{inputs_digest()}|megatron-fsdp {upstream}".encode()).hexdigest()


def _measure_engines() -> dict[str, Any]:
    """The strategy x outer x precision matrix under each of :data:`UPSTREAM_ENGINES`; an engine
    that is not installed is ``{"missing": why}``."""
    from mfsdp.check.engines import get_engine
    from mfsdp.check.matrix import measure_matrix

    out: dict[str, Any] = {}
    for engine in UPSTREAM_ENGINES:
        why = get_engine(engine).missing()
        # every cell in one launch of 4 ranks: upstream's 36 take several minutes on a busy
        # 2-core machine, past measure_matrix's default limit (which would relaunch each cell)
        out[engine] = {"missing": why} if why else measure_matrix(engine=engine, timeout=1800.0)
    return out


def rst_escape(text: str) -> str:
    """``text`` (an engine's own message) as literal reStructuredText: its markup characters
    (``aten.add_.Tensor`` reads as a link target otherwise) escaped."""
    for ch in "\\*`_|":
        text = text.replace(ch, "\\" + ch)
    return text


def rst_engines_table(mfsdp_data: dict[str, Any], engines: dict[str, Any]) -> str:
    """mfsdp's matrix and each engine's side by side as a reStructuredText list-table: one row
    per strategy, outer dimension and precision, one column per engine; refusals and layouts an
    engine lacks are numbered, their text below the table."""
    from mfsdp.check.engines import get_engine
    from mfsdp.check.matrix import PRECISION_TITLES

    columns = [("mfsdp", f"mfsdp ({mfsdp_data.get('engine_version', 'this build')})",
                mfsdp_data)]
    for engine in UPSTREAM_ENGINES:
        data = engines.get(engine, {"missing": "not measured"})
        title = get_engine(engine).title
        columns.append((engine, f"{title} ({data.get('engine_version', 'not installed')})",
                        data))
    cells = {name: {(c["strategy"], c["outer"], c["precision"]): c
                    for c in data.get("cells", [])} for name, _, data in columns}
    lines = [".. list-table::", "   :header-rows: 1", "", "   * - strategy", "     - outer",
             "     - precision"]
    lines += [f"     - {title}" for _, title, _ in columns]
    notes: list[str] = []
    for c in mfsdp_data["cells"]:
        key = (c["strategy"], c["outer"], c["precision"])
        lines += [f"   * - ``{key[0]}``", f"     - {key[1]}",
                  f"     - {PRECISION_TITLES[key[2]]}"]
        for name, _, data in columns:
            cell = cells[name].get(key)
            if "missing" in data:
                text = f"not measured: {rst_escape(data['missing'])}"
            elif cell is not None and cell["status"] in ("lacks", "refused"):
                kind = "n/a" if cell["status"] == "lacks" else "refused"
                note = f"{kind}: {rst_escape(cell['message'])}"
                if note not in notes:
                    notes.append(note)
                text = f"{kind} [{notes.index(note) + 1}]"
            elif cell is not None and cell["status"] == "fails":
                text = f"**fails**: {rst_escape(cell['message'])}"
            else:
                text = _cell_rst(cell, [])
            lines.append(f"     - {' '.join(text.split()) or ' '}")
    if notes:
        lines.append("")
        lines += [f"| [{i}] {' '.join(m.split())}" for i, m in enumerate(notes, 1)]
    for name, title, data in columns[1:]:
        if "cells" not in data:
            continue
        cost = (f"{data['launches']} launch{'es' if data['launches'] != 1 else ''}, "
                f"{data['seconds']} s wall, {data['cpu_seconds']} s of CPU")
        replaced = ("; on CPU ranks with these replaced: "
                    + rst_escape("; ".join(data["replacements"])) if data.get("replacements")
                    else "")
        lines += ["", f"{title}: measured on {data['nproc']} gloo ranks, model "
                      f"``{data['model']}``, {data['steps']} steps of SGD (lr {data['lr']}): "
                      f"{cost}{replaced}."]
    return "\n".join(lines)


def _measure_parallel() -> dict[str, Any]:
    from mfsdp.check.matrix_parallel import measure_parallel

    return measure_parallel()


def _measure_checkpoints() -> dict[str, Any]:
    from mfsdp.check.matrix_checkpoint import measure_checkpoints

    return measure_checkpoints()


def _cell_rst(cell: dict | None, refusals: list[str]) -> str:
    """A cell's text; a refusal is named by number, its message kept in ``refusals``."""
    from mfsdp.check.matrix import cell_text

    if cell is not None and cell["status"] == "refused":
        if cell["message"] not in refusals:
            refusals.append(cell["message"])
        return f"refused [{refusals.index(cell['message']) + 1}]"
    return cell_text(cell) if cell is not None else ""


def _rst_by_strategy(data: dict[str, Any], key: str, order, footer: str) -> str:
    """A table of ``data["cells"]`` as a reStructuredText list-table: one row per strategy, one
    column per value of ``key`` (in ``order``), ``footer`` below (and any refusals)."""
    columns = [p for p in order if any(c[key] == p for c in data["cells"])]
    rows: dict[str, dict[str, dict]] = {}
    for c in data["cells"]:
        rows.setdefault(c["strategy"], {})[c[key]] = c
    lines = [".. list-table::", "   :header-rows: 1", "", "   * - strategy"]
    lines += [f"     - {p}" for p in columns]
    refusals: list[str] = []
    for strategy, by_column in rows.items():
        lines.append(f"   * - ``{strategy}``")
        for p in columns:
            text = _cell_rst(by_column.get(p), refusals)
            lines.append(f"     - {' '.join(text.split()) or ' '}")
    if refusals:
        lines.append("")
        lines += [f"| [{i}] refused: {' '.join(m.split())}" for i, m in enumerate(refusals, 1)]
    cost = (f"{data['launches']} launch{'es' if data['launches'] != 1 else ''}, "
            f"{data['seconds']} s wall, {data['cpu_seconds']} s of CPU.")
    return "\n".join(lines + ["", f"{footer}: {cost}"])


def rst_parallel_table(data: dict[str, Any]) -> str:
    """The parallelism table as a reStructuredText list-table (one row per strategy)."""
    from mfsdp.check.matrix_parallel import PARALLEL

    models = ", ".join(f"``{m}``" for m in data["models"].values())
    return _rst_by_strategy(data, "parallel", PARALLEL,
                            f"Measured on {data['nproc']} gloo ranks, models {models}, "
                            f"{data['steps']} steps of SGD (lr {data['lr']})")


def rst_checkpoint_table(data: dict[str, Any]) -> str:
    """The checkpoint table as a reStructuredText list-table (one row per strategy)."""
    from mfsdp.check.matrix_checkpoint import ROUTES

    optimizers = "; ".join(f"{route}: {'AdamW' if opt == 'adamw' else 'SGD'}"
                           for route, opt in data["optimizers"].items())
    return _rst_by_strategy(data, "route", ROUTES,
                            f"Measured on {data['nproc']} gloo ranks, model ``{data['model']}``, "
                            f"one step, the trip, one step (lr {data['lr']}; {optimizers})")


def rst_table(data: dict[str, Any]) -> str:
    """The matrix as a reStructuredText list-table (the page's table)."""
    from mfsdp.check.matrix import PRECISION_TITLES, PRECISIONS

    precisions = [p for p in PRECISIONS if any(c["precision"] == p for c in data["cells"])]
    rows: dict[tuple[str, str], dict[str, dict]] = {}
    for c in data["cells"]:
        rows.setdefault((c["strategy"], c["outer"]), {})[c["precision"]] = c
    lines = [".. list-table::", "   :header-rows: 1", "",
             "   * - strategy", "     - outer"]
    lines += [f"     - {PRECISION_TITLES[p]}" for p in precisions]
    # A refusal is long and the same across a row: the cell names it by number, the API's
    # message is written once below the table.
    refusals: list[str] = []
    for (strategy, outer), by_precision in rows.items():
        lines += [f"   * - ``{strategy}``", f"     - {outer}"]
        for p in precisions:
            text = _cell_rst(by_precision.get(p), refusals)
            lines.append(f"     - {' '.join(text.split()) or ' '}")
    if refusals:
        lines.append("")
        lines += [f"| [{i}] refused: {' '.join(m.split())}" for i, m in enumerate(refusals, 1)]
    lines += ["", f"Measured on {data['nproc']} gloo ranks, model ``{data['model']}``, "
              f"{data['steps']} steps of SGD (lr {data['lr']}): {data['launches']} "
              f"launch{'es' if data['launches'] != 1 else ''}, "
              f"{data['seconds']} s wall, {data['cpu_seconds']} s of CPU."]
    return "\n".join(lines)


def _ensure_engines(app) -> None:
    start = time.perf_counter()
    app._mfsdp_matrix_engines, measured = load_or_measure(CACHE_ENGINES, engines_digest(),
                                                          measure=_measure_engines)
    logger.info("compatibility matrix, engines: %s",
                f"measured in {time.perf_counter() - start:.0f} s" if measured
                else "reused (nothing it depends on changed)")


def _ensure_matrix(app) -> None:
    start = time.perf_counter()
    app._mfsdp_matrix, measured = load_or_measure()
    logger.info("compatibility matrix: %s", f"measured in {time.perf_counter() - start:.0f} s"
                if measured else "reused (nothing it depends on changed)")
    start = time.perf_counter()
    app._mfsdp_matrix_parallel, measured = load_or_measure(CACHE_PARALLEL,
                                                           measure=_measure_parallel)
    logger.info("compatibility matrix, parallelism: %s",
                f"measured in {time.perf_counter() - start:.0f} s" if measured
                else "reused (nothing it depends on changed)")
    start = time.perf_counter()
    app._mfsdp_matrix_checkpoint, measured = load_or_measure(CACHE_CHECKPOINT,
                                                             measure=_measure_checkpoints)
    logger.info("compatibility matrix, checkpoints: %s",
                f"measured in {time.perf_counter() - start:.0f} s" if measured
                else "reused (nothing it depends on changed)")
    _ensure_engines(app)


def _measured_on(data: dict[str, Any]) -> list[nodes.Node]:
    """The line saying when, where and with what the table was measured (docs/_ext/measured.py);
    a cache that may be reused by a later build keeps the stamp of the run that measured it."""
    from measured import line, paragraph

    return [paragraph(line(data["measured_on"]))]


class CompatMatrixDirective(SphinxDirective):
    """Render the measured (or cached) compatibility matrix."""

    def run(self) -> list[nodes.Node]:
        self.env.note_dependency(str(CACHE))  # re-read the page when the matrix is re-measured
        data = getattr(self.env.app, "_mfsdp_matrix", None)
        if data is None:
            data, _ = load_or_measure()
        return rst_nodes(rst_table(data)) + _measured_on(data)


class CompatMatrixParallelDirective(SphinxDirective):
    """Render the measured (or cached) table of tensor, sequence, context and expert
    parallelism."""

    def run(self) -> list[nodes.Node]:
        self.env.note_dependency(str(CACHE_PARALLEL))
        data = getattr(self.env.app, "_mfsdp_matrix_parallel", None)
        if data is None:
            data, _ = load_or_measure(CACHE_PARALLEL, measure=_measure_parallel)
        return rst_nodes(rst_parallel_table(data)) + _measured_on(data)


class CompatMatrixCheckpointDirective(SphinxDirective):
    """Render the measured (or cached) table of checkpoint reloads and conversions."""

    def run(self) -> list[nodes.Node]:
        self.env.note_dependency(str(CACHE_CHECKPOINT))
        data = getattr(self.env.app, "_mfsdp_matrix_checkpoint", None)
        if data is None:
            data, _ = load_or_measure(CACHE_CHECKPOINT, measure=_measure_checkpoints)
        return rst_nodes(rst_checkpoint_table(data)) + _measured_on(data)


class CompatMatrixEnginesDirective(SphinxDirective):
    """Render mfsdp's matrix next to FSDP2's and upstream Megatron-FSDP's (measured or cached)."""

    def run(self) -> list[nodes.Node]:
        self.env.note_dependency(str(CACHE))
        self.env.note_dependency(str(CACHE_ENGINES))
        data = getattr(self.env.app, "_mfsdp_matrix", None)
        if data is None:
            data, _ = load_or_measure()
        engines = getattr(self.env.app, "_mfsdp_matrix_engines", None)
        if engines is None:
            engines, _ = load_or_measure(CACHE_ENGINES, engines_digest(),
                                         measure=_measure_engines)
        return rst_nodes(rst_engines_table(data, engines))


def setup(app):
    """Register the directives and measure (or reuse) the tables when the builder starts."""
    app.connect("builder-inited", _ensure_matrix)
    app.add_directive("mfsdp-compat-matrix", CompatMatrixDirective)
    app.add_directive("mfsdp-compat-matrix-parallel", CompatMatrixParallelDirective)
    app.add_directive("mfsdp-compat-matrix-checkpoint", CompatMatrixCheckpointDirective)
    app.add_directive("mfsdp-compat-matrix-engines", CompatMatrixEnginesDirective)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
