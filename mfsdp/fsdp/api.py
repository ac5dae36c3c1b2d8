"""``fully_shard``, ``fully_shard_model``, ``fully_shard_optimizer``: the drop-in entry points.

The argument names follow upstream Megatron-FSDP's ``fully_shard`` so that code written for it
keeps working after changing the import::

    model, optimizer = fully_shard(model, optimizer, fsdp_unit_modules=[Block],
                                   zero_dp_strategy="optim_grads_params")
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from mfsdp.config import MixedPrecisionPolicy, ShardingConfig, resolve_unit_classes
from mfsdp.fsdp import registry
from mfsdp.fsdp.module import FullyShardedModule
from mfsdp.fsdp.optimizer import ShardedOptimizer
from mfsdp.layout import ProcessGroups, rank_device

__all__ = ["fully_shard", "fully_shard_model", "fully_shard_optimizer"]

# fully_shard_model's arguments that it resolves itself (the module, where to shard, which groups
# and unit classes); every other argument goes to ShardingConfig.from_arguments, which refuses a
# name it does not read (mfsdp.config.CONFIG_ARGUMENTS). The two sets cover the signature exactly
# (tests/test_engine_arguments.py), so no argument can be silently lost.
API_ARGUMENTS = frozenset({
    "module", "device_mesh", "dp_shard_dim", "dp_outer_dim", "tp_dim", "hybrid_fsdp_group",
    "hybrid_fsdp_expt_group", "expt_device_mesh", "fsdp_unit_modules", "device",
    "fsdp_group_ag", "expt_fsdp_group_ag", "process_groups", "recursive_gather_modules",
})


def _mesh_group(mesh, dim: str | None, arg: str) -> dist.ProcessGroup | None:
    names = tuple(mesh.mesh_dim_names or ())
    if dim is None:
        if mesh.ndim == 1:
            return mesh.get_group()
        raise ValueError(f"{arg} is required for a {mesh.ndim}-D device_mesh (dims {names})")
    if dim in names:
        return mesh.get_group(dim)
    try:  # a flattened dimension (mesh["dp", "cp"]._flatten("dp_shard_cp")) is reached by name
        return mesh[dim].get_group()
    except (KeyError, RuntimeError, ValueError):
        raise ValueError(f"{arg}={dim!r} is not a dimension of device_mesh; its dimensions are "
                         f"{names} (flatten several with mesh[(...)]._flatten({dim!r}))") from None


def _mesh_size(mesh, dim: str) -> int:
    return mesh[dim].size()


def _default_device(module: nn.Module | None = None) -> torch.device:
    """The device to shard onto when ``device=`` is not given: where the model already is, if
    that is a GPU (gloo carries CUDA tensors too); else the device the default process group
    carries tensors of: the current GPU when NCCL is among its backends (``init_process_group()``
    with no backend argument on a GPU machine says ``"undefined"`` but has one), the CPU otherwise."""
    if module is not None:
        where = {p.device for p in module.parameters() if p.device.type != "meta"}
        if len(where) == 1 and next(iter(where)).type == "cuda":
            return next(iter(where))
    if not dist.is_initialized():
        return torch.device("cpu")
    config = str(dist.get_backend_config()).lower()
    return rank_device(cuda="nccl" in config and torch.cuda.is_available())


def fully_shard_model(
    module: nn.Module,
    device_mesh: Any = None,
    dp_shard_dim: str | None = None,
    dp_outer_dim: str | None = None,
    tp_dim: str | None = None,
    hybrid_fsdp_group: dist.ProcessGroup | None = None,
    expt_device_mesh: Any = None,
    fsdp_unit_modules: Any = None,
    zero_dp_strategy: int | str = 3,
    outer_dp_sharding_strategy: int | str = 0,
    device: torch.device | str | None = None,
    init_model_with_meta_device: bool = False,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    mixed_precision_policy: MixedPrecisionPolicy | None = None,
    overlap_grad_reduce: bool = True,
    overlap_param_gather: bool = True,
    sync_model_each_microbatch: bool = True,
    average_in_collective: bool = False,
    calculate_per_token_loss: bool = False,
    fsdp_double_buffer: bool = False,
    disable_bucketing: bool = False,
    fsdp_group_ag: dist.ProcessGroup | None = None,
    expt_fsdp_group_ag: dist.ProcessGroup | None = None,
    hybrid_fsdp_expt_group: dist.ProcessGroup | None = None,
    max_inflight_reduce: int = 2,
    prefetch_depth: int = 1,
    process_groups: ProcessGroups | None = None,
    recursive_gather_modules: Any = None,
    preproc_state_dict_for_dcp_ckpt: bool = True,
    report_nan_in_param_grad: bool = False,
    use_decoupled_grad: bool = False,
    grad_reduce_in_fp32: bool | None = None,
    preserve_fp32_weights: bool | None = None,
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False,
    keep_fp8_transpose_cache: bool = False,
    nccl_ub: bool = False,
    disable_symmetric_registration: bool = False,
    enable_fine_grained_param_gather: bool = False,
    maxpool_double_buffer: bool = False,
    cuda_graph_mode: Any = None,
) -> FullyShardedModule:
    """Shard ``module``'s parameters over the data-parallel group and return the wrapped module.

    Args:
        module: the model. Its parameters must be on ``device`` (or on ``meta`` with
            ``init_model_with_meta_device=True``).
        device_mesh: a ``torch.distributed.DeviceMesh``; ``None`` shards over the whole world.
        dp_shard_dim: the mesh dimension to shard over (required for a mesh of more than one dim).
        dp_outer_dim: the outer (replica) dimension for HSDP; a size of 1 is plain FSDP.
        tp_dim: the tensor-parallel dimension of ``device_mesh``. Parameters that are DTensors
            over ``device_mesh[tp_dim]`` (``parallelize_module``, a Hugging Face TP plan) are
            sharded over ``dp_shard_dim`` on their TP block; plain parameters are replicated
            over TP. Gradients are reduced over the data-parallel dimensions only.
        fsdp_unit_modules: module classes (or dotted import strings) gathered and released as
            units; parameters outside every unit form the root unit.
        zero_dp_strategy: ``0``-``3`` or ``"no_shard"``, ``"optim"``, ``"optim_grads"``,
            ``"optim_grads_params"``.
        outer_dp_sharding_strategy: ``"no_shard"`` (HSDP) or ``"optim"`` across the outer dimension.
        device: where buffers live; default from the mesh (CPU with gloo, the current GPU with NCCL).
        init_model_with_meta_device: materialise a model built on ``meta`` one module at a time,
            straight into the shards: each module's parameters and buffers are allocated, then
            ``param_init_fn(module)`` fills them (or the module's ``reset_parameters()``).
        param_init_fn: ``fn(module)`` initialising one module's own parameters and buffers
            (e.g. a Hugging Face model's ``_init_weights``, which also recomputes rotary
            ``inv_freq``). Needs ``init_model_with_meta_device=True``.
        mixed_precision_policy: main-weight, gradient and communication dtypes.
        overlap_grad_reduce: launch each bucket's reduction as soon as its gradients are ready.
        overlap_param_gather: prefetch the next unit's weights (ZeRO-3).
        sync_model_each_microbatch: reduce gradients in every backward (see ``no_sync``).
        average_in_collective: average with the collective (NCCL ``AVG``; on gloo a sum followed
            by a division) instead of dividing each rank's gradient before a sum, as upstream.
            Not with ``calculate_per_token_loss``.
        calculate_per_token_loss: sum gradients over ranks instead of averaging (the loss is
            normalised by the global token count by the caller).
        fsdp_double_buffer: keep gathered weights (ZeRO-3) and full gradients (ZeRO-2/3) of
            non-root units in fixed pools of two slots, each slot sized for the largest unit.
            Under ``no_shard`` and ``optim`` no buffer is temporary (weights are never gathered,
            gradients accumulate in buffers that persist), so both pools stay empty.
        disable_bucketing: put every parameter in the root unit (one bucket per group).
        fsdp_group_ag: a second process group over the dense shard ranks for all-gathers.
        expt_device_mesh, expt_fsdp_group_ag: the expert meshes and all-gather group.
        hybrid_fsdp_group, hybrid_fsdp_expt_group: the flattened (outer x shard) groups of the
            dense and expert parameters (HSDP/HFSDP): the engine agrees over them on which
            parameters got a gradient (one collective instead of one per dimension) and, under
            ``outer_dp_sharding_strategy='optim'``, shards main weights over them. A group
            whose ranks are not the shard group and its outer replicas is refused.
        max_inflight_reduce: reduce-scatters in flight at once before the oldest is waited for.
        prefetch_depth: how many units ahead all-gathers are launched (ZeRO-3); gathered
            weights then take up to ``prefetch_depth + 1`` units.
        process_groups: the groups of a :class:`mfsdp.ParallelLayout` (from its
            ``create_groups()``), instead of meshes: dense and expert shard groups, outer group,
            EP group and, when created, the all-gather groups.
        recursive_gather_modules: module classes whose forward bypasses their children's
            ``forward`` (fused kernels); each such module gathers all units inside it
            (see :meth:`FullyShardedModule.gather_recursively`).
        preproc_state_dict_for_dcp_ckpt: ``model.state_dict()`` (and the optimizer's) hold
            DTensors that carry their uneven row chunks for ``torch.distributed.checkpoint``;
            ``False`` hands out the sharded parameters themselves (as upstream does without
            preprocessing).
        report_nan_in_param_grad: after each synchronising backward, raise an error naming every
            parameter whose reduced gradient holds a NaN (costs one pass over the gradients).
        use_decoupled_grad: install the reduced gradients as ``param.decoupled_grad`` (on the
            sharded parameters and the optimizer's tensors) instead of ``.grad``, for optimizers
            that read them there (TransformerEngine's ``FusedAdam``).
        grad_reduce_in_fp32, preserve_fp32_weights: older upstream spellings of
            ``MixedPrecisionPolicy(main_grads_dtype=torch.float32, grad_comm_dtype=torch.float32)``
            and of ``main_params_dtype=torch.float32`` (``False``: the model's dtype); not
            together with ``mixed_precision_policy``.
        fsdp_db_use_persist_buf_on_alloc_fail: with the double buffer, gradients whose slot is
            still held by unreduced gradients of another unit (``overlap_grad_reduce=False``,
            nested units) get their own storage instead of stopping the backward with an error.
        maxpool_double_buffer: the double buffer with both slots sized to the largest unit
            (upstream's max-pooled layout, which is mfsdp's double buffer): it turns
            ``fsdp_double_buffer`` on.
        nccl_ub: upstream's CUDA-only features (also ``keep_fp8_transpose_cache``,
            ``disable_symmetric_registration``, ``enable_fine_grained_param_gather``,
            ``cuda_graph_mode``): a non-default value is an error that says so.
    """
    given = dict(locals())  # the arguments as given
    if isinstance(module, FullyShardedModule) or any(registry.owner(p) is not None
                                                     for p in module.parameters()):
        raise ValueError("fully_shard_model: this module is already sharded by an earlier "
                         "fully_shard call (its parameters belong to a FullyShardedModule); "
                         "shard a model once and keep using the wrapped model it returned")
    # validate (every argument is either resolved here or read by the config: API_ARGUMENTS)
    config = ShardingConfig.from_arguments(
        **{k: v for k, v in given.items() if k not in API_ARGUMENTS})
    if not dist.is_initialized():
        raise RuntimeError("fully_shard needs an initialised process group: call "
                           "torch.distributed.init_process_group() first (or use torchrun)")
    # resolve the process groups (and the device a mesh implies)
    groups, mesh_device = _resolve_groups(
        device_mesh, dp_shard_dim, dp_outer_dim, tp_dim, expt_device_mesh, process_groups,
        fsdp_group_ag, expt_fsdp_group_ag)
    outer_size = dist.get_world_size(groups.dp_outer) if groups.dp_outer is not None else 1
    hybrid = _check_hybrid_groups(groups, outer_size, hybrid_fsdp_group, hybrid_fsdp_expt_group)
    config = config.for_outer_size(outer_size)
    device = device if device is not None else mesh_device
    device = torch.device(device) if device is not None else _default_device(module)
    # build
    originals = list(module.parameters())  # the model takes them over (their values, their places)
    model = FullyShardedModule(module, groups=groups, strategy=config.strategy,
                               unit_classes=resolve_unit_classes(fsdp_unit_modules, module),
                               device=device, mixed_precision_policy=config.mixed_precision_policy,
                               options=config.options, outer_strategy=config.outer_strategy,
                               hybrid_groups=hybrid)
    recursive = resolve_unit_classes(recursive_gather_modules, module)
    for m in module.modules():
        if recursive and isinstance(m, recursive):
            model.gather_recursively(m)
    # (weakly: neither the model nor the registry keeps the originals alive)
    registry.register_taken_over(model, originals)
    _watch_stale_optimizers()
    return model


def _resolve_groups(device_mesh, dp_shard_dim, dp_outer_dim, tp_dim, expt_device_mesh,
                    process_groups, fsdp_group_ag, expt_fsdp_group_ag):
    """The :class:`~mfsdp.layout.ProcessGroups` the engine uses, from whichever way the caller
    named them (a layout's groups, upstream's device meshes and dimension names, separate
    all-gather groups), and the device a mesh implies (``None``: no mesh)."""
    device = None
    if process_groups is not None:
        if device_mesh is not None or expt_device_mesh is not None:
            raise ValueError("pass either process_groups or device_mesh/expt_device_mesh, not both")
        groups = dataclasses.replace(process_groups)  # the caller's object stays as it was
    else:
        groups = ProcessGroups()
    if device_mesh is not None:
        if device_mesh.size() != dist.get_world_size():
            raise ValueError(f"device_mesh covers {device_mesh.size()} ranks but the world has "
                             f"{dist.get_world_size()}; build the mesh over every rank")
        if tp_dim is not None:
            groups.tp = _mesh_group(device_mesh, tp_dim, "tp_dim")
            groups.tp_mesh = device_mesh[tp_dim]
        if dp_outer_dim is not None:
            groups.dp_outer = _mesh_group(device_mesh, dp_outer_dim, "dp_outer_dim")
        elif device_mesh.ndim > 1 and dp_shard_dim is None:
            raise ValueError(f"dp_shard_dim is required for a {device_mesh.ndim}-D device_mesh "
                             f"(dims {tuple(device_mesh.mesh_dim_names or ())})")
        groups.dp_shard = _mesh_group(device_mesh, dp_shard_dim, "dp_shard_dim")
        device = (rank_device(cuda=True) if device_mesh.device_type == "cuda"
                  else torch.device(device_mesh.device_type))
    elif dp_shard_dim is not None or tp_dim is not None or dp_outer_dim is not None:
        raise ValueError("dp_shard_dim / dp_outer_dim / tp_dim name dimensions of device_mesh, "
                         "but no device_mesh was given")
    if expt_device_mesh is not None:
        groups.expt_dp_shard = _mesh_group(expt_device_mesh, "expt_dp_shard", "expt_device_mesh")
        groups.ep = _mesh_group(expt_device_mesh, "ep", "expt_device_mesh")
    if fsdp_group_ag is not None:
        groups.dp_shard_ag = fsdp_group_ag
    if expt_fsdp_group_ag is not None:
        groups.expt_dp_shard_ag = expt_fsdp_group_ag
    return groups, device


def _check_hybrid_groups(groups, outer_size: int, hybrid_fsdp_group,
                         hybrid_fsdp_expt_group) -> tuple:
    """Upstream passes the flattened (outer x shard) groups of the dense and expert parameters;
    check that each spans this rank's shard group and its outer replicas, and return them
    ``(dense, expert)`` for the engine to use (``None`` where not given)."""
    shard, expt = groups.dp_shard, groups.expt_dp_shard if groups.expt_dp_shard is not None \
        else groups.dp_shard
    outer_ranks = (set(dist.get_process_group_ranks(groups.dp_outer))
                   if groups.dp_outer is not None else {dist.get_rank()})
    for name, group, inner in (("hybrid_fsdp_group", hybrid_fsdp_group, shard),
                               ("hybrid_fsdp_expt_group", hybrid_fsdp_expt_group, expt)):
        if group is None:
            continue
        inner_ranks = (set(dist.get_process_group_ranks(inner)) if inner is not None
                       else set(range(dist.get_world_size())))
        size = dist.get_world_size(group)
        if size != len(inner_ranks) * outer_size:
            raise ValueError(f"{name} has {size} ranks but the shard group x dp_outer is "
                             f"{len(inner_ranks)} x {outer_size}; it must span both")
        ranks = set(dist.get_process_group_ranks(group))
        if not (inner_ranks | outer_ranks) <= ranks:
            raise ValueError(f"{name} holds ranks {sorted(ranks)}, which miss rank "
                             f"{dist.get_rank()}'s shard group {sorted(inner_ranks)} or outer "
                             f"group {sorted(outer_ranks)}; pass the flattened (dp_outer, "
                             "dp_shard) group, e.g. mesh['dp_outer', 'dp_shard']._flatten()")
    return hybrid_fsdp_group, hybrid_fsdp_expt_group


# [Note: optimizers from before fully_shard] An optimizer built on a module's parameters before
# fully_shard and not handed to it would step tensors the sharded model no longer reads: training
# would silently stand still. fully_shard never sees that optimizer, so the one place to refuse it
# is its step: a step pre-hook, registered by the first fully_shard_model (never at import),
# checks the optimizer's parameters while some parameter a model took over is alive (and returns
# at once otherwise; it stays registered: torch iterates its hooks while calling them). Optimizers over the sharded model's own parameters need no hook: the
# next forward installs what their step changed ([Note: main weights a plain optimizer stepped]
# in mfsdp/fsdp/state.py).
_STALE_WATCH: list[RemovableHandle] = []  # the pre-hook's handle, once registered


def _watch_stale_optimizers() -> None:
    """Register the step pre-hook of [Note: optimizers from before fully_shard] (once)."""
    if not _STALE_WATCH:
        _STALE_WATCH.append(register_optimizer_step_pre_hook(_refuse_stale_step))


def _refuse_stale_step(optimizer, args, kwargs) -> None:
    """Before an optimizer's step: refuse one that holds a parameter some sharded model took
    over (see [Note: optimizers from before fully_shard])."""
    if not registry.any_taken_over():
        return
    for g, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            if registry.model_of(p) is None and registry.taken_over_by(p) is not None:
                raise RuntimeError(
                    f"mfsdp: this {type(optimizer).__name__} holds param_groups[{g}]['params']"
                    f"[{j}] (shape {tuple(p.shape)}), a parameter of the module from before "
                    "fully_shard, which the sharded model no longer reads (its step would "
                    "change nothing); pass the optimizer to fully_shard(model, optimizer), or "
                    "build it after fully_shard from the returned model's parameters")


def fully_shard_optimizer(optimizer: torch.optim.Optimizer,
                          preproc_state_dict_for_dcp_ckpt: bool = True) -> ShardedOptimizer:
    """Make ``optimizer`` step on the main-weight shards of the model its parameters belong to.

    ``preproc_state_dict_for_dcp_ckpt=False``: ``state_dict()`` holds this rank's local state
    tensors as ``torch.optim`` has them (no DTensors, not for ``torch.distributed.checkpoint``).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer={optimizer!r} is not a torch.optim.Optimizer")
    model = None
    for g, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            owner = registry.owner(p)
            if owner is None:
                raise ValueError(
                    f"fully_shard_optimizer: param_groups[{g}]['params'][{j}] (shape "
                    f"{tuple(p.shape)}) is not managed by mfsdp; call fully_shard_model(model) "
                    "first and build the optimizer from its parameters, or pass the optimizer "
                    "to fully_shard(model, optimizer)")
            if model is not None and owner is not model:
                raise ValueError("fully_shard_optimizer: the optimizer's parameters belong to "
                                 "two different sharded models; use one optimizer per model")
            model = owner
    if model is None:
        raise ValueError("fully_shard_optimizer: the optimizer has no parameters")
    return ShardedOptimizer(optimizer, model, dcp_state_dict=preproc_state_dict_for_dcp_ckpt)


def fully_shard(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    device_mesh: Any = None,
    dp_shard_dim: str | None = None,
    dp_outer_dim: str | None = None,
    tp_dim: str | None = None,
    hybrid_fsdp_group: dist.ProcessGroup | None = None,
    expt_device_mesh: Any = None,
    fsdp_unit_modules: Any = None,
    zero_dp_strategy: int | str = 3,
    outer_dp_sharding_strategy: int | str = 0,
    device: torch.device | str | None = None,
    init_model_with_meta_device: bool = False,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    mixed_precision_policy: MixedPrecisionPolicy | None = None,
    overlap_grad_reduce: bool = True,
    overlap_param_gather: bool = True,
    sync_model_each_microbatch: bool = True,
    average_in_collective: bool = False,
    calculate_per_token_loss: bool = False,
    fsdp_double_buffer: bool = False,
    disable_bucketing: bool = False,
    fsdp_group_ag: dist.ProcessGroup | None = None,
    expt_fsdp_group_ag: dist.ProcessGroup | None = None,
    hybrid_fsdp_expt_group: dist.ProcessGroup | None = None,
    max_inflight_reduce: int = 2,
    prefetch_depth: int = 1,
    process_groups: ProcessGroups | None = None,
    recursive_gather_modules: Any = None,
    preproc_state_dict_for_dcp_ckpt: bool = True,
    report_nan_in_param_grad: bool = False,
    use_decoupled_grad: bool = False,
    grad_reduce_in_fp32: bool | None = None,
    preserve_fp32_weights: bool | None = None,
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False,
    keep_fp8_transpose_cache: bool = False,
    nccl_ub: bool = False,
    disable_symmetric_registration: bool = False,
    enable_fine_grained_param_gather: bool = False,
    maxpool_double_buffer: bool = False,
    cuda_graph_mode: Any = None,
) -> tuple[FullyShardedModule, ShardedOptimizer | None]:
    """Shard ``module`` and ``optimizer``; return both. The keyword arguments are
    :func:`mfsdp.fully_shard_model`'s (see there); they are keyword-only here, as upstream
    Megatron-FSDP's ``fully_shard`` takes them.

    ``optimizer`` may be built on the original parameters, before this call, as upstream
    Megatron-FSDP allows; its state must still be empty. Or leave it out and build a plain
    ``torch.optim`` optimizer afterwards over the returned model's parameters (FSDP2's pattern):
    its ``zero_grad()`` clears what the next backward accumulates into and the next forward
    installs what its ``step()`` changed (see [Note: gradients cleared by hand] in
    ``mfsdp/fsdp/reducer.py`` and [Note: main weights a plain optimizer stepped] in
    ``mfsdp/fsdp/state.py``); one still holding the parameters from before this call is refused
    at its first step.
    """
    model = fully_shard_model(
        module,
        device_mesh=device_mesh,
        dp_shard_dim=dp_shard_dim,
        dp_outer_dim=dp_outer_dim,
        tp_dim=tp_dim,
        hybrid_fsdp_group=hybrid_fsdp_group,
        expt_device_mesh=expt_device_mesh,
        fsdp_unit_modules=fsdp_unit_modules,
        zero_dp_strategy=zero_dp_strategy,
        outer_dp_sharding_strategy=outer_dp_sharding_strategy,
        device=device,
        init_model_with_meta_device=init_model_with_meta_device,
        param_init_fn=param_init_fn,
        mixed_precision_policy=mixed_precision_policy,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        sync_model_each_microbatch=sync_model_each_microbatch,
        average_in_collective=average_in_collective,
        calculate_per_token_loss=calculate_per_token_loss,
        fsdp_double_buffer=fsdp_double_buffer,
        disable_bucketing=disable_bucketing,
        fsdp_group_ag=fsdp_group_ag,
        expt_fsdp_group_ag=expt_fsdp_group_ag,
        hybrid_fsdp_expt_group=hybrid_fsdp_expt_group,
        max_inflight_reduce=max_inflight_reduce,
        prefetch_depth=prefetch_depth,
        process_groups=process_groups,
        recursive_gather_modules=recursive_gather_modules,
        preproc_state_dict_for_dcp_ckpt=preproc_state_dict_for_dcp_ckpt,
        report_nan_in_param_grad=report_nan_in_param_grad,
        use_decoupled_grad=use_decoupled_grad,
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        preserve_fp32_weights=preserve_fp32_weights,
        fsdp_db_use_persist_buf_on_alloc_fail=fsdp_db_use_persist_buf_on_alloc_fail,
        keep_fp8_transpose_cache=keep_fp8_transpose_cache,
        nccl_ub=nccl_ub,
        disable_symmetric_registration=disable_symmetric_registration,
        enable_fine_grained_param_gather=enable_fine_grained_param_gather,
        maxpool_double_buffer=maxpool_double_buffer,
        cuda_graph_mode=cuda_graph_mode)
    return model, (fully_shard_optimizer(optimizer, preproc_state_dict_for_dcp_ckpt)
                   if optimizer is not None else None)
