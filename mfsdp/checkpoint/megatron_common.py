"""What both Megatron-LM checkpoint formats share: the mapping between Megatron-LM's parameter
names and mfsdp's, the ``args`` namespace and common state Megatron-LM keeps beside the tensors,
its optimizer groups, and the writer of an iteration directory (tracker last).

Used by :mod:`mfsdp.checkpoint.megatron_lm` (``torch_dist``) and
:mod:`mfsdp.checkpoint.megatron_lm_dtensor` (``fsdp_dtensor``).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import types
from pathlib import Path, PosixPath

import torch

from mfsdp.checkpoint.dcp import MODEL_CONFIG_FILE, DCPSource, LazyPlanner, commit_dir, ranks, shared_temp_name
from mfsdp.checkpoint.detect import TRACKER
from mfsdp.checkpoint.manifest import CheckpointError

__all__ = ["COMMON", "SAFE_TYPES", "MegatronEnum", "MEGATRON_ENUMS", "HYPER", "MAIN_FIELDS",
           "FUSED_NORMS", "WRITTEN_FUSED", "source_key", "target_key", "read_common_state",
           "optimizer_common", "mfsdp_groups", "saved_steps", "not_carried",
           "carried_args",
           "merge_model_flags", "add_carried",
           "mfsdp_name", "is_decayed", "megatron_args", "write_iteration",
           "config_from_megatron_args", "fsdp_model_config"]

FUSED_NORMS = {"input_layernorm": "self_attention.linear_qkv.layer_norm",
                "pre_mlp_layernorm": "mlp.linear_fc1.layer_norm",
                # multi-latent attention with Transformer Engine: the latents' norms
                "self_attention.q_layernorm": "self_attention.linear_q_up_proj.layer_norm",
                "self_attention.kv_layernorm": "self_attention.linear_kv_up_proj.layer_norm"}
# the fused names of each layer spec megatron-core writes (mfsdp module -> fused in the key):
# every spec fuses the pre-attention and pre-MLP norms of linear_qkv attention (the local spec
# by its sharded_state_dict_keys_map); with multi-latent attention the local spec fuses none
# and Transformer Engine's fuses the latents' norms and the dense MLP's
WRITTEN_FUSED = {
    (False, "transformer_engine"): ("input_layernorm", "pre_mlp_layernorm"),
    (False, "local"): ("input_layernorm", "pre_mlp_layernorm"),
    (True, "transformer_engine"): ("self_attention.q_layernorm", "self_attention.kv_layernorm",
                                   "pre_mlp_layernorm"),
    (True, "local"): (),
}
COMMON = "common_state/shard_0_1"


class MegatronEnum:
    """A member of a megatron-core enum (``AttnBackend``, ...) in the ``args`` Megatron-LM's
    ``save_checkpoint`` pickles, read without megatron-core: its enum's ``name`` and ``value``.

    >>> MEGATRON_ENUMS["megatron.core.transformer.enums.AttnBackend"](5)
    AttnBackend(5)
    """

    name = "MegatronEnum"

    def __init__(self, value):
        self.value = value

    def __repr__(self) -> str:
        return f"{self.name}({self.value!r})"


# the enums of megatron-core's own allow-list (megatron/core/safe_globals.py) under their names
MEGATRON_ENUMS = {f"{module}.{name}": type(name, (MegatronEnum,), {"name": name})
                  for module, names in (
                      ("megatron.core.transformer.enums",
                       ("AttnBackend", "CudaGraphModule", "CudaGraphScope",
                        "InferenceCudaGraphScope")),
                      ("megatron.core.enums", ("ModelType",)),
                      ("megatron.core.rerun_state_machine", ("RerunDiagnostic", "RerunMode")))
                  for name in names}
# what megatron-core's checkpoint loader allows in common_state besides plain containers: the
# namespaces, the signal and path types a real ``args`` holds (``exit_signal``), and
# megatron-core's enums as :class:`MegatronEnum` stand-ins
SAFE_TYPES = (argparse.Namespace, types.SimpleNamespace, signal.Signals, PosixPath,
              *((cls, name) for name, cls in MEGATRON_ENUMS.items()))
# optimizer hyperparameters that torch.optim (and Transformer Engine's FusedAdam) read
HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad", "momentum", "dampening", "nesterov",
          "maximize")
MAIN_FIELDS = ("param", "fp32_param")  # the distributed optimizer's fp32 main weights


EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


def source_key(name: str, keys) -> tuple[str, tuple[int, ...]]:
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
        m = EXPERT.match(rest)
        if m:
            rest, expert = f"mlp.experts.experts.{m.group(2)}", (int(m.group(1)),)
        rest = rest.replace("mlp.shared_expert.", "mlp.shared_experts.", 1)
        names = [rest]
        if module in FUSED_NORMS:  # layer_norm_weight / layer_norm_bias first
            names.insert(0, FUSED_NORMS[module] + "_" + field)
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

    directory = Path(directory)
    legacy = directory / "common.pt"
    if legacy.is_file():
        with torch.serialization.safe_globals(list(SAFE_TYPES)):
            return torch.load(legacy, map_location="cpu", weights_only=True)
    source = DCPSource(directory)
    if COMMON not in source.blob_keys:
        raise CheckpointError(f"{directory} has neither common.pt nor a {COMMON!r} entry: not a "
                              "megatron-core torch_dist checkpoint")
    value = source.object(COMMON, SAFE_TYPES)
    return value[0] if isinstance(value, list) else value


def optimizer_common(common: dict) -> tuple[list[dict], str | None]:
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


def saved_steps(common: dict, where: Path) -> dict[int, float]:
    """The optimizer step of each of mfsdp's two groups (0: weight decay, 1: none, by
    ``wd_mult``) as the checkpoint keeps it: ``step`` in the param groups (megatron-core's
    distributed optimizer), else ``optimizer.state.common_step`` (its plain optimizer over
    torch's Adam, which steps every parameter alike and saves the step once), else a ``step``
    per parameter in the state. ``{}`` where there is none (SGD). A ``CheckpointError`` names
    two groups of one kind with different steps."""
    opt = common.get("optimizer") or {}
    parts = [opt[k] for k in sorted(opt)] if opt and all(isinstance(k, int) for k in opt) else [opt]
    steps: dict[int, float] = {}
    for part in parts:
        inner = part.get("optimizer", part) if isinstance(part, dict) else {}
        state = inner.get("state") or {}
        shared = state.get("common_step")
        if shared is None:  # a step kept per parameter: one value when megatron-core saved it
            found = {float(v["step"]) for v in state.values()
                     if isinstance(v, dict) and v.get("step") is not None}
            shared = found.pop() if len(found) == 1 else None
        for g in inner.get("param_groups") or []:
            value = g.get("step", shared)
            if value is None:
                continue
            mine, value = int(g.get("wd_mult", 1.0) == 0.0), float(value)
            if steps.setdefault(mine, value) != value:
                raise CheckpointError(f"{where}: two optimizer groups of one kind have taken "
                                      f"{steps[mine]:g} and {value:g} steps; mfsdp keeps one "
                                      "step per group (weight decay and none)")
    return steps


# the common state's entries a conversion reads (into weights, optimizer state, ``extra``) or
# that describe the source's own layout; everything else is named by not_carried
_READ = ("args", "checkpoint_version", "iteration", "optimizer", "opt_param_scheduler",
         "content_metadata", "num_floating_point_operations_so_far")
_WHY_NOT = {
    "rng_state": "Megatron-LM's per-rank Python, NumPy, torch and CUDA generator states; "
                 "mfsdp train seeds its own from --seed",
    "rerun_state_machine": "Megatron-LM's rerun state machine (fault detection); mfsdp has "
                           "none",
    "_extra_state": "Transformer Engine's per-layer FP8 metadata; mfsdp keeps none",
}


def not_carried(common: dict, entries, weights_only: bool = False) -> list[str]:
    """What a conversion of a Megatron-LM checkpoint leaves behind, one ``KEY (why)`` each:
    entries of the common state mfsdp has no counterpart for, the checkpoint's other objects
    (``entries``: its DCP keys, ``rng_state/shard_...``) by their first name, Transformer
    Engine's ``*._extra_state`` in one line, and with ``weights_only`` the optimizer."""
    out = [f"{k} ({_WHY_NOT.get(k, 'no counterpart in mfsdp')})"
           for k in sorted(common, key=str) if k not in _READ]
    extra = sorted(k for k in entries if "._extra_state" in k)
    if extra:
        out.append(f"*._extra_state ({len(extra)} entries: {_WHY_NOT['_extra_state']})")
    tops = sorted({k.split("/")[0].split(".")[0] for k in entries
                   if "/" in k and "._extra_state" not in k and k != COMMON})
    out += [f"{t} ({_WHY_NOT.get(t, 'no counterpart in mfsdp')})" for t in tops
            if t not in common and t not in _READ]
    if weights_only:
        out += ["optimizer (--weights-only)"] if "optimizer" in common else []
    return out


def carried_args(args) -> dict:
    """Megatron-LM's ``args`` as a plain dict for mfsdp's ``extra`` (values that are numbers,
    strings, flags and lists of them; ``consumed_train_samples`` among them), so that an export
    back to Megatron-LM and a reader of the converted checkpoint see them."""
    plain = (bool, int, float, str, type(None))
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()
            if isinstance(v, plain) or (isinstance(v, (list, tuple))
                                        and all(isinstance(x, plain) for x in v))}


def add_carried(extra: dict, args, flops, left: list[str]) -> None:
    """Add to a conversion's ``extra`` what it carries of a Megatron-LM checkpoint beyond the
    tensors, groups and schedule: ``args`` as a plain dict (``megatron_lm_args``) with its
    ``consumed_train_samples``, the FLOPs counter ``flops`` (``None``: not saved), and ``left``,
    what it does not carry (:func:`not_carried`), named at the end of the conversion."""
    if args is not None:
        extra["megatron_lm_args"] = carried_args(args)
        extra["consumed_train_samples"] = getattr(args, "consumed_train_samples", None)
    if flops is not None:
        extra["num_floating_point_operations_so_far"] = flops
    extra["not_carried"] = left


def mfsdp_groups(groups: list[dict], where: Path) -> list[dict]:
    """Megatron-LM's groups -> mfsdp's two (weight decay, then none: dims >= 2 and not a bias,
    the rule both use), by ``wd_mult``."""
    def distinct(found):  # the expert optimizer's groups merge with the dense ones they equal
        out = []
        for g in found:
            h = {k: g[k] for k in HYPER if k in g}
            if h not in [{k: o[k] for k in HYPER if k in o} for o in out]:
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
        h = {k: g[k] for k in HYPER if k in g}
        if wd is not None:
            h["weight_decay"] = wd
        out.append(h)
    return out


def mfsdp_name(name: str) -> str:
    """mfsdp's name for a parameter named as Megatron-LM names it in a model or a parameter map
    (per layer, wrapper prefixes dropped, fused norm names unfused); other names unchanged.

    >>> fused = "self_attention.linear_qkv.layer_norm_weight"
    >>> mfsdp_name(f"model.module.decoder.layers.3.{fused}")
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
        for ours, fused in FUSED_NORMS.items():
            for field in ("weight", "bias"):
                if name.endswith(f".{fused}_{field}"):
                    return name[:-len(f"{fused}_{field}")] + f"{ours}.{field}"
    return name




def is_decayed(name: str, param) -> bool:
    """Whether a parameter is in the weight-decay group (mfsdp's and Megatron-LM's rule)."""
    return param.dim() >= 2 and not name.endswith(".bias")


def target_key(name: str, per_layer: bool = False, mla: bool = False,
                transformer_impl: str = "transformer_engine") -> tuple[str, int | None]:
    """The Megatron-LM key megatron-core writes for mfsdp parameter ``name``, and the index
    into it where it stacks: a dense model's layers stacked (``per_layer`` False); otherwise, as
    megatron-core writes a model with MoE layers, one key per layer with the experts stacked.
    Norms carry the fused names megatron-core writes for the spec (``WRITTEN_FUSED``)."""
    if not name.startswith("layers."):
        return source_key(name, ())[0], None
    _, i, rest = name.split(".", 2)
    module, _, field = rest.rpartition(".")
    if module in WRITTEN_FUSED[mla, transformer_impl]:
        rest = f"{FUSED_NORMS[module]}_{field}"
    rest = rest.replace("mlp.shared_expert.", "mlp.shared_experts.", 1)
    if not per_layer:
        return f"decoder.layers.{rest}", int(i)
    m = EXPERT.match(rest)
    if m:
        return f"decoder.layers.{i}.mlp.experts.experts.{m.group(2)}", int(m.group(1))
    return f"decoder.layers.{i}.{rest}", None


def megatron_args(cfg, optimizer: str | None, distributed: bool, iteration: int,
                  tensor_model_parallel_size: int = 1):
    """The ``args`` namespace Megatron-LM's loader reads from a checkpoint: the architecture
    (compared with the job's, and used by ``--use-checkpoint-args``), the loading job's
    tensor-parallel size (``--use-checkpoint-args`` takes it from here), a pipeline-parallel size
    of 1, and ``no_save_rng`` (mfsdp's RNG states are not Megatron-LM's)."""
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
        padded_vocab_size=cfg.vocab_size,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=1, ckpt_format="torch_dist", no_save_rng=True,
        no_save_optim=optimizer is None, optimizer=optimizer or "adam",
        use_distributed_optimizer=distributed, iteration=iteration, consumed_train_samples=0,
        skipped_train_samples=0, **_architecture_args(cfg))


def _architecture_args(cfg) -> dict:
    """The rest of the architecture under Megatron-LM's argument names (which GPTConfig shares),
    so that the checkpoint describes its model (:func:`config_from_megatron_args`)."""
    names = ("rotary_interleaved", "qk_layernorm", "multi_latent_attention", "q_lora_rank",
             "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "num_experts",
             "moe_ffn_hidden_size", "moe_router_topk", "moe_router_score_function",
             "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_num_groups",
             "moe_router_group_topk", "moe_router_enable_expert_bias",
             "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_grouped_gemm",
             "rope_scaling_factor")
    out = {n: getattr(cfg, n) for n in names if getattr(cfg, n, None) is not None}
    if cfg.rope_scaling_factor:
        out["use_rope_scaling"] = True
    if cfg.num_experts:
        out["moe_layer_freq"] = ([0] * cfg.moe_first_dense_layers
                                 + [1] * (cfg.num_layers - cfg.moe_first_dense_layers))
    return out




def write_iteration(dst: Path, iteration: int, state: dict, produce, split=frozenset(),
                    metadata_json: dict | None = None) -> None:
    """Write ``state`` (meta tensors made by ``produce`` as the writer asks; objects) as the
    Megatron-LM checkpoint ``dst``: ``iter_XXXXXXX/`` (one file per rank, with ``metadata.json``
    when given) and the tracker, in a temporary directory renamed into place when complete, so
    that a failure leaves nothing behind. Every rank of
    :class:`mfsdp.checkpoint.dcp.spread_over_ranks` calls it."""
    import shutil
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter


    rank, world = ranks()
    tmp = shared_temp_name(dst.parent, dst.name)
    tmp_iter = tmp / f"iter_{iteration:07d}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=FileSystemWriter(str(tmp_iter),
                                                            single_file_per_rank=True,
                                                            thread_count=1),
                     planner=LazyPlanner(produce, flatten_state_dict=False, split=split),
                     no_dist=world == 1)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    def finish() -> None:
        if metadata_json is not None:
            (tmp_iter / "metadata.json").write_text(json.dumps(metadata_json))
        (tmp / TRACKER).write_text(str(iteration))

    commit_dir(tmp, dst, finish)


# GPTConfig fields Megatron-LM's arguments carry under another name or that are not architecture.
_NOT_ARCHITECTURE = ("vocab_size", "share_embeddings_and_output_weights", "recompute_granularity",
                     "recompute_method", "recompute_num_layers", "moe_token_dispatcher_type",
                     "moe_flex_dispatcher_backend", "moe_first_dense_layers")


_FLAG_OF = {"padded_vocab_size": "--vocab-size", "add_bias_linear": "--disable-bias-linear"}
# trainer flags whose Megatron-LM argument has another name or sense: flag -> (argument, value)
_AS_ARGUMENT = {"vocab_size": lambda v: ("padded_vocab_size", v),
                "disable_bias_linear": lambda v: ("add_bias_linear", not v)}


def merge_model_flags(args, flags: dict, where: str = "the checkpoint") -> argparse.Namespace:
    """Megatron-LM's saved ``args`` (``None``: none saved) with the model flags of ``mfsdp
    convert`` merged in: ``flags`` maps each given flag's name, as ``mfsdp train`` spells it
    (``num_attention_heads``, ``vocab_size``, ``disable_bias_linear``, ...), to its value. A flag
    that contradicts a value the checkpoint's arguments hold is refused in one line naming both.

    >>> import argparse
    >>> merge_model_flags(argparse.Namespace(num_layers=2), {"vocab_size": 128}).padded_vocab_size
    128
    """
    merged = dict(vars(args)) if args is not None else {}
    for name, value in flags.items():
        key, wanted = _AS_ARGUMENT.get(name, lambda v: (name, v))(value)
        saved = merged.get(key)
        if saved is not None and saved != wanted:
            raise CheckpointError(f"--{name.replace('_', '-')} {value} contradicts {where}: its "
                                  f"Megatron-LM arguments hold {key}={saved!r}; leave the flag "
                                  "out, or convert the checkpoint it describes")
        merged[key] = wanted
    return argparse.Namespace(**merged)


def config_from_megatron_args(args, where: str = "the checkpoint") -> dict:
    """The model configuration (a :class:`~mfsdp.models.gpt.GPTConfig` as a dict) that
    Megatron-LM's saved ``args`` describe, as its ``--use-checkpoint-args`` reads them: most
    fields share Megatron-LM's names; the vocabulary is ``padded_vocab_size``, tied embeddings
    ``not untie_embeddings_and_output_weights``, query groups ``num_query_groups`` only with
    ``group_query_attention``, the leading dense layers of an MoE from ``moe_layer_freq``.

    >>> import argparse
    >>> args = argparse.Namespace(
    ...     num_layers=2, hidden_size=64, num_attention_heads=4, padded_vocab_size=128,
    ...     ffn_hidden_size=176, swiglu=True, group_query_attention=True,
    ...     num_query_groups=2, normalization="RMSNorm",
    ...     untie_embeddings_and_output_weights=True, position_embedding_type="rope")
    >>> cfg = config_from_megatron_args(args)
    >>> tied = cfg["share_embeddings_and_output_weights"]
    >>> cfg["vocab_size"], cfg["num_query_groups"], tied
    (128, 2, False)
    """
    import dataclasses

    from mfsdp.models.gpt import GPTConfig

    given = {k: v for k, v in vars(args).items() if v is not None}
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads", "padded_vocab_size")
               if k not in given]
    if missing:  # every one at once, each with the flag of mfsdp convert that names it
        named = ", ".join(f"{k} ({_FLAG_OF.get(k, '--' + k.replace('_', '-'))})"
                          for k in missing)
        raise CheckpointError(f"{where}: its Megatron-LM arguments lack {named}; pass those "
                              "flags (the head count is not in the tensors' shapes), or "
                              "--model-preset or --model-config")
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    cfg = {k: v for k, v in given.items() if k in fields and k not in _NOT_ARCHITECTURE}
    if not given.get("use_rope_scaling", False):
        cfg["rope_scaling_factor"] = None  # Megatron-LM applies no scaling without the flag
    cfg["vocab_size"] = given["padded_vocab_size"]
    cfg["share_embeddings_and_output_weights"] = not given.get(
        "untie_embeddings_and_output_weights", False)
    if not given.get("group_query_attention", False):
        cfg["num_query_groups"] = None  # one per head: GPTConfig's default
    cfg.setdefault("ffn_hidden_size", 4 * given["hidden_size"])  # Megatron-LM's default
    if cfg.get("kv_channels") == given["hidden_size"] // given["num_attention_heads"]:
        cfg["kv_channels"] = None  # the default, as GPTConfig spells it
    if cfg.get("position_embedding_type") not in (None, "rope", "learned_absolute"):
        raise CheckpointError(f"{where}: position_embedding_type="
                              f"{cfg['position_embedding_type']!r} has no mfsdp model")
    freq = given.get("moe_layer_freq", 1)
    if given.get("num_experts") and isinstance(freq, (list, tuple)):
        dense = next((i for i, f in enumerate(freq) if f), len(freq))
        if any(not f for f in freq[dense:]):
            raise CheckpointError(f"{where}: moe_layer_freq={list(freq)} interleaves dense and MoE "
                                  "layers; mfsdp's models have leading dense layers only")
        cfg["moe_first_dense_layers"] = dense
    elif given.get("num_experts") and freq != 1:
        raise CheckpointError(f"{where}: moe_layer_freq={freq!r}: mfsdp reads 1 or a list")
    return GPTConfig.from_dict(cfg).to_dict()


def fsdp_model_config(src: Path, model_config: dict | None, transformer_impl: str):
    """The ``GPTConfig`` of the mfsdp checkpoint at ``src`` (resolved by
    :func:`~mfsdp.checkpoint.full.fsdp_source`) for an export to Megatron-LM.

    ``model_config``: the model's config dict for checkpoints without ``model_config.json``
    (else read from it; a ``CheckpointError`` names ``--model-preset``/``--model-config`` when
    neither is there). ``transformer_impl``: ``transformer_engine`` or ``local``, else
    ``ValueError``.
    """
    from mfsdp.models.gpt import GPTConfig

    if model_config is None:
        if not (src / MODEL_CONFIG_FILE).is_file():
            raise CheckpointError(f"{src} has no {MODEL_CONFIG_FILE}; name the model with "
                                  "--model-preset or --model-config")
        model_config = json.loads((src / MODEL_CONFIG_FILE).read_text())
    cfg = GPTConfig.from_dict(model_config)
    if transformer_impl not in ("transformer_engine", "local"):
        raise ValueError(f"transformer_impl={transformer_impl!r}: choose transformer_engine or "
                         "local")
    return cfg
