"""Ordinary PyTorch idioms on a sharded model, on real gloo ranks, against plain PyTorch.

Each rank runs the same loop on a sharded copy and on an unsharded reference (the whole global
batch, one process's worth of PyTorch): reading parameters outside forward, ``state_dict`` with
``torch.save``/``torch.load`` and with ``torch.distributed.checkpoint``, ``clip_grad_norm_`` on
``model.parameters()``, an LR scheduler, ``unsharded()`` full weights, and the error when
``requires_grad`` changes after wrapping. Optimizer: SGD with momentum (AdamW would hide a scale
error in the gradients). Tolerance: 1e-5 relative (only the reduction order differs).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor

from mfsdp import fully_shard_model, fully_shard_optimizer
from mfsdp.launch import launch

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


class _Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class _Net(nn.Module):
    def __init__(self, dim: int = 12, blocks: int = 3):
        super().__init__()
        self.inp = nn.Linear(5, dim)
        self.blocks = nn.ModuleList(_Block(dim) for _ in range(blocks))
        self.out = nn.Linear(dim, 3)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h) * self.scale


def _full(v):
    return v.full_tensor() if isinstance(v, DTensor) else v


def _full_state(model) -> dict:
    return {k.removeprefix("module."): _full(v) for k, v in model.state_dict().items()}


def _assert_state(model, ref, what: str) -> None:
    got = _full_state(model)
    want = ref.state_dict()
    assert set(got) == set(want), f"{what}: keys differ: {set(got) ^ set(want)}"
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{what}: {k}: {m}")


def _step(model, ref, opt, ropt, scheds, x, clip: float) -> tuple[float, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    n = x.shape[0] // world
    model(x[rank * n:(rank + 1) * n]).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    rnorm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
    opt.step()
    ropt.step()
    for s in scheds:
        s.step()
    opt.zero_grad()
    ropt.zero_grad()
    return float(_full(norm)), float(rnorm)


def idioms(strategy: str, ckpt_dir: str, outer: str | None = None) -> dict:
    """The idioms on this rank (run with :func:`mfsdp.launch.launch`); ``outer``: HSDP
    (``"no_shard"``) or HFSDP (``"optim"``) over a (2, world/2) mesh."""
    torch.manual_seed(0)
    ref = _Net()
    mesh = {}
    if outer is not None:
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        mesh = dict(device_mesh=init_device_mesh("cpu", (2, world // 2),
                                                 mesh_dim_names=("dp_outer", "dp_shard")),
                    dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
                    outer_dp_sharding_strategy=outer)
    model = fully_shard_model(copy.deepcopy(ref), fsdp_unit_modules=[_Block],
                              zero_dp_strategy=strategy, **mesh)
    opt = fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9))
    ropt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt, ropt)]
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 5, generator=g) for _ in range(6)]
    report = {"norms": []}

    # Parameters read outside forward, before any step: DTensors (sharded) or tensors.
    for (name, p), (_, rp) in zip(model.module.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(_full(p), rp, msg=lambda m: f"{name}: {m}")
        # DTensor ops on uneven shards: the sum is Partial, full_tensor() all-reduces it
        torch.testing.assert_close(float(_full(p.detach().float().pow(2).sum())),
                                   float(rp.pow(2).sum()), rtol=1e-5, atol=1e-6)
    first = next(model.parameters())
    report["param_is_dtensor"] = isinstance(first, DTensor)
    report["param_placement"] = type(first.placements[0]).__name__ if report["param_is_dtensor"] else None
    report["grad_is_dtensor"] = isinstance(first.grad, DTensor) if first.grad is not None else None
    # This small model's buckets are cut on element boundaries (whole rows would pad > 1%): some
    # parameters' pieces start or end inside a row, and every idiom below must still hold.
    report["cut_inside_rows"] = sum(
        not sp.bucket.plan.params[sp.index].row_aligned(sp.bucket.main_index)
        for sp in model.fsdp_state().sparams)
    _assert_state(model, ref, "before the first step")

    for i in range(3):
        report["norms"].append(_step(model, ref, opt, ropt, scheds, xs[i], clip=0.05))
        _assert_state(model, ref, f"after step {i}")
    assert opt.param_groups[0]["lr"] == ropt.param_groups[0]["lr"] == 0.2 * 0.5 ** 3

    # torch.save / torch.load of the state dict (each rank its own shards), then load it back.
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    ref_saved = copy.deepcopy(ref.state_dict())
    _step(model, ref, opt, ropt, scheds, xs[3], clip=1e9)
    # A forward with autograd on and no backward (an evaluation written without no_grad): the
    # root keeps its gathered weights for a backward that never comes; the load below changes
    # them, and the next forward must compute with what was loaded.
    model(xs[0])
    model.load_state_dict(saved)
    ref.load_state_dict(ref_saved)
    _assert_state(model, ref, "after torch.load + load_state_dict")
    torch.testing.assert_close(model(xs[1]), ref(xs[1]), rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"forward after a load: {m}")
    model.zero_grad()

    # Upstream README's DCP lines: save model and optimizer, move on, load, and continue.
    dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=ckpt_dir)
    ref_at_save = (copy.deepcopy(ref.state_dict()), copy.deepcopy(ropt.state_dict()))
    _step(model, ref, opt, ropt, scheds, xs[4], clip=1e9)
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    dcp.load(state_dict=ckpt, checkpoint_id=ckpt_dir)
    model.load_state_dict(ckpt["model"], strict=False)
    opt.load_state_dict(ckpt["optimizer"])
    ref.load_state_dict(ref_at_save[0])
    ropt.load_state_dict(ref_at_save[1])
    _assert_state(model, ref, "after DCP load")
    _step(model, ref, opt, ropt, scheds, xs[5], clip=1e9)  # momentum was restored too
    _assert_state(model, ref, "one step after DCP load")

    # Full weights on demand.
    with model.unsharded():
        for (name, p), (_, rp) in zip(model.module.named_parameters(), ref.named_parameters()):
            assert not isinstance(p, DTensor), name
            torch.testing.assert_close(p, rp, rtol=1e-5, atol=1e-6)
        out = model(xs[0])
    torch.testing.assert_close(out, ref(xs[0]), rtol=1e-5, atol=1e-6)

    # Changing requires_grad after wrapping is an error that says what to do.
    next(model.parameters()).requires_grad_(False)
    try:
        model(xs[0]).sum().backward()
    except RuntimeError as e:
        report["requires_grad_error"] = str(e)
    return report


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_pytorch_idioms_match_plain_pytorch(strategy, tmp_path):
    reports = launch(idioms, 2, args=(strategy, str(tmp_path / "ckpt")), timeout=300)
    for r in reports:
        for norm, rnorm in r["norms"]:
            assert norm == pytest.approx(rnorm, rel=1e-5)
        assert "after fully_shard" in r["requires_grad_error"]
        # every strategy hands out DTensors, as upstream: no_shard's replicated over the mesh
        assert r["param_is_dtensor"]
        assert r["param_placement"] == ("Replicate" if strategy == "no_shard" else "Shard")
        assert r["grad_is_dtensor"] in (True, None)
        if strategy != "no_shard":
            assert r["cut_inside_rows"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("outer", ["no_shard", "optim"])
def test_pytorch_idioms_under_hsdp_and_hfsdp(outer, tmp_path):
    """4 ranks, outer 2 x shard 2: parameters are DTensors over the shard group (HSDP) or over
    the inner x outer group their main rows are spread on (HFSDP)."""
    reports = launch(idioms, 4, args=("optim_grads_params", str(tmp_path / "ckpt"), outer),
                     timeout=300)
    for r in reports:
        for norm, rnorm in r["norms"]:
            assert norm == pytest.approx(rnorm, rel=1e-5)
        assert r["param_is_dtensor"]
