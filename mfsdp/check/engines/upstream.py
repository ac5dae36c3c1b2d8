"""``--engine megatron_fsdp``: the sharded side run by upstream Megatron-FSDP, the installed
``megatron_fsdp`` package (``pip install mfsdp[upstream]``: megatron-fsdp 0.6.1), called as its
README does::

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp_shard", "tp"))
    model, optimizer = fully_shard(module=model, optimizer=optimizer, device_mesh=mesh,
                                   dp_shard_dim="dp_shard", tp_dim="tp",
                                   fsdp_unit_modules=units, zero_dp_strategy=strategy, ...)

with the layout's arguments (HSDP: a ``("dp_outer", "dp_shard", "tp")`` mesh, ``dp_outer_dim``,
the flattened ``hybrid_fsdp_group`` and ``outer_dp_sharding_strategy``; precision: upstream's
``MixedPrecisionPolicy``). ``fully_shard(module, optimizer)`` replaces the optimizer's parameter
groups with one group of every parameter, so with ``--optimizer-factory`` the README's two-call
form is used instead (``fully_shard_model``, then the factory on the sharded module, then
``fully_shard_optimizer``), which keeps the factory's groups.

[Note: upstream on the CPU] Megatron-FSDP 0.6.1 calls CUDA stream, event and device APIs
unconditionally, and reduces gradients with NCCL's pre-multiplied sum. When the ranks compute
on the CPU (gloo, as ``mfsdp check`` runs them), :data:`CPU_REPLACEMENTS` stand in for the CUDA
calls only while the engine runs (one in-order stream, events complete, tensors stay where they
are), and ``gradient_reduce_div_fusion`` (the pre-multiplied sum, which gloo lacks) is turned off
on the wrapped model: upstream then scales the gradients and sums them, the same arithmetic. The
report names each replacement. With CUDA ranks nothing is replaced.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from mfsdp.check.engines import Engine, Sharded, strip_name

__all__ = ["MegatronFSDPEngine", "CPU_REPLACEMENTS", "cpu_replacements", "reset_optimizer_step"]


def reset_optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The workaround for NVIDIA/Megatron-LM#5974 in megatron-fsdp 0.6.1, called right after
    ``fully_shard``: its ``fully_shard_optimizer`` builds the optimizer state by stepping once on
    zero gradients, so Adam's ``step`` count starts at 1 (the first updates get step 2's bias
    correction: about 1.34x too small) and AdamW's decoupled weight decay has already shrunk
    every weight once. This sets every ``step`` back to 0, zeroes the other state tensors (the
    moments) and, where that synthetic step decayed the weights (AdamW, ``step`` still 1),
    divides the decay back out: the state of an optimizer that has not trained, as
    NVIDIA/Megatron-LM#5976 (not released in 0.6.1) makes it. Check it with ``after_shard``
    (``--after-shard mfsdp.check.engines.upstream:reset_optimizer_step``)."""
    with torch.no_grad():
        for group in optimizer.param_groups:
            decoupled = isinstance(optimizer, torch.optim.AdamW) or group.get(
                "decoupled_weight_decay", False)
            decay = group.get("weight_decay", 0.0) if decoupled else 0.0
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                if "step" not in state:
                    continue
                if decay and float(state["step"]) == 1:
                    p.div_(1 - group["lr"] * decay)
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        value.zero_()
                    elif key == "step":
                        state[key] = 0


class _Event:
    """A CUDA event on an in-order CPU stream: always complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Stream:
    """A CUDA stream on the CPU: there is one in-order stream, so waiting is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> _Event:
        return _Event()

    def synchronize(self) -> None:
        pass


CPU_REPLACEMENTS: list[tuple[Any, str, Any, str]] = [
    (torch.cuda, "Stream", _Stream, "torch.cuda.Stream: one in-order CPU stream"),
    (torch.cuda, "current_stream", lambda *a, **k: _Stream(),
     "torch.cuda.current_stream: the in-order CPU stream"),
    (torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext(),
     "torch.cuda.stream(...): no-op context"),
    (torch.cuda, "Event", _Event, "torch.cuda.Event: always complete"),
    (torch.cuda, "synchronize", lambda *a, **k: None, "torch.cuda.synchronize: no-op"),
    (torch.cuda, "current_device", lambda: 0, "torch.cuda.current_device: 0"),
    (torch.Tensor, "record_stream", lambda self, *a, **k: None,
     "Tensor.record_stream: no-op"),
    (torch.Tensor, "cuda", lambda self, *a, **k: self,
     "Tensor.cuda(): the tensor stays on the CPU"),
]
"""(object, attribute, stand-in, what the report says) for each CUDA call replaced on the CPU."""

DIV_FUSION_OFF = ("gradient_reduce_div_fusion=False: NCCL's pre-multiplied sum is not in gloo; "
                  "gradients are scaled, then summed")


def cpu_replacements() -> list[str]:
    """What the report lists as replaced when the upstream engine runs on CPU ranks."""
    return [what for *_, what in CPU_REPLACEMENTS] + [DIV_FUSION_OFF]


class MegatronFSDPEngine(Engine):
    """The installed ``megatron_fsdp`` package's ``fully_shard``."""

    name = "megatron_fsdp"
    title = "Megatron-FSDP"
    _meshes = 0
    """HSDP meshes flattened in this process so far (each gets its own name)."""

    def version(self) -> str:
        """``megatron-fsdp <version>`` of the installed package."""
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"megatron-fsdp {version('megatron-fsdp')}"
        except PackageNotFoundError:
            return "megatron-fsdp (not installed)"

    def missing(self) -> str | None:
        """Why ``megatron_fsdp`` cannot be imported, or ``None``."""
        try:
            import megatron_fsdp  # noqa: F401
        except ImportError as exc:
            return (f"--engine megatron_fsdp needs the megatron_fsdp package ({exc}); "
                    "pip install 'mfsdp[upstream]'")
        return None

    def refuses(self, layout) -> str | None:
        """TP, CP, EP and the resume layout run under mfsdp only; every ZeRO strategy, HSDP,
        HFSDP and both precisions are upstream's."""
        if layout.parallel:
            return f"{layout.parallel_kind()} is checked under --engine mfsdp only"
        if layout.resume_as:
            return "saves with mfsdp.checkpoint: --engine mfsdp only"
        return None

    @staticmethod
    def on_cpu() -> bool:
        """Whether the ranks compute on the CPU (then the CUDA calls are replaced)."""
        import torch.distributed as dist

        return not torch.cuda.is_available() or dist.get_backend() == "gloo"

    def replacements(self) -> list[str]:
        """:func:`cpu_replacements` on CPU ranks, else nothing."""
        return cpu_replacements() if self.on_cpu() else []

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """:data:`CPU_REPLACEMENTS` in place while the engine runs on CPU ranks, restored
        after."""
        if not self.on_cpu():
            yield
            return
        saved = [(obj, attr, obj.__dict__.get(attr, _ABSENT)) for obj, attr, *_ in
                 CPU_REPLACEMENTS]
        try:
            for obj, attr, stand_in, _ in CPU_REPLACEMENTS:
                setattr(obj, attr, stand_in)
            yield
        finally:
            for obj, attr, old in saved:
                if old is _ABSENT:
                    delattr(obj, attr)
                else:
                    setattr(obj, attr, old)

    def shard(self, s: dict, layout, strategy: str) -> Sharded:
        """``megatron_fsdp.fully_shard`` with the layout's arguments (see the module notes)."""
        import torch.distributed as dist
        from megatron_fsdp import (MixedPrecisionPolicy, fully_shard, fully_shard_model,
                                   fully_shard_optimizer)
        from torch.distributed.device_mesh import init_device_mesh

        from mfsdp.check.models import build_model, resolve_units
        from mfsdp.check.run import _user_optimizer

        world = dist.get_world_size()
        model = build_model(s.model, s.seed)
        units = resolve_units(model, s.units)
        if layout.compute_dtype == "bf16":
            model = model.to(torch.bfloat16)
            policy = MixedPrecisionPolicy(main_params_dtype=torch.float32,
                                          main_grads_dtype=torch.float32)
        elif layout.grad_comm_dtype == "bf16":
            policy = MixedPrecisionPolicy(grad_comm_dtype=torch.bfloat16)
        else:
            policy = MixedPrecisionPolicy()
        device = "cpu" if self.on_cpu() else "cuda"
        hsdp: dict[str, Any] = {}
        if layout.dp_outer > 1:
            mesh = init_device_mesh(device, (layout.dp_outer, world // layout.dp_outer, 1),
                                    mesh_dim_names=("dp_outer", "dp_shard", "tp"))
            MegatronFSDPEngine._meshes += 1  # a fresh name: a flattened mesh is cached by it
            flat = f"hsdp{MegatronFSDPEngine._meshes}"
            mesh[("dp_outer", "dp_shard")]._flatten(flat)
            hsdp = dict(dp_outer_dim="dp_outer", hybrid_fsdp_group=mesh[flat].get_group(),
                        outer_dp_sharding_strategy=layout.outer_strategy)
        else:
            mesh = init_device_mesh(device, (world, 1), mesh_dim_names=("dp_shard", "tp"))
        kwargs = dict(device_mesh=mesh, dp_shard_dim="dp_shard", tp_dim="tp",
                      fsdp_unit_modules=units, zero_dp_strategy=strategy,
                      mixed_precision_policy=policy, device=torch.device(device), **hsdp)
        if s.optimizer_factory is None:
            # the README's one call; it steps the optimizer once to build its state
            model, optimizer = fully_shard(module=model, optimizer=_user_optimizer(s, model),
                                           **kwargs)
        else:  # the README's two calls, which keep the factory's parameter groups
            model = fully_shard_model(module=model, **kwargs)
            model._replace_param_with_distributed_if_needed()
            optimizer = fully_shard_optimizer(_user_optimizer(s, model.module))
        if self.on_cpu():
            model.ddp_config.gradient_reduce_div_fusion = False  # DIV_FUSION_OFF
        return Sharded(model, optimizer)

    def full_gradients(self, sh: Sharded) -> dict[str, torch.Tensor]:
        """Each main gradient (upstream's uneven DTensor) gathered (:func:`_full`)."""
        sh.model.finish_grad_sync()
        out = {}
        for n, p in sh.model.module.named_parameters():
            if not p.requires_grad:
                continue
            # laid out as the parameter's shard; a rank that holds no gradient for it (its
            # shard is empty, or the gradient was not attached) sends zeros of that shape
            g = p.grad
            local = (g.to_local() if hasattr(g, "to_local") else g) if g is not None else None
            shape = p.to_local().shape if hasattr(p, "to_local") else p.shape
            if local is None:
                local = torch.zeros(shape, dtype=p.dtype)
            elif local.shape != shape:
                if local.numel() != shape.numel():
                    raise RuntimeError(f"{n}: gradient shard {tuple(local.shape)} does not "
                                       f"match its parameter's shard {tuple(shape)}")
                local = local.reshape(shape)
            out[strip_name(n)] = _full(p, local).float()
        return out

    def full_parameters(self, sh: Sharded) -> dict[str, torch.Tensor]:
        """Each main weight (the optimizer's fp32 DTensor) gathered."""
        sh.model._replace_param_with_distributed_if_needed()
        return {strip_name(n): _full(p.detach()).float()
                for n, p in sh.model.module.named_parameters()}

    def state_bytes(self, sh: Sharded) -> int:
        """Local shards of the main weights and gradients plus the optimizer state."""
        from mfsdp.check.engines.fsdp2 import _local_bytes

        return _local_bytes(sh.model.module, sh.optimizer)


_ABSENT = object()


def _full(t: torch.Tensor, local: torch.Tensor | None = None) -> torch.Tensor:
    """``t`` (or, with ``local``, values laid out as ``t``'s local shard: its gradient) at its
    full shape on every rank; a collective call over the world.

    Upstream's DTensors may be sharded unevenly, so the offsets come from the local shapes:
    every rank's mesh coordinate and local piece are gathered once, and for each mesh dimension
    that shards a tensor dimension, innermost first, a piece's offset grows by the sizes of the
    pieces before it in its group, as upstream's ``gather_and_compute_chunk_metadata`` computes
    them (one gather here instead of one per mesh dimension, so ranks whose gradient is missing
    still take part alike)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):
        return (t if local is None else local).detach()
    mesh = t.device_mesh
    values = (t.to_local() if local is None else local).detach().cpu()
    pieces: list = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, (tuple(mesh.get_coordinate()), values))
    pieces = list({coord: v for coord, v in pieces}.items())  # one piece per coordinate
    sizes = [list(v.shape) for _, v in pieces]
    offsets = [[0] * len(t.shape) for _ in pieces]
    for m in reversed(range(mesh.ndim)):
        placement = t.placements[m]
        if not isinstance(placement, Shard):
            continue
        d = placement.dim
        grown = [list(s) for s in sizes]
        for i, (ci, _) in enumerate(pieces):
            group = [j for j, (cj, _) in enumerate(pieces)
                     if all(a == b for k, (a, b) in enumerate(zip(ci, cj)) if k != m)]
            offsets[i][d] += sum(sizes[j][d] for j in group if pieces[j][0][m] < ci[m])
            grown[i][d] = sum(sizes[j][d] for j in group)
        sizes = grown
    full = torch.zeros(tuple(t.shape), dtype=values.dtype)
    for (_, part), offset in zip(pieces, offsets):
        full[tuple(slice(o, o + n) for o, n in zip(offset, part.shape))] = part
    return full
