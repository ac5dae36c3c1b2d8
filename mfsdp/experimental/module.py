"""What the per-module API builds: :class:`FsdpContext` (the modules sharded together, built
into one mfsdp engine per root when the context closes) and :class:`FsdpModule` (the class
every sharded module takes on, with upstream's public views of its state).

[Note: one engine per root] Upstream v2 keeps state per module. mfsdp keeps it per model: a
:class:`mfsdp.FullyShardedModule` whose FSDP units are the modules given to ``fully_shard``
(its units are named by instance instead of by class) and whose root unit is the root module
itself, hooked in place (``hooks_on_module=True``), so the model is called as it is. Sharding,
buckets, collectives, the reducer and the optimizer adapter are the engine's.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from mfsdp.config import EngineOptions, MixedPrecisionPolicy, ShardingStrategy
from mfsdp.fsdp.buffers import BufferView, ParameterGroupView
from mfsdp.fsdp.module import FullyShardedModule
from mfsdp.fsdp.state import UnitPhase
from mfsdp.fsdp.unit import in_backward
from mfsdp.layout import ProcessGroups

__all__ = ["FsdpContext", "FsdpModule", "FsdpParameter", "FsdpParameterGroup", "ModuleOrder",
           "Registration", "make_fsdp_module"]


class ModuleOrder:
    """Sharded modules in a fixed order, each with its successor (upstream's ``IndexedOrder``:
    ``list(order)``, ``order.next_item(module)``)."""

    def __init__(self) -> None:
        self._items: list[nn.Module] = []  # in order
        self._index: dict[int, int] = {}  # id(module) -> its position

    def append(self, module: nn.Module) -> None:
        """Put ``module`` last; a module already in the order is refused."""
        if id(module) in self._index:
            raise ValueError(f"{type(module).__name__} is already in the order")
        self._index[id(module)] = len(self._items)
        self._items.append(module)

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def next_item(self, module: nn.Module) -> nn.Module | None:
        """The module after ``module`` (``None`` after the last)."""
        i = self._index[id(module)] + 1
        return self._items[i] if i < len(self._items) else None


@dataclass
class Registration:
    """One ``fully_shard`` call, kept until the context builds the engines."""

    module: nn.Module
    mesh: DeviceMesh
    placements: Any  # mfsdp.experimental.Placements
    strategies: tuple[ShardingStrategy, ShardingStrategy | None]
    policy: MixedPrecisionPolicy
    grad_divisor: int


class FsdpContext:
    """The modules of one ``fully_shard_context``: registered by ``fully_shard``, built into
    engines by :meth:`finalize`; ``is_last_microbatch`` is what :func:`microbatch` set."""

    def __init__(self, device: torch.device):
        self.device = device  # where every engine built here keeps its shards
        self.is_last_microbatch = True  # set by microbatch(); outside it, every backward is last
        self.engines: list[FullyShardedModule] = []  # one per root, after finalize()
        self.modules: list[nn.Module] = []  # every sharded module, after finalize()
        # Every sharded module, root by root (in the order they were sharded), each root's in
        # its named_modules() order: the static order upstream prefetches by (mfsdp prefetches
        # by the order it records in the first forward, mfsdp/fsdp/state.py's ForwardOrder).
        self.forward_order = ModuleOrder()
        # The same modules in upstream's static backward order: the roots last-sharded first,
        # each root's tree depth-first with its children in reverse (a parent before its
        # children, the last child first), the order upstream prefetches backward by. As with
        # forward_order, mfsdp's engine prefetches by the order it records, not by this view.
        self.backward_order = ModuleOrder()
        self._registrations: list[Registration] = []  # until finalize()
        self._finalized = False

    def register(self, registration: Registration) -> None:
        """Note one ``fully_shard`` call (before :meth:`finalize`)."""
        if self._finalized:
            raise RuntimeError("fully_shard after its fully_shard_context closed; shard every "
                               "module inside the block")
        self._registrations.append(registration)

    def ensure_finalized(self) -> None:
        """Raise unless the context has closed (and built its engines)."""
        if not self._finalized:
            raise RuntimeError("the fully_shard_context is still open: Exit fully_shard_context "
                               "(leave the `with` block) before running forward")

    def finalize(self) -> None:
        """Build one mfsdp engine per root (see [Note: one engine per root])."""
        if self._finalized:
            raise RuntimeError("this fully_shard_context is already finalized")
        regs = self._registrations
        inside = {id(sub) for r in regs for sub in r.module.modules() if sub is not r.module}
        roots = [r for r in regs if id(r.module) not in inside]
        for root in roots:
            members = [r for r in regs if any(m is r.module for m in root.module.modules())]
            self.engines.append(self._build(root, members))
        sharded = {id(m) for m in self.modules}
        for root in reversed(roots):
            _collect_backward_order(root.module, sharded, self.backward_order)
        self._registrations = []
        self._finalized = True

    def _build(self, root: Registration, members: list[Registration]) -> FullyShardedModule:
        for r in members:
            if (r.mesh is not root.mesh and r.mesh != root.mesh) or r.strategies != root.strategies \
                    or r.policy != root.policy:
                raise NotImplementedError(
                    f"{type(r.module).__name__} was sharded with another mesh, placements or "
                    f"policy than its root {type(root.module).__name__}; mfsdp shards one model "
                    "(one root) with one layout: give every module of it the same arguments")
        module, mesh = root.module, root.mesh
        inner, outer = root.strategies
        groups = ProcessGroups(dp_shard=mesh.get_group(mesh.ndim - 1),
                               dp_outer=mesh.get_group(0) if mesh.ndim == 2 else None)
        meta = any(p.device.type == "meta" for p in module.parameters())
        if not meta:
            module.to(self.device)  # CPU-built parameters move in place onto the context's device
        engine = FullyShardedModule(
            module, groups=groups, strategy=inner,
            unit_classes=tuple(r.module for r in members if r is not root),
            device=self.device, mixed_precision_policy=root.policy,
            options=EngineOptions(init_model_with_meta_device=meta),
            outer_strategy=outer or ShardingStrategy.NO_SHARD, hooks_on_module=True)
        ref = weakref.ref(engine)
        names = {id(m): n for n, m in module.named_modules()}
        for r in sorted(members, key=lambda r: list(names).index(id(r.module))):
            name = names[id(r.module)]
            r.module._fsdp_attach(engine, name, r is root)
            self.modules.append(r.module)
            self.forward_order.append(r.module)
            if r.grad_divisor != 1:
                for b in engine.fsdp_state().unit_by_name[name].buckets:
                    b.grad_scale /= r.grad_divisor
        module.register_forward_pre_hook(_zero_cleared_grads(ref))
        module.register_state_dict_post_hook(_state_dict_hook(ref))
        return engine


def _collect_backward_order(module: nn.Module, sharded: set[int], order: ModuleOrder) -> None:
    """Append ``module``'s sharded modules to ``order`` as upstream's static backward order
    visits them: the module itself, then its children last to first, each depth-first (a module
    shared by two parents is taken once)."""
    if id(module) in sharded and id(module) not in order._index:
        order.append(module)
    for child in reversed(list(module.children())):
        _collect_backward_order(child, sharded, order)


def _zero_cleared_grads(ref):
    """A root pre-forward hook: after ``optimizer.zero_grad()`` the next backward starts from
    zero, as upstream's. With ``set_to_none=True`` the gradients the engine handed out are gone.
    With ``set_to_none=False`` they were zeroed in place, which zeroes the engine's accumulator
    itself where ``.grad`` views it; where it is a cast copy (gradients kept in another dtype
    than the main weights) the copy is all zero, and then so is what it was cast from: the
    accumulator is zeroed too (one host sync per forward, mixed precision only)."""

    def hook(module, args):
        engine = ref()
        if engine is None or in_backward() or not torch.is_grad_enabled():
            return
        copies = []
        for sp in engine.fsdp_state().sparams:
            if sp.grad is None:
                continue
            face = sp.sharded.grad
            if face is None:  # set_to_none=True
                engine.zero_grad_buffer()
                return
            if sp.bucket.grad_shard is not None and sp.bucket.grad_shard.dtype != sp.local.dtype:
                copies.append(face._local_tensor if isinstance(face, DTensor) else face)
        copies = [c for c in copies if c.numel()]
        if copies and not torch.stack([c.abs().max() for c in copies]).any().item():
            engine.zero_grad_buffer()

    return hook


def _state_dict_hook(ref):
    """A root's ``state_dict()`` hook: each parameter's entry becomes a DTensor over its
    main-weight rows that carries its uneven chunk layout (``state_dict()`` detaches the
    parameter, which drops it), so ``full_tensor()`` and DCP read the right rows."""

    def hook(module, state_dict, prefix, local_metadata):
        engine = ref()
        if engine is not None:
            engine.fsdp_state().dcp_state_dict(state_dict, prefix)

    return hook


class FsdpParameter:
    """One parameter of a parameter group: its names in the owning module and its shards."""

    def __init__(self, sp, prefix: str):
        self._sp = sp
        self.fqns = tuple(n[len(prefix):] if prefix and n.startswith(prefix) else n
                          for n in sp.names)  # names relative to the owning module

    @property
    def main_weight(self) -> torch.Tensor:
        """This rank's rows of the main weights (what the optimizer steps)."""
        return self._sp.local

    @property
    def main_grad(self) -> torch.Tensor | None:
        """This rank's reduced gradient rows, or ``None``."""
        return self._sp.grad

    @property
    def sharded(self) -> torch.Tensor:
        """The DTensor the module holds between uses."""
        return self._sp.sharded

    @property
    def unsharded(self) -> torch.Tensor:
        """The full parameter the module holds during forward and backward."""
        return self._sp.unsharded

    def __repr__(self) -> str:
        return f"FsdpParameter({self.fqns})"


class MainWeightView(BufferView):
    """A group's main weights: ``data`` is this rank's shard, ``layout.size`` the elements of
    the whole flat buffer over the shard group (padding included)."""

    def __init__(self, bucket):
        super().__init__(bucket.main_shard)
        self.layout = SimpleNamespace(size=bucket.plan.padded_numel)


class UnshardedWeightView:
    """A group's gathered model weights (upstream's ``_unsharded_model_weight``): ``local_buffer``
    is the bucket's full buffer in compute dtype, whose storage is released between uses under
    ZeRO-3 (0 bytes) and kept under the other strategies."""

    def __init__(self, bucket, ndim: int):
        self._bucket = bucket
        self.placements = (Replicate(),) * ndim  # every rank holds all of it

    @property
    def local_buffer(self) -> torch.Tensor:
        """The full flat buffer (read when asked: a pool slot may back it)."""
        return self._bucket.full

    @property
    def dtype(self) -> torch.dtype:
        return self._bucket.full.dtype


class FsdpParameterGroup(ParameterGroupView):
    """One bucket of a module's unit, with upstream v2's names (``fsdp_parameters``,
    ``main_weight``, ``main_grad``, ``model_weight``, ``_unsharded_model_weight``) beside v1's."""

    def __init__(self, bucket, engine: FullyShardedModule, prefix: str):
        super().__init__(bucket)
        self._engine = engine
        # upstream's name (its test reads the storage of the gathered weights through it)
        ndim = 2 if engine.fsdp_state().comms.outer is not None else 1
        self._unsharded_model_weight = UnshardedWeightView(bucket, ndim)
        self.fsdp_parameters = tuple(FsdpParameter(sp, prefix) for sp in bucket.sparams)
        self.model_weight = self.model_weight_buffer
        self.main_weight = MainWeightView(bucket)
        self.main_grad = self.main_grad_buffer if bucket.requires_grad else None

    def sync_model_weight_from_main_weight(self) -> None:
        """Copy the main weights into the model weights and start re-gathering them where they
        are replicated (the next forward waits); the optimizer adapter calls it after every
        step, once per group."""
        self._engine.fsdp_state().install_main_weights([self._bucket])


class FsdpModule:
    """The class a module takes on in ``fully_shard`` (mixed in before its own class)."""

    class Phase(enum.Enum):
        """Where the module is in a step."""

        RESTING = "resting"
        FORWARD = "forward"
        BACKWARD = "backward"

    def _init_fsdp(self, context: FsdpContext) -> None:
        # Plain attributes in __dict__ (object.__setattr__): the engine is not a submodule.
        object.__setattr__(self, "_fsdp_context", context)  # the context it was sharded in
        object.__setattr__(self, "_fsdp_engine", None)  # the engine of its root, once built
        object.__setattr__(self, "_fsdp_name", None)  # its path under its root
        object.__setattr__(self, "_fsdp_is_root", False)  # no other module of it contains it
        object.__setattr__(self, "_fsdp_groups", ())  # views of its unit's buckets, once built
        # A forward before the context closed would run on parameters not yet sharded.
        self.register_forward_pre_hook(
            lambda module, args: module.context.ensure_finalized(), prepend=True)
        self.register_load_state_dict_pre_hook(FsdpModule._refuse_assign)

    @staticmethod
    def _refuse_assign(module, state_dict, prefix, local_metadata, *rest) -> None:
        # (torch hands load_state_dict(assign=True) to pre-hooks in this metadata key)
        if local_metadata.get("assign_to_params_buffers", False):
            raise RuntimeError("load_state_dict(assign=True) would replace parameters that "
                               "fully_shard manages; load with assign=False (in place), or "
                               "before fully_shard")

    def _apply(self, fn, recurse=True):
        """``model.to(device)`` and friends: the parameters this module's engine manages stay
        where the engine keeps them (the context's device); the rest (parameters of modules not
        sharded, buffers) are converted as usual."""
        engine = self._fsdp_engine
        if engine is None:
            return super()._apply(fn, recurse)
        mine = {id(m) for m in self.modules()}
        hidden = []
        for sp in engine.fsdp_state().sparams:
            for module, attr in sp.uses:
                if id(module) in mine and attr in module._parameters:
                    hidden.append((module, attr, module._parameters.pop(attr)))
        try:
            return super()._apply(fn, recurse)
        finally:
            for module, attr, p in hidden:
                module._parameters[attr] = p

    def _fsdp_attach(self, engine: FullyShardedModule, name: str, is_root: bool) -> None:
        object.__setattr__(self, "_fsdp_engine", engine)
        object.__setattr__(self, "_fsdp_name", name)
        object.__setattr__(self, "_fsdp_is_root", is_root)
        prefix = f"{name}." if name else ""
        # The views are made once: the optimizer adapter syncs through them (and code written
        # for upstream may hold on to them).
        object.__setattr__(self, "_fsdp_groups", tuple(
            FsdpParameterGroup(b, engine, prefix)
            for b in engine.fsdp_state().unit_by_name[name].buckets))

    @property
    def context(self) -> FsdpContext:
        """The context the module was sharded in."""
        return self._fsdp_context

    @property
    def engine(self) -> FullyShardedModule:
        """mfsdp's sharded model of this module's root (``None`` until the context closes)."""
        return self._fsdp_engine

    @property
    def name(self) -> str:
        """The module's path under its root (``""`` for the root)."""
        if self._fsdp_name is None:
            raise RuntimeError("the module's name is known once its fully_shard_context closes")
        return self._fsdp_name

    def is_root(self) -> bool:
        """Whether no other module of the context contains this one."""
        return self._fsdp_is_root

    @property
    def phase(self) -> "FsdpModule.Phase":
        """RESTING, FORWARD or BACKWARD (from its unit's state)."""
        unit = self._unit()
        if unit.phase is UnitPhase.FORWARD:
            return FsdpModule.Phase.FORWARD
        if unit.phase is UnitPhase.BACKWARD:
            return FsdpModule.Phase.BACKWARD
        return FsdpModule.Phase.RESTING

    def _unit(self):
        self.context.ensure_finalized()
        return self.engine.fsdp_state().unit_by_name[self.name]

    @property
    def parameter_groups(self) -> tuple[FsdpParameterGroup, ...]:
        """The module's own parameters by group (dtype, requires_grad): views of its unit's
        buckets; ``()`` for a module without parameters of its own."""
        self.context.ensure_finalized()
        return self._fsdp_groups


def make_fsdp_module(module: nn.Module, context: FsdpContext) -> None:
    """Make ``module`` an :class:`FsdpModule` in place, sharded in ``context``: its class becomes
    ``Fsdp<its class>`` (``FsdpModule`` mixed in before its own class), as upstream's does."""
    cls = type(module)
    module.__class__ = type(f"Fsdp{cls.__name__}", (FsdpModule, cls), {})
    module._init_fsdp(context)
