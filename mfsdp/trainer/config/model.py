"""The model's flag groups: ``model`` (sizes, norms, positions, attention, recomputation) and
``mixture of experts`` (experts, router, capacity, dispatcher).

A field left None keeps the value of the preset (``--model-preset``) or of the ``--load``
checkpoint's configuration; :func:`mfsdp.trainer.build.model_config` applies the others to a
:class:`~mfsdp.models.config.GPTConfig` by name (the fields are Megatron-LM's names)."""

from __future__ import annotations

from dataclasses import dataclass

from mfsdp.argtypes import positive_float, positive_int
from mfsdp.trainer.config.flags import flag


def _presets() -> list[str]:
    """The ``--model-preset`` names (read when the parser is built: models load lazily)."""
    from mfsdp.models.gpt import GPT_PRESETS

    return sorted(GPT_PRESETS)


def _dispatchers():
    """The token dispatchers ``--moe-token-dispatcher-type`` may name."""
    from mfsdp.moe.dispatcher import DISPATCHERS

    return DISPATCHERS


def _flex_backends():
    """The backends of the flex dispatcher."""
    from mfsdp.moe.dispatcher import FLEX_BACKENDS

    return FLEX_BACKENDS


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """Megatron-LM's model flags: sizes, norms, positions, attention, recomputation."""

    model_preset: str | None = flag(choices=_presets)
    """starting sizes; the flags below override them (default: the configuration saved in the --load
    checkpoint, else gpt-tiny)"""
    num_layers: int | None = flag(type=positive_int)
    """transformer layers"""
    hidden_size: int | None = flag(type=positive_int)
    """model width"""
    ffn_hidden_size: int | None = flag(type=positive_int)
    """dense MLP width"""
    num_attention_heads: int | None = flag(type=positive_int)
    """attention heads"""
    vocab_size: int | None = flag(type=positive_int)
    """vocabulary (at least 256 with data files; under tensor parallelism padded to a multiple of
    the TP size)"""
    max_position_embeddings: int | None = flag(type=positive_int)
    """longest sequence (default: --seq-length)"""
    swiglu: bool | None = flag()
    """gated MLPs"""
    normalization: str | None = flag(choices=("LayerNorm", "RMSNorm"))
    """the norm of every layer (None: the preset's)"""
    norm_epsilon: float | None = flag(type=positive_float)
    """epsilon of the norms"""
    position_embedding_type: str | None = flag(choices=("learned_absolute", "rope"))
    """learned positions or rotary embeddings (None: the preset's)"""
    rotary_base: float | None = flag(type=float)
    """RoPE base (theta)"""
    use_rope_scaling: bool | None = flag()
    """Llama-3 RoPE frequency scaling (factor: --rope-scaling-factor)"""
    rope_scaling_factor: float = flag(default=8.0, type=float)
    """with --use-rope-scaling, refused without it"""
    rotary_interleaved: bool | None = flag()
    """rotate interleaved channel pairs (DeepSeek)"""
    group_query_attention: bool = flag(default=False)
    """grouped-query attention with --num-query-groups key/value heads"""
    num_query_groups: int | None = flag(type=positive_int)
    """key/value heads (with the above)"""
    kv_channels: int | None = flag(type=positive_int)
    """width of one attention head"""
    disable_bias_linear: bool = flag(default=False)
    """no biases in linear layers"""
    add_qkv_bias: bool | None = flag()
    """biases on query, key and value only (Qwen2)"""
    qk_layernorm: bool | None = flag()
    """RMSNorm on each query and key head (Qwen3)"""
    untie_embeddings_and_output_weights: bool = flag(default=False)
    """a separate output layer (the presets' default; see the migrating page)"""
    multi_latent_attention: bool | None = flag()
    """DeepSeek's multi-head latent attention (the five sizes below)"""
    q_lora_rank: int | None = flag(type=positive_int)
    """MLA: rank of the query's low-rank projection"""
    kv_lora_rank: int | None = flag(type=positive_int)
    """MLA: rank of the joint key/value compression"""
    qk_head_dim: int | None = flag(type=positive_int)
    """MLA: plain query/key channels per head"""
    qk_pos_emb_head_dim: int | None = flag(type=positive_int)
    """MLA: rotary query/key channels per head"""
    v_head_dim: int | None = flag(type=positive_int)
    """MLA: value channels per head"""
    init_method_std: float | None = flag(type=float)
    """initialise weights from N(0, std) (the Llama and DeepSeek presets: 0.02)"""
    recompute_granularity: str | None = flag(choices=("full", "selective"))
    """activation recomputation: whole layers (full) or the core attention (selective)"""
    recompute_method: str | None = flag(choices=("uniform", "block"))
    """with full: recompute chunks of --recompute-num-layers layers (uniform) or the first
    --recompute-num-layers layers (block)"""
    recompute_num_layers: int | None = flag(type=positive_int)
    """with full: layers per chunk (uniform) or layers recomputed (block)"""

    def __post_init__(self) -> None:
        if self.group_query_attention != bool(self.num_query_groups):
            raise ValueError("--group-query-attention and --num-query-groups go together (as in "
                             "Megatron-LM): pass both; for multi-head attention, as many query "
                             "groups as heads (a preset's grouped-query attention stays when "
                             "neither is given)")


@dataclass(kw_only=True, frozen=True)
class MoEConfig:
    """The mixture-of-experts flags: experts, router, capacity, dispatcher."""

    num_experts: int | None = flag(type=int)
    """routed experts per MoE layer (0: dense)"""
    moe_router_topk: int | None = flag(type=positive_int)
    """experts per token"""
    moe_first_dense_layers: int | None = flag(type=int)
    """leading layers that stay dense (DeepSeek-V3: 3)"""
    moe_ffn_hidden_size: int | None = flag(type=positive_int)
    """each expert's width"""
    moe_shared_expert_intermediate_size: int | None = flag(type=int)
    """width of the shared expert (0: none)"""
    moe_router_score_function: str | None = flag(choices=("softmax", "sigmoid"))
    """how router logits become scores (None: the preset's)"""
    moe_router_pre_softmax: bool | None = flag()
    """softmax over all experts, not renormalised over the chosen ones"""
    moe_router_topk_scaling_factor: float | None = flag(type=float)
    """multiply the routing weights (DeepSeek-V3: 2.5)"""
    moe_shared_expert_gate: bool | None = flag()
    """sigmoid gate on the shared expert (Qwen2-MoE)"""
    moe_router_num_groups: int | None = flag(type=positive_int)
    """expert groups (group-limited)"""
    moe_router_group_topk: int | None = flag(type=positive_int)
    """groups each token may use"""
    moe_router_enable_expert_bias: bool | None = flag()
    """auxiliary-loss-free balancing bias, updated every iteration"""
    moe_router_bias_update_rate: float = flag(default=0.001, type=float)
    """step of the balancing bias"""
    moe_aux_loss_coeff: float | None = flag(type=float)
    """load-balancing loss weight"""
    moe_z_loss_coeff: float | None = flag(type=float)
    """router z-loss weight"""
    moe_expert_capacity_factor: float | None = flag(type=float)
    """cap tokens per expert at factor x the fair share (default: no cap)"""
    moe_token_drop_policy: str | None = flag(choices=("probs", "position"))
    """which tokens an over-full expert keeps"""
    moe_pad_expert_input_to_capacity: bool | None = flag()
    """fill every expert to exactly its capacity"""
    moe_token_dispatcher_type: str = flag(default="alltoall", choices=_dispatchers)
    """how tokens reach their experts"""
    moe_flex_dispatcher_backend: str = flag(default="torch", choices=_flex_backends)
    """backend of the flex dispatcher"""
    moe_grouped_gemm: bool | None = flag()
    """fused experts (one batched matmul) instead of one module per expert"""
