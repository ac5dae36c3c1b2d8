"""``save_checkpoint`` / ``load_checkpoint`` for the per-module API: mfsdp's own ``fsdp_dtensor``
checkpoints (``docs/checkpointing.md``), so one written through either front door loads through
the other, on any layout. As upstream's, ``save_checkpoint`` writes the DCP files directly into
its directory (no ``iter_*/`` or ``latest``).

mfsdp's checkpoint code (``mfsdp.checkpoint``) reads one sharded model and its optimizer as the
main-weight rows it steps. Two small adapters present the per-module API's objects that way:

* :class:`_Roots`: the sharded roots inside ``model`` (one engine each: the model itself when
  ``fully_shard(model)`` came last, or several siblings) as one model, each parameter named from
  ``model`` (a root's names get its path as prefix);
* :class:`_OptimizerRows`: the user's ``torch.optim`` optimizer over the DTensor parameters as
  each parameter's local rows and the local tensors of its state (the same memory, so a load
  writes into the optimizer's own state).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mfsdp.checkpoint import load_checkpoint as _load
from mfsdp.checkpoint.io import save_checkpoint_directory as _save
from mfsdp.experimental.module import FsdpModule

__all__ = ["save_checkpoint", "load_checkpoint"]


class _NamedBucket:
    """A bucket whose parameter names carry their root's path (what the checkpoint reads)."""

    def __init__(self, bucket, prefix: str):
        self.sparams = bucket.sparams
        self.names = [prefix + n for n in bucket.names]


class _Roots:
    """The sharded roots of ``model`` as the one model mfsdp's checkpoint code reads."""

    def __init__(self, model: nn.Module):
        self.module = model  # (its buffers are saved from here)
        self.engines = []  # (path prefix, engine) per root, in module order
        for path, m in model.named_modules():
            if isinstance(m, FsdpModule) and m.is_root():
                m.context.ensure_finalized()
                self.engines.append((f"{path}." if path else "", m.engine))
        if not self.engines:
            raise ValueError(f"{type(model).__name__} holds no module sharded by fully_shard")
        managed = {id(sp.sharded) for _, e in self.engines
                   for sp in e.fsdp_state().sparams}
        for name, p in model.named_parameters():
            if id(p) not in managed:
                raise ValueError(f"parameter {name!r} is not sharded (it is outside every module "
                                 "given to fully_shard), so a checkpoint would miss it; shard "
                                 "the module that holds it, or the model itself")
        self._named = {}  # id(bucket) -> its _NamedBucket
        for prefix, engine in self.engines:
            for b in engine.fsdp_state().buckets:
                self._named[id(b)] = _NamedBucket(b, prefix)
        first = self.engines[0][1]
        # What the manifest records of the layout (the first root's; all share the world)
        state = first.fsdp_state()
        self.device, self.strategy, self.comms = first.device, state.strategy, state.comms
        self.world_mesh = state.world_mesh  # (the mesh checkpoint DTensors name ranks by)

    def fsdp_state(self) -> _Roots:
        """What the checkpoint code reads of a sharded model's state: here the roots'."""
        return self

    def named(self, bucket) -> _NamedBucket:
        """``bucket`` with its parameters named from the model."""
        return self._named[id(bucket)]

    def named_main_shards(self):
        """(name, local main-weight rows, bucket, index) of every parameter, as the engine's."""
        return [(self.named(b).names[i], local, self.named(b), i)
                for _, e in self.engines
                for _, local, b, i in e.fsdp_state().named_main_shards()]

    def global_name(self, name: str) -> str:
        """Names are already the model's."""
        return name

    def sparam(self, p):
        """The engine's record of parameter ``p`` (any of its faces), or ``None``."""
        for _, engine in self.engines:
            sp = engine.fsdp_state().sharded_param(p)
            if sp is not None:
                return sp
        return None

    def finish_grad_sync(self) -> None:
        for _, engine in self.engines:
            engine.finish_grad_sync()

    def install_main_weights(self) -> None:
        for _, engine in self.engines:
            engine.fsdp_state().install_main_weights()

    def wait_param_sync(self) -> None:
        for _, engine in self.engines:
            engine.wait_param_sync()


class _OptimizerRows:
    """``optimizer`` as mfsdp's checkpoint code reads an optimizer (see the module notes)."""

    def __init__(self, roots: _Roots, optimizer: torch.optim.Optimizer):
        self.param_groups = optimizer.param_groups
        # (main-weight rows, named bucket, index), in the optimizer's order, as
        # ShardedOptimizer.main_shards
        self.main_shards = []
        self._pairs = []  # (parameter, its ShardedParam)
        self.state: dict = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                sp = roots.sparam(p)
                if sp is None:
                    raise ValueError(f"the optimizer steps a parameter of shape {tuple(p.shape)} "
                                     "that the model does not shard; build it from "
                                     "model.parameters()")
                self.main_shards.append((sp.local, roots.named(sp.bucket), sp.index))
                self._pairs.append((p, sp))
                self.state[sp.local] = {k: (v._local_tensor.view(sp.local.shape)
                                            if isinstance(v, DTensor) else v)
                                        for k, v in optimizer.state.get(p, {}).items()}
        self.optimizer = SimpleNamespace(state=self.state)  # (mfsdp's keeps torch's here)
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
                if shaped and isinstance(p, DTensor):  # a DTensor as torch.optim makes one
                    state = torch.zeros_like(p.detach(), dtype=v.dtype)
                    state.to_local().copy_(v.view(state.to_local().shape))
                    v = state
                live[k] = v


def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer,
                    checkpoint_dir: str | os.PathLike) -> None:
    """Save the sharded ``model`` (main weights, buffers) and ``optimizer`` into
    ``checkpoint_dir`` (a collective call): as upstream's, the DCP files (``.metadata``,
    ``*.distcp``) lie directly in the directory, here with mfsdp's ``manifest.json`` (checksums,
    layout) beside them; the save is atomic and the checkpoint loads through
    :func:`mfsdp.checkpoint.load_checkpoint` at any layout. ``checkpoint_dir`` may be new,
    empty or an earlier checkpoint (replaced). Every parameter of ``model`` must be sharded (by
    ``fully_shard`` on a module holding it)."""
    roots = _Roots(model)
    _save(Path(checkpoint_dir), roots, _OptimizerRows(roots, optimizer))


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
    roots = _Roots(model)
    rows = _OptimizerRows(roots, optimizer)
    _load(checkpoint_dir, roots, rows)
    rows.write_back()
