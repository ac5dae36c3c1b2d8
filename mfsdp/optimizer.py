"""The sharded optimizer: any ``torch.optim`` optimizer stepping on this rank's main-weight shards.

:func:`mfsdp.fully_shard_optimizer` swaps every parameter of the optimizer's groups for that
parameter's local main-weight rows (fp32 by default), so optimizer state exists for the local shard
only. ``step()`` waits for gradient reduction, hands each shard its reduced gradient, steps, and
writes the new weights back into the model (re-replicating them where the strategy needs it).
The optimizer's own ``step`` counters start at zero and advance exactly as in plain PyTorch.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["ShardedOptimizer"]


class ShardedOptimizer:
    """Wraps ``optimizer`` so that it steps on the main-weight shards of ``model``.

    Attribute access falls through to the wrapped optimizer (``param_groups``, ``state``, ...).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model):
        if optimizer.state:
            raise ValueError("fully_shard_optimizer: the optimizer already has state; shard it "
                             "before its first step (state is created for the local shard only)")
        self.optimizer = optimizer
        self.model = model
        self._mains: list[tuple[torch.Tensor, object, int]] = []  # (main rows, bucket, index)
        for g, group in enumerate(optimizer.param_groups):
            new_params = []
            for j, p in enumerate(group["params"]):
                slot = model._slot.get(id(p))
                if slot is None:
                    slot = model._slot_by_new.get(id(p))
                if slot is None:
                    raise ValueError(
                        f"fully_shard_optimizer: param_groups[{g}]['params'][{j}] (shape "
                        f"{tuple(p.shape)}) is not a parameter of the sharded model; call "
                        "fully_shard_model(model) first and build the optimizer from its "
                        "parameters, or pass the optimizer to fully_shard(model, optimizer)")
                bucket, i = slot
                main = bucket.local_view(bucket.main_shard, i)
                new_params.append(main)
                self._mains.append((main, bucket, i))
            group["params"] = new_params

    def __getattr__(self, name):
        return getattr(self.optimizer, name)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def _install_grads(self) -> None:
        for main, bucket, i in self._mains:
            if not bucket.requires_grad or not bucket.used[i]:
                main.grad = None
                continue
            grad = bucket.local_view(bucket.grad_shard, i)
            main.grad = grad if grad.dtype == main.dtype else grad.to(main.dtype)

    @torch.no_grad()
    def grad_norm(self) -> float:
        """The global L2 norm of the reduced gradients over all shards (a collective call)."""
        self.model.finish_grad_sync()
        model = self.model
        total = 0.0
        for expert in (False, True):
            for replicated in (False, True):
                buckets = [b for b in model.buckets if b.grad_shard is not None
                           and b.is_expert == expert and b.replicated == replicated]
                if not buckets:
                    continue
                sq = sum(b.grad_shard.double().pow(2).sum() for b in buckets)
                # Sum over the ranks holding *different* pieces: the shard group (and the outer
                # group under HFSDP) unless replicated, and the EP group for experts.
                comms = [] if replicated else [buckets[0].comm]
                if not replicated and model.outer_sharded:
                    comms.append(model.outer_comm)
                if expert and model.ep_comm is not None:
                    comms.append(model.ep_comm)
                for comm in comms:
                    if comm.size > 1:
                        comm.all_reduce(sq, async_op=False, kind="grad_norm")
                total += sq.item()
        return math.sqrt(total)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale gradients so their global norm is at most ``max_norm``; return the norm before."""
        if max_norm <= 0:
            raise ValueError(f"max_norm={max_norm} must be positive")
        norm = self.grad_norm()
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for b in self.model.buckets:
                if b.grad_shard is not None:
                    b.grad_shard.mul_(coef)
        return norm

    @torch.no_grad()
    def grads_are_finite(self) -> bool:
        """Whether every reduced gradient on every rank is finite (a collective call).

        With a loss scale (fp16), skip the step when this is False and lower the scale.
        """
        self.model.finish_grad_sync()
        bad = torch.zeros((), device=self.model.device)
        for b in self.model.buckets:
            if b.grad_shard is not None and not torch.isfinite(b.grad_shard).all():
                bad.fill_(1.0)
        if dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bool(bad.item())

    @torch.no_grad()
    def unscale_(self, loss_scale: float) -> None:
        """Divide the reduced gradients by ``loss_scale`` (the loss was multiplied by it)."""
        if loss_scale <= 0:
            raise ValueError(f"loss_scale={loss_scale} must be positive")
        self.model.finish_grad_sync()
        for b in self.model.buckets:
            if b.grad_shard is not None:
                b.grad_shard.div_(loss_scale)

    def step(self, closure=None):
        """Step on the shards with the reduced gradients, then update the model weights."""
        if closure is not None:
            raise ValueError("closures are not supported: the loss is computed outside step()")
        self.model.finish_grad_sync()
        self._install_grads()
        out = self.optimizer.step()
        self.model.install_main_weights()
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffers of the model and drop the shards' ``.grad``."""
        self.model.zero_grad_buffers()
        for main, _, _ in self._mains:
            main.grad = None

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def local_state_bytes(self) -> int:
        """Bytes of optimizer state tensors on this rank."""
        return sum(v.numel() * v.element_size() for s in self.optimizer.state.values()
                   for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
