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
"""

from __future__ import annotations


import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mfsdp.fsdp.dtensor import attach_uneven, gather_pieces, uneven_dtensor

__all__ = ["ShardedParam", "gather_pieces"]


class ShardedParam:
    """A parameter of a sharded model (see the module notes): its views, its rows, its grad."""

    def __init__(self, name: str, bucket, index: int, uses: list[tuple[nn.Module, str]],
                 unsharded: nn.Parameter, mesh, group, requires_grad: bool):
        self.name = name
        self.bucket = bucket
        self.index = index
        self.uses = uses
        self.unsharded = unsharded
        self.requires_grad = requires_grad
        slot = bucket.plan.params[index]
        self.global_shape = tuple(slot.shape)
        self.start = slot.local_range(bucket.main_index)[0]  # first element of the local piece
        self.local = bucket.local_view(bucket.main_shard, index)
        if not self.global_shape and mesh is None:  # a replicated 0-dim parameter keeps its shape
            self.local = self.local.reshape(())
        self.mesh = mesh
        self.group = group  # the ranks holding distinct rows (None: replicated, no_shard)
        if mesh is None:
            self.sharded = nn.Parameter(self.local, requires_grad=requires_grad)
        else:
            # (a 0-dim parameter is sharded as one row: its DTensor has shape (1,))
            dt = uneven_dtensor(self.local, mesh, self.global_shape or (1,), self.start)
            self.sharded = nn.Parameter(dt, requires_grad=requires_grad)
            self._attach(self.sharded)  # the parameter has a local tensor of its own
        self.grad: torch.Tensor | None = None

    # -- faces ----------------------------------------------------------------------------------
    @property
    def is_dtensor(self) -> bool:
        return self.mesh is not None

    def _attach(self, dt: DTensor) -> DTensor:
        attach_uneven(dt, self.global_shape or (1,), self.start, self.group)
        return dt

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` (a tensor shaped like this rank's rows) in the form of ``sharded``."""
        if self.mesh is None:
            return local
        return uneven_dtensor(local, self.mesh, self.global_shape or (1,), self.start,
                              self.group)

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
        face = None if grad is None else (grad if self.mesh is None else self.wrap(grad))
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
            if (getattr(local, "_mfsdp_start", None) == self.start
                    and local.numel() == self.local.numel()):
                self.local.copy_(local.reshape(self.local.shape))
                return
            value = value.full_tensor()
        flat = value.reshape(-1)
        self.local.copy_(flat[self.start:self.start + self.local.numel()]
                         .view(self.local.shape).to(self.local.device))
