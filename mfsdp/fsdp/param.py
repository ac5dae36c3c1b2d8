"""One parameter of a sharded model: its two faces and the rows it owns.

Every parameter of a :class:`mfsdp.FullyShardedModule` is a :class:`ShardedParam`, which owns

* ``unsharded``: an ``nn.Parameter`` viewing the parameter's place in its bucket's gathered weights
  (compute dtype, full shape). Modules hold it *during their forward*; autograd records it, and its
  post-accumulate-grad hook moves gradients into the bucket;
* ``sharded``: what modules hold *outside forward*, so that reading a parameter never touches
  released memory. Under a sharding strategy it is a ``DTensor`` of the full shape, sharded on
  dim 0 over the bucket's shard group (uneven row split, see :mod:`mfsdp.fsdp.dtensor`), whose
  local tensor is this rank's piece of the *main* weights (fp32 by default; whole rows, or a flat
  range where the bucket is cut on element boundaries), as FSDP2 and upstream
  Megatron-FSDP hand out; under ``no_shard`` it is a plain parameter over the (full) main weights;
* ``local``: this rank's main-weight rows as a plain tensor: what the optimizer steps on;
* after a synchronising backward, ``local.grad`` and ``sharded.grad`` hold this rank's reduced
  gradient rows (the same memory), so ``torch.nn.utils.clip_grad_norm_(model.parameters())``,
  ``GradScaler.unscale_`` and the optimizer all see and change one gradient.

Swapping is a dictionary assignment in the owning modules' ``_parameters``: cheap, and invisible
to code that looks parameters up by attribute on every call (as ``nn.Module`` does).

Under tensor parallelism (``tp``, a :class:`~mfsdp.fsdp.dtensor.TPSpec`) the bucket holds the
parameter's *TP block* (``block_shape``): ``unsharded`` is a DTensor over the TP mesh with the
parameter's own placements (what the TP layers expect), ``sharded`` a DTensor over the 2-D
``(dp, tp)`` mesh, and gradients arriving as DTensors are brought to the parameter's placements
(a ``Partial`` is reduced over TP there, as FSDP2 does) before their local block enters the
bucket.
"""

from __future__ import annotations


import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor, Replicate

from mfsdp.fsdp.dtensor import (TPSpec, attach_uneven, gather_pieces, piece_origin,
                                uneven_dtensor, view_dtensor)

__all__ = ["ShardedParam", "gather_pieces"]


class ShardedParam:
    """A parameter of a sharded model (see the module notes): its views, its rows, its grad."""

    def __init__(self, name: str, bucket, index: int, uses: list[tuple[nn.Module, str]],
                 mesh, group, requires_grad: bool, tp: TPSpec | None = None,
                 names: list[str] | None = None):
        self.name = name
        # Every name it has in the model (a tied weight has one per module that registers it):
        # the state-dict keys it answers to.
        self.names = list(names) if names is not None else [name]
        self.bucket = bucket
        self.index = index
        self.uses = uses  # (module, attribute) of each registration, swapped between faces
        self.requires_grad = requires_grad
        self.tp = tp
        view = bucket.param_view(index)
        if tp is not None and tp.dtensor_param:  # the TP layers compute with a DTensor
            view = tp.as_dtensor(view)
        self.unsharded = nn.Parameter(view, requires_grad=requires_grad)
        slot = bucket.plan.params[index]
        self.block_shape = tuple(slot.shape)  # what the bucket holds: the TP block, or all
        self.global_shape = tuple(tp.global_shape) if tp is not None else self.block_shape
        self.start = slot.local_range(bucket.main_index)[0]  # first element of the local piece
        self.local = bucket.local_view(bucket.main_shard, index)
        self.replicated = bucket.replicated  # no_shard: every data-parallel rank holds it all
        if self.replicated:  # (whole: a 0-dim parameter keeps its shape)
            self.local = self.local.view(self.block_shape)
        self.mesh = mesh
        self.group = group  # the ranks holding distinct rows (None: replicated, no_shard)
        if self.replicated:  # a DTensor replicated over the data-parallel mesh, as upstream's
            self.sharded = view_dtensor(self.local, mesh, self._replicated_placements(),
                                        self.global_shape, requires_grad)
        else:
            # (a 0-dim parameter is sharded as one row: its DTensor has shape (1,))
            dt = uneven_dtensor(self.local, mesh, self.global_shape or (1,), self.start, tp=tp)
            self.sharded = nn.Parameter(dt, requires_grad=requires_grad)
            self._attach(self.sharded)  # the parameter has a local tensor of its own
        self.grad: torch.Tensor | None = None

    # -- faces ----------------------------------------------------------------------------------
    @property
    def is_dtensor(self) -> bool:
        """Whether ``sharded`` is a DTensor (always, with a mesh: sharded or replicated over DP)."""
        return self.mesh is not None

    @property
    def tp_sharded(self) -> bool:
        """Whether TP ranks hold different blocks of this parameter."""
        return self.tp is not None and self.tp.sharded

    def _attach(self, dt: DTensor) -> DTensor:
        attach_uneven(dt, self.global_shape or (1,), self.start, self.group, self.tp)
        return dt

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` (a tensor shaped like this rank's rows) in the form of ``sharded``."""
        if self.replicated:
            return view_dtensor(local.view(self.block_shape), self.mesh,
                                self._replicated_placements(), self.global_shape)
        return uneven_dtensor(local, self.mesh, self.global_shape or (1,), self.start,
                              self.group, self.tp)

    def _replicated_placements(self) -> list:
        return [Replicate()] + (list(self.tp.placements) if self.tp is not None else [])

    def piece_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece (shaped like ``local``) of a full tensor of the parameter's shape."""
        block = self.tp.block_of(full) if self.tp is not None else full
        flat = block.reshape(-1)
        return flat[self.start:self.start + self.local.numel()].view(self.local.shape)

    def owns(self, piece: torch.Tensor) -> bool:
        """Whether ``piece`` (a DTensor's local tensor) is exactly this rank's piece."""
        mine = (self.start, self.tp.segments if self.tp else None)
        return piece_origin(piece) == mine and piece.numel() == self.local.numel()

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """A gradient of ``unsharded`` as the plain block the bucket holds: a DTensor gradient
        is first brought to the parameter's TP placements (a ``Partial`` is all-reduced over
        TP, as FSDP2 does)."""
        if not isinstance(grad, DTensor):
            return grad
        if self.tp is not None and tuple(grad.placements) != self.tp.placements:
            grad = grad.redistribute(placements=list(self.tp.placements))
        local = grad.to_local()
        return local.wait() if isinstance(local, AsyncCollectiveTensor) else local

    def to_unsharded(self) -> None:
        for module, attr in self.uses:
            module._parameters[attr] = self.unsharded

    def to_sharded(self) -> None:
        for module, attr in self.uses:
            module._parameters[attr] = self.sharded

    def check_requires_grad(self) -> None:
        """Raise if ``requires_grad`` was changed after wrapping (the buckets were laid out by it)."""
        if self.sharded.requires_grad != self.requires_grad:
            now = "unfrozen" if self.sharded.requires_grad else "frozen"
            raise RuntimeError(
                f"parameter {self.name!r} was {now} after fully_shard (requires_grad "
                f"{self.requires_grad} -> {self.sharded.requires_grad}); mfsdp lays out gradient "
                "buffers by requires_grad when it wraps the model, so set requires_grad on the "
                "model before fully_shard_model / fully_shard")

    # -- gradients ------------------------------------------------------------------------------
    def set_grad(self, grad: torch.Tensor | None, decoupled: bool = False) -> None:
        """Install this rank's reduced gradient rows (``None``: no gradient on any rank), as
        ``.grad``, or as ``.decoupled_grad`` (upstream's ``use_decoupled_grad``)."""
        self.grad = grad
        face = None if grad is None else (self.wrap(grad) if self.is_dtensor else grad)
        if decoupled:
            self.local.decoupled_grad = grad
            self.sharded.decoupled_grad = face
        else:
            self.local.grad = grad
            self.sharded.grad = face

    # -- values ---------------------------------------------------------------------------------
    @torch.no_grad()
    def load_(self, value: torch.Tensor) -> None:
        """Write ``value`` (a full tensor, or a DTensor of the full shape) into the main rows."""
        shape = tuple(value.shape)
        if shape != self.global_shape and not (isinstance(value, DTensor) and shape == (1,)
                                               and not self.global_shape):
            raise ValueError(f"{self.name}: loaded shape {shape} does not match the parameter's "
                             f"{self.global_shape}")
        if isinstance(value, DTensor):
            local = value._local_tensor
            if self.owns(local):
                self.local.copy_(local.reshape(self.local.shape))
                return
            value = value.full_tensor()
        self.local.copy_(self.piece_of(value).to(self.local.device))
