"""Megatron-LM's ``torch_dist`` checkpoints (megatron-core's ``dist_checkpointing``): read, written.

What Megatron-LM's ``save_checkpoint`` writes with ``--ckpt-format torch_dist``::

    CKPT/latest_checkpointed_iteration.txt      the latest iteration ("7")
    CKPT/iter_0000007/.metadata                 a torch.distributed.checkpoint
    CKPT/iter_0000007/__0_0.distcp ...
    CKPT/iter_0000007/metadata.json             {"sharded_backend": "torch_dist", ...}

Model keys have no ``model.`` prefix. The transformer layers are stacked: one tensor
``decoder.layers.<name>`` of shape ``[num_layers, ...]`` per parameter name, and the norms carry
Transformer Engine's fused names whether or not Transformer Engine was used:
``decoder.layers.self_attention.linear_qkv.layer_norm_weight`` is layer ``i``'s
``input_layernorm.weight`` and ``decoder.layers.mlp.linear_fc1.layer_norm_weight`` its
``pre_mlp_layernorm.weight``. Everything else maps one to one onto mfsdp's GPT
(``embedding.word_embeddings.weight`` -> ``embedding.weight``, ``decoder.final_layernorm`` ->
``final_layernorm``, the per-group ``linear_qkv`` and ``[gate; up]`` ``linear_fc1`` layouts are
the same). ``*._extra_state`` (Transformer Engine's FP8 metadata) is dropped.

Optimizer state is read and written in model space, where each tensor is keyed by the weight it
belongs to: ``optimizer.state.<field>.<model key>`` with fields ``param`` (the fp32 main weights,
distributed optimizer only), ``exp_avg``, ``exp_avg_sq`` (Adam) or ``momentum_buffer`` (SGD),
stacked like the weights. Megatron-LM writes it so with ``--dist-ckpt-optim-fully-reshardable``
(the distributed optimizer) and without ``--use-distributed-optimizer``; its default for the
distributed optimizer, ``dp_reshardable``, keeps the state as the optimizer's flat bucket buffers
(``optimizer.distributed.*``), read here as model-space state by
:class:`~mfsdp.checkpoint.megatron_lm_buckets.BucketSource` (one data-parallel group per TP
rank, each rank's pieces joined; pipeline parallelism above 1 is refused with the fix). Exports are always by weight (``fully_reshardable``), which
megatron-core loads at any data-parallel size. The non-tensor state (``args``, ``iteration``, the
optimizer's ``param_groups`` with ``step``, ``opt_param_scheduler``, the content metadata naming
the optimizer layout) is one ``torch.save`` object, ``common_state``, inside the DCP files.

Checked against checkpoints megatron-core 0.19.2 wrote (``tests/fixtures/megatron_lm``): every
weight and optimizer tensor equal, the imported model gives megatron-core's logits, one more
iteration from an imported checkpoint gives megatron-core's next weights (Adam and SGD), and the
export of an import is the checkpoint it came from.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mfsdp.checkpoint.dcp import (MAP_FILE, MODEL_CONFIG_FILE, DCPSource, Progress, owned_keys, ranks,
                                  tensor_nbytes, write_streaming)
from mfsdp.checkpoint.full import fsdp_source
from mfsdp.checkpoint.io import load_converted
from mfsdp.checkpoint.detect import TRACKER, is_megatron_lm, megatron_lm_backend, resolve_megatron_lm
from mfsdp.checkpoint.manifest import CheckpointError
from mfsdp.checkpoint.megatron_lm_buckets import BUCKETS, BucketSource
from mfsdp.checkpoint.megatron_common import (COMMON, MAIN_FIELDS, SAFE_TYPES,
                                              config_from_megatron_args, merge_model_flags,
                                              fsdp_model_config, is_decayed, megatron_args,
                                              add_carried, mfsdp_groups, mfsdp_name,
                                              not_carried, optimizer_common,
                                              read_common_state, saved_steps, source_key,
                                              target_key, write_iteration)
from mfsdp.checkpoint.megatron_schedule import (carry_into_args, scheduler_in_iterations,
                                                scheduler_in_samples)

__all__ = ["FORMAT", "fsdp_to_megatron_lm", "is_megatron_lm", "load_megatron_lm",
           "megatron_lm_to_fsdp", "not_carried_line", "mfsdp_name", "read_common_state", "resolve_megatron_lm",
           "saved_arguments", "write_iteration"]

FORMAT = "megatron_lm_torch_dist"


def megatron_lm_to_fsdp(src: str | Path, dst: str | Path, model_config: dict | None = None,
                        weights_only: bool = False, progress: bool = True,
                        model_flags: dict | None = None) -> Path:
    """A Megatron-LM ``torch_dist`` checkpoint -> mfsdp ``fsdp_dtensor``, streamed: one weight
    (one layer's slice of a stacked tensor, read from its own chunks) is in memory at a time;
    ``progress`` reports on stderr.

    ``model_config`` is the :class:`~mfsdp.models.gpt.GPTConfig` the checkpoint was trained with;
    ``None`` reads it from the Megatron-LM arguments the checkpoint carries
    (:func:`~mfsdp.checkpoint.megatron_common.config_from_megatron_args`, as Megatron-LM's
    ``--use-checkpoint-args``). Every weight of that model must be in the checkpoint with its
    shape, and every model tensor of the checkpoint must be used.

    The optimizer state, in model space or in ``dp_reshardable`` buckets, comes along: Adam
    moments or SGD momentum by parameter name, ``step`` from the param groups, the two groups'
    hyperparameters (weight decay and none, told apart by Megatron-LM's ``wd_mult``), the
    learning-rate schedule (``extra["opt_param_scheduler"]``) and the iteration. The model weights are the optimizer's
    fp32 main weights where it has them (``optimizer.state.param``, or a ``dp_reshardable``
    checkpoint's buckets). ``weights_only`` leaves the optimizer out. ``model_flags``: the
    model flags of ``mfsdp convert`` by the trainer's names (``{"num_attention_heads": 4}``),
    merged into the checkpoint's arguments (a contradiction is refused) or applied on top of
    ``model_config``.
    """
    from mfsdp.models.gpt import GPT, GPTConfig

    found = resolve_megatron_lm(src)
    if found is None:
        raise CheckpointError(f"{src} is not a Megatron-LM checkpoint (no {TRACKER}, no "
                              "metadata.json beside a .metadata)")
    directory, iteration = found
    backend = megatron_lm_backend(directory)
    model_config = _megatron_lm_model_config(directory, backend, model_config, model_flags)
    if backend == "fsdp_dtensor":
        from mfsdp.checkpoint.megatron_lm_dtensor import megatron_lm_dtensor_to_fsdp

        return megatron_lm_dtensor_to_fsdp(directory, dst, model_config, iteration,
                                           weights_only, progress)
    if backend != "torch_dist":
        raise CheckpointError(f"{directory} is a Megatron-LM {backend!r} checkpoint; mfsdp reads "
                              "Megatron-LM's torch_dist and fsdp_dtensor")
    cfg = GPTConfig.from_dict(model_config)
    with torch.device("meta"):
        model = GPT(cfg)
    ref = model.state_dict()
    source = DCPSource(directory)
    keys = set(source.tensors)
    plan = _megatron_lm_plan(directory, source, ref, model_flags)
    common = read_common_state(directory)
    if iteration is None:
        iteration = int(common.get("iteration") or 0)
    state_keys = [k for k in keys if k.startswith("optimizer.state.")]
    buckets = any(k.startswith(BUCKETS) for k in keys) and not weights_only
    blobs: dict[str, object] = {}
    files = {MODEL_CONFIG_FILE: json.dumps(cfg.to_dict(), indent=1)}
    fields: dict[str, set[str]] = {}  # optimizer field -> the model keys it has state for
    for key in state_keys:
        field, _, model_key = key[len("optimizer.state."):].partition(".")
        fields.setdefault(field, set()).add(model_key)
    if buckets:  # dp_reshardable: the flat buckets read as model-space state
        reader = BucketSource(directory, source, common, plan, model)
        fields, common = reader.fields, reader.common
    specs, origin = _weight_specs(plan, ref, fields)
    extra: dict[str, object] = {"iteration": iteration, "data_position": iteration,
                                "source": FORMAT}
    if common.get("opt_param_scheduler"):
        extra["opt_param_scheduler"] = scheduler_in_iterations(common["opt_param_scheduler"],
                                                               common.get("args"), extra)
    # what is left is named at the end of the conversion (mfsdp convert, mfsdp train --load)
    add_carried(extra, common.get("args"), common.get("num_floating_point_operations_so_far"),
                not_carried(common, source.blob_keys, weights_only))
    step = None
    if not weights_only and (state_keys or buckets or common.get("optimizer")):
        step = _megatron_lm_optimizer(directory, common, fields, plan, model, ref, specs,
                                      origin, blobs, files)
    blobs["extra"] = extra
    return _write_from_megatron_lm(dst, reader if buckets else source, specs, origin, step,
                                   blobs, files, backend, directory, progress)


def _weight_specs(plan: dict, ref: dict, fields: dict[str, set[str]]) -> tuple[dict, dict]:
    """Each weight's shape (``specs``) and where it is read (``origin``: the optimizer's fp32
    main weight where it keeps one, else the model's tensor), by mfsdp key."""
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    origin: dict[str, tuple[str, tuple[int, ...]]] = {}
    main_field = next((f for f in MAIN_FIELDS if f in fields), None)
    for name, (key, index) in plan.items():
        src_key = f"optimizer.state.{main_field}.{key}" if main_field else key
        if main_field and key not in fields[main_field]:
            src_key = key
        specs[f"model.{name}"] = (tuple(ref[name].shape), torch.float32)
        origin[f"model.{name}"] = (src_key, index)
    return specs, origin


def not_carried_line(converted: str | Path) -> str:
    """``"\nnot carried: KEY (why), ..."`` for what the conversion that wrote ``converted`` (an
    ``fsdp_dtensor`` checkpoint) left out of the Megatron-LM checkpoint it read; ``""`` where it
    left nothing or is not such a conversion."""
    source = DCPSource(converted, verify=False)
    extra = source.blob("extra") if "extra" in source.blob_keys else {}
    left = extra.get("not_carried") or []
    return f"\nnot carried: {', '.join(left)}" if left else ""


def _megatron_lm_model_config(directory: Path, backend: str, model_config: dict | None,
                              model_flags: dict | None = None) -> dict:
    """``model_config``, or where it is ``None`` the one the Megatron-LM arguments saved in the
    checkpoint at ``directory`` describe (``torch_dist``: in its common state; ``fsdp_dtensor``:
    its ``args`` entry), with ``model_flags`` (the model flags of ``mfsdp convert``, by the
    trainer's names) merged in or applied on top; a ``CheckpointError`` names the flags of
    what neither tells."""
    flags = model_flags or {}
    args = saved_arguments(directory, backend)
    if model_config is not None:
        model_config = _config_with_flags(model_config, flags)
        # the one dimension the shapes cannot check: a job's config must agree with the args
        saved = getattr(args, "num_attention_heads", None)
        if saved is not None and saved != model_config["num_attention_heads"]:
            raise CheckpointError(f"the model's num_attention_heads="
                                  f"{model_config['num_attention_heads']} contradicts "
                                  f"{directory}: its Megatron-LM arguments hold "
                                  f"num_attention_heads={saved} (the shapes alone cannot tell)")
        return model_config
    if args is None and not flags:
        raise CheckpointError(f"{directory} is a Megatron-LM {backend} checkpoint without its "
                              "arguments; name its model with the model flags of mfsdp train "
                              "(--num-layers, --hidden-size, --num-attention-heads, ...), "
                              "--model-preset or --model-config")
    return config_from_megatron_args(merge_model_flags(args, flags, str(directory)),
                                     str(directory))


def saved_arguments(directory: Path, backend: str):
    """The ``args`` namespace Megatron-LM saved in the iteration directory ``directory`` of
    format ``backend`` (``torch_dist``: in its common state; ``fsdp_dtensor``: its ``args``
    entry), or ``None`` where it saved none."""
    if backend == "torch_dist":
        return read_common_state(directory).get("args")
    source = DCPSource(directory)
    return source.object("args", SAFE_TYPES) if "args" in source.blob_keys else None


def _config_with_flags(model_config: dict, flags: dict) -> dict:
    """``model_config`` (a GPTConfig dict) with the model flags ``flags`` applied, as ``mfsdp
    train`` applies its flags to a preset."""
    from mfsdp.models.gpt import GPTConfig

    cfg = dict(model_config)
    for name, value in flags.items():
        if name == "disable_bias_linear":
            cfg["add_bias_linear"] = not value
        elif name == "untie_embeddings_and_output_weights":
            cfg["share_embeddings_and_output_weights"] = not value
        elif name == "use_rope_scaling":
            cfg["rope_scaling_factor"] = (flags.get("rope_scaling_factor", 8.0) if value
                                          else None)
        elif name != "group_query_attention":  # (--num-query-groups carries the number)
            cfg[name] = value
    return GPTConfig.from_dict(cfg).to_dict()


def _megatron_lm_plan(directory: Path, source: DCPSource, ref: dict,
                      model_flags: dict | None = None) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each weight of the model's state dict ``ref`` -> (the ``torch_dist`` tensor it is read
    from, its layer/expert index in that stack); a ``CheckpointError`` names a tensor missing,
    stacking too few, of the wrong shape or left over, and the ``model_flags`` given."""
    try:
        return _plan(directory, source, ref)
    except CheckpointError as exc:
        if not model_flags:
            raise
        given = " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
                         for k, v in model_flags.items())
        raise CheckpointError(f"{exc} (the model flags given: {given})") from None


def _plan(directory: Path, source: DCPSource, ref: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """:func:`_megatron_lm_plan` without the flags."""
    keys = set(source.tensors)
    plan: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, t in ref.items():
        key, index = source_key(name, keys)
        if key not in keys:
            raise CheckpointError(f"{directory} has no tensor {key!r} (for {name}); is "
                                  "the model config the one it was trained with?")
        shape = source.tensors[key][0]
        got = tuple(shape[len(index):])
        for i, n, what in zip(index, shape, ("layers", "experts")):
            if i >= n:
                raise CheckpointError(f"{key} stacks {n} {what}; the model config has more")
        if got != tuple(t.shape):
            raise CheckpointError(f"{key} gives {name} the shape {got}; the model config implies "
                                  f"{tuple(t.shape)}")
        plan[name] = (key, index)
    used = {k for k, _ in plan.values()}
    unused = sorted(k for k in keys - used if not k.endswith("_extra_state")
                    and not k.startswith(("optimizer.", "rng_state", "common_state")))
    if unused:
        raise CheckpointError(f"{directory} holds {len(unused)} model tensors this config does not "
                              f"have, e.g. {unused[0]!r}")
    return plan


def _megatron_lm_optimizer(directory: Path, common: dict, fields: dict[str, set[str]],
                           plan: dict, model, ref: dict, specs: dict, origin: dict, blobs: dict,
                           files: dict) -> dict[int, float]:
    """Add the optimizer state of the ``torch_dist`` checkpoint at ``directory`` to ``specs``,
    ``origin`` (by parameter name), ``blobs`` (the param groups) and ``files`` (the parameter ->
    group map); return the step of each mfsdp group (``{}`` where none is kept). ``fields``:
    the state by model key (``dp_reshardable`` buckets already read as such). A
    ``CheckpointError`` refuses the distributed optimizer's other layouts and partial state."""
    params = {n for n, _ in model.named_parameters()}  # the rest are buffers (expert bias)
    opt_common = common.get("optimizer") or {}
    layout = (common.get("content_metadata") or {}).get(
        "distrib_optim_sharding_type", opt_common.get("param_state_sharding_type"))
    if layout and layout not in ("fully_reshardable", "fully_sharded_model_space",
                                 "dp_reshardable"):
        raise CheckpointError(
            f"{directory} holds the distributed optimizer's state in its {layout!r} layout, "
            "which mfsdp does not map onto the weights. Save it from Megatron-LM with "
            "--dist-ckpt-optim-fully-reshardable (the state by weight), or convert the "
            "weights alone with --weights-only")
    groups, _ = optimizer_common(common)
    mine = mfsdp_groups(groups, directory)
    steps = saved_steps(common, directory)
    group_of = {n: 0 if is_decayed(n, p) else 1 for n, p in model.named_parameters()}
    for field, have in sorted(fields.items()):
        if field in MAIN_FIELDS:
            continue
        missing = sorted({plan[n][0] for n in params} - have)
        if missing:
            raise CheckpointError(f"{directory} has optimizer state {field!r} for some "
                                  f"weights but not for {missing[0]!r}")
        for name in params:
            key, index = plan[name]
            out = f"optimizer.state.{name}.{field}"
            specs[out] = (tuple(ref[name].shape), torch.float32)
            origin[out] = (f"optimizer.state.{field}.{key}", index)
    if "exp_avg" in fields:  # torch.optim.Adam keeps the step per parameter
        lacking = sorted({group_of[n] for n in params} - set(steps))
        if lacking:
            raise CheckpointError(f"{directory} has Adam's moments but no step counter for "
                                  f"parameter group {lacking[0]} (none in its param_groups, no "
                                  "optimizer.state.common_step); convert the weights alone with "
                                  "--weights-only")
        for name in params:
            specs[f"optimizer.state.{name}.step"] = ((), torch.float32)
            origin[f"optimizer.state.{name}.step"] = ("", (group_of[name],))
    blobs["optimizer.param_groups"] = mine
    files[MAP_FILE] = json.dumps(group_of, indent=1)
    return steps


def _write_from_megatron_lm(dst: Path, source: DCPSource, specs: dict, origin: dict,
                            step: dict[int, float] | None, blobs: dict, files: dict, backend: str,
                            directory: Path, progress: bool) -> Path:
    """Write ``dst`` (``fsdp_dtensor``), streaming each tensor of ``specs`` from where ``origin``
    says in ``source`` (an empty source key: the optimizer's ``step``), in the checkpoint's
    order."""
    share = owned_keys({k: tensor_nbytes(*v) for k, v in specs.items()})  # all, without torchrun
    report = Progress(f"reading {directory.name}", sum(tensor_nbytes(*specs[k]) for k in share),
                       progress)

    def produce(key: str) -> torch.Tensor:
        source_key, index = origin[key]
        if not source_key:  # the step of the parameter's group
            return torch.tensor(step[index[0]], dtype=torch.float32)
        # one layer (one expert) of a stacked tensor: read from its own chunks
        t = source.get(source_key, index).float()
        report(tensor_nbytes(*specs[key]))
        return t

    order = sorted(specs, key=lambda k: origin[k])  # the checkpoint's order
    specs = {k: specs[k] for k in order}
    return write_streaming(dst, specs, produce, blobs, "fsdp_dtensor",
                           {"source": FORMAT, "backend": backend}, files)




def _check_tensor_parallel_split(cfg, tp: int) -> None:
    """Refuse a tensor-parallel size the model cannot be split by, naming what does not divide:
    the model's TP rules (:func:`mfsdp.models.tensor_parallel.check_tensor_parallel`), and the
    shared expert, which Megatron-LM splits too."""
    from mfsdp.models.tensor_parallel import check_tensor_parallel

    if tp < 1:
        raise CheckpointError(f"--tensor-model-parallel-size {tp}: must be at least 1")
    problems = []
    try:
        check_tensor_parallel(cfg, tp)
    except ValueError as exc:
        problems.append(str(exc))
    shared = getattr(cfg, "moe_shared_expert_intermediate_size", None)
    if shared and shared % tp:
        problems.append(f"moe_shared_expert_intermediate_size={shared} is not divisible by {tp} "
                        "(Megatron-LM splits the shared expert)")
    if problems:
        raise CheckpointError(f"a job at --tensor-model-parallel-size {tp} cannot split this "
                              f"model: {'; '.join(problems)}")


def _export_plan(src: Path, source, model, cfg, transformer_impl: str, weights_only: bool,
                 ddp: bool = False):
    """What each output tensor of a ``torch_dist`` export is made of: the stacked (per layer or
    expert) and whole weights by megatron-core key, the optimizer's groups and state fields (none
    with ``weights_only``), ``origin`` (key -> (field or None for the weights, mfsdp names)) and
    every key's shape."""
    ref = model.state_dict()
    params = {n for n, _ in model.named_parameters()}
    per_layer = bool(cfg.num_experts)  # as Megatron-LM builds MoE models (one spec per layer)
    indexed: dict[str, dict[int, str]] = {}
    whole: dict[str, str] = {}
    for name in ref:
        if f"model.{name}" not in source.tensors:
            raise CheckpointError(f"{src} has no weight {name!r} of the model config")
        key, index = target_key(name, per_layer, cfg.multi_latent_attention, transformer_impl)
        if index is None:
            whole[key] = name
        else:
            indexed.setdefault(key, {})[index] = name
    stacks = {k: [v[i] for i in range(len(v))] for k, v in indexed.items()}
    groups = (source.blob("optimizer.param_groups")
              if "optimizer.param_groups" in source.blob_keys and not weights_only else None)
    fields: list[str] = []
    if groups is not None:
        first = next(iter(ref))
        fields = sorted(k.rpartition(".")[2] for k in source.tensors
                        if k.startswith(f"optimizer.state.{first}.")
                        and source.tensors[k][0] == tuple(ref[first].shape))
    distributed = "exp_avg" in fields and not ddp
    if groups is not None and not fields:
        raise CheckpointError(f"{src}: optimizer state of {sorted(source.tensors)[0]!r}... is "
                              "neither Adam's nor SGD's; write the weights alone with "
                              "--weights-only")
    # what each output tensor is made of: (field or None for the weights, mfsdp names)
    origin: dict[str, tuple[str | None, list[str] | str]] = {}
    for key, names in {**stacks, **whole}.items():
        origin[key] = (None, names)
        if (names if isinstance(names, str) else names[0]) not in params:
            continue  # a buffer (the router's expert bias): no optimizer state
        if distributed:
            origin[f"optimizer.state.param.{key}"] = (None, names)
        for field in fields:
            origin[f"optimizer.state.{field}.{key}"] = (field, names)
    shapes = {k: (tuple(ref[n].shape) if isinstance(n, str) else
                  (len(n), *ref[n[0]].shape)) for k, (_, n) in origin.items()}
    return stacks, whole, groups, fields, origin, shapes


def _linear_extra_states(state: dict, weights: dict) -> None:
    """Add each linear's (empty) TransformerEngine extra state, as megatron-core writes it."""
    for key, names in weights.items():
        module = key.rpartition(".")[0]
        if key.endswith(".weight") and module.rpartition(".")[2].startswith("linear_"):
            n = 1 if isinstance(names, str) else len(names)
            for i in range(n):
                state[f"{module}._extra_state/shard_{i}_{n}"] = [None]


def _export_common(source, extra: dict, groups, fields: list[str], model, cfg, iteration: int,
                   expert_model_parallel_size: int, tensor_model_parallel_size: int,
                   ddp: bool = False) -> dict:
    """The common state of a ``torch_dist`` export: version, iteration, the optimizer's groups
    (as megatron-core's distributed or plain optimizer holds them, chained per expert parallelism
    above 1), the schedule, ``args`` and the content metadata."""
    distributed = "exp_avg" in fields and not ddp
    first = next(iter(model.state_dict()))
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    common: dict[str, object] = {"checkpoint_version": 3.0, "iteration": iteration,
                                 "num_floating_point_operations_so_far": 0}
    scheduler = extra.get("opt_param_scheduler")
    if groups is not None:
        step = None
        if f"optimizer.state.{first}.step" in source.tensors:
            step = float(source.get(f"optimizer.state.{first}.step"))
        megatron_groups = []
        for g, group in enumerate(groups):
            out = {k: v for k, v in group.items() if k not in ("params", "initial_lr")}
            out.update(wd_mult=1.0 if g == 0 else 0.0, lr_mult=1.0, is_expert_parallel=False,
                       is_decoupled_lr=False, default_config=True,
                       max_lr=(scheduler or {}).get("max_lr", group["lr"]),
                       min_lr=(scheduler or {}).get("min_lr", group["lr"]))
            if step is not None and distributed:  # megatron-core's distributed optimizer
                out["step"] = step
            megatron_groups.append(out)
        if distributed:
            metadata.update(distrib_optim_sharding_type="fully_reshardable",
                            distrib_optim_fully_reshardable_mem_efficient=False)

        def part(found):
            if distributed:
                return {"optimizer": {"param_groups": found},
                        "param_state_sharding_type": "fully_reshardable"}
            if step is not None:  # torch's Adam under megatron-core's plain optimizer
                return {"state": {"common_step": torch.tensor(step)}, "param_groups": found}
            return {"param_groups": found}

        if expert_model_parallel_size > 1 and cfg.num_experts:
            # megatron-core chains an optimizer for the routed experts: its groups are those
            # of the experts' parameters, marked expert-parallel
            in_group = [{0 if is_decayed(n, p) else 1 for n, p in model.named_parameters()
                         if (".mlp.experts." in n) == experts} for experts in (False, True)]
            common["optimizer"] = {
                0: part([g for i, g in enumerate(megatron_groups) if i in in_group[0]]),
                1: part([dict(g, is_expert_parallel=True) for i, g in enumerate(megatron_groups)
                         if i in in_group[1]])}
        else:
            common["optimizer"] = part(megatron_groups)
        if scheduler:
            common["opt_param_scheduler"] = scheduler_in_samples(scheduler, extra)
    kind = "adam" if "exp_avg" in fields else "sgd"
    common["args"] = megatron_args(cfg, None if groups is None else kind,
                                   distributed, iteration, tensor_model_parallel_size)
    common["args"].expert_model_parallel_size = expert_model_parallel_size
    carry_into_args(common["args"], extra)
    common["content_metadata"] = metadata
    return common


def fsdp_to_megatron_lm(src: str | Path, dst: str | Path, model_config: dict | None = None,
                        weights_only: bool = False, progress: bool = True,
                        transformer_impl: str = "transformer_engine",
                        expert_model_parallel_size: int = 1, verify: bool = True,
                        tensor_model_parallel_size: int = 1,
                        distributed_optimizer: bool | None = None) -> Path:
    """mfsdp ``fsdp_dtensor`` -> a Megatron-LM ``torch_dist`` checkpoint (``dst`` is the root:
    ``latest_checkpointed_iteration.txt`` and ``iter_XXXXXXX/``), streamed: stacked tensors are
    written one chunk per layer (or expert), as megatron-core writes them, so one weight is in
    memory at a time; ``progress`` reports on stderr. Within
    :class:`mfsdp.checkpoint.dcp.spread_over_ranks` every rank calls it and writes its share
    of the tensors.

    Weights are stacked per layer with megatron-core's key names; optimizer state is written in
    model space: Adam's (``param``, ``exp_avg``, ``exp_avg_sq``) as the distributed optimizer's
    ``fully_reshardable`` layout, SGD's ``momentum_buffer`` as Megatron-LM's non-distributed
    optimizer (megatron-core's distributed optimizer takes Adam only). Load it in Megatron-LM with
    ``--ckpt-format torch_dist`` and, for Adam, ``--use-distributed-optimizer``. ``common_state``
    carries ``args`` (the architecture, ``no_save_rng``), the iteration, the param groups with
    ``step`` and the learning-rate schedule when the checkpoint has one (``mfsdp train`` writes
    it). ``model_config``: for checkpoints without ``model_config.json``.

    ``transformer_impl`` names the loading job's layer spec where the names differ, which is for
    multi-latent attention only (``local``: every norm by its own name; ``transformer_engine``:
    the latents' norms as ``linear_q_up_proj.layer_norm_weight`` and
    ``linear_kv_up_proj.layer_norm_weight``, the dense MLP's fused into ``linear_fc1``).
    ``expert_model_parallel_size``: the loading job's; above 1 the optimizer's groups are
    written as megatron-core's chained optimizer holds them (the routed experts' own optimizer
    after the dense one), the tensors as they are at any expert parallelism.
    ``tensor_model_parallel_size``: the loading job's, written into ``args`` (which
    ``--use-checkpoint-args`` reads); the tensors are global at any TP size (megatron-core's
    sharded state dict places each rank's piece), so only the model must split: heads, query
    groups, the FFN and the vocabulary divisible by it, else a ``CheckpointError`` names which.
    ``verify``: check ``src``'s files against their SHA-256 sums first.
    ``distributed_optimizer``: the loading job's ``--use-distributed-optimizer`` (``None``: as
    the job the checkpoint came from, else on); off, Adam's state is megatron-core's plain
    optimizer's (no main weights, the step once as ``optimizer.state.common_step``).
    """
    from mfsdp.models.gpt import GPT

    src, dst = fsdp_source(src, dst)
    cfg = fsdp_model_config(src, model_config, transformer_impl)
    _check_tensor_parallel_split(cfg, tensor_model_parallel_size)
    with torch.device("meta"):
        model = GPT(cfg)
    source = DCPSource(src, verify=verify)
    extra = source.blob("extra") if "extra" in source.blob_keys else {}
    iteration = int(extra.get("iteration", 0))
    ddp = not (distributed_optimizer if distributed_optimizer is not None else
               (extra.get("megatron_lm_args") or {}).get("use_distributed_optimizer", True))
    stacks, whole, groups, fields, origin, shapes = _export_plan(
        src, source, model, cfg, transformer_impl, weights_only, ddp)
    share = owned_keys({k: tensor_nbytes(s, torch.float32) for k, s in shapes.items()})
    report = Progress(f"writing {dst.name}",
                       sum(tensor_nbytes(shapes[k], torch.float32) for k in share), progress)

    def read(field, name):
        t = source.get(f"optimizer.state.{name}.{field}" if field else f"model.{name}").float()
        report(tensor_nbytes(tuple(t.shape), torch.float32))
        return t

    def produce(key: str, i: int | None = None) -> torch.Tensor:
        field, names = origin[key]
        return read(field, names if isinstance(names, str) else names[i])

    rank = ranks()[0]
    state: dict[str, object] = {k: torch.empty(s, dtype=torch.float32, device="meta")
                                for k, s in shapes.items() if k in share}
    if rank == 0:
        _linear_extra_states(state, {**stacks, **whole})
    common = _export_common(source, extra, groups, fields, model, cfg, iteration,
                            expert_model_parallel_size, tensor_model_parallel_size, ddp)
    # as megatron-core stores a ShardedObject: torch.save of [object], not flattened into keys
    state[COMMON] = [common]
    if rank != 0:
        state.pop(COMMON)
    write_iteration(dst, iteration, state, produce,
                    split={k for k, (_, n) in origin.items() if not isinstance(n, str)},
                    metadata_json={"sharded_backend": "torch_dist", "sharded_backend_version": 1})
    return dst


def load_megatron_lm(path: str | Path, model, optimizer=None) -> dict:
    """Load a Megatron-LM ``torch_dist`` checkpoint into a sharded mfsdp GPT (and its optimizer):
    a collective call. Rank 0 converts it next to ``path`` with the model's own config (weights
    only when ``optimizer`` is None), every rank loads the result with
    :func:`mfsdp.checkpoint.load_checkpoint`, rank 0 removes it. Returns the ``extra`` dict
    (``iteration``, ``opt_param_scheduler``)."""

    config = getattr(getattr(model, "module", model), "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise CheckpointError(f"{path} is a Megatron-LM checkpoint, read into mfsdp's GPT: the "
                              "model has no GPTConfig (model.module.config); convert it with "
                              "mfsdp convert --from megatron_lm --model-config FILE instead")
    return load_converted(path, model, optimizer, lambda tmp: megatron_lm_to_fsdp(
        path, tmp, config.to_dict(), weights_only=optimizer is None), "a Megatron-LM checkpoint")
