"""One MoE layer with expert parallelism, run through each token dispatcher.

Run it with ``torchrun --nproc-per-node 4 -m mfsdp.examples.moe_dispatch``; the
guide's recipe (``recipes/plot_moe_dispatchers.py``) runs :func:`run_layer` once per
dispatcher.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

__all__ = ["run_layer", "main"]


def run_layer(dispatcher: str, counts: list[int], flex_backend: str = "torch",
              dim: int = 64, ffn: int = 128, num_experts: int = 8, topk: int = 2,
              steps: int = 5) -> dict:
    """Build an MoE layer (``num_experts`` experts, top-``topk`` routing) on every rank
    from one seed, keep this rank's experts (EP over all ranks), and run forward and
    backward on this rank's ``counts[rank]`` tokens ``steps`` times. Returns the
    output, the bytes this rank sent per collective, the rows each local expert
    computed, the median seconds per call and, for the static-shape ``flex``
    dispatcher, the token count it padded to and whether any padding row was routed
    to an expert."""
    from mfsdp.moe import MoELayer, shard_experts

    rank = dist.get_rank()
    torch.manual_seed(0)  # the same router and experts on every rank
    layer = MoELayer(dim=dim, ffn=ffn, num_experts=num_experts, topk=topk,
                     dispatcher=dispatcher, flex_backend=flex_backend)
    # rank r keeps experts [r * E / EP, (r + 1) * E / EP)
    shard_experts(layer, dist.group.WORLD)
    tokens = torch.randn(sum(counts), dim, generator=torch.Generator().manual_seed(1))
    start = sum(counts[:rank])
    # this rank's tokens: counts differ between ranks
    x = tokens[start:start + counts[rank]]
    times = []
    for _ in range(steps):
        layer.zero_grad()
        t0 = time.perf_counter()
        out = layer(x.clone().requires_grad_(True))
        out.pow(2).sum().backward()
        times.append(time.perf_counter() - t0)
    d = layer.dispatcher
    # flex: rows past counts[rank] are padding
    padded = getattr(d, "padded_routing_map", None)
    return {"output": out.detach(), "bytes_sent": dict(d.bytes_sent),
            "tokens_per_expert": list(d.tokens_per_expert),
            "seconds": sorted(times)[len(times) // 2],
            "padded_tokens": getattr(d, "padded_tokens", None),
            "padding_routed": (bool(padded[counts[rank]:].any()) if padded is not None
                               else None)}


def main() -> None:
    """Print each dispatcher's bytes sent and time per call (rank 0)."""
    from mfsdp.runtime import shutdown

    dist.init_process_group("gloo")
    counts = [40, 64, 23, 90][:dist.get_world_size()]
    for kind in ("allgather", "alltoall", "flex"):
        r = run_layer(kind, counts)
        if dist.get_rank() == 0:
            print(f"{kind:<9} sent {sum(r['bytes_sent'].values()) / 1024:.1f} KiB, "
                  f"{1e3 * r['seconds']:.2f} ms per call")
    shutdown()


if __name__ == "__main__":
    main()
