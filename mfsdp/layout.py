"""ParallelLayout: how the world's ranks split into tensor-, context-, data- and expert-parallel
groups.

Pure rank arithmetic first (no process group needed), then one call that creates the groups::

    >>> layout = ParallelLayout(world_size=8, dp_outer=2, ep=2)
    >>> layout.groups("ep")
    [[0, 1], [2, 3], [4, 5], [6, 7]]
    >>> layout.groups("expt_dp_shard")
    [[0, 2], [4, 6], [1, 3], [5, 7]]
    >>> ParallelLayout(world_size=8, tp=2, cp=2).groups("dp_shard")
    [[0, 2, 4, 6], [1, 3, 5, 7]]

Dense ranks form the grid ``[dp_outer][dp][cp][tp]`` = ``arange(world).reshape(...)``: TP fastest,
then CP, then DP, as Megatron-LM orders them, so a TP group is consecutive ranks (one node's
NVLink). Parameters are sharded over ``dp_shard``, the ranks of one replica at one TP index
(``dp x cp``: upstream's ``dp_shard_cp``). Experts are laid out inside each such shard group as
``(expt_dp_shard, ep)``, so that each EP group is contiguous when ``tp == 1`` (on one node, where the
all-to-all is fastest). The outer groups are the same for dense and expert parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["ParallelLayout", "ProcessGroups", "GROUP_KINDS", "rank_device"]


def rank_device(cuda: bool | None = None) -> torch.device:
    """The device this rank computes on: its current GPU with ``cuda=True``, the CPU with
    ``False``; ``None`` asks the default process group (NCCL: the GPU, gloo: the CPU).

    >>> rank_device(cuda=False)
    device(type='cpu')
    """
    if cuda is None:
        cuda = dist.is_initialized() and dist.get_backend() == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

GROUP_KINDS = ("dp_shard", "dp_outer", "ep", "expt_dp_shard", "expt_dp", "tp", "cp", "dp")


@dataclass(frozen=True)
class ParallelLayout:
    """The rank layout of tensor, context, data (shard x outer) and expert parallelism.

    Args:
        world_size: number of ranks.
        dp_outer: size of the outer (replica) dimension.
        ep: expert-parallel size; experts are split over ``ep`` ranks of a shard group.
        num_experts: when given, checked against ``ep`` (each EP rank owns ``num_experts / ep``).
        tp: tensor-parallel size (consecutive ranks).
        cp: context-parallel size; parameters are sharded over ``dp x cp``.
    """

    world_size: int
    dp_outer: int = 1
    ep: int = 1
    num_experts: int | None = None
    tp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "dp_outer", "ep", "tp", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.world_size % self.dp_outer:
            raise ValueError(f"world_size={self.world_size} is not divisible by dp_outer="
                             f"{self.dp_outer}; choose an outer size that divides the world")
        if (self.world_size // self.dp_outer) % (self.tp * self.cp):
            raise ValueError(f"world_size={self.world_size} / dp_outer={self.dp_outer} is not "
                             f"divisible by tp x cp = {self.tp} x {self.cp}; the world must be "
                             "dp_outer x dp x cp x tp")
        if self.dp_shard % self.ep:
            over = (f"dp_outer {self.dp_outer}" if self.tp == 1
                    else f"(dp_outer {self.dp_outer} x tp {self.tp})")
            raise ValueError(f"ep={self.ep} does not divide the shard group size "
                             f"{self.dp_shard} (= world_size {self.world_size} / {over}); EP "
                             "groups must fit inside a shard group")
        if self.num_experts is not None:
            if self.ep > self.num_experts:
                raise ValueError(f"ep={self.ep} is larger than num_experts={self.num_experts}; "
                                 "every EP rank needs at least one expert")
            if self.num_experts % self.ep:
                raise ValueError(f"num_experts={self.num_experts} is not divisible by ep="
                                 f"{self.ep}; each EP rank must own the same number of experts")

    @property
    def dp(self) -> int:
        """Data-parallel ranks of one replica that read different data (without CP)."""
        return self.world_size // (self.dp_outer * self.cp * self.tp)

    @property
    def dp_shard(self) -> int:
        """Ranks in one dense shard group (``dp x cp``)."""
        return self.dp * self.cp

    @property
    def expt_dp_shard(self) -> int:
        """Ranks in one expert shard group."""
        return self.dp_shard // self.ep

    def _grid(self) -> torch.Tensor:
        return torch.arange(self.world_size).reshape(self.dp_outer, self.dp, self.cp, self.tp)

    def _expert_grid(self) -> torch.Tensor:
        """``[tp][dp_outer][expt_dp_shard][ep]``: each shard group laid out for experts."""
        g = self._grid().permute(3, 0, 1, 2).reshape(self.tp, self.dp_outer, self.dp_shard)
        return g.reshape(self.tp, self.dp_outer, self.expt_dp_shard, self.ep)

    def groups(self, kind: str) -> list[list[int]]:
        """Rank lists of every group of ``kind`` (one of ``GROUP_KINDS``)."""
        g = self._grid()
        shard = g.permute(0, 3, 1, 2).reshape(self.dp_outer * self.tp, self.dp_shard)
        ex = self._expert_grid()
        t_range, o_range = range(self.tp), range(self.dp_outer)
        if kind == "dp_shard":
            return shard.tolist()
        if kind == "dp_outer":
            return g.permute(1, 2, 3, 0).reshape(-1, self.dp_outer).tolist()
        if kind == "tp":
            return g.reshape(-1, self.tp).tolist()
        if kind == "cp":
            return g.permute(0, 1, 3, 2).reshape(-1, self.cp).tolist()
        if kind == "dp":
            return g.permute(2, 3, 0, 1).reshape(-1, self.dp_outer * self.dp).tolist()
        if kind == "ep":
            return ex.reshape(-1, self.ep).tolist()
        if kind == "expt_dp_shard":
            return [ex[t, o, :, e].tolist() for t in t_range for e in range(self.ep)
                    for o in o_range]
        if kind == "expt_dp":
            return [ex[t, :, :, e].flatten().tolist() for t in t_range for e in range(self.ep)]
        raise ValueError(f"kind={kind!r} is not a group kind; use one of {GROUP_KINDS}")

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The group of ``kind`` that contains ``rank``."""
        return next(g for g in self.groups(kind) if rank in g)

    def __str__(self) -> str:
        extra = "".join(f", {k}={getattr(self, k)}" for k in ("tp", "cp") if getattr(self, k) > 1)
        rows = [f"ParallelLayout(world_size={self.world_size}, dp_outer={self.dp_outer}, "
                f"ep={self.ep}{extra}): dp_shard={self.dp_shard}, "
                f"expt_dp_shard={self.expt_dp_shard}",
                f"{'group':<14} | ranks"]
        rows.append("-" * 15 + "+" + "-" * 40)
        for kind in GROUP_KINDS:
            if kind in ("tp", "cp") and getattr(self, kind) == 1:
                continue
            if kind == "dp" and self.cp == 1 and self.tp == 1:
                continue  # the same ranks as dp_shard x dp_outer
            rows.append(f"{kind:<14} | " + " ".join(str(g).replace(" ", "")
                                                    for g in self.groups(kind)))
        return "\n".join(rows)

    def create_groups(self, all_gather_groups: bool = False,
                      backend: str | None = None) -> "ProcessGroups":
        """Create this rank's process groups (a collective call: every rank must make it).

        ``all_gather_groups=True`` also creates a second communicator over the same ranks as each
        dense and expert shard group, used for all-gathers so that they do not queue behind
        reduce-scatters.
        """
        if not dist.is_initialized():
            raise RuntimeError("create_groups needs an initialised process group")
        if dist.get_world_size() != self.world_size:
            raise ValueError(f"ParallelLayout(world_size={self.world_size}) but the process group "
                             f"has {dist.get_world_size()} ranks")
        made: dict[str, dist.ProcessGroup] = {}
        kinds = list(GROUP_KINDS) + (["dp_shard_ag", "expt_dp_shard_ag"] if all_gather_groups else [])
        for kind in kinds:
            base = kind.removesuffix("_ag")
            group, _ = dist.new_subgroups_by_enumeration(self.groups(base), backend=backend)
            made[kind] = group
        return ProcessGroups(layout=self, **made)


@dataclass
class ProcessGroups:
    """This rank's process groups, by kind: what :meth:`mfsdp.ParallelLayout.create_groups` makes, and
    the one type the engine takes (``fully_shard(process_groups=...)``).

    A field that is ``None`` means the default (world) group for ``dp_shard``, and no such
    dimension otherwise. ``groups["ep"]`` reads a field by its kind name.
    """

    dp_shard: dist.ProcessGroup | None = None  # dense parameters are sharded over it
    dp_outer: dist.ProcessGroup | None = None  # HSDP/HFSDP outer (replica) dimension
    ep: dist.ProcessGroup | None = None  # ranks holding different experts
    expt_dp_shard: dist.ProcessGroup | None = None  # expert parameters are sharded over it
    expt_dp: dist.ProcessGroup | None = None  # expert data-parallel ranks (inner x outer)
    tp: dist.ProcessGroup | None = None  # tensor-parallel ranks
    cp: dist.ProcessGroup | None = None  # context-parallel ranks
    dp: dist.ProcessGroup | None = None  # data-parallel ranks (one batch each)
    dp_shard_ag: dist.ProcessGroup | None = None  # dp_shard's ranks, for all-gathers only
    expt_dp_shard_ag: dist.ProcessGroup | None = None  # expt_dp_shard's, for all-gathers only
    tp_mesh: object = None  # the 1-D DeviceMesh over `tp`, when the caller has one
    layout: ParallelLayout | None = None  # the layout the groups were made from

    def __getitem__(self, kind: str) -> dist.ProcessGroup | None:
        if kind not in _FIELD_KINDS:
            raise KeyError(f"{kind!r} is not a group kind; use one of {_FIELD_KINDS}")
        return getattr(self, kind)


_FIELD_KINDS = GROUP_KINDS + ("dp_shard_ag", "expt_dp_shard_ag")
