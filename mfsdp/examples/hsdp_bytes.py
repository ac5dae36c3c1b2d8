"""What each process group carries in one training step under FSDP, HSDP and HFSDP.

Run it with ``torchrun --nproc-per-node 4 -m mfsdp.examples.hsdp_bytes``; the guide's
recipe (``recipes/plot_hsdp_bytes_per_group.py``) runs :func:`bytes_per_group` for
the three layouts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["bytes_per_group", "main"]


def bytes_per_group(dp_outer: int = 1, outer_strategy: str = "no_shard", dim: int = 128,
                    hidden: int = 512, blocks: int = 4) -> dict:
    """Shard a small MLP over shard groups of ``world / dp_outer`` ranks with
    ``dp_outer`` replicas (``outer_strategy="optim"``: HFSDP, main weights sharded
    over the replicas too), take two AdamW steps and return the bytes this rank sent
    per group in the second, with the model's parameter count and the gradient and
    optimizer bytes it holds."""
    import mfsdp
    from mfsdp.models import Block, ToyModel

    layout = mfsdp.ParallelLayout(dist.get_world_size(), dp_outer=dp_outer)
    groups = layout.create_groups()
    torch.manual_seed(0)
    model = ToyModel(dim, hidden, blocks)
    numel = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = mfsdp.fully_shard(model, optimizer,
                                   fsdp_unit_modules=[Block], process_groups=groups,
                                   zero_dp_strategy="optim_grads_params",
                                   outer_dp_sharding_strategy=outer_strategy)
    x = torch.randn(16, dim, generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(2):
        model.fsdp_state().comms.log.clear()  # keep the last step's collectives only
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        model.wait_param_sync()
    sent: dict[str, int] = {}
    # one record per collective: its group, the bytes it sent
    for r in model.fsdp_state().comms.log.records:
        if r["op"] != "flags":
            sent[r["group"]] = sent.get(r["group"], 0) + r["sent_bytes"]
    held = model.fsdp_state().memory_by_kind()
    return {"sent_bytes": sent, "numel": numel,
            "grad_and_optimizer_bytes": held["main_grads"] + opt.local_state_bytes()}


def main() -> None:
    """Print the three layouts' bytes per group (rank 0)."""
    from mfsdp.runtime import shutdown

    dist.init_process_group("gloo")
    for name, kw in (("FSDP", {}), ("HSDP", dict(dp_outer=2)),
                     ("HFSDP", dict(dp_outer=2, outer_strategy="optim"))):
        r = bytes_per_group(**kw)
        if dist.get_rank() == 0:
            print(name, {g: f"{b / 2**20:.3f} MiB" for g, b in r["sent_bytes"].items()})
    shutdown()


if __name__ == "__main__":
    main()
