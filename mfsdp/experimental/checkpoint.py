"""``save_checkpoint`` / ``load_checkpoint`` for the per-module API: mfsdp's own ``fsdp_dtensor``
checkpoints (``docs/checkpointing.md``), so one written through either front door loads through
the other, on any layout.

The optimizer of the per-module API is the user's ``torch.optim`` optimizer over the model's
DTensor parameters; mfsdp's checkpoint code reads an optimizer as the list of main-weight rows
it steps and their state. :class:`_OptimizerRows` presents the former as the latter: each
parameter's local rows and the local tensors of its state (the same memory, so a load writes
into the optimizer's own state).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mfsdp.checkpoint import load_checkpoint as _load
from mfsdp.checkpoint import save_checkpoint as _save
from mfsdp.experimental.module import FsdpModule

__all__ = ["save_checkpoint", "load_checkpoint"]


def _engine(model: nn.Module):
    """The one mfsdp engine of ``model`` (a root sharded by ``fully_shard``)."""
    if not isinstance(model, FsdpModule) or not model.is_root():
        roots = [n or "(the model)" for n, m in model.named_modules()
                 if isinstance(m, FsdpModule) and m.is_root()]
        raise ValueError(f"{type(model).__name__} is not a root sharded by fully_shard (its "
                         f"sharded roots: {', '.join(roots) or 'none'}); an mfsdp checkpoint "
                         "holds one sharded model: call fully_shard(model, ...) last, on the "
                         "model itself")
    engine = model.engine
    managed = {id(sp.sharded) for sp in engine._sparams}
    for name, p in model.named_parameters():
        if id(p) not in managed:
            raise ValueError(f"parameter {name!r} is not sharded (a parameter outside every "
                             "module given to fully_shard); shard the model's root as well")
    return engine


class _OptimizerRows:
    """``optimizer`` as mfsdp's checkpoint code reads an optimizer (see the module notes)."""

    def __init__(self, engine, optimizer: torch.optim.Optimizer):
        self.param_groups = optimizer.param_groups
        self._mains = []  # (main-weight rows, bucket, index), in the optimizer's order
        self._pairs = []  # (parameter, its ShardedParam)
        state: dict = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                sp = engine._sparam_by_id.get(id(p))
                if sp is None:
                    raise ValueError(f"the optimizer steps a parameter of shape {tuple(p.shape)} "
                                     "that this model does not shard; build it from "
                                     "model.parameters()")
                self._mains.append((sp.local, sp.bucket, sp.index))
                self._pairs.append((p, sp))
                state[sp.local] = {k: (v._local_tensor.view(sp.local.shape)
                                       if isinstance(v, DTensor) else v)
                                   for k, v in optimizer.state.get(p, {}).items()}
        self.optimizer = self  # (mfsdp's optimizer keeps torch's as .optimizer)
        self.state = state
        self._torch = optimizer

    def write_back(self) -> None:
        """Hand state created for a load (a fresh optimizer) to the torch optimizer."""
        for p, sp in self._pairs:
            rows = self.state.get(sp.local, {})
            live = self._torch.state.setdefault(p, {})
            for k, v in rows.items():
                if k in live:
                    continue
                shaped = torch.is_tensor(v) and v.dim() > 0 and v.shape == sp.local.shape
                live[k] = sp.wrap(v) if shaped and sp.is_dtensor else v


def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer,
                    checkpoint_dir: str | os.PathLike) -> None:
    """Save the sharded ``model`` (main weights, buffers) and ``optimizer`` under
    ``checkpoint_dir`` (a collective call): mfsdp's ``fsdp_dtensor`` checkpoint, atomic, with
    checksums, readable by :func:`mfsdp.checkpoint.load_checkpoint` at any layout."""
    engine = _engine(model)
    _save(Path(checkpoint_dir), engine, _OptimizerRows(engine, optimizer))


def load_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer,
                    checkpoint_dir: str | os.PathLike, *, sync_model_weights: bool = True) -> None:
    """Load a checkpoint into the sharded ``model`` and ``optimizer`` (a collective call),
    resharding to their layout: one written by :func:`save_checkpoint`, by
    :func:`mfsdp.checkpoint.save_checkpoint` (the model-level API), or any format
    :func:`mfsdp.checkpoint.load_checkpoint` reads. The model weights are refreshed from the
    loaded main weights; ``sync_model_weights=False`` (leave them stale) is refused."""
    if not sync_model_weights:
        raise ValueError("sync_model_weights=False: mfsdp always refreshes the model weights "
                         "from the loaded main weights; leave it True")
    engine = _engine(model)
    rows = _OptimizerRows(engine, optimizer)
    _load(checkpoint_dir, engine, rows)
    rows.write_back()
