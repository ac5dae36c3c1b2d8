"""``mfsdp convert`` as the command line runs it: the converter's flags
(:mod:`mfsdp.checkpoint.convert`) and, for a Megatron-LM checkpoint, the model flags of
``mfsdp train`` under the same names (``--num-layers``, ``--hidden-size``,
``--num-attention-heads``, ``--group-query-attention --num-query-groups``, ``--swiglu``,
``--vocab-size``, ...)::

    mfsdp convert --from megatron_lm --to fsdp_dtensor CKPT OUT --num-attention-heads 32

They complete or check the architecture the checkpoint's saved Megatron-LM arguments describe
(a flag contradicting them is refused, naming both), or name the model where none are saved;
with ``--model-preset`` or ``--model-config`` they override it, as in ``mfsdp train``. Only the
flags that shape the model are taken (recomputation, initialisation and the MoE training knobs
are the trainer's alone).
"""

from __future__ import annotations

import argparse

from mfsdp.checkpoint import convert
from mfsdp.trainer.config import ModelConfig, MoEConfig
from mfsdp.trainer.config.flags import flag_arguments, flag_fields

__all__ = ["MODEL_FLAGS", "build_parser", "model_flags", "run_distributed"]

# the trainer's flags that shape a model (fields of its ModelConfig and MoEConfig groups)
MODEL_FLAGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size",
    "max_position_embeddings", "swiglu", "normalization", "norm_epsilon",
    "position_embedding_type", "rotary_base", "use_rope_scaling", "rope_scaling_factor",
    "rotary_interleaved", "group_query_attention", "num_query_groups", "kv_channels",
    "disable_bias_linear", "add_qkv_bias", "qk_layernorm", "untie_embeddings_and_output_weights",
    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
    "qk_pos_emb_head_dim", "v_head_dim", "num_experts", "moe_router_topk",
    "moe_first_dense_layers", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
    "moe_router_score_function", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
    "moe_shared_expert_gate", "moe_router_num_groups", "moe_router_group_topk",
    "moe_router_enable_expert_bias", "moe_grouped_gemm")


def _model_fields():
    """(config class, field) of every model flag, in the trainer's order."""
    return [(cls, f) for cls in (ModelConfig, MoEConfig) for f in flag_fields(cls)
            if f.name in MODEL_FLAGS]


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """``mfsdp convert``'s parser with the trainer's model flags added (``--swiglu`` is then the
    trainer's: the model's MLPs are gated, which is also what the safetensors conversions read
    it as)."""
    parser = parser or argparse.ArgumentParser(prog="mfsdp convert")
    parser.conflict_handler = "resolve"  # the trainer's --swiglu replaces the converter's
    convert.build_parser(parser)
    group = parser.add_argument_group(
        "model (mfsdp train's flags; with --from megatron_lm: name or check the model)")
    for cls, f in _model_fields():
        names, kw = flag_arguments(cls, f)
        group.add_argument(*names, **kw)
    return parser


def model_flags(args: argparse.Namespace) -> dict:
    """The model flags given on the command line (a value other than the flag's default), by the
    trainer's names."""
    out = {}
    for cls, f in _model_fields():
        _, kw = flag_arguments(cls, f)
        value = getattr(args, f.name)
        if value != kw.get("default"):
            out[f.name] = value
    return out


def run_distributed(args: argparse.Namespace) -> int:
    """Check the model flags (the trainer's rules: ``--group-query-attention`` with
    ``--num-query-groups``), refuse them where no Megatron-LM checkpoint is read, then run the
    conversion (:func:`mfsdp.checkpoint.convert.run_distributed`)."""
    given = model_flags(args)
    safetensors = {"safetensors", "hf"} & {args.src_format, args.dst_format}
    if safetensors and set(given) <= {"swiglu"}:
        given = {}  # --swiglu alone: the fused gate/up weights of a safetensors conversion
    if given:
        names = ", ".join(f"--{k.replace('_', '-')}" for k in given)
        if args.src_format not in ("megatron_lm", "torch_dist"):
            raise SystemExit(f"mfsdp convert: the model flags ({names}) name the model of a "
                             "Megatron-LM checkpoint: use them with --from megatron_lm (for "
                             "other inputs, --model-preset or --model-config)")
        try:
            ModelConfig(**{k: v for k, v in given.items()
                           if k in {f.name for f in flag_fields(ModelConfig)}})
        except ValueError as exc:
            raise SystemExit(f"mfsdp convert: {exc}") from None
    args.model_flags = given
    return convert.run_distributed(args)
