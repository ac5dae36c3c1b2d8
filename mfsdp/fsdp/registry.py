"""What mfsdp remembers about objects it does not own: which sharded model a parameter belongs
to (or was taken over by), and the checkpoint names a model's builder declared for its parameters.

Why maps and not attributes: the objects are torch's (parameters, their ``DTensor`` faces) or the
user's (their ``nn.Module``), and an ``_mfsdp_*`` attribute written onto them from outside is a
hidden protocol that no class declares. Why weak keys: an entry lives exactly as long as its
object, and an ``id()`` reused by a later object never inherits a dead object's entry.

Public protocol for model builders: :func:`declare_checkpoint_names` records, for a module that
will be sharded, how its parameters are named in checkpoints (``mfsdp.moe.shard_experts`` names
each expert by its global index this way); :class:`mfsdp.FullyShardedModule` applies the names
when it wraps that module, as if
:meth:`~mfsdp.fsdp.state.ShardingState.set_global_names` were called.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["register_parameters", "register_taken_over", "model_of", "taken_over_by", "owner",
           "any_taken_over", "changes", "declare_checkpoint_names", "checkpoint_names"]

# a sharded model's parameter (the DTensor its modules hold) -> weak reference to that model
_MODEL_OF = WeakIdKeyDictionary()
# a parameter from before fully_shard -> weak reference to the model that took it over (so that an
# optimizer built on it can still be sharded, or be refused if it steps it directly)
_TAKEN_OVER = WeakIdKeyDictionary()
# a module the user builds -> {parameter name: its name in checkpoints}
_CHECKPOINT_NAMES = WeakIdKeyDictionary()
# how many registrations so far (caches of "which models does this optimizer step" compare it)
_changes = 0


def _record(table: WeakIdKeyDictionary, model: nn.Module, params) -> None:
    global _changes
    ref = weakref.ref(model)
    for p in params:
        table[p] = ref
    _changes += 1


def register_parameters(model: nn.Module, params) -> None:
    """Record ``params`` as the parameters of the sharded ``model``."""
    _record(_MODEL_OF, model, params)


def register_taken_over(model: nn.Module, params) -> None:
    """Record ``params`` (a module's parameters from before sharding) as taken over by ``model``."""
    _record(_TAKEN_OVER, model, params)


def model_of(p: torch.Tensor) -> nn.Module | None:
    """The sharded model whose parameter ``p`` is, or ``None``."""
    ref = _MODEL_OF.get(p)
    return ref() if ref is not None else None


def taken_over_by(p: torch.Tensor) -> nn.Module | None:
    """The sharded model that took over ``p`` (a parameter from before sharding), or ``None``."""
    ref = _TAKEN_OVER.get(p)
    return ref() if ref is not None else None


def owner(p: torch.Tensor) -> nn.Module | None:
    """The sharded model ``p`` belongs to, as its parameter or as one it took over; or ``None``."""
    model = model_of(p)
    return model if model is not None else taken_over_by(p)


def any_taken_over() -> bool:
    """Whether some parameter taken over by a sharded model is still alive."""
    return len(_TAKEN_OVER) > 0


def changes() -> int:
    """A number that grows with every registration (to tell when a cached lookup is stale)."""
    return _changes


def declare_checkpoint_names(module: nn.Module, mapping: dict[str, str]) -> None:
    """Name ``module``'s parameters in checkpoints by ``mapping`` (parameter name, as
    ``module.named_parameters()`` gives it -> checkpoint name) once it is sharded; further calls
    add to the names declared before."""
    names = _CHECKPOINT_NAMES.get(module)
    if names is None:
        names = _CHECKPOINT_NAMES[module] = {}
    names.update(mapping)


def checkpoint_names(module: nn.Module) -> dict[str, str]:
    """The checkpoint names declared for ``module`` (empty if none)."""
    return dict(_CHECKPOINT_NAMES.get(module, {}))
