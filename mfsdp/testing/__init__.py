"""Reference and sharded training runs of the toy model, used by the tests and the recipes.

:func:`train_reference` trains one process on the whole global batch; :func:`train_sharded` runs
inside a launched rank (see :mod:`mfsdp.launch`) on that rank's slice of the same global batch.
The two must agree: that is the engine's correctness test.

>>> from mfsdp.launch import launch
>>> cfg = dict(strategy="optim_grads_params", steps=2)
>>> ref = train_reference(cfg, world_size=2)
>>> shard = launch(train_sharded, 2, args=(cfg,))[0]
>>> [abs(a - b) < 1e-5 for a, b in zip(ref["losses"], shard["losses"])]
[True, True]
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from mfsdp.config import dtype_named
from mfsdp.layout import ParallelLayout
from mfsdp.models.toy import Block, ToyModel
from mfsdp.models.toy_moe import MoEBlock, ToyMoE, keep_local_experts

__all__ = ["DEFAULTS", "train_reference", "train_sharded", "train_sharded_many", "make_batches",
           "initial_parameters"]

DEFAULTS = dict(
    strategy="optim_grads_params", optimizer="sgd", dtype="fp32", steps=5, micro_batches=1,
    local_batch=4, dim=32, hidden=64, blocks=4, lr=0.05, seed=0, meta_init=False,
    model_kwargs={}, grad_comm_dtype=None, main_grads_dtype=None, clip=None,
    per_token_loss=False, return_params=True, track_memory=False, fsdp_kwargs={},
    model="toy", num_experts=4, dp_outer=1, ep=1, outer_strategy="no_shard", ag_groups=False,
    device_mesh=False, global_batch=None, sync_micro_batches=False, save_dir=None, save_at=None, load_dir=None, grad_norms=False,
)


def _cfg(cfg: dict) -> dict:
    unknown = set(cfg) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    return {**DEFAULTS, **cfg}


def make_batches(cfg: dict, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches of every step: inputs and regression targets, from the seed alone."""
    c = _cfg(cfg)
    g = torch.Generator().manual_seed(1000 + c["seed"])
    n = c["global_batch"] or c["local_batch"] * world_size
    if n % world_size:
        raise ValueError(f"global_batch={n} is not divisible by the world size {world_size}")
    return [(torch.randn(n, c["dim"], generator=g), torch.randn(n, c["dim"], generator=g))
            for _ in range(c["steps"])]


def _model(c: dict, device: str | torch.device = "cpu") -> torch.nn.Module:
    torch.manual_seed(c["seed"])
    with torch.device(device):
        if c["model"] == "moe":
            return ToyMoE(c["dim"], c["hidden"], c["blocks"], c["num_experts"],
                          **c["model_kwargs"])
        return ToyModel(c["dim"], c["hidden"], c["blocks"], **c["model_kwargs"])


def _optimizer(c: dict, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if c["optimizer"] == "sgd":
        return torch.optim.SGD(params, lr=c["lr"])
    if c["optimizer"] == "adamw":
        return torch.optim.AdamW(params, lr=c["lr"] * 0.1, weight_decay=0.01)
    if c["optimizer"] == "adamw2":  # two groups: weight decay on matrices only
        decay = [p for p in params if p.dim() >= 2]
        rest = [p for p in params if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                  {"params": rest, "weight_decay": 0.0}], lr=c["lr"] * 0.1)
    raise ValueError(f"optimizer={c['optimizer']!r}: use 'sgd', 'adamw' or 'adamw2'")


def train_reference(cfg: dict, world_size: int) -> dict:
    """Train one process on the concatenated global batch; fp32 main weights for bf16 compute."""
    c = _cfg(cfg)
    dtype = dtype_named(c["dtype"])
    model = _model(c).to(dtype)
    master = _model(c)
    with torch.no_grad():  # main weights start from the model's (possibly bf16) values
        for pm, pw in zip(master.parameters(), model.parameters()):
            pm.copy_(pw)
    main = [p for p in master.parameters() if p.requires_grad]
    work = [p for p in model.parameters() if p.requires_grad]
    opt = _optimizer(c, master)
    losses, start = [], 0
    if c["load_dir"]:  # resume from an mfsdp_full checkpoint (what a single-process job writes)
        from mfsdp.checkpoint.full import load_full_checkpoint

        start = load_full_checkpoint(c["load_dir"], master, opt)
        with torch.no_grad():
            for pm, pw in zip(master.parameters(), model.parameters()):
                pw.copy_(pm)
    for step, (x, y) in enumerate(make_batches(c, world_size)):
        if step < start:
            continue
        for p in work:
            p.grad = None
        out = model(x.to(dtype))
        loss = torch.nn.functional.mse_loss(out.float(), y)
        loss.backward()
        losses.append(loss.item())
        for pm, pw in zip(main, work):
            pm.grad = None if pw.grad is None else pw.grad.float()
        if c["clip"]:
            torch.nn.utils.clip_grad_norm_(main, c["clip"])
        opt.step()
        with torch.no_grad():
            for pm, pw in zip(main, work):
                pw.copy_(pm)
        if c["save_at"] == step + 1:
            from mfsdp.checkpoint.full import save_full_checkpoint

            save_full_checkpoint(master, opt, c["save_dir"], iteration=step + 1)
    return {"losses": losses,
            "params": {n: p.detach().clone() for n, p in master.named_parameters()}}


def train_sharded(cfg: dict) -> dict:
    """Train this rank's slice of the global batch with :func:`mfsdp.fully_shard` (run in a rank)."""
    from mfsdp import MixedPrecisionPolicy, fully_shard

    c = _cfg(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = dtype_named(c["dtype"])
    if c["meta_init"]:
        model = _model(c, "meta").to(dtype)
    else:
        model = _model(c).to(dtype)
    groups, mesh_kwargs, ep_group = None, {}, None
    if c["device_mesh"]:  # upstream's style: DeviceMeshes with named dimensions
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (c["dp_outer"], world // c["dp_outer"]),
                                mesh_dim_names=("dp_outer", "dp_shard"))
        mesh_kwargs = dict(device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer")
        if c["dp_outer"] > 1:  # upstream also passes the flattened (outer x shard) group
            mesh_kwargs["hybrid_fsdp_group"] = dist.new_group(list(range(world)))
        if c["model"] == "moe":  # experts: (dp_outer, expt_dp_shard, ep), EP ranks contiguous
            expt = init_device_mesh("cpu", (c["dp_outer"], world // (c["dp_outer"] * c["ep"]),
                                            c["ep"]),
                                    mesh_dim_names=("dp_outer", "expt_dp_shard", "ep"))
            mesh_kwargs["expt_device_mesh"] = expt
            ep_group = expt.get_group("ep")
    elif c["dp_outer"] > 1 or c["ep"] > 1 or c["ag_groups"]:
        layout = ParallelLayout(world, c["dp_outer"], c["ep"],
                                c["num_experts"] if c["model"] == "moe" else None)
        groups = layout.create_groups(all_gather_groups=c["ag_groups"])
        ep_group = groups["ep"]
    global_names = keep_local_experts(model, ep_group) if c["model"] == "moe" else {}
    opt = _optimizer(c, model)
    policy = MixedPrecisionPolicy(main_grads_dtype=dtype_named(c["main_grads_dtype"]),
                                  grad_comm_dtype=dtype_named(c["grad_comm_dtype"]))
    model, opt = fully_shard(model, opt, fsdp_unit_modules=[Block, MoEBlock],
                             zero_dp_strategy=c["strategy"], process_groups=groups,
                             outer_dp_sharding_strategy=c["outer_strategy"],
                             init_model_with_meta_device=c["meta_init"],
                             mixed_precision_policy=policy,
                             calculate_per_token_loss=c["per_token_loss"], **mesh_kwargs,
                             **c["fsdp_kwargs"])
    state = model.fsdp_state()
    if global_names:
        state.set_global_names(global_names)
    start = 0
    if c["load_dir"]:
        from mfsdp.checkpoint import load_checkpoint

        start = load_checkpoint(c["load_dir"], model, opt)["iteration"]
    lb, m = (c["global_batch"] // world if c["global_batch"] else c["local_batch"]), c["micro_batches"]
    losses, memory, comm, norms, scratch = [], [], [], [], []
    for step, (x, y) in enumerate(make_batches(c, world)):
        if step < start:  # resumed: the data of these steps was consumed before the save
            continue
        x, y = x[rank * lb:(rank + 1) * lb], y[rank * lb:(rank + 1) * lb]
        opt.zero_grad()
        state.comms.log.clear()
        total = 0.0
        for i, (xm, ym) in enumerate(zip(x.chunk(m), y.chunk(m))):
            last = i == m - 1
            # sync_micro_batches: every micro-batch reduces (no no_sync), as plain loops do
            with contextlib.nullcontext() if last or c["sync_micro_batches"] else model.no_sync():
                out = model(xm.to(dtype))
                loss = torch.nn.functional.mse_loss(out.float(), ym, reduction="sum")
                # per-token loss: gradients are summed over ranks, so normalise by global count
                denom = (x.numel() * world) if c["per_token_loss"] else ym.numel() * m
                (loss / denom).backward()
                total += loss.item() / (ym.numel() * m)
        if c["grad_norms"]:
            norms.append(opt.grad_norm())
        if c["clip"]:
            opt.clip_grad_norm_(c["clip"])
        opt.step()
        if c["save_at"] == step + 1:
            from mfsdp.checkpoint import save_checkpoint

            save_checkpoint(c["save_dir"], model, opt, iteration=step + 1)
        t = torch.tensor([total])
        dist.all_reduce(t)
        losses.append(t.item() / world)
        comm.append(list(state.comms.log.records))
        if c["track_memory"]:
            memory.append({**state.memory_by_kind(),
                           "optimizer_state": opt.local_state_bytes()})
        scratch.append(state.comm_scratch_bytes())
    params = model.full_parameters() if c["return_params"] else None
    if params is not None and c["model"] == "moe":  # every rank's experts, by global name
        parts = [None] * world
        dist.all_gather_object(parts, {global_names.get(n, n): p for n, p in params.items()})
        params = {n: p for part in parts for n, p in part.items()}
    states = [s for s in opt.state.values()]
    return {"losses": losses, "params": params if rank == 0 else None, "memory": memory,
            "grad_norms": norms,
            "peaks": dict(state.memory), "comm": comm, "comm_scratch": scratch,
            "numel": sum(b.plan.numel for b in state.buckets),
            "padded_numel": sum(b.plan.padded_numel for b in state.buckets),
            "optimizer_steps": sorted({int(s["step"]) for s in states if "step" in s}),
            "state_numel": [v.numel() for s in states for v in s.values()
                            if torch.is_tensor(v) and v.dim() > 0],
            "local_numel": [m.numel() for m, _, _ in opt.main_shards],
            "pool_bytes": sum(t.numel() for t in state.pool.slots) if state.pool else 0,
            "slot_bytes": state.pool.slot_bytes if state.pool else 0,
            "grad_pool": ({"slot_bytes": state.grad_pool.slot_bytes,
                           "takes": state.grad_pool.takes,
                           "fallbacks": state.grad_pool.fallbacks}
                          if state.grad_pool else None),
            "grad_buckets": sum(1 for u in state.units[1:] for b in u.buckets
                                if b.requires_grad and b.sharded_grads),
            "unit_grad_bytes": max((sum(b.plan.padded_numel * b.grad_shard.element_size()
                                        for b in u.buckets if b.requires_grad)
                                    for u in state.units[1:]), default=0),
            "root_bytes": sum(b.plan.padded_numel * b.full.element_size()
                              for b in state.units[0].buckets),
            "unit_bytes": max((u.gathered_bytes for u in state.units if not u.is_root),
                              default=0)}


def train_sharded_many(cfgs: list[dict]) -> list[dict]:
    """:func:`train_sharded` for several configurations in one launch (saves process start-ups)."""
    return [train_sharded(c) for c in cfgs]


def initial_parameters(cfg: dict) -> dict[str, torch.Tensor]:
    """The toy model's main weights before training (as both runs start them), in fp32."""
    c = _cfg(cfg)
    return {n: p.detach().to(dtype_named(c["dtype"])).float()
            for n, p in _model(c).named_parameters()}
