"""The engines ``mfsdp check`` can run the sharded side with, one adapter each, behind the same
reference, steps, layouts and report (``mfsdp check --engine``, ``mfsdp.check.check(engine=...)``):

* ``mfsdp`` (:mod:`~mfsdp.check.engines.native`): this package's ``mfsdp.fully_shard``;
* ``fsdp2`` (:mod:`~mfsdp.check.engines.fsdp2`): PyTorch's ``torch.distributed.fsdp.fully_shard``
  per FSDP unit and on the root, over the same mesh;
* ``megatron_fsdp`` (:mod:`~mfsdp.check.engines.upstream`): the installed ``megatron_fsdp``
  package's ``fully_shard`` (``pip install mfsdp[upstream]``), called as its README does.

An adapter says which layouts its engine has (:meth:`Engine.refuses`: a layout it lacks is
skipped with the reason), shards the model and optimizer for a layout, and reads back what the
report compares: the global gradient norm, every full gradient and every full parameter.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

__all__ = ["ENGINES", "Engine", "Sharded", "get_engine", "engine_names"]


class Sharded:
    """One layout's sharded model and optimizer, as an engine built them."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 par: Any = None) -> None:
        self.model = model
        """The wrapped model the training loop calls."""
        self.optimizer = optimizer
        """The optimizer the training loop steps (the engine's wrapper where it has one)."""
        self.par = par
        """mfsdp's :class:`~mfsdp.check.parallel.ParallelRun` for a TP, CP or EP layout."""


class Engine:
    """The adapter of one sharding engine (subclasses fill in each method)."""

    name = ""
    """The ``--engine`` value."""
    title = ""
    """How the report names the engine."""

    def version(self) -> str:
        """The engine's version, as the report prints it."""
        raise NotImplementedError

    def missing(self) -> str | None:
        """Why the engine cannot run here (not installed), or ``None``."""
        return None

    def refuses(self, layout) -> str | None:
        """Why ``layout`` is not one of the engine's layouts (one line), or ``None``."""
        raise NotImplementedError

    def replacements(self) -> list[str]:
        """What the check replaces around the engine on this machine so that it runs (empty:
        nothing; the report names each)."""
        return []

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The scope the engine runs in on a rank (the replacements, if any, live only here)."""
        yield

    def shard(self, s: dict, layout, strategy: str) -> Sharded:
        """Build the user's model and optimizer and shard them as ``layout`` with ``strategy``."""
        raise NotImplementedError

    def grad_norm(self, sh: Sharded, full: dict[str, torch.Tensor] | None = None) -> float:
        """The global L2 norm of the reduced gradients (a collective call), from ``full`` (what
        :meth:`full_gradients` returned this step) when given."""
        return _norm_of((full if full else self.full_gradients(sh)).values())

    def full_gradients(self, sh: Sharded) -> dict[str, torch.Tensor]:
        """Every reduced gradient at its full shape, by parameter name (a collective call)."""
        raise NotImplementedError

    def full_parameters(self, sh: Sharded) -> dict[str, torch.Tensor]:
        """Every parameter (its fp32 main weights) at its full shape (a collective call)."""
        raise NotImplementedError

    def state_bytes(self, sh: Sharded) -> int:
        """Bytes of sharded weights, gradients and optimizer state this rank holds."""
        raise NotImplementedError


def _norm_of(tensors) -> float:
    return float(sum(t.double().pow(2).sum() for t in tensors)) ** 0.5


def strip_name(name: str) -> str:
    """A parameter name without the wrappers' prefixes (``module.``)."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def engine_names() -> list[str]:
    """The ``--engine`` values."""
    return list(ENGINES)


def get_engine(name: str) -> Engine:
    """The adapter for ``name``; a one-line ``ValueError`` naming the choices otherwise."""
    if name not in ENGINES:
        raise ValueError(f"--engine={name!r}: choose from {', '.join(ENGINES)}")
    module, _, cls = ENGINES[name].partition(":")
    import importlib

    return getattr(importlib.import_module(module), cls)()


ENGINES: dict[str, str] = {
    "mfsdp": "mfsdp.check.engines.native:MfsdpEngine",
    "fsdp2": "mfsdp.check.engines.fsdp2:FSDP2Engine",
    "megatron_fsdp": "mfsdp.check.engines.upstream:MegatronFSDPEngine",
}
"""Each ``--engine`` value and its adapter class (imported only when chosen)."""
