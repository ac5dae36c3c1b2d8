"""The sharded optimizer: any ``torch.optim`` optimizer stepping on this rank's main-weight shards.

:func:`mfsdp.fully_shard_optimizer` swaps every parameter of the optimizer's groups for that
parameter's local main-weight rows (fp32 by default), so optimizer state exists for the local shard
only. The result is a ``torch.optim.Optimizer``: LR schedulers, ``torch.amp.GradScaler`` and edits of
``param_groups`` work on it as on the optimizer it wraps. After a synchronising backward every
parameter's reduced gradient rows are installed (``local.grad``, and ``.grad`` of the model's
sharded parameters: the same memory), so ``clip_grad_norm_`` and ``GradScaler.unscale_`` act on what
``step()`` uses. ``step()`` steps on the shards and writes the new weights back into the model
(re-replicating them where the strategy needs it). ``state_dict()`` holds the state by parameter
index as ``torch.optim`` does, tensors as DTensors of the parameter's full shape, present from
construction (see ``ShardedOptimizer.state_dict``), so ``torch.distributed.checkpoint`` saves and
loads it directly.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["ShardedOptimizer"]

# GradScaler hands itself to optimizers that handle scaling (``_step_supports_amp_scaling``) and
# warns that it will stop doing so; we need it to agree on infs across ranks (see step()).
warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself",
                        category=FutureWarning)


class ShardedOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer`` so that it steps on the main-weight shards of ``model``.

    ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's (the same objects), so
    schedulers and hand edits reach it; other attributes fall through to it. It is built by
    ``torch.optim.Optimizer.__init__``: ``step()`` runs the hooks registered on it (and the global
    ones) as any optimizer's does, and ``add_param_group`` takes more of the model's parameters.
    """

    # torch.amp.GradScaler then calls step(grad_scaler=...) and lets us skip steps on all ranks
    # together when any rank found an inf.
    _step_supports_amp_scaling = True

    def __init__(self, optimizer: torch.optim.Optimizer, model, dcp_state_dict: bool = True):
        if optimizer.state:
            raise ValueError("fully_shard_optimizer: the optimizer already has state; shard it "
                             "before its first step (state is created for the local shard only)")
        self.optimizer = optimizer  # the torch.optim optimizer whose step() steps the shards
        self.model = model  # the sharded model whose main-weight rows are stepped
        model.fsdp_state().installed_by_optimizer = True  # step() installs the main weights itself
        self.dcp_state_dict = dcp_state_dict  # state_dict() hands out DTensors (for DCP)
        # every parameter stepped, in param_groups order: state_dict()'s indices name them
        self._sparams: list = []
        self._sparam_set: set = set()  # the same, for grad_norm's test of who steps a parameter
        # torch.optim.Optimizer's set-up (its hooks, the profiled and hooked step()), on the
        # wrapped optimizer's groups: add_param_group swaps each parameter for its rows.
        super().__init__(optimizer.param_groups, optimizer.defaults)
        # One set of groups and one state, the wrapped optimizer's (its step() reads them): a
        # scheduler or an edit of param_groups reaches it through either object.
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state

    def __getattr__(self, name):
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group of the sharded model's parameters (any of their faces), as
        ``torch.optim.Optimizer.add_param_group`` does: each parameter is swapped for its
        main-weight rows, and the wrapped optimizer steps them too."""
        g = len(self.param_groups)
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        sparams = []
        for j, p in enumerate(params):
            sp = self.model.fsdp_state().sharded_param(p)
            if sp is None:
                raise ValueError(
                    f"fully_shard_optimizer: param_groups[{g}]['params'][{j}] (shape "
                    f"{tuple(p.shape)}) is not a parameter of the sharded model; call "
                    "fully_shard_model(model) first and build the optimizer from its "
                    "parameters, or pass the optimizer to fully_shard(model, optimizer)")
            sparams.append(sp)
        param_group["params"] = [sp.local for sp in sparams]
        super().add_param_group(param_group)
        self._sparams.extend(sparams)
        self._sparam_set.update(sparams)

    @property
    def sharded_params(self) -> list:
        """The :class:`~mfsdp.fsdp.param.ShardedParam` of every parameter stepped, in
        ``param_groups`` order (``state_dict()``'s indices)."""
        return list(self._sparams)

    @property
    def main_shards(self) -> list[tuple[torch.Tensor, object, int]]:
        """(main-weight rows, bucket, index in the bucket) of every parameter stepped, in
        ``param_groups`` order: what checkpoints read the optimizer state by."""
        return [(sp.local, sp.bucket, sp.index) for sp in self._sparams]

    def __repr__(self) -> str:
        return f"ShardedOptimizer({self.optimizer!r})"

    # -- gradients ------------------------------------------------------------------------------
    def _grads(self) -> list[torch.Tensor]:
        self.model.finish_grad_sync()
        return [sp.grad for sp in self._sparams if sp.grad is not None]

    @torch.no_grad()
    def grad_norm(self) -> float:
        """The global L2 norm of the reduced gradients over all shards (a collective call)."""
        self.model.finish_grad_sync()
        model = self.model
        # Sum squares over the ranks holding *different* rows: each parameter's shard group (the
        # hybrid group under HFSDP, none under no_shard) and, for experts, the EP group. Groups
        # are visited in parameter order, which is the same on every rank.
        # Parameters whose TP ranks hold different blocks are summed over the TP group too.
        sums: dict = {}
        for sp in model.fsdp_state().sparams:
            tp = model.fsdp_state().comms.tp_group if sp.tp_sharded else None
            key = (id(sp.group), sp.bucket.is_expert, id(tp))
            if key not in sums:
                sums[key] = [sp.group, sp.bucket.is_expert, tp,
                             torch.zeros((), dtype=torch.float64, device=model.device)]
            if sp.grad is not None and sp in self._sparam_set:
                sums[key][3] += sp.grad.double().pow(2).sum()
        total = 0.0
        for group, expert, tp, sq in sums.values():
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(sq, group=group)
            if expert and model.fsdp_state().comms.ep is not None:
                model.fsdp_state().comms.ep.all_reduce(sq, async_op=False, kind="grad_norm")
            if tp is not None:
                dist.all_reduce(sq, group=tp)
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
            for g in self._grads():
                g.mul_(coef)
        return norm

    @torch.no_grad()
    def grads_are_finite(self) -> bool:
        """Whether every reduced gradient on every rank is finite (a collective call).

        With a loss scale (fp16), skip the step when this is False and lower the scale.
        """
        bad = torch.zeros((), device=self.model.device)
        for g in self._grads():
            if not torch.isfinite(g).all():
                bad.fill_(1.0)
        if dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bool(bad.item())

    @torch.no_grad()
    def unscale_(self, loss_scale: float) -> None:
        """Divide the reduced gradients by ``loss_scale`` (the loss was multiplied by it)."""
        if loss_scale <= 0:
            raise ValueError(f"loss_scale={loss_scale} must be positive")
        for g in self._grads():
            g.div_(loss_scale)

    # -- steps ----------------------------------------------------------------------------------
    def step(self, closure=None, grad_scaler=None, sync_grad_before_optimizer_step: bool = True,
             install_optimized_model_weights: bool = True):
        """Step on the shards with the reduced gradients, then update the model weights.

        Under ``torch.amp.GradScaler`` (which passes itself as ``grad_scaler``) the gradients are
        unscaled unless they already were, and the step is skipped on every rank when any rank
        found an inf or NaN (the scaler's records are made to agree, so every rank's ``update()``
        moves the scale the same way). ``install_optimized_model_weights=False`` (upstream's
        keyword) leaves the model weights as they were until
        ``model.install_optimized_model_weights()``.
        """
        if closure is not None:
            raise ValueError("closures are not supported: the loss is computed outside step()")
        if sync_grad_before_optimizer_step:
            self.model.finish_grad_sync()
        if grad_scaler is not None and grad_scaler.is_enabled():
            if not self._agree_no_inf(grad_scaler):
                return None
        out = self.optimizer.step()
        if install_optimized_model_weights:
            self.model.fsdp_state().install_main_weights()
        return out

    @torch.no_grad()
    def _agree_no_inf(self, scaler) -> bool:
        from torch.amp.grad_scaler import OptState

        state = scaler._per_optimizer_states[id(self)]
        if state["stage"] is OptState.READY:
            scaler.unscale_(self)
        found = state["found_inf_per_device"]
        total = torch.zeros((), device=self.model.device)
        for t in found.values():
            total += t.to(total.device)
        if dist.get_world_size() > 1:
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
        for t in found.values():
            t.copy_(total.to(t.device))
        return not bool(total.item())

    def zero_grad(self, set_to_none: bool = True, zero_grad_buffer: bool = True) -> None:
        """Zero the gradient buffers of the model and drop the shards' ``.grad``
        (``zero_grad_buffer=False``, upstream's keyword: leave the buffers, clear ``.grad``
        only). ``set_to_none=False`` zeroes the ``.grad`` the shards hold in place instead of
        dropping it (``torch.optim.Optimizer.zero_grad``'s meaning)."""
        if zero_grad_buffer:
            self.model.zero_grad(set_to_none=set_to_none)
            return
        for sp in self._sparams:
            if set_to_none or sp.grad is None:
                sp.set_grad(None, self.model.fsdp_state().options.use_decoupled_grad)
            else:
                sp.grad.zero_()

    # -- state ----------------------------------------------------------------------------------
    @torch.no_grad()
    def _ensure_state(self) -> None:
        """Create optimizer state for every parameter that has none yet, at its initial value.

        A DCP load fills the tensors of a state dict in place, so they must exist before the first
        step (upstream Megatron-LM initialises the same way). One step of the wrapped optimizer on
        zero gradients with ``lr`` and ``weight_decay`` set to 0 creates them without changing a
        weight; step counters are then reset to 0. For Adam(W), SGD and Adagrad the state created
        so equals a fresh one (zeros, or Adagrad's initial accumulator); SGD with momentum and
        dampening > 0 then treats its first real step as a later one.
        """
        opt = self.optimizer
        missing = [sp for sp in self._sparams if not opt.state.get(sp.local)]
        if not missing:
            return
        saved = [(sp.local, sp.local.grad) for sp in self._sparams]
        hyper = [{k: g[k] for k in ("lr", "weight_decay") if k in g} for g in opt.param_groups]
        try:
            for g in opt.param_groups:
                for k in ("lr", "weight_decay"):
                    if k in g:
                        g[k] = 0.0
            for sp in self._sparams:
                sp.local.grad = torch.zeros_like(sp.local) if sp in missing else None
            opt.step()
            for sp in missing:
                st = opt.state.get(sp.local, {})
                if "step" in st:
                    st["step"] = (torch.zeros_like(st["step"]) if torch.is_tensor(st["step"])
                                  else 0)
        finally:
            for g, h in zip(opt.param_groups, hyper):
                g.update(h)
            for t, grad in saved:
                t.grad = grad

    def state_dict(self) -> dict:
        """``{"state": {index: {key: value}}, "param_groups": [...]}`` as ``torch.optim`` has it,
        with every state tensor shaped like its parameter's rows as a DTensor of the full shape
        (sharing memory with the state, so loading into it loads the state). Every parameter has
        state, also before the first step (see ``_ensure_state``)."""
        self._ensure_state()
        sd = self.optimizer.state_dict()
        if not self.dcp_state_dict:
            return sd
        for i, live in list(sd["state"].items()):
            sp = self._sparams[i]
            sd["state"][i] = st = dict(live)  # (torch.optim hands out the live state dicts)
            for k, v in list(st.items()):
                if (sp.is_dtensor and torch.is_tensor(v) and v.dim() > 0
                        and tuple(v.shape) == tuple(sp.local.shape)):
                    st[k] = sp.wrap(v)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of :meth:`state_dict`'s form; DTensor entries of any split (or full
        tensors) are cut to this rank's piece."""
        state = {}
        for i, st in state_dict["state"].items():
            sp = self._sparams[int(i)]
            out = {}
            for k, v in st.items():
                if isinstance(v, DTensor):
                    local = v._local_tensor
                    if not sp.owns(local):
                        local = sp.piece_of(v.full_tensor())
                    v = local.reshape(sp.local.shape)
                elif (torch.is_tensor(v) and sp.is_dtensor and v.dim() > 0
                      and tuple(v.shape) == sp.global_shape and v.shape != sp.local.shape):
                    v = sp.piece_of(v)
                out[k] = v
            state[int(i)] = out
        self.optimizer.load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})

    def local_state_bytes(self) -> int:
        """Bytes of optimizer state tensors on this rank."""
        return sum(v.numel() * v.element_size() for s in self.optimizer.state.values()
                   for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
