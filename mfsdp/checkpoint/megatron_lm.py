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
(``optimizer.distributed.*``), which only a Megatron-LM job with the same data-parallel layout
reads: that is refused with the fix. The non-tensor state (``args``, ``iteration``, the
optimizer's ``param_groups`` with ``step``, ``opt_param_scheduler``, the content metadata naming
the optimizer layout) is one ``torch.save`` object, ``common_state``, inside the DCP files.

Checked against checkpoints megatron-core 0.19.2 wrote (``tests/fixtures/megatron_lm``): every
weight and optimizer tensor equal, the imported model gives megatron-core's logits, one more
iteration from an imported checkpoint gives megatron-core's next weights (Adam and SGD), and the
export of an import is the checkpoint it came from.
"""

from __future__ import annotations

import argparse
import json
import re
import types
from pathlib import Path

import torch

from mfsdp.checkpoint.io import CheckpointError

__all__ = ["FORMAT", "fsdp_to_megatron_lm", "is_megatron_lm", "load_megatron_lm",
           "megatron_lm_to_fsdp", "mfsdp_name", "read_common_state", "resolve_megatron_lm",
           "write_iteration"]

FORMAT = "megatron_lm_torch_dist"
TRACKER = "latest_checkpointed_iteration.txt"
_FUSED_NORMS = {"input_layernorm": "self_attention.linear_qkv.layer_norm",
                "pre_mlp_layernorm": "mlp.linear_fc1.layer_norm",
                # multi-latent attention with Transformer Engine: the latents' norms
                "self_attention.q_layernorm": "self_attention.linear_q_up_proj.layer_norm",
                "self_attention.kv_layernorm": "self_attention.linear_kv_up_proj.layer_norm"}
# the fused names of each layer spec megatron-core writes (mfsdp module -> fused in the key):
# every spec fuses the pre-attention and pre-MLP norms of linear_qkv attention (the local spec
# by its sharded_state_dict_keys_map); with multi-latent attention the local spec fuses none
# and Transformer Engine's fuses the latents' norms and the dense MLP's
_WRITTEN_FUSED = {
    (False, "transformer_engine"): ("input_layernorm", "pre_mlp_layernorm"),
    (False, "local"): ("input_layernorm", "pre_mlp_layernorm"),
    (True, "transformer_engine"): ("self_attention.q_layernorm", "self_attention.kv_layernorm",
                                   "pre_mlp_layernorm"),
    (True, "local"): (),
}
COMMON = "common_state/shard_0_1"
# what megatron-core's checkpoint loader allows in common_state besides plain containers
_SAFE = (argparse.Namespace, types.SimpleNamespace)
# optimizer hyperparameters that torch.optim (and Transformer Engine's FusedAdam) read
_HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad", "momentum", "dampening", "nesterov",
          "maximize")
_MAIN_FIELDS = ("param", "fp32_param")  # the distributed optimizer's fp32 main weights


def _is_megatron_lm_dcp(path: Path) -> bool:
    """Whether ``path`` is an iteration directory Megatron-LM wrote as a plain DCP (its
    ``fsdp_dtensor`` or ``torch_dcp`` formats: no ``metadata.json``; Megatron-LM's
    ``checkpoint_version`` and ``iteration`` among the entries)."""
    if not (path / ".metadata").is_file() or (path / "manifest.json").exists():
        return False
    from mfsdp.checkpoint.convert import DCPSource

    return {"checkpoint_version", "iteration"} <= set(DCPSource(path).blob_keys)


def resolve_megatron_lm(path: str | Path) -> tuple[Path, int | None] | None:
    """``(iteration directory, iteration)`` of a Megatron-LM checkpoint (root with the tracker, or
    one ``iter_XXXXXXX``), or None when ``path`` is not one."""
    path = Path(path)
    if (path / TRACKER).is_file():
        text = (path / TRACKER).read_text().strip()
        if text == "release":
            return path / "release", None
        try:
            iteration = int(text)
        except ValueError:
            raise CheckpointError(f"{path / TRACKER} holds {text!r}, not an iteration") from None
        return path / f"iter_{iteration:07d}", iteration
    if ((path / "metadata.json").is_file() and (path / ".metadata").is_file()
            or _is_megatron_lm_dcp(path)):
        name = path.name
        iteration = int(name[5:]) if name.startswith("iter_") and name[5:].isdigit() else None
        return path, iteration
    return None


def is_megatron_lm(path: str | Path) -> bool:
    """Whether ``path`` is a Megatron-LM checkpoint root or iteration directory."""
    return resolve_megatron_lm(path) is not None


def _backend(directory: Path) -> str:
    """The format of a Megatron-LM iteration directory (``torch_dist``'s ``sharded_backend``,
    or ``fsdp_dtensor``), or an error naming what the directory holds instead."""
    try:
        return json.loads((directory / "metadata.json").read_text()).get("sharded_backend", "?")
    except FileNotFoundError:
        pass
    where = f"{directory} holds a Megatron-LM checkpoint"
    if not directory.is_dir():
        raise CheckpointError(f"{where} tracker, but the iteration directory {directory.name} is "
                              "missing") from None
    if (directory / ".metadata").is_file():
        from mfsdp.checkpoint.convert import DCPSource
        from mfsdp.checkpoint.megatron_lm_dtensor import is_fsdp_dtensor_keys

        if is_fsdp_dtensor_keys(DCPSource(directory).tensors):
            return "fsdp_dtensor"
        raise CheckpointError(f"{where} in a format mfsdp does not read: a plain "
                              "torch.distributed.checkpoint without metadata.json or "
                              "Megatron-FSDP's model.module.* keys (Megatron-LM's --ckpt-format "
                              "torch_dcp); save it with --ckpt-format torch_dist, or with "
                              "--use-megatron-fsdp --ckpt-format fsdp_dtensor") from None
    if any(directory.glob("mp_rank_*")):
        raise CheckpointError(f"{where} in Megatron-LM's legacy --ckpt-format torch "
                              "(mp_rank_XX/model_optim_rng.pt), which mfsdp does not read; save "
                              "it with --ckpt-format torch_dist") from None
    raise CheckpointError(f"{where} tracker, but {directory} has no checkpoint files "
                          "(metadata.json and .metadata)") from None


_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


def _source_key(name: str, keys) -> tuple[str, tuple[int, ...]]:
    """The Megatron-LM key holding mfsdp parameter ``name`` and the index into it: ``(layer,)``
    where megatron-core stacked the layers (every layer alike), ``()`` where it wrote one key per
    layer (dense and MoE layers mixed), and the expert's index after it where experts are stacked
    (``mlp.experts.experts.linear_fc1.weight`` of shape ``[experts, ...]``)."""
    if name == "embedding.weight":
        return "embedding.word_embeddings.weight", ()
    if name == "position_embedding.weight":
        return "embedding.position_embeddings.weight", ()
    if name.startswith("final_layernorm."):
        return "decoder." + name, ()
    if name == "output_layer.weight":
        return name, ()
    if name.startswith("layers."):
        _, i, rest = name.split(".", 2)
        module, _, field = rest.rpartition(".")
        expert: tuple[int, ...] = ()
        m = _EXPERT.match(rest)
        if m:
            rest, expert = f"mlp.experts.experts.{m.group(2)}", (int(m.group(1)),)
        rest = rest.replace("mlp.shared_expert.", "mlp.shared_experts.", 1)
        names = [rest]
        if module in _FUSED_NORMS:  # layer_norm_weight / layer_norm_bias first
            names.insert(0, _FUSED_NORMS[module] + "_" + field)
        candidates = []
        for r in names:
            candidates += [(f"decoder.layers.{r}", (int(i), *expert)),
                           (f"decoder.layers.{i}.{r}", expert)]
        for key, index in candidates:
            if key in keys:
                return key, index
        return candidates[-1]
    return name, ()


def read_common_state(directory: str | Path) -> dict:
    """The non-tensor state of one Megatron-LM ``torch_dist`` iteration directory (``args``,
    ``iteration``, the optimizer's ``param_groups``, ``opt_param_scheduler``, ...): the
    ``common_state`` object inside the DCP files, or ``common.pt`` beside them (megatron-core
    before 0.15). Read with ``weights_only=True``."""
    from mfsdp.checkpoint.convert import DCPSource

    directory = Path(directory)
    legacy = directory / "common.pt"
    if legacy.is_file():
        with torch.serialization.safe_globals(list(_SAFE)):
            return torch.load(legacy, map_location="cpu", weights_only=True)
    source = DCPSource(directory)
    if COMMON not in source.blob_keys:
        raise CheckpointError(f"{directory} has neither common.pt nor a {COMMON!r} entry: not a "
                              "megatron-core torch_dist checkpoint")
    value = source.object(COMMON, _SAFE)
    return value[0] if isinstance(value, list) else value


def _optimizer_common(common: dict) -> tuple[list[dict], str | None]:
    """The saved optimizer's param groups and its state layout (``None``: not distributed). A
    chained optimizer (megatron-core chains one for the experts of an expert-parallel job) is
    saved as ``{0: part, 1: part, ...}``: the parts' groups, in order."""
    opt = common.get("optimizer") or {}
    parts = [opt[k] for k in sorted(opt)] if opt and all(isinstance(k, int) for k in opt) else [opt]
    layout = (common.get("content_metadata") or {}).get(
        "distrib_optim_sharding_type", parts[0].get("param_state_sharding_type"))
    groups = []
    for part in parts:
        inner = part.get("optimizer", part)
        found = inner.get("param_groups") if isinstance(inner, dict) else None
        if found is None:
            raise CheckpointError("the checkpoint's optimizer holds no param_groups; mfsdp reads "
                                  "megatron-core's optimizers (one, or chained): convert the "
                                  "weights alone with --weights-only")
        groups += found
    return groups, layout


def _mfsdp_groups(groups: list[dict], where: Path) -> list[dict]:
    """Megatron-LM's groups -> mfsdp's two (weight decay, then none: dims >= 2 and not a bias,
    the rule both use), by ``wd_mult``."""
    def distinct(found):  # the expert optimizer's groups merge with the dense ones they equal
        out = []
        for g in found:
            h = {k: g[k] for k in _HYPER if k in g}
            if h not in [{k: o[k] for k in _HYPER if k in o} for o in out]:
                out.append(g)
        return out

    decay = distinct([g for g in groups if g.get("wd_mult", 1.0) != 0.0])
    plain = distinct([g for g in groups if g.get("wd_mult", 1.0) == 0.0])
    odd = [g for g in groups if g.get("lr_mult", 1.0) != 1.0 or g.get("is_decoupled_lr")]
    if odd or len(decay) > 1 or len(plain) > 1:
        raise CheckpointError(f"{where}: the optimizer has {len(groups)} parameter groups with "
                              "different hyperparameters (lr_mult, decoupled lr, or expert "
                              "groups unlike the dense ones); mfsdp reads two groups (weight "
                              "decay and none)")
    base = decay[0] if decay else plain[0]
    out = []
    for found, wd in ((decay, None), (plain, 0.0)):
        g = found[0] if found else base
        h = {k: g[k] for k in _HYPER if k in g}
        if wd is not None:
            h["weight_decay"] = wd
        out.append(h)
    return out


def mfsdp_name(name: str) -> str:
    """mfsdp's name for a parameter named as Megatron-LM names it in a model or a parameter map
    (per layer, wrapper prefixes dropped, fused norm names unfused); other names unchanged.

    >>> mfsdp_name("model.module.decoder.layers.3.self_attention.linear_qkv.layer_norm_weight")
    'layers.3.input_layernorm.weight'
    >>> mfsdp_name("module.module.embedding.word_embeddings.weight")
    'embedding.weight'
    """
    for prefix in ("model.module.", "module.module.", "module."):
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    if name == "embedding.word_embeddings.weight":
        return "embedding.weight"
    if name == "embedding.position_embeddings.weight":
        return "position_embedding.weight"
    if name.startswith("decoder.final_layernorm."):
        return name[len("decoder."):]
    if name.startswith("decoder.layers."):
        name = name[len("decoder."):]
        for ours, fused in _FUSED_NORMS.items():
            for field in ("weight", "bias"):
                if name.endswith(f".{fused}_{field}"):
                    return name[:-len(f"{fused}_{field}")] + f"{ours}.{field}"
    return name


def megatron_lm_to_fsdp(src: str | Path, dst: str | Path, model_config: dict,
                        weights_only: bool = False, progress: bool = True) -> Path:
    """A Megatron-LM ``torch_dist`` checkpoint -> mfsdp ``fsdp_dtensor``, streamed: one weight
    (one layer's slice of a stacked tensor, read from its own chunks) is in memory at a time;
    ``progress`` reports on stderr.

    ``model_config`` is the :class:`~mfsdp.models.gpt.GPTConfig` the checkpoint was trained with
    (Megatron-LM keeps its arguments in a pickled ``argparse.Namespace``; name the model with
    ``--model-preset`` or ``--model-config`` instead). Every weight of that model must be in the
    checkpoint with its shape, and every model tensor of the checkpoint must be used.

    The optimizer state, when the checkpoint has it in model space, comes along: Adam moments or
    SGD momentum by parameter name, ``step`` from the param groups, the two groups' hyperparameters
    (weight decay and none, told apart by Megatron-LM's ``wd_mult``), the learning-rate schedule
    (``extra["opt_param_scheduler"]``) and the iteration. The model weights are the optimizer's
    fp32 main weights where it has them (``optimizer.state.param``). ``weights_only`` leaves the
    optimizer out (and reads a ``dp_reshardable`` checkpoint's weights).
    """
    from mfsdp.checkpoint.convert import (MAP_FILE, MODEL_CONFIG_FILE, DCPSource, _nbytes,
                                          _Progress, owned_keys, write_streaming)
    from mfsdp.models.gpt import GPT, GPTConfig

    found = resolve_megatron_lm(src)
    if found is None:
        raise CheckpointError(f"{src} is not a Megatron-LM checkpoint (no {TRACKER}, no "
                              "metadata.json beside a .metadata)")
    directory, iteration = found
    backend = _backend(directory)
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
    plan: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, t in ref.items():
        key, index = _source_key(name, keys)
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
    common = read_common_state(directory)
    if iteration is None:
        iteration = int(common.get("iteration") or 0)
    state_keys = [k for k in keys if k.startswith("optimizer.state.")]
    bucket_keys = [k for k in keys if k.startswith("optimizer.distributed.")]
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    origin: dict[str, tuple[str, tuple[int, ...]]] = {}
    blobs: dict[str, object] = {}
    files = {MODEL_CONFIG_FILE: json.dumps(cfg.to_dict(), indent=1)}
    fields: dict[str, set[str]] = {}  # optimizer field -> the model keys it has state for
    for key in state_keys:
        field, _, model_key = key[len("optimizer.state."):].partition(".")
        fields.setdefault(field, set()).add(model_key)
    main_field = next((f for f in _MAIN_FIELDS if f in fields), None)
    params = {n for n, _ in model.named_parameters()}  # the rest are buffers (expert bias)
    for name, (key, index) in plan.items():
        src_key = f"optimizer.state.{main_field}.{key}" if main_field else key
        if main_field and key not in fields[main_field]:
            src_key = key
        specs[f"model.{name}"] = (tuple(ref[name].shape), torch.float32)
        origin[f"model.{name}"] = (src_key, index)
    extra: dict[str, object] = {"iteration": iteration, "data_position": iteration,
                                "source": FORMAT}
    if common.get("opt_param_scheduler"):
        extra["opt_param_scheduler"] = dict(common["opt_param_scheduler"])
    if not weights_only and (state_keys or bucket_keys or common.get("optimizer")):
        opt_common = common.get("optimizer") or {}
        layout = (common.get("content_metadata") or {}).get(
            "distrib_optim_sharding_type", opt_common.get("param_state_sharding_type"))
        if bucket_keys or (layout and layout not in ("fully_reshardable",
                                                     "fully_sharded_model_space")):
            raise CheckpointError(
                f"{directory} holds the distributed optimizer's state in its {layout!r} layout "
                "(the optimizer's flat bucket buffers, which only a Megatron-LM job with the same "
                "data-parallel layout reads). Save it from Megatron-LM with "
                "--dist-ckpt-optim-fully-reshardable (the state by weight), or convert the "
                "weights alone with --weights-only")
        groups, _ = _optimizer_common(common)
        mine = _mfsdp_groups(groups, directory)
        step = next((float(g["step"]) for g in groups if "step" in g), None)
        for field, have in sorted(fields.items()):
            if field in _MAIN_FIELDS:
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
        if step is not None and "exp_avg" in fields:  # torch.optim.Adam keeps it per parameter
            for name in params:
                specs[f"optimizer.state.{name}.step"] = ((), torch.float32)
                origin[f"optimizer.state.{name}.step"] = ("", ())
        blobs["optimizer.param_groups"] = mine
        group_of = {n: 0 for n, p in model.named_parameters() if _decays(n, p)}
        group_of.update({n: 1 for n, p in model.named_parameters() if not _decays(n, p)})
        files[MAP_FILE] = json.dumps(group_of, indent=1)
    blobs["extra"] = extra
    share = owned_keys({k: _nbytes(*v) for k, v in specs.items()})  # all, without torchrun
    report = _Progress(f"reading {directory.name}", sum(_nbytes(*specs[k]) for k in share),
                       progress)

    def produce(key: str) -> torch.Tensor:
        source_key, index = origin[key]
        if not source_key:
            return torch.tensor(step, dtype=torch.float32)
        # one layer (one expert) of a stacked tensor: read from its own chunks
        t = source.get(source_key, index).float()
        report(_nbytes(*specs[key]))
        return t

    order = sorted(specs, key=lambda k: origin[k])  # the checkpoint's order
    specs = {k: specs[k] for k in order}
    return write_streaming(dst, specs, produce, blobs, "fsdp_dtensor",
                           {"source": FORMAT, "backend": backend}, files)


def _decays(name: str, param) -> bool:
    """Whether a parameter is in the weight-decay group (mfsdp's and Megatron-LM's rule)."""
    return param.dim() >= 2 and not name.endswith(".bias")


def _target_key(name: str, per_layer: bool = False, mla: bool = False,
                transformer_impl: str = "transformer_engine") -> tuple[str, int | None]:
    """The Megatron-LM key megatron-core writes for mfsdp parameter ``name``, and the index
    into it where it stacks: a dense model's layers stacked (``per_layer`` False); otherwise, as
    megatron-core writes a model with MoE layers, one key per layer with the experts stacked.
    Norms carry the fused names megatron-core writes for the spec (``_WRITTEN_FUSED``)."""
    if not name.startswith("layers."):
        return _source_key(name, ())[0], None
    _, i, rest = name.split(".", 2)
    module, _, field = rest.rpartition(".")
    if module in _WRITTEN_FUSED[mla, transformer_impl]:
        rest = f"{_FUSED_NORMS[module]}_{field}"
    rest = rest.replace("mlp.shared_expert.", "mlp.shared_experts.", 1)
    if not per_layer:
        return f"decoder.layers.{rest}", int(i)
    m = _EXPERT.match(rest)
    if m:
        return f"decoder.layers.{i}.mlp.experts.experts.{m.group(2)}", int(m.group(1))
    return f"decoder.layers.{i}.{rest}", None


def _args(cfg, optimizer: str | None, distributed: bool, iteration: int):
    """The ``args`` namespace Megatron-LM's loader reads from a checkpoint: the architecture
    (compared with the job's, and used by ``--use-checkpoint-args``), a tensor- and
    pipeline-parallel size of 1, and ``no_save_rng`` (mfsdp's RNG states are not Megatron-LM's)."""
    heads = cfg.num_attention_heads
    groups = cfg.num_query_groups or heads
    return argparse.Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size, num_attention_heads=heads,
        group_query_attention=groups != heads, num_query_groups=groups,
        kv_channels=cfg.kv_channels or cfg.hidden_size // heads,
        max_position_embeddings=cfg.max_position_embeddings,
        position_embedding_type=("rope" if cfg.position_embedding_type == "rope"
                                 else "learned_absolute"),
        add_position_embedding=cfg.position_embedding_type != "rope",
        rotary_base=(int(cfg.rotary_base) if float(cfg.rotary_base).is_integer()
                     else cfg.rotary_base),
        normalization=cfg.normalization, norm_epsilon=cfg.norm_epsilon, swiglu=cfg.swiglu,
        add_bias_linear=cfg.add_bias_linear, add_qkv_bias=cfg.add_qkv_bias,
        untie_embeddings_and_output_weights=not cfg.share_embeddings_and_output_weights,
        padded_vocab_size=cfg.vocab_size, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, ckpt_format="torch_dist", no_save_rng=True,
        no_save_optim=optimizer is None, optimizer=optimizer or "adam",
        use_distributed_optimizer=distributed, iteration=iteration, consumed_train_samples=0,
        skipped_train_samples=0)


def fsdp_to_megatron_lm(src: str | Path, dst: str | Path, model_config: dict | None = None,
                        weights_only: bool = False, progress: bool = True,
                        transformer_impl: str = "transformer_engine",
                        expert_model_parallel_size: int = 1) -> Path:
    """mfsdp ``fsdp_dtensor`` -> a Megatron-LM ``torch_dist`` checkpoint (``dst`` is the root:
    ``latest_checkpointed_iteration.txt`` and ``iter_XXXXXXX/``), streamed: stacked tensors are
    written one chunk per layer (or expert), as megatron-core writes them, so one weight is in
    memory at a time; ``progress`` reports on stderr. Within
    :class:`mfsdp.checkpoint.convert.spread_over_ranks` every rank calls it and writes its share
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
    """
    from mfsdp.checkpoint.convert import (MODEL_CONFIG_FILE, DCPSource, _nbytes, _Progress,
                                          _ranks, fsdp_source, owned_keys)
    from mfsdp.models.gpt import GPT, GPTConfig

    src, dst = fsdp_source(src, dst)
    if model_config is None:
        if not (src / MODEL_CONFIG_FILE).is_file():
            raise CheckpointError(f"{src} has no {MODEL_CONFIG_FILE}; name the model with "
                                  "--model-preset or --model-config")
        model_config = json.loads((src / MODEL_CONFIG_FILE).read_text())
    cfg = GPTConfig.from_dict(model_config)
    if transformer_impl not in ("transformer_engine", "local"):
        raise ValueError(f"transformer_impl={transformer_impl!r}: choose transformer_engine or "
                         "local")
    with torch.device("meta"):
        model = GPT(cfg)
    ref = model.state_dict()
    params = {n for n, _ in model.named_parameters()}
    source = DCPSource(src)
    extra = source.blob("extra") if "extra" in source.blob_keys else {}
    iteration = int(extra.get("iteration", 0))
    per_layer = bool(cfg.num_experts)  # as Megatron-LM builds MoE models (one spec per layer)
    indexed: dict[str, dict[int, str]] = {}
    whole: dict[str, str] = {}
    for name in ref:
        if f"model.{name}" not in source.tensors:
            raise CheckpointError(f"{src} has no weight {name!r} of the model config")
        key, index = _target_key(name, per_layer, cfg.multi_latent_attention, transformer_impl)
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
    distributed = "exp_avg" in fields
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

    share = owned_keys({k: _nbytes(s, torch.float32) for k, s in shapes.items()})
    report = _Progress(f"writing {dst.name}",
                       sum(_nbytes(shapes[k], torch.float32) for k in share), progress)

    def read(field, name):
        t = source.get(f"optimizer.state.{name}.{field}" if field else f"model.{name}").float()
        report(_nbytes(tuple(t.shape), torch.float32))
        return t

    def produce(key: str, i: int | None = None) -> torch.Tensor:
        field, names = origin[key]
        return read(field, names if isinstance(names, str) else names[i])

    rank, world = _ranks()
    state: dict[str, object] = {k: torch.empty(s, dtype=torch.float32, device="meta")
                                for k, s in shapes.items() if k in share}
    for key, names in {**stacks, **whole}.items():  # each linear's (empty) extra state
        if rank != 0:
            break
        module = key.rpartition(".")[0]
        if key.endswith(".weight") and module.rpartition(".")[2].startswith("linear_"):
            n = 1 if isinstance(names, str) else len(names)
            for i in range(n):
                state[f"{module}._extra_state/shard_{i}_{n}"] = [None]
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
            if step is not None:
                out["step"] = step
            megatron_groups.append(out)
        if distributed:
            metadata.update(distrib_optim_sharding_type="fully_reshardable",
                            distrib_optim_fully_reshardable_mem_efficient=False)

        def part(found):
            if distributed:
                return {"optimizer": {"param_groups": found},
                        "param_state_sharding_type": "fully_reshardable"}
            return {"param_groups": found}

        if expert_model_parallel_size > 1 and cfg.num_experts:
            # megatron-core chains an optimizer for the routed experts: its groups are those
            # of the experts' parameters, marked expert-parallel
            in_group = [{0 if _decays(n, p) else 1 for n, p in model.named_parameters()
                         if (".mlp.experts." in n) == experts} for experts in (False, True)]
            common["optimizer"] = {
                0: part([g for i, g in enumerate(megatron_groups) if i in in_group[0]]),
                1: part([dict(g, is_expert_parallel=True) for i, g in enumerate(megatron_groups)
                         if i in in_group[1]])}
        else:
            common["optimizer"] = part(megatron_groups)
        if scheduler:
            common["opt_param_scheduler"] = dict(scheduler)
    common["args"] = _args(cfg, None if groups is None else ("adam" if distributed else "sgd"),
                           distributed, iteration)
    common["args"].expert_model_parallel_size = expert_model_parallel_size
    common["content_metadata"] = metadata
    # as megatron-core stores a ShardedObject: torch.save of [object], not flattened into keys
    state[COMMON] = [common]
    if rank != 0:
        state.pop(COMMON)
    write_iteration(dst, iteration, state, produce,
                    split={k for k, (_, n) in origin.items() if not isinstance(n, str)},
                    metadata_json={"sharded_backend": "torch_dist", "sharded_backend_version": 1})
    return dst


def write_iteration(dst: Path, iteration: int, state: dict, produce, split=frozenset(),
                    metadata_json: dict | None = None) -> None:
    """Write ``state`` (meta tensors made by ``produce`` as the writer asks; objects) as the
    Megatron-LM checkpoint ``dst``: ``iter_XXXXXXX/`` (one file per rank, with ``metadata.json``
    when given) and the tracker, in a temporary directory renamed into place when complete, so
    that a failure leaves nothing behind. Every rank of
    :class:`mfsdp.checkpoint.convert.spread_over_ranks` calls it."""
    import shutil
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from mfsdp.checkpoint.convert import _commit_dir, _LazyPlanner, _ranks, shared_temp_name

    rank, world = _ranks()
    tmp = shared_temp_name(dst.parent, dst.name)
    tmp_iter = tmp / f"iter_{iteration:07d}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=FileSystemWriter(str(tmp_iter),
                                                            single_file_per_rank=True,
                                                            thread_count=1),
                     planner=_LazyPlanner(produce, flatten_state_dict=False, split=split),
                     no_dist=world == 1)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    def finish() -> None:
        if metadata_json is not None:
            (tmp_iter / "metadata.json").write_text(json.dumps(metadata_json))
        (tmp / TRACKER).write_text(str(iteration))

    _commit_dir(tmp, dst, finish)


def load_megatron_lm(path: str | Path, model, optimizer=None) -> dict:
    """Load a Megatron-LM ``torch_dist`` checkpoint into a sharded mfsdp GPT (and its optimizer):
    a collective call. Rank 0 converts it next to ``path`` with the model's own config (weights
    only when ``optimizer`` is None), every rank loads the result with
    :func:`mfsdp.checkpoint.load_checkpoint`, rank 0 removes it. Returns the ``extra`` dict
    (``iteration``, ``opt_param_scheduler``)."""
    from mfsdp.checkpoint.io import load_converted

    config = getattr(getattr(model, "module", model), "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise CheckpointError(f"{path} is a Megatron-LM checkpoint, read into mfsdp's GPT: the "
                              "model has no GPTConfig (model.module.config); convert it with "
                              "mfsdp convert --from megatron_lm --model-config FILE instead")
    return load_converted(path, model, optimizer, lambda tmp: megatron_lm_to_fsdp(
        path, tmp, config.to_dict(), weights_only=optimizer is None), "a Megatron-LM checkpoint")
