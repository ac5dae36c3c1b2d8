"""Run NVIDIA's own per-module ("v2") Megatron-FSDP test suite against ``mfsdp.experimental``.

``third_party/`` holds Megatron-LM's ``tests/unit_tests/distributed/mfsdp_v2/`` files, kept
verbatim with their license headers, from NVIDIA/Megatron-LM commit
``d98e8a64ddf34856e74b24714e3bedb2f5a39553`` (the directory last changed in ``09fde85ea25f``):
``conftest.py``, ``profiler_utils.py``, ``test_annotation.py``, ``test_checkpoint.py``,
``test_context.py``, ``test_fully_shard.py``, ``test_memory.py``, ``test_optimizer.py`` and
``test_overlap.py``. Left out, because every test in them needs what a CPU lacks or what is not
v2's API: ``test_cuda_graph.py`` (CUDA graphs), ``test_symmetric_memory.py`` (NCCL symmetric
memory), ``test_mcore_adapter.py`` and ``test_expert_parallel.py`` (Megatron-Core's GPT/hybrid
models on CUDA), ``test_dbuffer.py`` (upstream's private ``DBuffer`` storage class, which mfsdp
does not have: its engine keeps its own buffers).

This runner builds a scratch directory where those files run unchanged in their logic:

- ``megatron.core.distributed.fsdp.src.megatron_fsdp.experimental`` (and its ``module`` and
  ``placement`` submodules) re-export ``mfsdp.experimental``; ``...megatron_fsdp.mixed_precision``
  and the package itself re-export ``mfsdp``'s ``MixedPrecisionPolicy``; ``placement.Flat`` is
  upstream's two-line ``Shard(0)`` subclass, the one name the files import from there;
- ``tests.unit_tests.test_utilities.Utils`` gives the rank torchrun's environment names, and
  ``tests.unit_tests.dist_checkpointing.TempNamedDir`` is Megatron-LM's named temporary directory
  (made on rank 0, a barrier around it) without the GPT helpers that package also imports;
- ``transformer_engine`` is a stub whose ``FusedAdam`` skips the test that builds it (a CUDA
  kernel);
- the suite's own ``conftest.py`` is used as is: with no CUDA it gives every test the CPU device,
  and ``init_device_mesh("cpu", ...)`` starts gloo;
- a ``tests/conftest.py`` declares Megatron-LM's ``flaky`` markers; gives its
  ``tmp_path_dist_ckpt`` fixture (one directory all ranks share, in the scratch directory);
  destroys the process groups a test created once it ends (gloo runs threads per group); and
  marks as skipped, each with its reason, the tests listed in ``NEEDS_CUDA``: they read CUDA's
  allocator (``torch.cuda.memory_allocated``), count CUDA kernels in a profile, or call
  ``torch.cuda.synchronize``, none of which a CPU has.

Nothing in the test files is edited (no ``"cuda"`` string appears in them: they take the device
from the ``distributed_setup`` fixture).

Usage: ``python tests/upstream/v2/run_suite.py [--nproc 4] [-k EXPR] [--junit PATH]``; extra
arguments after ``--`` go to pytest. The suite adapts to the world size; 4 ranks run its 2-D
(HSDP/HFSDP) cases as well. Exit status: pytest's on rank 0.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
THIRD_PARTY = HERE / "third_party"
sys.path.insert(0, str(HERE.parent))
from suite_common import DESTROY_TEST_GROUPS  # noqa: E402 (the runners' shared conftest text)
UPSTREAM_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"

# test function -> why it cannot run on a CPU (each is skipped with this reason)
NEEDS_CUDA = {
    "test_hsdp_defers_dp_outer_allreduce_to_last_microbatch":
        "counts NCCL kernels in a CUDA profile and calls torch.cuda.synchronize",
    "test_hfsdp_reduce_scatters_dp_outer_on_last_microbatch":
        "counts NCCL kernels in a CUDA profile and calls torch.cuda.synchronize",
    "test_overlaps_communication_and_compute":
        "measures overlap of CUDA kernels on streams in a profile",
    "test_persistent_sharded_storage": "reads torch.cuda.memory_allocated",
    "test_training_step_peak_memory_bounds_full_size_buffers":
        "reads torch.cuda.max_memory_allocated",
    "test_zero1_memory_matches_sharded_optimizer_and_replicated_weight":
        "reads torch.cuda.max_memory_allocated",
    "test_deleted_model_releases_fsdp_storage": "reads torch.cuda.memory_allocated",
    "test_fully_shard_returns_to_resting_memory":
        "reads torch.cuda.memory_allocated and clears cuBLAS workspaces",
    "test_fully_shard_reduces_peak_training_memory": "reads torch.cuda.max_memory_allocated",
}

SHIM_PACKAGE = '''"""megatron_fsdp, answered by mfsdp (the names the v2 suite imports)."""
from mfsdp import MixedPrecisionPolicy
'''

SHIM_EXPERIMENTAL = '''"""megatron_fsdp.experimental, answered by mfsdp.experimental."""
from mfsdp.experimental import *  # noqa: F401,F403
from mfsdp.experimental import __all__  # noqa: F401
'''

SHIM_MODULE = '''"""megatron_fsdp.experimental.module, answered by mfsdp.experimental.module."""
from mfsdp.experimental.module import FsdpContext, FsdpModule  # noqa: F401
'''

SHIM_PLACEMENT = '''"""megatron_fsdp.experimental.placement's Flat, as upstream defines it:
a Shard(0) subclass (a flat dim-0 shard of a group's buffer)."""
from torch.distributed.tensor import Shard


class Flat(Shard):
    def __init__(self) -> None:
        super().__init__(0)
'''

SHIM_MIXED_PRECISION = '''"""megatron_fsdp.mixed_precision, answered by mfsdp."""
from mfsdp import MixedPrecisionPolicy  # noqa: F401
'''

SHIM_UTILS = '''"""Megatron-LM's test Utils: the rank torchrun's environment names."""
import os


class Utils:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
'''

SHIM_DIST_CHECKPOINTING = '''"""Megatron-LM's TempNamedDir (its
tests/unit_tests/dist_checkpointing/__init__.py), without the GPT-model helpers that package
also imports: a named directory, made and emptied on rank 0,
with a barrier on entry and before rank 0 removes it."""
import os
import shutil
from pathlib import Path

import torch

from tests.unit_tests.test_utilities import Utils


def _barrier():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


class TempNamedDir:
    def __init__(self, name, sync=True, ignore_cleanup_errors=False):
        self.name = str(name)
        self.sync = sync
        if Utils.rank == 0:
            shutil.rmtree(self.name, ignore_errors=True)
            os.makedirs(self.name, exist_ok=True)
        if sync:
            _barrier()
        else:
            os.makedirs(self.name, exist_ok=True)

    def cleanup(self):
        if self.sync:
            _barrier()
        if Utils.rank == 0:
            shutil.rmtree(self.name, ignore_errors=True)

    def __enter__(self):
        if self.sync:
            _barrier()
        return Path(self.name)

    def __exit__(self, exc_type, exc_val, exc_tb):
        if exc_type is None:
            self.cleanup()
'''

SHIM_TE = '''"""A stand-in for Transformer Engine: its optimizers are CUDA kernels, so a test
that builds one is skipped on a CPU."""
'''

SHIM_TE_OPTIMIZERS = '''"""transformer_engine.pytorch.optimizers: FusedAdam is a CUDA kernel."""
import pytest


class FusedAdam:
    def __init__(self, *args, **kwargs):
        pytest.skip("Transformer Engine's FusedAdam needs CUDA")
'''

CONFTEST = '''"""Skip the tests that need CUDA (each with its reason); after each test,
destroy every process group but the world's (gloo runs threads per group)."""
from pathlib import Path

import pytest
import torch.distributed as dist

NEEDS_CUDA = {needs_cuda!r}


def pytest_configure(config):
    # markers Megatron-LM's pytest configuration declares (test_overlap.py uses them)
    for marker in ("flaky", "flaky_in_dev"):
        config.addinivalue_line("markers", marker)


def pytest_collection_modifyitems(config, items):
    for item in items:
        reason = NEEDS_CUDA.get(getattr(item, "originalname", item.name))
        if reason:
            item.add_marker(pytest.mark.skip(reason="needs CUDA: " + reason))


@pytest.fixture(scope="session")
def tmp_path_dist_ckpt() -> Path:
    """Megatron-LM's shared checkpoint directory (its tests/unit_tests/conftest.py fixture): one
    path for every rank, here in the scratch directory."""
    return Path(__file__).resolve().parent.parent / "tmp_dist_ckpt"

'''


def _package(root: Path, dotted: str) -> Path:
    """Make ``dotted`` a package under ``root`` (every level with an ``__init__.py``)."""
    path = root
    for part in dotted.split("."):
        path = path / part
        path.mkdir(exist_ok=True)
        (path / "__init__.py").touch()
    return path


def write_scratch(root: Path) -> Path:
    """Lay out the shims and the suite under ``root``; return the suite's directory."""
    pkg = _package(root, "megatron.core.distributed.fsdp.src.megatron_fsdp")
    (pkg / "__init__.py").write_text(SHIM_PACKAGE)
    (pkg / "mixed_precision.py").write_text(SHIM_MIXED_PRECISION)
    exp = _package(root, "megatron.core.distributed.fsdp.src.megatron_fsdp.experimental")
    (exp / "__init__.py").write_text(SHIM_EXPERIMENTAL)
    (exp / "module.py").write_text(SHIM_MODULE)
    (exp / "placement.py").write_text(SHIM_PLACEMENT)
    unit = _package(root, "tests.unit_tests")
    (unit / "test_utilities.py").write_text(SHIM_UTILS)
    (_package(root, "tests.unit_tests.dist_checkpointing") / "__init__.py").write_text(
        SHIM_DIST_CHECKPOINTING)
    (root / "tests" / "conftest.py").write_text(CONFTEST.format(needs_cuda=NEEDS_CUDA)
                                                + DESTROY_TEST_GROUPS)
    te = _package(root, "transformer_engine.pytorch")
    (root / "transformer_engine" / "__init__.py").write_text(SHIM_TE)
    (te / "optimizers.py").write_text(SHIM_TE_OPTIMIZERS)
    suite = _package(root, "tests.unit_tests.distributed.mfsdp_v2")
    for source in sorted(THIRD_PARTY.glob("*.py")):
        shutil.copyfile(source, suite / source.name)
    return suite


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, build the scratch directory and run the suite under torchrun."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4,
                        help="ranks (the suite adapts; 4 runs its 2-D mesh cases too)")
    parser.add_argument("-k", default=None, help="pytest -k expression")
    parser.add_argument("--junit", default=None, help="write rank 0's JUnit XML here")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mfsdp-upstream-v2-") as tmp:
        root = Path(tmp)
        suite = write_scratch(root)
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(root), str(REPO)]))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.nproc}", "--local-ranks-filter=0", "-m", "pytest", "-q",
               "-rs", "-p", "no:cacheprovider", "--rootdir", str(root), "-c", os.devnull,
               str(suite)]
        if args.k:
            cmd += ["-k", args.k]
        if args.junit:
            cmd += [f"--junit-xml={Path(args.junit).resolve()}"]
        cmd += args.pytest_args
        return subprocess.call(cmd, cwd=root, env=env)


if __name__ == "__main__":
    sys.exit(main())
