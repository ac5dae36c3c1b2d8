"""bf16 gradient reduction numerics, measured on real per-rank gradients.

:func:`reduction_errors` runs in every rank of :func:`mfsdp.launch.launch`: each rank computes the
gradient of the same model on its own slice of the batch, the ranks exchange them
exactly (fp32), and every rank then reduces them four ways and compares with the
exact mean (fp64):

* ``fp32``: a ring in fp32 (add one rank's contribution per hop, round to fp32);
* ``bf16_fp32_accum``: values sent in bf16, summed in fp32 on arrival, rounded once. This is what
  mfsdp's gloo reduce-scatter does with ``grad_comm_dtype=torch.bfloat16``
  (``all_to_all`` of bf16 chunks, then one ``sum``, which accumulates in fp32);
* ``bf16_ring``: a ring in bf16, rounding to bf16 after every hop, as a bf16 ring reduce-scatter
  does;
* ``bf16_tree``: pairwise (tree) summation in bf16, rounding at every level.

At scale, :func:`rank_gradients` computes the gradients of a Llama-style model (the
``llama-tiny`` preset: RMSNorm, RoPE, grouped-query attention, SwiGLU) on up to
thousands of different micro-batches in one process, and :func:`simulate_reduction`
reduces them exactly as each path does, bit for bit: :func:`ring_reduce` follows
NCCL's ring reduce-scatter order (chunk ``c`` starts at rank ``c + 1`` and gathers
one rank per hop, rounding to the communication dtype after every addition),
:func:`fp32_accum_reduce` is mfsdp's gloo path. Nothing is extrapolated.

>>> g = torch.tensor([[1.0, 1.0], [2.0 ** -8, 2.0 ** -8]])   # two ranks, one chunk each
>>> ring_reduce(g, torch.bfloat16)  # 1 + 2**-8 is not a bf16 number: rounds to even, back to 1
tensor([1., 1.])
>>> fp32_accum_reduce(g, torch.bfloat16)  # the same single rounding here
tensor([1., 1.])
>>> small = torch.full((4, 4), 2.0 ** -8).index_fill(0, torch.tensor([0]), 1.0)  # rank 0 holds 1s
>>> ring_reduce(small, torch.bfloat16)  # chunks 0, 1 meet rank 0 last; chunks 2, 3 lose 2**-8s
tensor([1.0156, 1.0156, 1.0000, 1.0000])
>>> fp32_accum_reduce(small, torch.bfloat16)  # one rounding of 1 + 3 * 2**-8
tensor([1.0156, 1.0156, 1.0156, 1.0156])

>>> a, b = fit_power_law([2, 4, 8], [1e-3, 2e-3, 4e-3])  # error = a * N ** b
>>> round(a, 6), round(b, 6)
(0.0005, 1.0)
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["METHODS", "SCALE_METHODS", "engine_reduce_scatter", "fit_power_law", "fp32_accum_reduce", "rank_gradients",
           "reduction_errors", "ring_reduce", "simulate_reduction"]

METHODS = ("fp32", "bf16_fp32_accum", "bf16_ring", "bf16_tree")
# What each path gives (the numerics page's table): fp32 rings (NCCL or gloo, fp32
# gradients), bf16 values with fp32 sums (mfsdp's gloo path), bf16 rings (NCCL with bf16
# reduction).
SCALE_METHODS = ("fp32_ring", "bf16_fp32_accum", "bf16_ring")


def ring_reduce(grads: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Sum of ``grads`` (``[ranks, n]``) as a ring reduce-scatter computes it, bit for
    bit.

    Each rank's values are first cast to ``dtype``; the ``n`` elements are cut into
    ``ranks`` chunks (zero-padded, which changes no rounding); chunk ``c`` starts at
    rank ``c + 1`` and travels the ring, every hop adding one rank's values and
    rounding to ``dtype`` (NCCL's sum of two bf16 values is the fp32 sum rounded to
    bf16, which is what ``(a.float() + b.float())`` rounded gives). Returns the ``n``
    sums in fp32.
    """
    world, n = grads.shape
    per = -(-n // world)
    chunks = torch.zeros(world, world * per, dtype=grads.dtype)
    chunks[:, :n] = grads
    chunks = chunks.to(dtype).view(world, world, per)  # [rank, chunk, element]
    cols = torch.arange(world)
    acc = chunks[(cols + 1) % world, cols]
    for hop in range(2, world + 1):
        acc = (acc.float() + chunks[(cols + hop) % world, cols].float()).to(dtype)
    return acc.reshape(-1)[:n].float()


def fp32_accum_reduce(grads: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Sum of ``grads`` (``[ranks, n]``) sent in ``dtype`` and accumulated in fp32,
    rounded to ``dtype`` once: mfsdp's gloo reduce-scatter with ``grad_comm_dtype``
    bf16 (an ``all_to_all`` of bf16 chunks, then one ``sum``). Returns fp32."""
    return grads.to(dtype).sum(0).float()


def rank_gradients(world: int, preset: str = "llama-tiny", seq_length: int = 64,
                   seed: int = 0) -> torch.Tensor:
    """``[world, parameters]`` fp32: the gradient of one Llama-style model (``preset``
    of ``mfsdp.models.gpt``, initialised with ``seed``) on each rank's own
    micro-batch, a window of the text bundled with mfsdp at a seeded offset
    (next-token loss, mean over tokens). Computed in this process, one backward per
    rank."""
    from pathlib import Path

    from mfsdp.models.gpt import GPT, GPT_PRESETS

    cfg = GPT_PRESETS[preset]
    torch.manual_seed(seed)
    model = GPT(cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    corpus = Path(__file__).parent.parent / "data" / "sample_corpus.txt"
    text = torch.tensor(list(corpus.read_bytes()))
    text = text % cfg.vocab_size
    offsets = torch.randint(0, len(text) - seq_length - 1, (world,),
                            generator=torch.Generator().manual_seed(seed + 1))
    out = torch.empty(world, sum(p.numel() for p in params))
    for r, o in enumerate(offsets.tolist()):
        tokens = text[o:o + seq_length + 1]
        logits = model(tokens[None, :-1]).reshape(seq_length, -1)
        loss = torch.nn.functional.cross_entropy(logits.float(), tokens[1:])
        grads = torch.autograd.grad(loss, params)
        out[r] = torch.cat([g.reshape(-1) for g in grads])
    return out


def engine_reduce_scatter(grads: torch.Tensor,
                          dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Run in every rank of :func:`mfsdp.launch.launch`: this rank's row of ``grads``
    (cast to ``dtype``) through the engine's own reduce-scatter
    (``mfsdp.fsdp.collectives.Communicator``, the path of ``grad_comm_dtype``);
    returns this rank's chunk of the sum, in fp32. With gloo it equals
    :func:`fp32_accum_reduce` bit for bit (``tests/test_numerics.py``)."""
    from mfsdp.fsdp.collectives import Communicator

    rank = dist.get_rank()
    comm = Communicator(None, "dp")
    return comm.reduce_scatter(grads[rank].to(dtype).contiguous()).wait().float()


def simulate_reduction(grads: torch.Tensor,
                       worlds: list[int]) -> dict[int, dict[str, float]]:
    """Relative L2 error of the mean gradient for each world size in ``worlds`` (the
    first ``N`` rows of ``grads``) and each path of ``SCALE_METHODS`` (``fp32_ring``,
    ``bf16_fp32_accum``, ``bf16_ring``), against the exact mean (fp64). Use powers of
    two for ``N``: NCCL's average pre-multiplies by ``1 / N``, exact in bf16 then, so
    a sum divided by ``N`` rounds the same way."""
    out = {}
    for n in worlds:
        g = grads[:n]
        exact = g.double().mean(0)
        norm = exact.norm().item()
        sums = {"fp32_ring": ring_reduce(g, torch.float32),
                "bf16_fp32_accum": fp32_accum_reduce(g, torch.bfloat16),
                "bf16_ring": ring_reduce(g, torch.bfloat16)}
        out[n] = {k: ((v.double() / n - exact).norm().item() / norm)
                  for k, v in sums.items()}
    return out

def _tree_bf16(parts: list[torch.Tensor]) -> torch.Tensor:
    level = [p.bfloat16() for p in parts]
    while len(level) > 1:
        nxt = [(level[i].float() + level[i + 1].float()).bfloat16()
               for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0].float()


def reduction_errors(dim: int = 64, hidden: int = 256, blocks: int = 3, local_batch: int = 16,
                     seed: int = 0) -> dict[str, float]:
    """Relative L2 error of the mean gradient under each method (see module doc), on this world."""
    from mfsdp.models import ToyModel

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model = ToyModel(dim, hidden, blocks)
    g = torch.Generator().manual_seed(seed + 1 + rank)  # every rank its own data
    x = torch.randn(local_batch, dim, generator=g)
    torch.nn.functional.mse_loss(model(x), torch.sin(x)).backward()
    mine = torch.cat([p.grad.flatten() for p in model.parameters()])
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine)
    exact = torch.stack([p.double() for p in parts]).sum(0) / world
    ring32 = parts[0].clone()
    ring16 = parts[0].bfloat16()
    for p in parts[1:]:
        ring32 = ring32 + p
        ring16 = (ring16.float() + p.bfloat16().float()).bfloat16()
    results = {
        "fp32": ring32 / world,
        "bf16_fp32_accum": torch.stack([p.bfloat16() for p in parts]).sum(0).float() / world,
        "bf16_ring": ring16.float() / world,
        "bf16_tree": _tree_bf16(parts) / world,
    }
    norm = exact.norm().item()
    return {k: ((v.double() - exact).norm().item() / norm) for k, v in results.items()}


def fit_power_law(ns: list[int], errs: list[float]) -> tuple[float, float]:
    """Least-squares fit of ``err = a * N ** b`` in log-log space; returns ``(a, b)``."""
    xs = [math.log(n) for n in ns]
    ys = [math.log(e) for e in errs]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return math.exp(my - b * mx), b
