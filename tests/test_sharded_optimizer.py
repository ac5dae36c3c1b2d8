"""``ShardedOptimizer`` is a ``torch.optim.Optimizer`` built by ``Optimizer.__init__``: its step
runs the hooks registered on it (``args[0]`` the optimizer, as torch passes them), its
``param_groups`` and ``state`` are the wrapped optimizer's, and ``add_param_group`` takes more of
the model's parameters, which then train like plain PyTorch's. On 2 gloo ranks against an
unsharded copy; SGD with momentum; tolerance 1e-5 relative (only the reduction order differs).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mfsdp import fully_shard_model, fully_shard_optimizer
from mfsdp.launch import launch


class _Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class _Net(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.inp = nn.Linear(4, dim)
        self.blocks = nn.ModuleList(_Block(dim) for _ in range(2))
        self.out = nn.Linear(dim, 2)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def _groups(named) -> tuple[list, list]:
    """The first group: the input layer and the blocks; the second: the output layer."""
    first = [p for n, p in named if not n.startswith("out.")]
    second = [p for n, p in named if n.startswith("out.")]
    return first, second


def added_group_and_hooks(strategy: str) -> dict:
    torch.manual_seed(0)
    ref = _Net()
    model = fully_shard_model(copy.deepcopy(ref), fsdp_unit_modules=[_Block],
                              zero_dp_strategy=strategy)
    first, second = _groups(list(model.module.named_parameters()))
    opt = fully_shard_optimizer(torch.optim.SGD(first, lr=0.1, momentum=0.9))
    opt.add_param_group({"params": second, "lr": 0.05})
    rfirst, rsecond = _groups(list(ref.named_parameters()))
    ropt = torch.optim.SGD([{"params": rfirst}, {"params": rsecond, "lr": 0.05}], lr=0.1,
                           momentum=0.9)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", args[0] is o)))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", args[0] is o)))
    g = torch.Generator().manual_seed(1)
    rank = torch.distributed.get_rank()
    for _ in range(3):
        x = torch.randn(8, 4, generator=g)  # (2 ranks x 4 samples)
        opt.zero_grad()
        model(x[rank * 4:(rank + 1) * 4]).pow(2).mean().backward()  # (ranks' mean: averaged)
        opt.step()
        ropt.zero_grad()
        ref(x).pow(2).mean().backward()
        ropt.step()
    full = model.full_parameters()
    for name, rp in ref.named_parameters():
        torch.testing.assert_close(full[name], rp, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
    try:
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
        foreign = ""
    except ValueError as e:
        foreign = str(e)
    return {"calls": calls, "is_optimizer": isinstance(opt, torch.optim.Optimizer),
            "shared": (opt.param_groups is opt.optimizer.param_groups
                       and opt.state is opt.optimizer.state),
            "groups": [len(grp["params"]) for grp in opt.param_groups],
            "lrs": [grp["lr"] for grp in opt.param_groups],
            "state_entries": len(opt.state_dict()["state"]), "foreign": foreign}


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_added_group_trains_and_step_hooks_run_as_torch_runs_them(strategy):
    for r in launch(added_group_and_hooks, 2, args=(strategy,), timeout=240):
        assert r["calls"] == [("pre", True), ("post", True)] * 3
        assert r["is_optimizer"] and r["shared"]
        assert r["groups"] == [6, 2] and r["lrs"] == [0.1, 0.05]
        assert r["state_entries"] == 8  # momentum of every parameter, both groups
        assert r["foreign"].startswith("fully_shard_optimizer: param_groups[2]['params'][0] "
                                       "(shape (3,)) is not a parameter of the sharded model")
