"""Run NVIDIA's own ``fully_shard`` test suite against mfsdp on CPU ranks (gloo).

``third_party/fully_shard_suite.py`` is Megatron-LM's
``tests/unit_tests/distributed/megatron_fsdp/test_mfsdp_fully_shard.py`` (the suite of the
``megatron_fsdp`` 0.6.1 release), kept verbatim. This runner builds a scratch directory where
that file runs unchanged in its logic:

- ``megatron.core.distributed.fsdp.src.megatron_fsdp.fully_shard`` is a module that re-exports
  ``mfsdp``'s ``fully_shard``, ``fully_shard_model``, ``fully_shard_optimizer`` and
  ``MixedPrecisionPolicy`` (the one import line the suite reads them from);
- ``tests.unit_tests.test_utilities.Utils`` starts and ends the gloo process group that torchrun's
  environment describes, as Megatron-LM's ``Utils`` does for NCCL;
- ``transformer_engine`` is a stub whose modules skip the test that builds them: Transformer
  Engine's layers and FP8 recipes are CUDA kernels, so those cases cannot run on a CPU;
- a ``conftest.py`` destroys the process groups a test created once it ends (the device meshes'
  groups and mfsdp's), as Megatron-LM's ``Utils.destroy_model_parallel`` does between its tests:
  gloo runs threads per group, and 300 tests' groups on 8 ranks would be thousands of threads;
- in a copy of the suite, the device strings ``"cuda"`` become ``"cpu"`` and ``.cuda()`` becomes
  ``.cpu()``; nothing else is changed.

Usage: ``python tests/upstream/v1/run_suite.py [--nproc 8] [-k EXPR] [--junit PATH]``; extra
arguments after ``--`` go to pytest. Exit status: pytest's on rank 0.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(HERE.parent))
from suite_common import DESTROY_TEST_GROUPS  # noqa: E402 (the runners' shared conftest text)

SUITE = HERE / "third_party" / "fully_shard_suite.py"

SHIM_FULLY_SHARD = '''"""megatron_fsdp's fully_shard module, answered by mfsdp."""
from mfsdp import MixedPrecisionPolicy, fully_shard, fully_shard_model, fully_shard_optimizer
'''

SHIM_UTILS = '''"""Megatron-LM's test Utils, on gloo: start and end the process group torchrun describes."""
import os

import torch


class Utils:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))

    @staticmethod
    def initialize_model_parallel(*args, **kwargs):
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("gloo")
        torch.distributed.barrier()

    @staticmethod
    def destroy_model_parallel():
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
'''

SHIM_TE = '''"""A stand-in for Transformer Engine: its layers and FP8 recipes are CUDA kernels, so a test
that builds one is skipped on a CPU."""
import pytest


class _AnyName(type):
    def __getattr__(cls, name):  # te.common.recipe.Format.HYBRID and the like
        return cls


class _NeedsCuda(metaclass=_AnyName):
    def __init__(self, *args, **kwargs):
        pytest.skip("Transformer Engine needs CUDA")



class _Namespace:
    def __getattr__(self, name):
        return _NeedsCuda


pytorch = _Namespace()
common = _Namespace()
'''


CONFTEST = '''"""After each test: destroy every process group but the world's (gloo threads are per group)."""
import pytest
import torch.distributed as dist
''' + DESTROY_TEST_GROUPS


def to_cpu(source: str) -> str:
    """The suite with its device strings moved to the CPU (the only edit made to it)."""
    source = source.replace('"cuda"', '"cpu"').replace("'cuda'", "'cpu'")
    return re.sub(r"\.cuda\(\)", ".cpu()", source)


def write_scratch(root: Path) -> Path:
    """Lay out the shims and the CPU copy of the suite under ``root``; return the copy."""
    pkg = root / "megatron/core/distributed/fsdp/src/megatron_fsdp"
    pkg.mkdir(parents=True)
    for d in [root / "megatron", *pkg.relative_to(root).parents]:
        if str(d) != ".":
            (root / d / "__init__.py").touch()
    (pkg / "__init__.py").touch()
    (pkg / "fully_shard.py").write_text(SHIM_FULLY_SHARD)
    utils = root / "tests/unit_tests"
    utils.mkdir(parents=True)
    (root / "tests/__init__.py").touch()
    (utils / "__init__.py").touch()
    (utils / "test_utilities.py").write_text(SHIM_UTILS)
    (utils / "conftest.py").write_text(CONFTEST)
    (root / "transformer_engine").mkdir()
    (root / "transformer_engine/__init__.py").write_text(SHIM_TE)
    copy = utils / "test_mfsdp_fully_shard.py"
    copy.write_text(to_cpu(SUITE.read_text()))
    return copy


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, build the scratch directory and run the suite under torchrun."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=8, help="ranks (the suite's meshes need 8)")
    parser.add_argument("-k", default=None, help="pytest -k expression")
    parser.add_argument("--junit", default=None, help="write rank 0's JUnit XML here")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mfsdp-upstream-v1-") as tmp:
        root = Path(tmp)
        copy = write_scratch(root)
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(root), str(REPO)]))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.nproc}", "--local-ranks-filter=0", "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "--rootdir", str(root), "-c", os.devnull, str(copy)]
        if args.k:
            cmd += ["-k", args.k]
        if args.junit:
            cmd += [f"--junit-xml={Path(args.junit).resolve()}"]
        cmd += args.pytest_args
        return subprocess.call(cmd, cwd=root, env=env)


if __name__ == "__main__":
    sys.exit(main())
