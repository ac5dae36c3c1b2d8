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


def _hooked_training(strategies: list[str]) -> dict:
    """On each rank: the same model trained 3 SGD steps under DDP and under mfsdp (each of
    ``strategies``), with a gradient hook registered on the first layer's weight before wrapping
    that records the gradient's norm and returns it doubled; returns what each saw and the final
    weights, the refusal of a post-accumulate-grad hook, and a sharded model's public names."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from mfsdp import fully_shard

    rank = dist.get_rank()

    def make(seen: list) -> nn.Module:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

        def hook(grad):
            seen.append(float(grad.norm()))
            return grad * 2

        net[0].weight.register_hook(hook)
        return net

    def train(model) -> list:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            g = torch.Generator().manual_seed(10 * step + rank)
            x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
        return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
                for p in model.parameters()]

    ddp_seen = []
    out = {"ddp": (ddp_seen, train(DistributedDataParallel(make(ddp_seen))))}
    for strategy in strategies:
        ours_seen = []
        model, _ = fully_shard(make(ours_seen), zero_dp_strategy=strategy)
        out[strategy] = (ours_seen, train(model))
    net = nn.Linear(2, 2)
    net.weight.register_post_accumulate_grad_hook(lambda p: None)
    try:
        fully_shard(net)
    except ValueError as exc:
        out["refused"] = str(exc)
    out["public"] = _public_names()
    return out


STRATEGIES = ["no_shard", "optim_grads_params"]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    """Each rank's results of :func:`_hooked_training` (one launch for this module's tests)."""
    from mfsdp.launch import launch

    return launch(_hooked_training, 2, args=(STRATEGIES,), timeout=240)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_gradient_hook_registered_before_fully_shard_acts_as_under_ddp(two_ranks, strategy):
    """A ``register_hook`` on a parameter before ``fully_shard`` fires with the gradient DDP hands
    it (each rank's local gradient, before the reduction) and what it returns (the gradient
    doubled) is what the model trains on: the norms it saw and the weights after 3 SGD steps
    equal DDP's. (FSDP2 and upstream drop such a hook: the weights would differ by the factor.)
    A post-accumulate-grad hook is refused, naming the parameter."""
    import torch

    for out in two_ranks:
        ddp_seen, ddp = out["ddp"]
        ours_seen, ours = out[strategy]
        assert len(ddp_seen) == 3
        assert ours_seen == pytest.approx(ddp_seen, rel=1e-5)
        for a, b in zip(ours, ddp):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert out["refused"].startswith("parameter 'weight' has a post-accumulate-grad hook")


# The model's public names beyond nn.Module's: behaviour (FSDP2's FSDPModule: unshard, reshard,
# set_requires_gradient_sync), upstream Megatron-FSDP's names (MegatronFSDP's methods and its
# module / mp_policy / device / param_and_grad_buffer attributes), and one accessor for the rest.
MODEL_SURFACE = {
    "fsdp_state",  # introspection: units, buckets, communicators, memory counters
    "unshard", "reshard", "unsharded", "set_requires_gradient_sync", "gather_recursively",
    "full_parameters", "wait_param_sync",
    # upstream Megatron-FSDP (megatron_fsdp.MegatronFSDP)
    "module", "mp_policy", "device", "param_and_grad_buffer", "model_auto_sync", "no_sync", "sync",
    "set_model_auto_sync", "mixed_precision_context", "reset_mixed_precision_policy",
    "start_param_sync", "start_grad_sync", "finish_grad_sync", "zero_grad_buffer",
    "install_optimized_model_weights",
}


def _public_names() -> dict:
    """In a launched rank: the public names of a sharded model beyond ``nn.Module``'s."""
    from torch import nn

    from mfsdp import fully_shard

    model, _ = fully_shard(nn.Sequential(nn.Linear(2, 2)))
    plain = set(dir(nn.Sequential()))
    return {"names": sorted(n for n in dir(model) if not n.startswith("_") and n not in plain),
            "state": type(model.fsdp_state()).__name__}


def test_the_sharded_model_advertises_behaviour_and_one_state_accessor(two_ranks):
    """A sharded model's public names (its class's and its instance's) are exactly
    ``MODEL_SURFACE``: 23 names instead of 51; buckets, the reducer, pools and communicators are
    reached through ``fsdp_state()``. Every upstream name on the list is one MegatronFSDP has."""
    from megatron_fsdp.megatron_fsdp import MegatronFSDP

    out = two_ranks[0]["public"]
    assert set(out["names"]) == MODEL_SURFACE
    assert len(out["names"]) == 23
    assert out["state"] == "ShardingState"
    upstream = {"no_sync", "sync", "set_model_auto_sync", "mixed_precision_context",
                "reset_mixed_precision_policy", "start_param_sync", "start_grad_sync",
                "finish_grad_sync", "zero_grad_buffer", "install_optimized_model_weights"}
    assert upstream <= set(dir(MegatronFSDP)) and upstream <= MODEL_SURFACE
