"""Upstream's remaining v1 methods and the v2 per-module API (``mfsdp.experimental``), on real gloo
ranks against single-process references.

Rank functions live at module level so that :func:`mfsdp.launch.launch` can import them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from mfsdp.launch import launch

LR = 0.5


# ------------------------------------------------------------------------------------------------
# v1: mixed_precision_context / reset_mixed_precision_policy
# ------------------------------------------------------------------------------------------------
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)


def _v1_precision_rank(strategies: list[str]) -> dict:
    import torch.distributed as dist

    import mfsdp

    out = {}
    for strategy in strategies:
        model = mfsdp.fully_shard_model(_mlp(), fsdp_unit_modules=[nn.Linear],
                                        zero_dp_strategy=strategy)
        opt = mfsdp.fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=LR))
        seen = []
        for step, comm in enumerate([torch.float16, None]):
            x, y = _batch(dist.get_rank(), step)
            policy = mfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float64,
                                                grad_comm_dtype=comm)
            with model.mixed_precision_context(policy):
                seen.append((model.mp_policy.main_params_dtype, model.mp_policy.grad_comm_dtype,
                             {b.comm_dtype for b in model.fsdp_state().buckets}))
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            seen.append((model.mp_policy.main_params_dtype, model.mp_policy.grad_comm_dtype,
                         {b.comm_dtype for b in model.fsdp_state().buckets}))
        try:
            with model.mixed_precision_context(mfsdp.MixedPrecisionPolicy(
                    grad_comm_dtype=torch.bfloat16)):
                raise KeyError("inside")
        except KeyError:
            pass
        seen.append((model.mp_policy.main_params_dtype, model.mp_policy.grad_comm_dtype,
                     {b.comm_dtype for b in model.fsdp_state().buckets}))
        out[strategy] = (seen, {k: v.clone() for k, v in model.full_parameters().items()})
    return out


def _v1_reference(world: int, fp16_first_step: bool) -> dict[str, torch.Tensor]:
    """Plain SGD on one process; the first step's gradient reduced as the sharded model does
    under an fp16 communication dtype (each rank's gradient cast to fp16, pre-divided by the
    world size, summed in fp16) when ``fp16_first_step``."""
    model = _mlp()
    for step in range(2):
        grads = []
        for rank in range(world):
            model.zero_grad()
            x, y = _batch(rank, step)
            nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                if step == 0 and fp16_first_step:
                    total = torch.zeros_like(p, dtype=torch.float16)
                    for g in grads:
                        total += g[i].to(torch.float16) * (1.0 / world)
                    grad = total.float()
                else:
                    grad = sum(g[i] for g in grads) / world
                p -= LR * grad
    return dict(model.named_parameters())


STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


def _two_rank_suite(root: str) -> dict:
    """Everything `make test` checks on two ranks, in one launch (ranks start once)."""
    return {"v1": _v1_precision_rank(STRATEGIES),
            "v2": _v2_rank([TWO_RANKS[i] for i in CORE], behaviours=True),
            "checkpoint": _round_trip_rank(root)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """Each rank's results of :func:`_two_rank_suite`."""
    return launch(_two_rank_suite, 2, args=(str(tmp_path_factory.mktemp("ckpt")),), timeout=600)


@pytest.mark.slow
def test_mixed_precision_context_changes_grad_comm_dtype_for_one_step(two_ranks):
    """Upstream 0.6.1's ``mixed_precision_context``: the first step reduces gradients in fp16
    (the weights then equal a reference that rounds each rank's gradient to fp16 and sums in
    fp16, and differ from the fp32 reference), the second step in the main-gradient dtype again;
    the main-weight dtype stays what the model was built with; the policy is restored on exit,
    also when the block raises."""
    strategies = STRATEGIES
    results = [r["v1"] for r in two_ranks]
    fp16 = _v1_reference(2, True)
    fp32 = _v1_reference(2, False)
    for strategy in strategies:
        seen, params = results[0][strategy]
        f32 = torch.float32
        assert seen == [(f32, torch.float16, {torch.float16}), (f32, None, {f32}),
                        (f32, None, {f32}), (f32, None, {f32}), (f32, None, {f32})], strategy
        for name, value in params.items():
            key = name.removeprefix("module.")
            # fp32 arithmetic in a different order: a few ulps of the weights (~1e-7)
            assert torch.allclose(value, fp16[key], rtol=0, atol=2e-6), (strategy, name)
        # the fp16 rounding of the first step's gradient is visible (~5e-4 relative)
        worst = max((v - fp32[n.removeprefix("module.")]).abs().max().item()
                    for n, v in params.items())
        assert worst > 2e-5, (strategy, worst)
        for rank_result in results[1:]:
            for name, value in rank_result[strategy][1].items():
                assert torch.equal(value, params[name])


def test_reset_mixed_precision_policy_refuses_what_is_not_a_policy():
    from mfsdp.fsdp.module import FullyShardedModule
    with pytest.raises(TypeError, match="mixed_precision_policy"):
        FullyShardedModule.reset_mixed_precision_policy(object.__new__(FullyShardedModule),
                                                        torch.float16)


# ------------------------------------------------------------------------------------------------
# v2: mfsdp.experimental against one process
# ------------------------------------------------------------------------------------------------
class Tiny(nn.Module):
    def __init__(self, frozen: bool = False, dim: int = 6):
        super().__init__()
        self.bias = nn.Parameter(torch.linspace(-0.5, 0.5, dim))
        self.fc1 = nn.Linear(dim, 10)
        self.act = nn.Tanh()  # a module without parameters, sharded too
        self.fc2 = nn.Linear(10, dim)
        self.head = nn.Linear(dim, dim, bias=False)
        if frozen:
            self.fc1.requires_grad_(False)

    def reset_parameters(self):  # what meta-device initialisation calls for the root's own
        with torch.no_grad():
            self.bias.copy_(torch.linspace(-0.5, 0.5, self.bias.numel()))

    def forward(self, x):
        return self.head(self.fc2(self.act(self.fc1(x + self.bias))))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 6, bias=False)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 6, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.embed(x))))


def _build(kind: str, device: str = "cpu") -> nn.Module:
    torch.manual_seed(7)
    with torch.device(device):
        return Tied() if kind == "tied" else Tiny(frozen=kind == "frozen")


def _placements(name: str):
    from torch.distributed.tensor import Partial, Replicate, Shard

    from mfsdp.experimental import Placements
    S, R, P = Shard(0), Replicate(), Partial("avg")
    return {
        "zero3": Placements([0], [S], [S], [S]),
        "zero2": Placements([0], [R], [S], [S]),
        "zero1": Placements([0], [R], [P], [S]),
        "no_shard": Placements([0], [R], [P], [R]),
        "hsdp": Placements([0, 1], [R, S], [P, S], [R, S]),
        "hfsdp": Placements([0, 1], [R, S], [P, S], [S, S]),
    }[name]


def _data(step: int, micro: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global micro-batch: 2 rows per rank."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(2 * world, 6, generator=g), torch.randn(2 * world, 6, generator=g)


def _v2_case(case: dict) -> dict:
    """Train ``case``'s model with the per-module API and with plain PyTorch on the global batch
    (in this process); return the largest difference of the weights after each step and what the
    case wants to check besides."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from mfsdp.experimental import (FsdpModule, fully_shard, fully_shard_context,
                                    fully_shard_optimizer, microbatch)

    world, rank = dist.get_world_size(), dist.get_rank()
    kind, layout = case["model"], case["layout"]
    micro = case.get("micro", 1)
    mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("outer", "shard"))
            if layout in ("hsdp", "hfsdp") else init_device_mesh("cpu", (world,)))
    ref = _build(kind)
    model = _build(kind, "meta" if case.get("meta") else "cpu")
    placements = _placements(layout)
    with fully_shard_context() as context:
        for name in case.get("children", ["fc1", "act", "fc2"]):
            fully_shard(getattr(model, name), mesh, placements)
        fully_shard(model, mesh, placements)
    opt_cls = torch.optim.AdamW if case["optimizer"] == "adamw" else torch.optim.SGD
    kw = dict(lr=0.1, weight_decay=0.01) if case["optimizer"] == "adamw" else dict(lr=0.3)
    opt = opt_cls(model.parameters(), **kw)
    fully_shard_optimizer(opt)
    ref_opt = opt_cls([p for p in ref.parameters() if p.requires_grad], **kw)
    out = {"errors": [], "dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
           "groups": {n: [[fp.fqns for fp in g.fsdp_parameters] for g in m.parameter_groups]
                      for n, m in model.named_modules() if isinstance(m, FsdpModule)},
           "phases": set(), "outer": []}  # collectives over the outer axis per backward

    def diff() -> float:
        ours = {n: p.full_tensor() for n, p in model.named_parameters()}
        return max((ours[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())

    out["errors"].append(diff())  # after wrapping (meta init: the values the reference drew)
    for step in range(3):
        opt.zero_grad(set_to_none=case.get("set_to_none", True))
        ref_opt.zero_grad()
        for m in range(micro):
            x, y = _data(step, m, world)
            mine = slice(2 * rank, 2 * rank + 2)
            with microbatch(context, is_last=m == micro - 1):
                loss = nn.functional.mse_loss(model(x[mine]), y[mine]) / micro
                model.engine.fsdp_state().comms.log.clear()
                loss.backward()
            log = model.engine.fsdp_state().comms.log
            out["outer"].append(sum(r["group"] == "dp_outer" for r in log.records))
            nn.functional.mse_loss(ref(x), y).div(micro).backward()
        out["phases"].update(m.phase.name for m in model.modules() if isinstance(m, FsdpModule))
        opt.step()
        ref_opt.step()
        out["errors"].append(diff())
    return out


def _v2_behaviours() -> dict:
    """Upstream's contract beyond training: what a one-axis ``microbatch(is_last=False)``
    leaves in ``.grad``, ``model.to()`` after sharding a child of a CPU model, and the errors."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from mfsdp.experimental import fully_shard, fully_shard_context, microbatch, save_checkpoint

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    # Two backwards under is_last=False on one axis: each reduced (averaged), then summed.
    lin = nn.Linear(1, world, bias=False)
    nn.init.constant_(lin.weight, 1.0)
    with fully_shard_context() as context:
        fully_shard(lin, mesh, _placements("zero3"))
    x = torch.full((1, 1), float(rank + 1))
    with microbatch(context, is_last=False):
        lin(x).sum().backward()
        lin(x).sum().backward()
    out["grad"] = (isinstance(lin.weight.grad, DTensor), lin.weight.grad.full_tensor().tolist())
    # grad_divisor divides that module's reduced gradients once more (expert parallelism)
    lin2 = nn.Linear(1, world, bias=False)
    with fully_shard_context():
        fully_shard(lin2, mesh, _placements("zero3"), grad_divisor=2)
    lin2(x).sum().backward()
    out["divided"] = lin2.weight.grad.full_tensor().tolist()
    # A child sharded, the parent moved afterwards: the sharded child stays, the rest moves.
    seq = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    nn.init.constant_(seq[0].weight, 2.0)
    nn.init.constant_(seq[1].weight, 3.0)
    expected = seq(torch.ones(1, 4)).detach()
    with fully_shard_context():
        fully_shard(seq[1], mesh, _placements("zero3"))
    seq.to(torch.float32).to("cpu")
    out["to"] = (isinstance(seq[1].weight, DTensor), torch.equal(seq(torch.ones(1, 4)), expected))
    errors = []
    model = Tiny()
    with fully_shard_context():
        fully_shard(model, mesh, _placements("zero3"))
        try:
            model(torch.ones(2, 6))
        except RuntimeError as e:
            errors.append(str(e))
    try:
        model.load_state_dict(Tiny().state_dict(), assign=True)
    except RuntimeError as e:
        errors.append(str(e))
    try:
        save_checkpoint(seq, torch.optim.SGD(seq.parameters(), lr=1.0), "unused")
    except ValueError as e:
        errors.append(str(e))
    # An optimizer not adapted: upstream's dtype error where the gradients are kept in another
    # dtype than the parameters (bf16 gradients of fp32 main weights) ...
    bf16 = nn.Linear(4, 2).to(torch.bfloat16)
    with fully_shard_context():
        fully_shard(bf16, mesh, _placements("zero3"))
    bf16(torch.ones(3, 4, dtype=torch.bfloat16)).float().sum().backward()
    try:
        torch.optim.SGD(bf16.parameters(), lr=0.1).step()
    except RuntimeError as e:
        errors.append(str(e))
    out["errors"] = errors
    # ... and fp32 throughout it steps: w - lr * g
    fp32 = nn.Linear(4, 2)
    with fully_shard_context():
        fully_shard(fp32, mesh, _placements("zero3"))
    fp32(torch.ones(3, 4)).sum().backward()
    want = [p.full_tensor() - 0.1 * p.grad.full_tensor() for p in fp32.parameters()]
    torch.optim.SGD(fp32.parameters(), lr=0.1).step()
    out["nvtx"] = _nvtx_ranges(mesh)
    out["plain_fp32_step"] = max(float((p.full_tensor() - w).abs().max())
                                 for p, w in zip(fp32.parameters(), want))
    # bf16 weights, fp32 main weights: .grad is a cast copy of the bf16 accumulator, and
    # zero_grad(set_to_none=False) must still start the next step from zero
    out["bf16_zero_grad"] = [_bf16_training(mesh, stn) for stn in (True, False)]
    out["orders"], out["unsharded_bytes"] = _orders_and_gathered_storage(mesh)
    # state_dict() hands out DTensors that know their uneven rows: full_tensor() is the weight
    out["state_dict"] = all(torch.equal(v.full_tensor(), model_param.full_tensor())
                            for (k, v), model_param in zip(model.state_dict().items(),
                                                           model.parameters()))
    return out


class _FrozenMiddle(nn.Module):
    """A trainable bias, then a frozen layer whose input needs a gradient (the bias's), then a
    trainable one."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.ones(4))
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.layers[0].requires_grad_(False)

    def forward(self, x):
        return self.layers[1](self.layers[0](x + self.bias))


def _nvtx_ranges(mesh) -> list[str]:
    """The NVTX ranges of one training step, as ``torch.cuda.nvtx`` sees them (recorded by
    replacing its push and pop): ``"+label"`` opens, ``"-label"`` closes the innermost."""
    from mfsdp.experimental import fully_shard, fully_shard_context

    events, stack = [], []

    def push(label):
        stack.append(label)
        events.append("+" + label)

    def pop():
        events.append("-" + stack.pop())

    model = _FrozenMiddle()
    with fully_shard_context():
        fully_shard(model.layers[0], mesh, _placements("zero3"))
        fully_shard(model.layers[1], mesh, _placements("zero3"))
        fully_shard(model, mesh, _placements("zero3"))
    saved = torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
    torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop = push, pop
    try:
        model(torch.ones(2, 4)).sum().backward()
    finally:
        torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop = saved
    return events


def _orders_and_gathered_storage(mesh) -> tuple[dict, dict]:
    """Upstream's ``context.forward_order`` (two roots in one context; a parent sharded after
    its children) and the bytes its parameter group's ``_unsharded_model_weight`` holds during
    forward, after forward and after backward (ZeRO-3: released outside compute; no_shard:
    kept), with whether the gathered buffer held the full weights during forward."""
    from mfsdp.experimental import fully_shard, fully_shard_context

    orders = {}
    two = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with fully_shard_context() as context:
        fully_shard(two[0], mesh, _placements("zero3"))
        fully_shard(two[1], mesh, _placements("zero3"))
    orders["roots"] = ([m is two[i] for i, m in enumerate(context.forward_order)],
                       two[0].is_root() and two[1].is_root(), two[1].context is context)
    orders["roots_backward"] = [m is want for m, want in zip(context.backward_order, two[::-1])]
    nested = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with fully_shard_context() as context:
        fully_shard(nested[1], mesh, _placements("zero3"))
        fully_shard(nested[0], mesh, _placements("zero3"))
        fully_shard(nested, mesh, _placements("zero3"))
    order = list(context.forward_order)
    orders["nested"] = [m is want for m, want in zip(order, [nested, nested[0], nested[1]])]
    orders["next"] = (context.forward_order.next_item(nested[0]) is nested[1],
                      context.forward_order.next_item(nested[1]) is None)
    # upstream's static backward order: a parent before its children, the last child first
    backward = list(context.backward_order)
    orders["nested_backward"] = (len(backward), [m is want for m, want in
                                                 zip(backward, [nested, nested[1], nested[0]])])
    sizes = {}
    for layout in ("zero3", "no_shard"):
        torch.manual_seed(3)
        lin = nn.Linear(4, 4)
        full = torch.cat([lin.weight.detach().reshape(-1), lin.bias.detach()])
        with fully_shard_context():
            fully_shard(lin, mesh, _placements(layout))
        group = lin.parameter_groups[0]
        seen = []

        def during(module, args, output, group=group, full=full, seen=seen):
            buffer = group._unsharded_model_weight.local_buffer
            seen.append((buffer.untyped_storage().nbytes(),
                         torch.equal(buffer[:full.numel()], full)))

        lin.register_forward_hook(during, prepend=True)  # (before the engine releases)
        loss = lin(torch.ones(2, 4)).sum()
        after_forward = group._unsharded_model_weight.local_buffer.untyped_storage().nbytes()
        loss.backward()
        after_backward = group._unsharded_model_weight.local_buffer.untyped_storage().nbytes()
        sizes[layout] = (seen[0], after_forward, after_backward)
    return orders, sizes


def _bf16_training(mesh, set_to_none: bool) -> list[torch.Tensor]:
    from mfsdp.experimental import fully_shard, fully_shard_context, fully_shard_optimizer
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).to(torch.bfloat16)
    with fully_shard_context():
        fully_shard(model[0], mesh, _placements("zero3"))
        fully_shard(model, mesh, _placements("zero3"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fully_shard_optimizer(opt)
    for step in range(3):
        opt.zero_grad(set_to_none=set_to_none)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
        model(x).float().pow(2).mean().backward()
        opt.step()
    return [p.full_tensor() for p in model.parameters()]


def _v2_rank(cases: list[dict], behaviours: bool = False) -> list[dict]:
    return [_v2_case(c) for c in cases] + ([_v2_behaviours()] if behaviours else [])


TWO_RANKS = (
    [dict(model="tiny", layout=lay, optimizer=o, micro=mb)
     for lay in ("zero3", "zero2", "zero1", "no_shard") for o in ("sgd", "adamw") for mb in (1, 3)]
    + [dict(model="tiny", layout="zero3", optimizer="sgd", meta=True),
       dict(model="tiny", layout="zero3", optimizer="adamw", set_to_none=False, micro=2),
       dict(model="frozen", layout="zero3", optimizer="adamw"),
       dict(model="tied", layout="zero3", optimizer="sgd", children=["embed", "mid", "head"]),
       dict(model="tied", layout="zero2", optimizer="adamw", children=["embed", "mid", "head"]),
       dict(model="tiny", layout="hfsdp", optimizer="sgd", micro=3)]  # (outer 2 x shard 1)
)
FOUR_RANKS = [dict(model="tiny", layout=lay, optimizer=o, micro=3, set_to_none=stn)
              for lay in ("hsdp", "hfsdp") for o in ("sgd", "adamw") for stn in (True, False)]

# fp32 on both sides, summed in another order: a few ulps per step (Adam's normalisation can
# magnify a last-bit difference of a tiny gradient, hence 1e-5 rather than 1e-6)
TOL = 1e-5


def _check_cases(cases, results):
    for case, res in zip(cases, results):
        assert res["dtensors"], case
        assert res["phases"] == {"RESTING"}, case
        assert max(res["errors"]) < TOL, (case, res["errors"])


# What `make test` runs: every placement once, both optimizers, micro-batches, meta init, tied,
# frozen and parameterless modules, HFSDP; the whole matrix is extended.
CORE = [0, 3, 6, 9, 13, 16, 17, 18, 19, 20, 21]


@pytest.mark.slow
def test_v2_per_module_matches_one_process_on_two_ranks(two_ranks):
    """ZeRO-1/2/3 and no_shard placements, SGD and AdamW, 1 and 3 micro-batches, meta init,
    ``zero_grad(set_to_none=False)``, frozen, tied and parameterless modules: every step's
    weights equal a plain PyTorch model's trained on the global batch; and upstream's contract
    beyond training (see ``_v2_behaviours``)."""
    _check_v2([r["v2"] for r in two_ranks], "core")


@pytest.mark.extended
def test_v2_whole_matrix_on_two_ranks():
    """Every case of ``TWO_RANKS`` (the core set runs in `make test`)."""
    _check_v2(launch(_v2_rank, 2, args=(TWO_RANKS,), timeout=600), "all")


def _check_v2(results: list, which: str) -> None:
    cases = [TWO_RANKS[i] for i in CORE] if which == "core" else TWO_RANKS
    for r in results:
        _check_cases(cases, r[:len(cases)])
    groups = results[0][0]["groups"]
    assert groups["act"] == []  # a module without parameters has no group
    assert groups["fc1"] == [[("weight",), ("bias",)]]  # names relative to the module
    assert groups[""] == [[("bias",), ("head.weight",)]]  # the root keeps what no child owns
    if which == "core":
        extra = results[0][-1]
        # rank r's input is r + 1: each backward averages (1 + 2) / 2, two backwards add up
        assert extra["grad"] == (True, [[3.0], [3.0]])
        assert extra["to"] == (True, True)
        assert extra["divided"] == [[0.75], [0.75]]  # (1 + 2) / 2 ranks / grad_divisor 2
        assert extra["state_dict"]
        # upstream's FsdpContext.forward_order: roots in the order sharded, each in module order;
        # its backward_order: the roots last-sharded first, each depth-first, children reversed
        assert extra["orders"] == {"roots": ([True, True], True, True),
                                   "nested": [True, True, True], "next": (True, True),
                                   "roots_backward": [True, True],
                                   "nested_backward": (3, [True, True, True])}
        # its group's _unsharded_model_weight: the gathered weights (20 floats) during forward;
        # under ZeRO-3 released after forward (the root too, as upstream's) and after backward,
        # kept under no_shard
        assert extra["unsharded_bytes"] == {"zero3": ((80, True), 0, 0),
                                            "no_shard": ((80, True), 80, 80)}
        to_none, zeroed = extra["bf16_zero_grad"]
        assert all(torch.equal(a, b) for a, b in zip(to_none, zeroed))
        assert [e.split(":")[0].split(";")[0] for e in extra["errors"]] == [
            "the fully_shard_context is still open",
            "load_state_dict(assign=True) would replace parameters that fully_shard manages",
            "parameter '0.weight' is not sharded (it is outside every module given to "
            "fully_shard), so a checkpoint would miss it", "SGD.step()"]
        assert ("main_grads_dtype differs from main_params_dtype" in extra["errors"][-1]
                and "fully_shard_optimizer(optimizer)" in extra["errors"][-1]), extra["errors"]
        # upstream's NVTX ranges, each closed when its module's backward is over: the frozen
        # layer's when the gradient of its input is computed, before the root's bias's
        fwd, bwd = "MFSDP {} forward", "MFSDP {} backward"
        assert extra["nvtx"] == [
            "+" + fwd.format("<root>"), "+" + fwd.format("layers.0"), "-" + fwd.format("layers.0"),
            "+" + fwd.format("layers.1"), "-" + fwd.format("layers.1"), "-" + fwd.format("<root>"),
            "+" + bwd.format("<root>"), "+" + bwd.format("layers.1"), "-" + bwd.format("layers.1"),
            "+" + bwd.format("layers.0"), "-" + bwd.format("layers.0"), "-" + bwd.format("<root>")]
        assert extra["plain_fp32_step"] < 1e-6  # (one fp32 multiply-add per element)


@pytest.mark.extended
def test_v2_hsdp_and_hfsdp_with_micro_batches_on_four_ranks():
    """HSDP and HFSDP (outer 2 x shard 2), 3 micro-batches with the outer reduction deferred to
    the last, SGD and AdamW, both ``zero_grad`` modes, against one process."""
    results = launch(_v2_rank, 4, args=(FOUR_RANKS,), timeout=600)
    for r in results:
        _check_cases(FOUR_RANKS, r)
        for res in r:  # the outer reduction runs in the last micro-batch's backward only
            assert [n > 0 for n in res["outer"]] == [False, False, True] * 3, res["outer"]


# ------------------------------------------------------------------------------------------------
# checkpoints between the two front doors
# ------------------------------------------------------------------------------------------------
def _train(model, opt, steps: int, start: int = 0) -> None:
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(start, start + steps):
        x, y = _data(step, 0, world)
        mine = slice(2 * rank, 2 * rank + 2)
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
        opt.zero_grad()


def _full(t):
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t.clone()


def _v1_snapshot(fm, opt) -> dict:
    state = opt.state_dict()["state"]
    out = {f"w.{n}": v for n, v in fm.full_parameters().items()}
    for i, st in state.items():
        for k, v in st.items():
            out[f"s.{opt.sharded_params[i].name}.{k}"] = _full(v)
    return out


def _v2_snapshot(model, opt) -> dict:
    out = {}
    for n, p in model.named_parameters():
        out[f"w.{n}"] = p.full_tensor()
        sp = model.engine.fsdp_state().sharded_param(p)
        for k, v in opt.state.get(p, {}).items():
            # torch.optim's state of an uneven DTensor is a plain DTensor: gather its rows as
            # the parameter's
            out[f"s.{n}.{k}"] = (sp.wrap(v.to_local().reshape(sp.local.shape)).full_tensor()
                                 if v.dim() > 0 else _full(v))
    return out


def _v1_model(strategy: str, seed: int):
    import mfsdp
    torch.manual_seed(seed)
    fm = mfsdp.fully_shard_model(Tiny(), fsdp_unit_modules=[nn.Linear], zero_dp_strategy=strategy)
    return fm, mfsdp.fully_shard_optimizer(torch.optim.AdamW(fm.parameters(), lr=0.05))


def _v2_model(layout: str, seed: int):
    from torch.distributed.device_mesh import init_device_mesh

    from mfsdp.experimental import fully_shard, fully_shard_context, fully_shard_optimizer
    import torch.distributed as dist
    torch.manual_seed(seed)
    model = Tiny()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with fully_shard_context():
        for child in (model.fc1, model.fc2):
            fully_shard(child, mesh, _placements(layout))
        fully_shard(model, mesh, _placements(layout))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    fully_shard_optimizer(opt)
    return model, opt


def _round_trip_rank(root: str) -> list[tuple[str, list[str]]]:
    """v1 (ZeRO-3) trains and saves; v2 (no_shard) loads, checks, trains, saves; v1 (ZeRO-1)
    loads that. After each load every weight and optimizer state tensor must be bit-equal to what
    was saved; returns the keys that differ at each hand-over (all lists empty on success)."""
    import torch.distributed as dist

    from mfsdp.checkpoint import CheckpointError
    from mfsdp.checkpoint import load_checkpoint as v1_load
    from mfsdp.checkpoint import save_checkpoint as v1_save
    from mfsdp.experimental import load_checkpoint, save_checkpoint

    def differ(a, b):
        assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
        return [k for k in a if not torch.equal(a[k], b[k])]

    report = []
    fm, opt = _v1_model("optim_grads_params", seed=1)
    _train(fm, opt, 2)
    v1_save(f"{root}/v1", fm, opt, iteration=2)
    saved = _v1_snapshot(fm, opt)

    model, vopt = _v2_model("no_shard", seed=2)  # other values, other layout
    load_checkpoint(model, vopt, f"{root}/v1")
    report.append(("v1 -> v2", differ(saved, _v2_snapshot(model, vopt))))
    _train(model, vopt, 1, start=2)
    save_checkpoint(model, vopt, f"{root}/v2")
    save_checkpoint(model, vopt, f"{root}/v2")  # a save over an earlier checkpoint replaces it
    saved = _v2_snapshot(model, vopt)
    # upstream's layout: the DCP files directly in the directory, no iter_*/ or latest; a
    # directory holding something else is refused and left as it was
    names = {p.name for p in Path(root, "v2").iterdir()}
    foreign = Path(root, "notes")
    if dist.get_rank() == 0:
        foreign.mkdir()
        (foreign / "todo.txt").write_text("keep me")
    dist.barrier()
    try:
        save_checkpoint(model, vopt, foreign)
        refused = []
    except CheckpointError as e:
        refused = [] if "neither empty nor an mfsdp checkpoint" in str(e) else [str(e)]
    else:
        refused = ["saved into a directory holding other files"]
    kept = sorted(p.name for p in foreign.iterdir()) == ["todo.txt"]
    report.append(("v2 layout", sorted({".metadata", "manifest.json"} - names)
                   + sorted(n for n in names if n == "latest" or n.startswith("iter_"))
                   + refused + ([] if kept else ["the foreign directory changed"])))

    fm2, opt2 = _v1_model("optim", seed=3)
    v1_load(f"{root}/v2", fm2, opt2)
    report.append(("v2 -> v1", differ(saved, _v1_snapshot(fm2, opt2))))

    model3, vopt3 = _v2_model("zero3", seed=4)  # and v2 -> v2 at ZeRO-3
    load_checkpoint(model3, vopt3, f"{root}/v2")
    report.append(("v2 -> v2", differ(saved, _v2_snapshot(model3, vopt3))))
    # the loaded models train on alike (a step from equal state: equal up to reduction order)
    _train(fm2, opt2, 1, start=3)
    _train(model3, vopt3, 1, start=3)
    a, b = _v1_snapshot(fm2, opt2), _v2_snapshot(model3, vopt3)
    report.append(("step after load", [k for k in a if not torch.allclose(a[k], b[k], atol=1e-6)]))
    return report


@pytest.mark.slow
def test_checkpoint_round_trip_v1_v2_is_bit_exact(two_ranks):
    """A checkpoint saved through v1 (ZeRO-3) loads through v2 (no_shard) bit for bit, and one
    saved through v2 (upstream's layout: DCP files directly in the directory) loads through v1
    (ZeRO-1) and v2 (ZeRO-3) bit for bit, AdamW state included; the two continue training
    alike."""
    for report in [r["checkpoint"] for r in two_ranks]:
        assert report == [("v1 -> v2", []), ("v2 layout", []), ("v2 -> v1", []), ("v2 -> v2", []),
                          ("step after load", [])]


# ------------------------------------------------------------------------------------------------
# refusals (one process)
# ------------------------------------------------------------------------------------------------
def test_placements_and_refusals_name_the_fix():
    from torch.distributed.tensor import Partial, Replicate, Shard

    from mfsdp.config import ShardingStrategy
    from mfsdp.experimental import (Placements, fully_shard, fully_shard_context,
                                    fully_shard_optimizer)
    from mfsdp.experimental.fully_shard import strategies_of

    S, R, P = Shard(0), Replicate(), Partial("avg")
    assert [strategies_of(_placements(n)) for n in ("zero3", "zero2", "zero1", "no_shard",
                                                      "hsdp", "hfsdp")] == [
        (ShardingStrategy.OPTIM_GRADS_PARAMS, None), (ShardingStrategy.OPTIM_GRADS, None),
        (ShardingStrategy.OPTIM, None), (ShardingStrategy.NO_SHARD, None),
        (ShardingStrategy.OPTIM_GRADS_PARAMS, ShardingStrategy.NO_SHARD),
        (ShardingStrategy.OPTIM_GRADS_PARAMS, ShardingStrategy.OPTIM)]
    with pytest.raises(ValueError, match="one placement per axis"):
        Placements([0, 1], [S], [S], [S])
    with pytest.raises(NotImplementedError, match="Shard\\(0\\)"):
        strategies_of(Placements([0], [Shard(1)], [S], [S]))
    with pytest.raises(NotImplementedError, match="no ZeRO stage"):
        strategies_of(Placements([0], [S], [P], [S]))
    with pytest.raises(NotImplementedError, match="HFSDP"):
        strategies_of(Placements([0, 1], [R, R], [P, S], [S, S]))
    with pytest.raises(NotImplementedError, match="Partial\\('avg'\\)"):
        strategies_of(Placements([0], [R], [Partial("sum")], [S]))
    with pytest.raises(RuntimeError, match="inside fully_shard_context"):
        fully_shard(nn.Linear(2, 2), None, _placements("zero3"))
    with pytest.raises(ValueError, match="use_symmetric_memory=True"):
        with fully_shard_context(use_symmetric_memory=True):
            pass
    with pytest.raises(ValueError, match="unify_communication_stream=True"):
        with fully_shard_context(unify_communication_stream=True):
            pass
    with pytest.raises(ValueError, match="precision_aware=True"):
        fully_shard_optimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1.0),
                              precision_aware=True)
    with pytest.raises(ValueError, match="none of the optimizer's parameters is sharded"):
        fully_shard_optimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1.0))
