"""The same model trained with mfsdp's two front doors: the model-level API
(``mfsdp.fully_shard_model``, upstream Megatron-FSDP's "v1") and the per-module API
(``mfsdp.experimental.fully_shard``, upstream's "v2"). Shown by
``docs/per-module-api.md`` and the recipe ``recipes/plot_per_module_api.py``.

Run it as is, on CPUs (gloo) or one GPU per rank (NCCL, chosen from the machine)::

    torchrun --nproc-per-node 4 -m mfsdp.examples.per_module --dp-outer 2
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

from mfsdp.layout import rank_device

__all__ = ["Net", "batch", "train_v1", "train_v2", "compare", "main"]


class Net(nn.Module):
    """Three residual blocks and a head: a toy transformer-shaped stack."""

    def __init__(self, dim: int = 32, depth: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(),
                          nn.Linear(2 * dim, dim)) for _ in range(depth))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def batch(step: int, micro: int, device: torch.device, dim: int = 32):
    """This rank's micro-batch ``micro`` of step ``step``: 4 rows of a regression target."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + dist.get_rank())
    x = torch.randn(4, dim, generator=g)
    return x.to(device), torch.sin(2 * x).to(device)


def train_v1(steps: int = 8, micro_batches: int = 2, dp_outer: int = 1) -> list[float]:
    """The model-level API: one call wraps the model, its blocks are the units."""
    from torch.distributed.device_mesh import init_device_mesh

    import mfsdp

    device = rank_device()  # this rank's GPU under NCCL, the CPU under gloo
    mesh = init_device_mesh(device.type, (dp_outer, dist.get_world_size() // dp_outer),
                            mesh_dim_names=("outer", "shard"))
    torch.manual_seed(0)
    model = mfsdp.fully_shard_model(
        Net().to(device), device_mesh=mesh, dp_shard_dim="shard", dp_outer_dim="outer",
        fsdp_unit_modules=[nn.Sequential], zero_dp_strategy="optim_grads_params",
        outer_dp_sharding_strategy="no_shard")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    optimizer = mfsdp.fully_shard_optimizer(optimizer)
    losses = []
    for step in range(steps):
        for m in range(micro_batches):
            x, y = batch(step, m, device)
            last = m == micro_batches - 1
            with model.sync() if last else model.no_sync():
                loss = nn.functional.mse_loss(model(x), y) / micro_batches
                loss.backward()
            losses.append(loss.detach() * micro_batches)
        optimizer.step()
        optimizer.zero_grad()
    return _mean_per_step(losses, micro_batches)


def train_v2(steps: int = 8, micro_batches: int = 2, dp_outer: int = 1) -> list[float]:
    """The per-module API: ``fully_shard`` on each block, then on the model, in
    place."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard

    from mfsdp.experimental import (Placements, fully_shard, fully_shard_context,
                                    fully_shard_optimizer, microbatch)

    device = rank_device()  # this rank's GPU under NCCL, the CPU under gloo
    mesh = init_device_mesh(device.type, (dp_outer, dist.get_world_size() // dp_outer),
                            mesh_dim_names=("outer", "shard"))
    hsdp = Placements(dp_axes=["outer", "shard"], parameter=[Replicate(), Shard(0)],
                      gradient=[Partial("avg"), Shard(0)],
                      optimizer=[Replicate(), Shard(0)])
    torch.manual_seed(0)
    model = Net()
    with fully_shard_context() as context:
        for block in model.blocks:
            fully_shard(block, mesh, hsdp)
        fully_shard(model, mesh, hsdp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    fully_shard_optimizer(optimizer)
    losses = []
    for step in range(steps):
        for m in range(micro_batches):
            x, y = batch(step, m, device)
            with microbatch(context, is_last=m == micro_batches - 1):
                loss = nn.functional.mse_loss(model(x), y) / micro_batches
                loss.backward()
            losses.append(loss.detach() * micro_batches)
        optimizer.step()
        optimizer.zero_grad()
    return _mean_per_step(losses, micro_batches)


def compare(steps: int = 8, micro_batches: int = 2,
            dp_outer: int = 1) -> dict[str, list[float]]:
    """Both ways on the same ranks, one after the other: each step's loss."""
    return {"v1": train_v1(steps, micro_batches, dp_outer),
            "v2": train_v2(steps, micro_batches, dp_outer)}


def _mean_per_step(losses: list[torch.Tensor], micro_batches: int) -> list[float]:
    """Each step's loss, averaged over micro-batches and ranks."""
    per_step = torch.stack(losses).view(-1, micro_batches).mean(1)
    dist.all_reduce(per_step)
    return (per_step / dist.get_world_size()).tolist()


def main(argv: list[str] | None = None) -> None:
    """``torchrun ... -m mfsdp.examples.per_module``: train both ways, print both curves."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dp-outer", type=int, default=1)
    args = parser.parse_args(argv)
    if torch.cuda.is_available():
        import os
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    losses = compare(args.steps, dp_outer=args.dp_outer)
    v1, v2 = losses["v1"], losses["v2"]
    if dist.get_rank() == 0:
        for step, (a, b) in enumerate(zip(v1, v2), 1):
            print(f"step {step:3d}  v1 loss {a:.6f}  v2 loss {b:.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
