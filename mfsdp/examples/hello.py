"""The smallest multi-rank program: every rank reports what it sees of the process group
(the first recipe runs it with :func:`mfsdp.launch.launch`, whose doctest does too)."""

from __future__ import annotations

import os

__all__ = ["rank_info"]


def rank_info() -> dict:
    """This rank's view of the process group: rank, world size, backend, an all-reduce.

    Every rank contributes ``rank + 1`` to an all-reduce, so the sum proves the ranks
    really talk to each other.
    """
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(),
            "backend": dist.get_backend(), "pid": os.getpid(),
            "all_reduce_sum": t.item()}
