"""The public surface: what ``import mfsdp`` does (nothing to torch), ``fully_shard``'s written-out
signature, the frozen policy, and the names a sharded model advertises."""

from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys

import pytest
from conftest import ROOT

_IMPORT_PROBE = """
import json, sys, types
import torch
from torch.optim import optimizer as o
before = (len(o._global_optimizer_pre_hooks), len(o._global_optimizer_post_hooks))
import mfsdp, mfsdp.check, mfsdp.experimental
after = (len(o._global_optimizer_pre_hooks), len(o._global_optimizer_post_hooks))
swapped = sorted(name for name, m in sys.modules.items()
                 if name.startswith("mfsdp") and type(m) is not types.ModuleType)
print(json.dumps({"before": before, "after": after, "swapped": swapped}))
"""


def test_import_registers_no_optimizer_hook_and_swaps_no_module_class():
    """In a fresh process, importing mfsdp (and its check and experimental packages) leaves
    ``torch.optim.Optimizer``'s global step hooks empty and every mfsdp module a plain module."""
    proc = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out == {"before": [0, 0], "after": [0, 0], "swapped": []}


def test_fully_shard_spells_out_its_keyword_arguments():
    """``fully_shard(module, optimizer=None, *, ...)``: no ``**kwargs``; the keywords are exactly
    ``fully_shard_model``'s (same defaults, same annotations), each documented there."""
    from mfsdp import fully_shard, fully_shard_model

    sig = inspect.signature(fully_shard).parameters
    model_sig = inspect.signature(fully_shard_model).parameters
    kinds = {p.kind for p in sig.values()}
    assert inspect.Parameter.VAR_KEYWORD not in kinds
    assert inspect.Parameter.VAR_POSITIONAL not in kinds
    assert list(sig)[:2] == ["module", "optimizer"]
    keywords = list(sig)[2:]
    assert keywords == list(model_sig)[1:]
    for name in keywords:
        assert sig[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert sig[name].default == model_sig[name].default, name
        assert sig[name].annotation == model_sig[name].annotation, name
        assert name in fully_shard_model.__doc__, f"{name} is not documented"
    with pytest.raises(TypeError, match="no_such_option"):
        fully_shard(None, no_such_option=1)


def test_mixed_precision_policy_is_frozen():
    """As FSDP2's: assigning a field raises; a changed policy is a new object."""
    import torch

    from mfsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(main_grads_dtype=torch.float32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.grad_comm_dtype = torch.bfloat16
    changed = dataclasses.replace(policy, grad_comm_dtype=torch.bfloat16)
    assert (policy.grad_comm_dtype, changed.grad_comm_dtype) == (None, torch.bfloat16)
    assert hash(policy) == hash(MixedPrecisionPolicy(main_grads_dtype=torch.float32))
