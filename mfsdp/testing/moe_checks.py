"""Multi-rank checks of the MoE layer against a dense single-process reference (tests and recipes).

:func:`dispatcher_check` runs inside each rank of :func:`mfsdp.launch.launch`: every rank builds the
same full MoE layer and the same global batch from a seed, computes the dense reference (every
token through its experts one by one, in one process's arithmetic), then the real layer with this
rank's experts and tokens, and reports the largest differences in outputs and gradients.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from mfsdp.moe.layer import MoELayer, shard_experts

__all__ = ["dense_reference", "dispatcher_check", "dispatcher_check_all", "fused_experts_check"]


def _or_zero(t, like):
    return t if t is not None else torch.zeros_like(like)


def dense_reference(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """``sum_e probs[t, e] * expert_e(x[t])`` token by token, with the layer's own router."""
    probs, routing_map = layer.router(x)
    experts = layer.experts.local_experts
    rows = []
    for t in range(x.shape[0]):
        row = torch.zeros_like(x[t])
        for e in routing_map[t].nonzero().flatten().tolist():
            row = row + probs[t, e] * experts[e](x[t:t + 1])[0]
        rows.append(row)
    out = torch.stack(rows) if rows else torch.zeros_like(x)
    if layer.shared_expert is not None:
        out = out + layer.shared_expert(x)
    return out


def dispatcher_check(kind: str, counts: list[int], backend: str = "torch", dim: int = 16,
                     ffn: int = 32, num_experts: int = 8, topk: int = 2, fused: bool = False,
                     steps: int = 1, seed: int = 0, **router_kwargs) -> dict:
    """Compare one MoE layer under dispatcher ``kind`` with the dense reference on this rank.

    ``counts[r]`` is rank ``r``'s token count (uneven on purpose). Returns the largest absolute
    differences (``out``, ``grad_x``, ``grad_router``, ``grad_experts``), the bytes this rank sent,
    the rows per local expert, the padded token count (flex) and the seconds per layer call.
    """
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    kwargs = dict(dim=dim, ffn=ffn, num_experts=num_experts, topk=topk, **router_kwargs)
    ref = MoELayer(**kwargs)
    total = sum(counts)
    x_all = torch.randn(total, dim)
    w_all = torch.randn(total, dim)  # the loss is sum(out * w): every output element matters
    x_ref = x_all.clone().requires_grad_(True)
    (dense_reference(ref, x_ref) * w_all).sum().backward()
    start = sum(counts[:rank])
    mine = slice(start, start + counts[rank])

    torch.manual_seed(seed)
    layer = MoELayer(dispatcher=kind, flex_backend=backend, fused=fused, **kwargs)
    shard_experts(layer, dist.group.WORLD if ws > 1 else None)
    per = num_experts // ws
    times = []
    for _ in range(steps):
        layer.zero_grad()
        x = x_all[mine].clone().requires_grad_(True)
        t0 = time.perf_counter()
        out = layer(x)
        (out * w_all[mine]).sum().backward()
        times.append(time.perf_counter() - t0)
    grad_router = layer.router.weight.grad.clone()
    if ws > 1:
        dist.all_reduce(grad_router)
    ref_experts = ref.experts.local_experts[rank * per:(rank + 1) * per]
    if fused:
        got = [layer.experts.linear_fc1.weight.grad, layer.experts.linear_fc2.weight.grad]
        want = [torch.stack([_or_zero(e.linear_fc1.weight.grad, e.linear_fc1.weight)
                             for e in ref_experts]),
                torch.stack([_or_zero(e.linear_fc2.weight.grad, e.linear_fc2.weight)
                             for e in ref_experts])]
    else:
        got = [p.grad for p in layer.experts.parameters()]
        want = [p.grad for e in ref_experts for p in e.parameters()]
    with torch.no_grad():
        ref_out = dense_reference(ref, x_all)[mine]
    return {
        "out": (out - ref_out).abs().max().item() if counts[rank] else 0.0,
        "grad_x": (x.grad - x_ref.grad[mine]).abs().max().item() if counts[rank] else 0.0,
        "grad_router": (grad_router - ref.router.weight.grad).abs().max().item(),
        "grad_experts": max((_or_zero(g, w) - _or_zero(w, g)).abs().max().item()
                            for g, w in zip(got, want)),
        "output": out.detach(),
        "bytes_sent": dict(layer.dispatcher.bytes_sent),
        "tokens_per_expert": list(layer.dispatcher.tokens_per_expert),
        "padded_tokens": getattr(layer.dispatcher, "padded_tokens", None),
        "padding_routes_nowhere": (not layer.dispatcher.padded_routing_map[counts[rank]:].any().item()
                                   if hasattr(layer.dispatcher, "padded_routing_map") else None),
        "seconds": sorted(times)[len(times) // 2],
    }


def dispatcher_check_all(counts: list[int], runs: list[dict]) -> list[dict]:
    """:func:`dispatcher_check` for several configurations in one launch (``runs``: kwargs)."""
    return [dispatcher_check(counts=counts, **run) for run in runs]


class _MoENet(torch.nn.Module):
    """Input projection, one MoE layer (residual), head: the fused-experts regression model."""

    def __init__(self, dim: int, fused: bool, hook_mode: str):
        super().__init__()
        self.inp = torch.nn.Linear(dim, dim)
        self.moe = MoELayer(dim, 2 * dim, num_experts=4, topk=2, fused=fused, hook_mode=hook_mode)
        self.head = torch.nn.Linear(dim, dim)

    def forward(self, x):
        h = self.inp(x)
        return self.head(h + self.moe(h))


def fused_experts_check(mode: str, steps: int = 3, dim: int = 8, tokens: int = 12,
                        data_ranks: int = 2) -> dict:
    """Train the regression model under ZeRO-3 with the expert weights in their own FSDP units.

    ``mode``: ``"reference"`` (one process, no sharding, sequential experts; call it with one
    rank), ``"sequential"`` (units: each expert MLP), ``"replay"`` / ``"recursive"`` / ``"none"``
    (fused experts, units: the two stacked weights, with hook replay, with the parent gathering
    recursively, or with neither). Returns per-step losses and the final expert weights stacked
    per layer, or the error the run hit. The global batch is ``tokens * data_ranks`` rows.
    """
    from mfsdp import fully_shard
    from mfsdp.moe.experts import ExpertMLP, FusedExperts, GroupedLinear

    rank, ws = dist.get_rank(), dist.get_world_size()
    if mode != "reference" and ws != data_ranks:
        raise ValueError(f"run {mode!r} on data_ranks={data_ranks} ranks, not {ws}")
    torch.manual_seed(0)
    fused = mode in ("replay", "recursive", "none")
    model = _MoENet(dim, fused, "replay" if mode == "replay" else "none")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if mode != "reference":
        units = [GroupedLinear] if fused else [ExpertMLP]
        model, opt = fully_shard(model, opt, fsdp_unit_modules=units,
                                 zero_dp_strategy="optim_grads_params",
                                 recursive_gather_modules=[FusedExperts] if mode == "recursive"
                                 else None)
    gen = torch.Generator().manual_seed(1)
    losses = []
    try:
        for _ in range(steps):
            x = torch.randn(tokens * data_ranks, dim, generator=gen)
            y = torch.randn(tokens * data_ranks, dim, generator=gen)
            if mode != "reference":
                x, y = x[rank * tokens:(rank + 1) * tokens], y[rank * tokens:(rank + 1) * tokens]
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            t = loss.detach().clone()
            if mode != "reference":
                dist.all_reduce(t)
                t /= ws
            losses.append(t.item())
    except RuntimeError as exc:
        return {"error": f"{type(exc).__name__}: {exc}".splitlines()[0], "losses": losses}
    params = (model.full_parameters() if mode != "reference"
              else {n: p.detach() for n, p in model.named_parameters()})
    if fused:
        fc1 = params["moe.experts.linear_fc1.weight"]
        fc2 = params["moe.experts.linear_fc2.weight"]
    else:
        fc1 = torch.stack([params[f"moe.experts.local_experts.{j}.linear_fc1.weight"]
                           for j in range(4)])
        fc2 = torch.stack([params[f"moe.experts.local_experts.{j}.linear_fc2.weight"]
                           for j in range(4)])
    return {"error": None, "losses": losses, "fc1": fc1, "fc2": fc2}
