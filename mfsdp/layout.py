"""ParallelLayout: how the world's ranks split into shard, outer, expert and expert-data groups.

Pure rank arithmetic first (no process group needed), then one call that creates the groups::

    >>> layout = ParallelLayout(world_size=8, dp_outer=2, ep=2)
    >>> layout.groups("ep")
    [[0, 1], [2, 3], [4, 5], [6, 7]]
    >>> layout.groups("expt_dp_shard")
    [[0, 2], [4, 6], [1, 3], [5, 7]]

Dense ranks form the mesh ``[dp_outer][dp_shard]`` = ``arange(world).reshape(dp_outer, -1)``.
Expert ranks are laid out ``(dp_outer, expt_dp_shard, ep)``, so that each EP group is contiguous
(on one node, where the all-to-all is fastest). The outer groups are the same for dense and expert
parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["ParallelLayout", "ProcessGroups", "GROUP_KINDS"]

GROUP_KINDS = ("dp_shard", "dp_outer", "ep", "expt_dp_shard", "expt_dp")


@dataclass(frozen=True)
class ParallelLayout:
    """The rank layout of data parallelism (shard x outer) and expert parallelism.

    Args:
        world_size: number of ranks.
        dp_outer: size of the outer (replica) dimension; ``world_size // dp_outer`` ranks shard.
        ep: expert-parallel size; experts are split over ``ep`` consecutive ranks.
        num_experts: when given, checked against ``ep`` (each EP rank owns ``num_experts / ep``).
    """

    world_size: int
    dp_outer: int = 1
    ep: int = 1
    num_experts: int | None = None

    def __post_init__(self) -> None:
        for name in ("world_size", "dp_outer", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.world_size % self.dp_outer:
            raise ValueError(f"world_size={self.world_size} is not divisible by dp_outer="
                             f"{self.dp_outer}; choose an outer size that divides the world")
        if self.dp_shard % self.ep:
            raise ValueError(f"ep={self.ep} does not divide the shard group size "
                             f"{self.dp_shard} (= world_size {self.world_size} / dp_outer "
                             f"{self.dp_outer}); EP groups must fit inside a shard group")
        if self.num_experts is not None:
            if self.ep > self.num_experts:
                raise ValueError(f"ep={self.ep} is larger than num_experts={self.num_experts}; "
                                 "every EP rank needs at least one expert")
            if self.num_experts % self.ep:
                raise ValueError(f"num_experts={self.num_experts} is not divisible by ep="
                                 f"{self.ep}; each EP rank must own the same number of experts")

    @property
    def dp_shard(self) -> int:
        """Ranks in one dense shard group."""
        return self.world_size // self.dp_outer

    @property
    def expt_dp_shard(self) -> int:
        """Ranks in one expert shard group."""
        return self.dp_shard // self.ep

    def _expert_grid(self) -> torch.Tensor:
        return torch.arange(self.world_size).reshape(self.dp_outer, self.expt_dp_shard, self.ep)

    def groups(self, kind: str) -> list[list[int]]:
        """Rank lists of every group of ``kind`` (one of ``GROUP_KINDS``)."""
        dense = torch.arange(self.world_size).reshape(self.dp_outer, self.dp_shard)
        grid = self._expert_grid()
        if kind == "dp_shard":
            return dense.tolist()
        if kind == "dp_outer":
            return dense.t().tolist()
        if kind == "ep":
            return grid.reshape(-1, self.ep).tolist()
        if kind == "expt_dp_shard":
            return [grid[o, :, e].tolist() for e in range(self.ep) for o in range(self.dp_outer)]
        if kind == "expt_dp":
            return [grid[:, :, e].flatten().tolist() for e in range(self.ep)]
        raise ValueError(f"kind={kind!r} is not a group kind; use one of {GROUP_KINDS}")

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The group of ``kind`` that contains ``rank``."""
        return next(g for g in self.groups(kind) if rank in g)

    def __str__(self) -> str:
        rows = [f"ParallelLayout(world_size={self.world_size}, dp_outer={self.dp_outer}, "
                f"ep={self.ep}): dp_shard={self.dp_shard}, expt_dp_shard={self.expt_dp_shard}",
                f"{'group':<14} | ranks"]
        rows.append("-" * 15 + "+" + "-" * 40)
        for kind in GROUP_KINDS:
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
        return ProcessGroups(self, made)


@dataclass
class ProcessGroups:
    """This rank's groups of a :class:`ParallelLayout`, by kind (``groups["ep"]``, ...)."""

    layout: ParallelLayout
    by_kind: dict[str, dist.ProcessGroup] = field(default_factory=dict)

    def __getitem__(self, kind: str) -> dist.ProcessGroup | None:
        return self.by_kind.get(kind)
