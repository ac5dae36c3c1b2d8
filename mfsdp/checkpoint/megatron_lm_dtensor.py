"""Megatron-LM's ``--ckpt-format fsdp_dtensor`` checkpoints (Megatron-LM with ``--use-megatron-fsdp``): read, written.

What Megatron-LM's ``save_checkpoint`` writes for ``fsdp_dtensor``: the tracker and iteration
directories of ``torch_dist``, but each iteration is a plain ``torch.distributed.checkpoint`` of
Megatron-LM's state dictionary (no ``metadata.json``), flattened by DCP into dotted keys::

    CKPT/latest_checkpointed_iteration.txt
    CKPT/iter_0000002/.metadata, __0_0.distcp, __1_0.distcp, ...
        model.module.decoder.layers.0.self_attention.linear_qkv.weight      per layer, fp32
        model.module.decoder.layers.0.mlp.linear_fc1.weight_w / weight_v     SwiGLU's two halves
        model.module.decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight_w
                                                                     experts by global index
        optimizer.state.module.module.module.<name>.exp_avg / exp_avg_sq / step
        optimizer.param_to_group_meta.module.module.module.<name>.lr / wd_mult / betas / ...
        opt_param_scheduler.<field>, iteration, checkpoint_version, args, rng_state, ...

The model tensors are Megatron-FSDP's DTensors, saved unevenly sharded (each rank its slice of
the flat buffer) as full-shape tensors, so they read as plain tensors here; they are the fp32
main weights even for a ``--bf16`` job. The optimizer state is keyed by the parameter's name in
the wrapped model, so the number of ``module.`` prefixes is the job's wrapping (two without
``--bf16``/``--fp16``, three with its ``Float16Module``). SwiGLU ``linear_fc1`` weights (and
their Adam moments) are split by megatron-core's ``handle_swiglu_in_state_dict`` into ``_w``
(the gate, first half) and ``_v``; expert indices are global (``handle_experts_in_state_dict``);
GroupedMLP experts are ``mlp.experts.linear_fc1.weight<i>``. Norm names are the spec's: the
local spec's ``input_layernorm.weight``, Transformer Engine's fused
``linear_qkv.layer_norm_weight``. ``*._extra_state`` (Transformer Engine's FP8 metadata) is
dropped.

Checked against checkpoints megatron-core 0.19.2's Megatron-FSDP wrote on two ranks
(``tests/fixtures/megatron_lm/make_fsdp_dtensor.py``): every weight and Adam moment equal, one
more iteration from an imported checkpoint gives megatron-core's next weights, and the export of
an import holds the keys, tensors and objects megatron-core wrote.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from mfsdp.checkpoint.dcp import (MAP_FILE, MODEL_CONFIG_FILE, DCPSource, Progress, owned_keys, ranks,
                                  tensor_nbytes, write_streaming)
from mfsdp.checkpoint.detect import MODULE_PREFIX, is_fsdp_dtensor_keys
from mfsdp.checkpoint.full import fsdp_source
from mfsdp.checkpoint.manifest import CheckpointError
from mfsdp.checkpoint.megatron_common import (SAFE_TYPES, add_carried, fsdp_model_config,
                                              is_decayed, megatron_args, mfsdp_groups, mfsdp_name,
                                              not_carried, source_key, write_iteration)
from mfsdp.checkpoint.megatron_schedule import (carry_into_args, scheduler_in_iterations,
                                                scheduler_in_samples)

__all__ = ["FORMAT", "fsdp_to_megatron_lm_dtensor", "is_fsdp_dtensor_keys",
           "megatron_lm_dtensor_to_fsdp", "megatron_key", "split_key"]

FORMAT = "megatron_lm_fsdp_dtensor"
_HALF = re.compile(r"^(.*\.(?:weight|bias)\d*)_([wv])$")
_GROUPED = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts)\.(linear_fc[12])\.(weight|bias)(\d+)$")
_PARTS = ("w", "v")  # SwiGLU: act(x @ w.T) * (x @ v.T), w first in the fused weight
_STEP = "step"



def split_key(key: str) -> tuple[str, str | None]:
    """mfsdp's parameter name for one Megatron-LM ``fsdp_dtensor`` tensor key (without its
    ``model.`` / ``optimizer.state.`` head: wrapper prefixes, SwiGLU halves and GroupedMLP
    experts resolved) and which SwiGLU half it is (``"w"``, ``"v"`` or ``None``).

    >>> split_key("module.decoder.layers.1.mlp.linear_fc1.weight_v")
    ('layers.1.mlp.linear_fc1.weight', 'v')
    >>> split_key("module.module.module.decoder.layers.1.mlp.experts.linear_fc2.weight3")
    ('layers.1.mlp.experts.local_experts.3.linear_fc2.weight', None)
    >>> split_key("module.decoder.layers.0.self_attention.linear_qkv.layer_norm_weight")
    ('layers.0.input_layernorm.weight', None)
    """

    name = MODULE_PREFIX.sub("", key)
    part = None
    m = _HALF.match(name)
    if m:
        name, part = m.group(1), m.group(2)
    m = _GROUPED.match(name)
    if m:
        name = f"{m.group(1)}.local_experts.{m.group(4)}.{m.group(2)}.{m.group(3)}"
    name = mfsdp_name(name).replace("mlp.shared_experts.", "mlp.shared_expert.", 1)
    return name, part


def _collect(keys, head: str) -> dict[str, dict[str | None, str]]:
    """``{mfsdp name: {half: key}}`` for the keys under ``head``."""
    out: dict[str, dict[str | None, str]] = {}
    for key in keys:
        if key.startswith(head) and not key.endswith("_extra_state"):
            name, part = split_key(key[len(head):])
            out.setdefault(name, {})[part] = key
    return out


def _ordered(parts: dict[str | None, str], name: str, where: Path) -> list[str]:
    if None in parts and len(parts) == 1:
        return [parts[None]]
    if set(parts) == set(_PARTS):
        return [parts[p] for p in _PARTS]
    raise CheckpointError(f"{where}: {name} is stored as {sorted(parts.values())}; expected "
                          "either one tensor or SwiGLU's two halves (_w and _v)")


def megatron_lm_dtensor_to_fsdp(directory: str | Path, dst: str | Path, model_config: dict,
                                iteration: int | None = None, weights_only: bool = False,
                                progress: bool = True) -> Path:
    """One Megatron-LM ``fsdp_dtensor`` iteration directory -> mfsdp ``fsdp_dtensor``, streamed
    (one weight in memory at a time; ``progress`` reports on stderr). Called by
    :func:`mfsdp.checkpoint.megatron_lm.megatron_lm_to_fsdp`, which finds the directory.

    ``model_config`` is the :class:`~mfsdp.models.gpt.GPTConfig` the job trained (Megatron-LM
    keeps its arguments in a pickled ``argparse.Namespace``). Every weight and buffer of that
    model must be in the checkpoint with its shape, and every model tensor of the checkpoint
    must be used. SwiGLU halves are joined (``[w; v]``, mfsdp's fused ``linear_fc1``).

    The optimizer state comes along unless ``weights_only``: Adam's moments (or SGD's
    momentum) and ``step`` by parameter, the two parameter groups (weight decay and none, told
    apart by each parameter's ``wd_mult`` in ``optimizer.param_to_group_meta``), the
    learning-rate schedule (``extra["opt_param_scheduler"]``) and the iteration.
    """
    from mfsdp.models.gpt import GPT, GPTConfig

    directory = Path(directory)
    cfg = GPTConfig.from_dict(model_config)
    with torch.device("meta"):
        model = GPT(cfg)
    ref = model.state_dict()
    params = {n for n, _ in model.named_parameters()}
    source = DCPSource(directory)
    keys = set(source.tensors)
    plan = _dtensor_plan(directory, source, ref)
    blobs_present = set(source.blob_keys)

    def value(key: str, default=None):
        return source.object(key, SAFE_TYPES) if key in blobs_present else default

    if iteration is None:
        iteration = int(value("iteration", 0) or 0)
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    origin: dict[str, list[str]] = {}
    for name in plan:
        specs[f"model.{name}"] = (tuple(ref[name].shape), torch.float32)
        origin[f"model.{name}"] = plan[name]
    extra: dict[str, object] = {"iteration": iteration, "data_position": iteration,
                                "source": FORMAT}
    scheduler = {k[len("opt_param_scheduler."):]: value(k) for k in sorted(blobs_present)
                 if k.startswith("opt_param_scheduler.")}
    if scheduler:
        extra["opt_param_scheduler"] = scheduler_in_iterations(scheduler, value("args"), extra)
    add_carried(extra, value("args"), value("num_floating_point_operations_so_far"),
                _left_behind(blobs_present | keys, weights_only))
    files = {MODEL_CONFIG_FILE: json.dumps(cfg.to_dict(), indent=1)}
    blobs: dict[str, object] = {}
    by_field: dict[str, dict[str, dict[str | None, str]]] = {}  # field -> param -> half -> key
    for key in keys:
        if key.startswith("optimizer.state."):
            param_key, _, field = key[len("optimizer.state."):].rpartition(".")
            param, part = split_key(param_key)
            by_field.setdefault(field, {}).setdefault(param, {})[part] = key
    if not weights_only and by_field:
        _dtensor_optimizer_state(directory, by_field, params, ref, specs, origin)
        groups, group_of = _dtensor_param_groups(directory, value, blobs_present, model)
        blobs["optimizer.param_groups"] = groups
        files[MAP_FILE] = json.dumps(group_of, indent=1)
    blobs["extra"] = extra
    share = owned_keys({k: tensor_nbytes(*v) for k, v in specs.items()})
    report = Progress(f"reading {directory.name}", sum(tensor_nbytes(*specs[k]) for k in share),
                       progress)

    def produce(key: str) -> torch.Tensor:
        parts = [source.get(k).float() for k in origin[key]]
        t = parts[0] if len(parts) == 1 else torch.cat(parts)
        report(tensor_nbytes(*specs[key]))
        return t

    order = sorted(specs, key=lambda k: origin[k])
    specs = {k: specs[k] for k in order}
    return write_streaming(dst, specs, produce, blobs, "fsdp_dtensor",
                           {"source": FORMAT, "backend": "fsdp_dtensor"}, files)


def _left_behind(entries: set[str], weights_only: bool) -> list[str]:
    """What a conversion of the checkpoint whose DCP keys are ``entries`` does not carry (DCP
    flattened Megatron-LM's state into dotted keys: their first names are its entries)."""
    tops = {k.split(".")[0]: None for k in entries
            if "._extra_state" not in k and not k.startswith(("model.", "optimizer."))}
    tops.update({"optimizer": None} if any(k.startswith("optimizer.") for k in entries) else {})
    return not_carried(tops, [k for k in entries if "._extra_state" in k], weights_only)


def _dtensor_plan(directory: Path, source: DCPSource, ref: dict) -> dict[str, list[str]]:
    """Each weight of the model's state dict ``ref`` -> the Megatron-LM ``fsdp_dtensor`` keys
    it is read from (two for SwiGLU halves, in order); a ``CheckpointError`` names a tensor
    missing, of the wrong shape or left over."""
    keys = set(source.tensors)
    weights = _collect(keys, "model.")
    plan: dict[str, list[str]] = {}
    for name, t in ref.items():
        if name not in weights:
            raise CheckpointError(f"{directory} has no tensor for {name} (model.module.*); is the "
                                  "model config the one it was trained with?")
        plan[name] = _ordered(weights[name], name, directory)
        shapes = [source.tensors[k][0] for k in plan[name]]
        got = (tuple(shapes[0]) if len(shapes) == 1
               else (sum(s[0] for s in shapes), *shapes[0][1:]))
        if got != tuple(t.shape):
            raise CheckpointError(f"{plan[name][0]} gives {name} the shape {got}; the model "
                                  f"config implies {tuple(t.shape)}")
    unused = sorted(set(weights) - set(plan))
    if unused:
        raise CheckpointError(f"{directory} holds model tensors this config does not have, e.g. "
                              f"{sorted(weights[unused[0]].values())[0]!r}")
    return plan


def _dtensor_optimizer_state(directory: Path, by_field: dict, params: set[str], ref: dict,
                             specs: dict, origin: dict) -> None:
    """Add the optimizer state ``by_field`` (field -> parameter -> half -> key) to ``specs`` and
    ``origin`` by parameter name; a ``CheckpointError`` names state for a parameter the model
    lacks or a parameter without it."""
    strange = sorted(set().union(*(set(v) for v in by_field.values())) - params)
    if strange:
        raise CheckpointError(f"{directory} has optimizer state for {strange[0]!r}, which the "
                              "model config does not have")
    for field, have in sorted(by_field.items()):
        missing = sorted(params - set(have))
        if missing:
            raise CheckpointError(f"{directory} has optimizer state {field!r} for some "
                                  f"weights but not for {missing[0]}")
        for param in sorted(params):
            out = f"optimizer.state.{param}.{field}"
            if field == _STEP:  # one scalar per parameter (both halves hold the same)
                specs[out] = ((), torch.float32)
                origin[out] = _ordered(have[param], param, directory)[:1]
            else:
                specs[out] = (tuple(ref[param].shape), torch.float32)
                origin[out] = _ordered(have[param], param, directory)


def _dtensor_param_groups(directory: Path, value, blobs_present: set[str],
                          model) -> tuple[list[dict], dict[str, int]]:
    """mfsdp's param groups and parameter -> group map from the checkpoint's
    ``optimizer.param_to_group_meta`` (read with ``value``); a ``CheckpointError`` names a
    parameter without a meta or whose ``wd_mult`` disagrees with mfsdp's weight decay."""
    params = {n for n, _ in model.named_parameters()}
    metas: dict[str, dict[str, object]] = {}
    head = "optimizer.param_to_group_meta."
    for key in blobs_present:
        if key.startswith(head):
            param_key, _, hyper = key[len(head):].rpartition(".")
            name, _ = split_key(param_key)
            metas.setdefault(name, {})[hyper] = value(key)
    if set(metas) != params:
        gap = sorted(params ^ set(metas))
        raise CheckpointError(f"{directory}: optimizer.param_to_group_meta does not match the "
                              f"model's parameters (e.g. {gap[0]})")
    distinct: list[dict[str, object]] = []
    for meta in metas.values():
        if meta not in distinct:
            distinct.append(meta)
    groups = mfsdp_groups(distinct, directory)
    group_of = {}
    for n, p in model.named_parameters():
        group_of[n] = 0 if is_decayed(n, p) else 1
        decays = metas[n].get("wd_mult", 1.0) != 0.0
        if decays != (group_of[n] == 0):
            raise CheckpointError(f"{directory}: {n} has wd_mult {metas[n].get('wd_mult')}; "
                                  "mfsdp decays exactly the weights of two or more dimensions "
                                  "that are not biases")
    return groups, group_of


_LOCAL_NORMS = {"self_attention.linear_qkv.layer_norm": "input_layernorm",
                "mlp.linear_fc1.layer_norm": "pre_mlp_layernorm"}
_SWIGLU_NAME = re.compile(r"(^|\.)linear_fc1\.(weight|bias)$")
# torch.optim.AdamW's group flags, which megatron-core's groups carry and mfsdp's import drops
_ADAMW_FLAGS = {"foreach": None, "capturable": False, "differentiable": False, "fused": None,
                "decoupled_weight_decay": True}
PRECISIONS = {"bf16": "module.module.module.", "fp16": "module.module.module.",
              "fp32": "module.module."}


def megatron_key(name: str, transformer_impl: str = "transformer_engine") -> str:
    """The Megatron-LM name of mfsdp parameter ``name`` (without wrapper prefixes), per layer, as
    the job's layer spec names it: ``transformer_engine`` (Megatron-LM's default) fuses the
    pre-attention and pre-MLP norms into ``linear_qkv`` and ``linear_fc1``, ``local`` keeps them.

    >>> megatron_key("layers.0.input_layernorm.weight")
    'decoder.layers.0.self_attention.linear_qkv.layer_norm_weight'
    >>> megatron_key("layers.0.input_layernorm.weight", "local")
    'decoder.layers.0.input_layernorm.weight'
    >>> megatron_key("embedding.weight")
    'embedding.word_embeddings.weight'
    """

    if name.startswith("layers."):
        _, i, rest = name.split(".", 2)
        rest = rest.replace("mlp.shared_expert.", "mlp.shared_experts.", 1)
        key = f"decoder.layers.{i}.{rest}"
        if transformer_impl == "transformer_engine":
            for fused, local in _LOCAL_NORMS.items():
                for field in ("weight", "bias"):
                    if rest == f"{local}.{field}":
                        key = f"decoder.layers.{i}.{fused}_{field}"
        return key
    return source_key(name, ())[0]


def fsdp_to_megatron_lm_dtensor(src: str | Path, dst: str | Path, model_config: dict | None = None,
                                weights_only: bool = False, precision: str = "fp32",
                                transformer_impl: str = "transformer_engine",
                                progress: bool = True) -> Path:
    """mfsdp ``fsdp_dtensor`` -> a Megatron-LM ``--ckpt-format fsdp_dtensor`` checkpoint
    (``dst`` is the root: ``latest_checkpointed_iteration.txt`` and ``iter_XXXXXXX/``), streamed
    (one weight in memory at a time; ``progress`` reports on stderr).

    Megatron-LM loads it by the names of its live, wrapped model, so the names follow the job
    that will read it: ``precision`` (``bf16``/``fp16`` wrap the model in ``Float16Module``, one
    more ``module.`` before the optimizer's keys than ``fp32``) and ``transformer_impl`` (the
    layer spec: Transformer Engine's fused norm names or the local ones). SwiGLU ``linear_fc1``
    weights are split into ``_w``/``_v`` as megatron-core's ``handle_swiglu_in_state_dict`` does.
    The optimizer state (Adam) is written by parameter name with its ``step``, and each
    parameter's group as ``optimizer.param_to_group_meta`` (``wd_mult`` 0 for the group without
    weight decay; ``max_lr``/``min_lr`` from the schedule); ``args``, ``iteration``,
    ``checkpoint_version`` and ``opt_param_scheduler`` as Megatron-LM's ``save_checkpoint``
    stores them. Load it in Megatron-LM with ``--use-megatron-fsdp --ckpt-format fsdp_dtensor``.
    The same checkpoint serves any expert parallelism: expert keys carry global indices and
    Megatron-FSDP's one optimizer marks no group expert-parallel, at EP 1 as at EP 2.
    """
    from mfsdp.models.gpt import GPT

    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: choose one of {sorted(PRECISIONS)}")
    src, dst = fsdp_source(src, dst)
    cfg = fsdp_model_config(src, model_config, transformer_impl)
    with torch.device("meta"):
        model = GPT(cfg)
    ref = model.state_dict()
    source = DCPSource(src)
    extra = source.blob("extra") if "extra" in source.blob_keys else {}
    iteration = int(extra.get("iteration", 0))
    groups = (source.blob("optimizer.param_groups")
              if "optimizer.param_groups" in source.blob_keys and not weights_only else None)
    # output key -> (mfsdp source key, half: None, 0 or 1)
    origin: dict[str, tuple[str, int | None]] = {}
    shapes: dict[str, tuple[int, ...]] = {}

    params = {n for n, _ in model.named_parameters()}
    prefix = PRECISIONS[precision]
    fields = [] if groups is None else _adam_fields(src, source, ref, params)
    for name, t in ref.items():
        if f"model.{name}" not in source.tensors:
            raise CheckpointError(f"{src} has no weight {name!r} of the model config")
        mkey = megatron_key(name, transformer_impl)
        half = cfg.swiglu and _SWIGLU_NAME.search(mkey) is not None
        targets = [(f"{mkey}_{p}", i) for i, p in enumerate(_PARTS)] if half else [(mkey, None)]
        for out, i in targets:
            shape = tuple(t.shape) if i is None else (t.shape[0] // 2, *t.shape[1:])
            origin[f"model.module.{out}"] = (f"model.{name}", i)
            shapes[f"model.module.{out}"] = shape
            if groups is None or name not in params:
                continue
            for field in fields:
                key = f"optimizer.state.{name}.{field}"
                okey = f"optimizer.state.{prefix}{out}.{field}"
                origin[okey] = (key, None if field == _STEP else i)
                shapes[okey] = () if field == _STEP else shape
    share = owned_keys({k: tensor_nbytes(s, torch.float32) for k, s in shapes.items()})
    report = Progress(f"writing {dst.name}",
                       sum(tensor_nbytes(shapes[k], torch.float32) for k in share), progress)

    def produce(key: str) -> torch.Tensor:
        name, half = origin[key]
        t = source.get(name).float()
        if half is not None:
            t = t.chunk(2)[half].clone()
        report(tensor_nbytes(tuple(t.shape), torch.float32))
        return t

    rank, world = ranks()
    state: dict[str, object] = {k: torch.empty(s, dtype=torch.float32, device="meta")
                                for k, s in shapes.items() if k in share}
    if rank == 0:
        _megatron_fsdp_common_state(state, cfg, model, groups, extra, iteration, precision,
                                    transformer_impl)
    write_iteration(dst, iteration, state, produce)
    return dst


def _adam_fields(src: Path, source: DCPSource, ref: dict, params: set[str]) -> list[str]:
    """The optimizer state fields of the mfsdp checkpoint ``source`` (those of its first
    parameter); a ``CheckpointError`` refuses any but Adam's, which Megatron-FSDP requires."""
    first = next(n for n in ref if n in params)
    fields = sorted(k[len(f"optimizer.state.{first}."):] for k in source.tensors
                    if k.startswith(f"optimizer.state.{first}."))
    if "exp_avg" not in fields:
        raise CheckpointError(f"{src}: its optimizer state ({fields}) is not Adam's; "
                              "Megatron-FSDP's distributed optimizer is Adam only: write the "
                              "weights alone with --weights-only")
    return fields


def _megatron_fsdp_common_state(state: dict, cfg, model, groups: list[dict] | None, extra: dict,
                                iteration: int, precision: str, transformer_impl: str) -> None:
    """Add what rank 0 of Megatron-LM's ``save_checkpoint`` stores besides the tensors to
    ``state``: ``iteration``, ``checkpoint_version``, ``args``, ``opt_param_scheduler`` and,
    with the optimizer's ``groups``, each parameter's ``optimizer.param_to_group_meta``."""
    prefix = PRECISIONS[precision]
    scheduler = scheduler_in_samples(extra.get("opt_param_scheduler") or {}, extra)
    state.update({"iteration": iteration, "checkpoint_version": 3.0,
                  "num_floating_point_operations_so_far": 0})
    args = megatron_args(cfg, None if groups is None else "adam", groups is not None, iteration)
    args.ckpt_format, args.use_megatron_fsdp = "fsdp_dtensor", True
    args.bf16, args.fp16 = precision == "bf16", precision == "fp16"
    args.transformer_impl = transformer_impl
    carry_into_args(args, extra)
    state["args"] = args
    for field, value in scheduler.items():
        state[f"opt_param_scheduler.{field}"] = value
    if groups is not None:
        for name, p in model.named_parameters():
            g = groups[0 if is_decayed(name, p) else 1]
            meta = dict(_ADAMW_FLAGS)
            meta.update({k: v for k, v in g.items() if k not in ("params", "initial_lr")})
            meta.update(is_expert_parallel=False, default_config=True,
                        wd_mult=1.0 if is_decayed(name, p) else 0.0, lr_mult=1.0,
                        is_decoupled_lr=False, max_lr=scheduler.get("max_lr", g["lr"]),
                        min_lr=scheduler.get("min_lr", g["lr"]))
            mkey = megatron_key(name, transformer_impl)
            halves = ([f"{mkey}_{p}" for p in _PARTS]
                      if cfg.swiglu and _SWIGLU_NAME.search(mkey) else [mkey])
            for out in halves:
                for hyper, value in meta.items():
                    state[f"optimizer.param_to_group_meta.{prefix}{out}.{hyper}"] = value
