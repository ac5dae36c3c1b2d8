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


@dataclass(kw_only=True)
class ModelConfig:
    """Megatron-LM's model flags: sizes, norms, positions, attention, recomputation."""

    model_preset: str | None = flag("--model-preset", choices=_presets,
                                    help="starting sizes; the flags below override them "
                                         "(default: the configuration saved in the --load "
                                         "checkpoint, else gpt-tiny)")
    num_layers: int | None = flag("--num-layers", type=positive_int,
                                  help="transformer layers")
    hidden_size: int | None = flag("--hidden-size", type=positive_int,
                                   help="model width")
    ffn_hidden_size: int | None = flag("--ffn-hidden-size", type=positive_int,
                                       help="dense MLP width")
    num_attention_heads: int | None = flag("--num-attention-heads", type=positive_int,
                                           help="attention heads")
    vocab_size: int | None = flag("--vocab-size", type=positive_int,
                                  help="vocabulary (at least 256 with data files; under tensor "
                                       "parallelism padded to a multiple of the TP size)")
    max_position_embeddings: int | None = flag("--max-position-embeddings", type=positive_int,
                                               help="longest sequence (default: --seq-length)")
    swiglu: bool | None = flag("--swiglu", action="store_true",
                               help="gated MLPs")
    normalization: str | None = flag("--normalization", choices=("LayerNorm", "RMSNorm"),
                                     doc="the norm of every layer (None: the preset's)")
    norm_epsilon: float | None = flag("--norm-epsilon", type=positive_float,
                                      help="epsilon of the norms")
    position_embedding_type: str | None = flag("--position-embedding-type",
                                               choices=("learned_absolute", "rope"),
                                               doc="learned positions or rotary embeddings "
                                                   "(None: the preset's)")
    rotary_base: float | None = flag("--rotary-base", type=float,
                                     help="RoPE base (theta)")
    use_rope_scaling: bool | None = flag("--use-rope-scaling", action="store_true",
                                         help="Llama-3 RoPE frequency scaling (factor: "
                                              "--rope-scaling-factor)")
    rope_scaling_factor: float = flag("--rope-scaling-factor", default=8.0, type=float,
                                      help="with --use-rope-scaling, refused without it "
                                           "(default: %(default)s)")
    rotary_interleaved: bool | None = flag("--rotary-interleaved", action="store_true",
                                           help="rotate interleaved channel pairs (DeepSeek)")
    group_query_attention: bool = flag("--group-query-attention", default=False,
                                       action="store_true",
                                       help="grouped-query attention with --num-query-groups "
                                            "key/value heads")
    num_query_groups: int | None = flag("--num-query-groups", type=positive_int,
                                        help="key/value heads (with the above)")
    kv_channels: int | None = flag("--kv-channels", type=positive_int,
                                   help="width of one attention head")
    disable_bias_linear: bool = flag("--disable-bias-linear", default=False, action="store_true",
                                     help="no biases in linear layers")
    add_qkv_bias: bool | None = flag("--add-qkv-bias", action="store_true",
                                     help="biases on query, key and value only (Qwen2)")
    qk_layernorm: bool | None = flag("--qk-layernorm", action="store_true",
                                     help="RMSNorm on each query and key head (Qwen3)")
    untie_embeddings_and_output_weights: bool = flag("--untie-embeddings-and-output-weights",
                                                     default=False, action="store_true",
                                                     help="a separate output layer (the presets' "
                                                          "default; see the migrating page)")
    multi_latent_attention: bool | None = flag("--multi-latent-attention", action="store_true",
                                               help="DeepSeek's multi-head latent attention (the "
                                                    "five sizes below)")
    q_lora_rank: int | None = flag("--q-lora-rank", type=positive_int,
                                   doc="MLA: rank of the query's low-rank projection")
    kv_lora_rank: int | None = flag("--kv-lora-rank", type=positive_int,
                                    doc="MLA: rank of the joint key/value compression")
    qk_head_dim: int | None = flag("--qk-head-dim", type=positive_int,
                                   help="MLA: plain query/key channels per head")
    qk_pos_emb_head_dim: int | None = flag("--qk-pos-emb-head-dim", type=positive_int,
                                           help="MLA: rotary query/key channels per head")
    v_head_dim: int | None = flag("--v-head-dim", type=positive_int,
                                  help="MLA: value channels per head")
    init_method_std: float | None = flag("--init-method-std", type=float,
                                         help="initialise weights from N(0, std) (the Llama and "
                                              "DeepSeek presets: 0.02)")
    recompute_granularity: str | None = flag("--recompute-granularity",
                                             choices=("full", "selective"),
                                             help="activation recomputation: whole layers (full) "
                                                  "or the core attention (selective)")
    recompute_method: str | None = flag("--recompute-method", choices=("uniform", "block"),
                                        help="with full: recompute chunks of "
                                             "--recompute-num-layers layers (uniform) or the "
                                             "first --recompute-num-layers layers (block)")
    recompute_num_layers: int | None = flag("--recompute-num-layers", type=positive_int,
                                            help="with full: layers per chunk (uniform) or "
                                                 "layers recomputed (block)")

    def __post_init__(self) -> None:
        if self.group_query_attention != bool(self.num_query_groups):
            raise ValueError("--group-query-attention and --num-query-groups go together (as in "
                             "Megatron-LM): pass both, or neither for multi-head attention")


@dataclass(kw_only=True)
class MoEConfig:
    """The mixture-of-experts flags: experts, router, capacity, dispatcher."""

    num_experts: int | None = flag("--num-experts", type=int,
                                   help="routed experts per MoE layer (0: dense)")
    moe_router_topk: int | None = flag("--moe-router-topk", type=positive_int,
                                       help="experts per token")
    moe_first_dense_layers: int | None = flag("--moe-first-dense-layers", type=int,
                                              help="leading layers that stay dense (DeepSeek-V3: "
                                                   "3)")
    moe_ffn_hidden_size: int | None = flag("--moe-ffn-hidden-size", type=positive_int,
                                           help="each expert's width")
    moe_shared_expert_intermediate_size: int | None = flag("--moe-shared-expert-intermediate-size",
                                                           type=int,
                                                           help="width of the shared expert (0: "
                                                                "none)")
    moe_router_score_function: str | None = flag("--moe-router-score-function",
                                                 choices=("softmax", "sigmoid"),
                                                 doc="how router logits become scores "
                                                     "(None: the preset's)")
    moe_router_pre_softmax: bool | None = flag("--moe-router-pre-softmax", action="store_true",
                                               help="softmax over all experts, not renormalised "
                                                    "over the chosen ones")
    moe_router_topk_scaling_factor: float | None = flag("--moe-router-topk-scaling-factor",
                                                        type=float,
                                                        help="multiply the routing weights "
                                                             "(DeepSeek-V3: 2.5)")
    moe_shared_expert_gate: bool | None = flag("--moe-shared-expert-gate", action="store_true",
                                               help="sigmoid gate on the shared expert "
                                                    "(Qwen2-MoE)")
    moe_router_num_groups: int | None = flag("--moe-router-num-groups", type=positive_int,
                                             help="expert groups (group-limited)")
    moe_router_group_topk: int | None = flag("--moe-router-group-topk", type=positive_int,
                                             help="groups each token may use")
    moe_router_enable_expert_bias: bool | None = flag("--moe-router-enable-expert-bias",
                                                      action="store_true",
                                                      help="auxiliary-loss-free balancing bias, "
                                                           "updated every iteration")
    moe_router_bias_update_rate: float = flag("--moe-router-bias-update-rate", default=0.001,
                                              type=float,
                                              help="step of the balancing bias (default: "
                                                   "%(default)s)")
    moe_aux_loss_coeff: float | None = flag("--moe-aux-loss-coeff", type=float,
                                            help="load-balancing loss weight")
    moe_z_loss_coeff: float | None = flag("--moe-z-loss-coeff", type=float,
                                          help="router z-loss weight")
    moe_expert_capacity_factor: float | None = flag("--moe-expert-capacity-factor", type=float,
                                                    help="cap tokens per expert at factor x the "
                                                         "fair share (default: no cap)")
    moe_token_drop_policy: str | None = flag("--moe-token-drop-policy",
                                             choices=("probs", "position"),
                                             help="which tokens an over-full expert keeps")
    moe_pad_expert_input_to_capacity: bool | None = flag("--moe-pad-expert-input-to-capacity",
                                                         action="store_true",
                                                         help="fill every expert to exactly its "
                                                              "capacity")
    moe_token_dispatcher_type: str = flag("--moe-token-dispatcher-type", default="alltoall",
                                          choices=_dispatchers,
                                          help="how tokens reach their experts (default: "
                                               "%(default)s)")
    moe_flex_dispatcher_backend: str = flag("--moe-flex-dispatcher-backend", default="torch",
                                            choices=_flex_backends,
                                            help="backend of the flex dispatcher (default: "
                                                 "%(default)s)")
    moe_grouped_gemm: bool | None = flag("--moe-grouped-gemm", action="store_true",
                                         help="fused experts (one batched matmul) instead of one "
                                              "module per expert")
