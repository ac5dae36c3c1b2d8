"""A complete training script with mfsdp: the quickstart of the user guide.

Run it on two processes (CPUs with gloo; one GPU per rank with NCCL where the machine
has GPUs)::

    torchrun --nproc-per-node 2 -m mfsdp.examples

or from Python with the in-process launcher (this is what the guide's doctest does)::

    from mfsdp.launch import launch
    launch(quickstart_train, world_size=2)
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from mfsdp.layout import rank_device

__all__ = ["quickstart_train", "main"]


def quickstart_train(steps: int = 5,
                     strategy: str = "optim_grads_params") -> list[float]:
    """Shard a small model over every rank, train it ``steps`` steps, return the
    losses."""
    import mfsdp
    from mfsdp.models import Block, ToyModel

    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()  # this rank's GPU under NCCL, the CPU under gloo
    torch.manual_seed(0)  # every rank builds the same model
    model = ToyModel(dim=32, hidden=64, num_blocks=4).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    # One call shards both: each Block is gathered for its forward and backward, then
    # released.
    model, optimizer = mfsdp.fully_shard(
        model, optimizer,
        fsdp_unit_modules=[Block],
        zero_dp_strategy=strategy,
    )

    data = torch.Generator().manual_seed(1234)  # the same global batch on every rank
    x = torch.randn(8 * world, 32, generator=data)
    y = torch.sin(x)  # a target the model can learn
    x, y = x[rank * 8:(rank + 1) * 8], y[rank * 8:(rank + 1) * 8]  # this rank's slice
    x, y = x.to(device), y.to(device)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        dist.all_reduce(loss := loss.detach().clone())
        losses.append(round(loss.item() / world, 4))
    return losses


def main() -> None:
    """``torchrun -m mfsdp.examples``: train on every rank, print rank 0's losses, exit
    cleanly."""
    from mfsdp.runtime import shutdown

    if torch.cuda.is_available():  # one GPU per rank: torchrun says which in LOCAL_RANK
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
    else:  # CPUs
        dist.init_process_group("gloo")
    losses = quickstart_train()
    if dist.get_rank() == 0:
        print(f"world size {dist.get_world_size()}, losses: {losses}")
    # Barrier, destroy the process groups, and end the process without the interpreter's
    # teardown, in which gloo's threads can abort a finished run (see
    # mfsdp.runtime.shutdown).
    shutdown(exit_code=0)


if __name__ == "__main__":  # torchrun --nproc-per-node 2 quickstart.py
    main()
