"""What the ranks must agree on at wrap time: every rank wrapped the same model (parameter names,
global shapes, dtypes: refused otherwise), and the ranks that share a parameter (its
data-parallel group, the outer group under HSDP, the TP group for a parameter TP replicates)
start from the same values (where they do not, the group's first rank broadcasts its values,
as Megatron-LM's DDP does, and one line says so).

Why: a rank that wraps another model (a different config, a missing layer) otherwise calls a
different sequence of collectives and hangs until the timeout; ranks seeded differently (PyTorch
seeds every process at random) would under ``no_shard`` train apart while the logged loss, an
average, looks fine, and under the sharded strategies would each keep their own rows of
different initial weights (a model loaded on rank 0 only would be mixed with random rows).

The value check compares, per parameter, an exact fingerprint: the sum and the sum of squares
of the tensor's bytes read as integers (int64 arithmetic: exact and independent of summation
order, so equal bytes give equal fingerprints on any device). Its cost is one read of the local
parameters and one all-reduce of 4 integers per parameter per group. With meta-device
initialisation there are no values yet: the random-number generator states of the outer
replicas are compared (and aligned) instead; within a shard group every rank initialises only
its own rows, so differing states there give a consistent model.
"""

from __future__ import annotations

import hashlib
import logging

import torch
import torch.distributed as dist

__all__ = ["check_same_model", "agree_on_values", "agree_on_rng", "fingerprint"]

_log = logging.getLogger("mfsdp")


def _global_shape(e: dict) -> tuple:
    return tuple(e["tp"].global_shape) if e.get("tp") is not None else tuple(e["param"].shape)


def _describe(params: dict[int, dict]) -> list[tuple]:
    return [(e["name"], _global_shape(e), str(e["param"].dtype), bool(e["param"].requires_grad))
            for e in params.values()]


def check_same_model(params: dict[int, dict]) -> None:
    """Raise ValueError on every rank unless all ranks wrapped the same parameters (names, global
    shapes, dtypes, requires_grad); the message names the first difference and the ranks."""
    world = dist.get_world_size()
    if world == 1:
        return
    mine = _describe(params)
    digest = hashlib.sha256(repr(mine).encode()).hexdigest()
    digests: list = [None] * world
    dist.all_gather_object(digests, digest)
    if len(set(digests)) == 1:
        return
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    ref = {name: rest for name, *rest in everyone[0]}
    for r in range(1, world):
        if digests[r] == digests[0]:
            continue
        theirs = {name: rest for name, *rest in everyone[r]}
        missing = [n for n in ref if n not in theirs]
        extra = [n for n in theirs if n not in ref]
        if missing:
            what = f"parameter {missing[0]!r} of rank 0 is missing on rank {r}"
        elif extra:
            what = f"rank {r} has parameter {extra[0]!r}, which rank 0 does not"
        else:
            name = next(n for n in ref if ref[n] != theirs[n])
            (s0, d0, g0), (s1, d1, g1) = ref[name], theirs[name]
            what = (f"parameter {name!r} is {tuple(s0)} {d0}{'' if g0 else ' (frozen)'} on "
                    f"rank 0 but {tuple(s1)} {d1}{'' if g1 else ' (frozen)'} on rank {r}")
        odd = [i for i in range(world) if digests[i] != digests[0]]
        raise ValueError(f"fully_shard: the ranks wrapped different models: {what} ({len(odd)} "
                         f"rank(s) differ from rank 0: {odd[:8]}{' ...' if len(odd) > 8 else ''}); "
                         "every rank must build the same model (the same config and code) "
                         "before fully_shard")


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Two int64 numbers that equal bytes always give and different bytes almost never: the sum
    and the sum of squares of the tensor's bytes read as integers of its element size."""
    flat = t.detach().contiguous().reshape(-1)
    size = flat.element_size()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(size)
    words = flat.view(ints) if ints is not None else flat.view(torch.uint8)
    w = words.to(torch.int64)
    return torch.stack([w.sum(), (w * w).sum()])


def _disagree(values: torch.Tensor, group) -> torch.Tensor:
    """Per row, whether the ranks of ``group`` hold different values (an all-reduce of max and
    of minus min)."""
    both = torch.cat([values, -values], dim=-1)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    n = values.shape[-1]
    return (both[:, :n] != -both[:, n:]).any(dim=-1)


def agree_on_values(entries: list[tuple[str, torch.Tensor, tuple]], device) -> int:
    """Make the ranks that share a parameter hold the same values, as Megatron-LM's DDP does:
    where they differ, the first rank of the group broadcasts its value; say so in one line.

    ``entries``: (name, local value, groups) per parameter, where groups is a tuple of the
    process groups whose ranks must agree (its data-parallel group, the outer group, the TP group
    for a parameter TP replicates), applied in that order. Returns how many parameters this
    rank received (0 when the ranks agreed, the usual case: one all-reduce per group)."""
    device = _host(device)
    by_groups: dict[tuple, list] = {}
    for name, value, groups in entries:
        groups = tuple(g for g in groups if g is not None and dist.get_world_size(g) > 1)
        if groups:
            by_groups.setdefault(tuple(id(g) for g in groups), []).append((name, value, groups))
    fixed, first = 0, None
    for items in by_groups.values():
        prints = torch.stack([fingerprint(v).to(device) for _, v, _ in items])
        for group in items[0][2]:
            bad = _disagree(prints, group).nonzero().flatten().tolist()
            src = dist.get_process_group_ranks(group)[0]
            for i in bad:
                value = items[i][1]
                staged = value.detach().contiguous()
                dist.broadcast(staged, src=src, group=group)
                if staged.data_ptr() != value.data_ptr():
                    with torch.no_grad():
                        value.copy_(staged)
                prints[i] = fingerprint(value).to(device)  # for the next group's comparison
            if bad and dist.get_rank() != src:
                fixed += len(bad)
                first = first or items[bad[0]][0]
    count = _job_total(fixed, device)
    if count:
        names: list = [None] * dist.get_world_size()
        dist.all_gather_object(names, first)
        if dist.get_rank() == 0:
            _log.warning(
                "fully_shard: the ranks held different initial values of %d parameter cop%s "
                "(e.g. %r); every data-parallel replica now starts from its group's first rank, "
                "as Megatron-LM's DDP does. Seed every rank alike (torch.manual_seed) or load the "
                "weights on every rank to start from your own", count,
                "y" if count == 1 else "ies", next(n for n in names if n))
    return fixed


def _host(device) -> torch.device:
    """Where agreement's own small tensors live: ``device``, or the CPU for a model sharded
    onto the meta device (a dry run, :mod:`mfsdp.tools.dry_run`: there are no values to agree
    on, and the fake process group moves none)."""
    device = torch.device(device)
    return torch.device("cpu") if device.type == "meta" else device


def _job_total(n: int, device) -> int:
    """The sum of ``n`` over every rank of the job (one all-reduce; ``n`` in a world of one)."""
    if dist.get_world_size() == 1:
        return n
    total = torch.tensor([n], dtype=torch.int64, device=_host(device))
    dist.all_reduce(total)
    return int(total)


def agree_on_rng(device, groups) -> None:
    """Meta-device initialisation: the ranks of each group take the random-number generator
    state of the group's first rank when theirs differ (equal states draw equal initial
    weights); one line says so."""
    device = _host(device)
    gens = [None] + ([device] if device.type == "cuda" else [])

    def get(d):
        return torch.get_rng_state() if d is None else torch.cuda.get_rng_state(d)

    def put(d, state):
        if d is None:
            torch.set_rng_state(state)
        else:
            torch.cuda.set_rng_state(state, d)

    fixed = 0
    for group in groups:
        if group is None or dist.get_world_size(group) == 1:
            continue
        value = fingerprint(torch.cat([get(d).reshape(-1) for d in gens])).to(device)[None]
        if not bool(_disagree(value, group)[0]):
            continue
        src = dist.get_process_group_ranks(group)[0]
        for d in gens:
            state = get(d).to(device)
            dist.broadcast(state, src=src, group=group)
            put(d, state.cpu())
        fixed += dist.get_rank() != src
    count = _job_total(fixed, device)
    if count and dist.get_rank() == 0:
        _log.warning(
            "fully_shard: init_model_with_meta_device=True and %d rank(s) had another "
            "random-number generator state than the first rank of their replica group; they now "
            "use its state, so every replica initialises the same weights (seed every rank "
            "alike with torch.manual_seed to start from your own)", count)
