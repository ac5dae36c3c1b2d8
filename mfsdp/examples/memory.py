"""What one rank holds under each sharding strategy, measured after a training step.

Run it with ``torchrun --nproc-per-node 4 -m mfsdp.examples.memory``; the guide's recipe
(``recipes/plot_memory_per_strategy.py``) runs :func:`measure` on 1, 2 and 4 ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["measure", "main"]


def measure(strategy: str, dim: int = 128, hidden: int = 512, blocks: int = 4) -> dict:
    """Shard a small MLP with ``zero_dp_strategy=strategy``, take one AdamW step, and
    return the bytes this rank holds by kind (what the buffers' storages really
    hold), with the parameter count and the count after padding each shard to whole
    rows."""
    import mfsdp
    from mfsdp.models import Block, ToyModel

    torch.manual_seed(0)
    model = ToyModel(dim=dim, hidden=hidden, num_blocks=blocks)
    numel = sum(p.numel() for p in model.parameters())
    model, optimizer = mfsdp.fully_shard(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3),
        fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    x = torch.randn(8, dim)
    model(x).pow(2).mean().backward()
    optimizer.step()
    # weights, shards, gradients: from the tensors' storages
    state = model.fsdp_state()
    held = state.memory_by_kind()
    # AdamW's two moments, this rank's
    held["optimizer_state"] = optimizer.local_state_bytes()
    return {"bytes": held, "numel": numel,
            "padded_numel": sum(b.plan.padded_numel for b in state.buckets)}


def main() -> None:
    """Print bytes per parameter on this world size for every strategy (rank 0)."""
    from mfsdp.runtime import shutdown

    dist.init_process_group("gloo")
    for strategy in ("no_shard", "optim", "optim_grads", "optim_grads_params"):
        r = measure(strategy)
        if dist.get_rank() == 0:
            print(f"{strategy:>18}: {sum(r['bytes'].values()) / r['numel']:.2f} bytes/parameter")
    shutdown()


if __name__ == "__main__":
    main()
