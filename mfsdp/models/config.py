"""The configuration of the GPT family (:class:`GPTConfig`, Megatron-LM's switches as fields) and
its presets (``GPT_PRESETS``: Llama, Qwen, Mixtral, DeepSeek shapes and tiny test models); the
modules are :mod:`mfsdp.models.gpt`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

__all__ = ["GPTConfig", "GPT_PRESETS", "NORMALIZATIONS", "POSITION_EMBEDDINGS", "with_overrides"]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")


@dataclass(frozen=True)
class GPTConfig:
    """Sizes and MoE options of :class:`~mfsdp.models.gpt.GPT` (names follow Megatron-LM's flags)."""

    vocab_size: int = 256
    max_position_embeddings: int = 1024
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int | None = None
    """Key/value heads of grouped-query attention (``None``: one per query head)."""
    kv_channels: int | None = None
    """Width of one attention head (``None``: ``hidden_size // num_attention_heads``)."""
    swiglu: bool = False
    normalization: str = "LayerNorm"
    norm_epsilon: float = 1e-5
    position_embedding_type: str = "learned_absolute"
    rotary_base: float = 10000.0
    rotary_interleaved: bool = False
    """Rotate interleaved pairs ``(x0, x1), (x2, x3)...`` (DeepSeek) instead of the two halves."""
    rope_scaling_factor: float | None = None
    """Llama-3 frequency scaling (``None``: off); the three fields below are its other parameters."""
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    share_embeddings_and_output_weights: bool = False
    init_method_std: float | None = None
    """Initialise linear and embedding weights from N(0, std) and biases with zeros, as
    Megatron-LM and ``transformers`` do (``None``: PyTorch's module defaults)."""
    recompute_granularity: str | None = None
    """Activation recomputation as Megatron-LM names it, ``"full"`` (whole layers, see the two
    fields below) or ``"selective"`` (only the core attention, i.e. scores, softmax and the
    weighted sum)."""
    recompute_method: str | None = None
    """With ``"full"``: ``"uniform"`` checkpoints the input of every chunk of
    ``recompute_num_layers`` layers and recomputes the chunk; ``"block"`` recomputes the first
    ``recompute_num_layers`` layers one by one and keeps the others' activations."""
    recompute_num_layers: int | None = None
    multi_latent_attention: bool = False
    """DeepSeek's multi-head latent attention (the five fields below size it)."""
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    num_experts: int = 0
    """How many routed experts each MoE layer has (a dense model has none). Layers from
    ``moe_first_dense_layers`` on are MoE layers."""
    moe_first_dense_layers: int = 0
    moe_ffn_hidden_size: int | None = None
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    """With softmax scores, ``False`` (Megatron-LM's default, Mixtral) renormalises the chosen
    experts' weights to sum to one and ``True`` uses the softmax over all experts as it is
    (Qwen2-MoE). Sigmoid scores are always renormalised."""
    moe_router_topk_scaling_factor: float | None = None
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_enable_expert_bias: bool = False
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0
    moe_shared_expert_intermediate_size: int = 0
    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output by ``sigmoid(gate(x))`` (Qwen2-MoE)."""
    moe_token_dispatcher_type: str = "alltoall"
    moe_flex_dispatcher_backend: str = "torch"
    moe_expert_capacity_factor: float | None = None
    moe_token_drop_policy: str = "probs"
    moe_pad_expert_input_to_capacity: bool = False
    moe_grouped_gemm: bool = False
    """Fused experts (:class:`mfsdp.moe.FusedExperts`) instead of one module per expert."""

    def __post_init__(self) -> None:
        if self.kv_channels is None and not self.multi_latent_attention and \
                self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by "
                             f"num_attention_heads={self.num_attention_heads}; set kv_channels")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization={self.normalization!r}: choose one of {NORMALIZATIONS}")
        if self.position_embedding_type not in POSITION_EMBEDDINGS:
            raise ValueError(f"position_embedding_type={self.position_embedding_type!r}: choose one "
                             f"of {POSITION_EMBEDDINGS}")
        groups = self.num_query_groups or self.num_attention_heads
        if self.num_attention_heads % groups:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not divisible by "
                             f"num_query_groups={groups}")
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ValueError(f"recompute_granularity={self.recompute_granularity!r}: choose "
                             "'full' or 'selective'")
        if self.recompute_granularity == "full":
            if self.recompute_method not in ("uniform", "block"):
                raise ValueError("recompute_granularity='full' needs recompute_method 'uniform' "
                                 "or 'block' (and recompute_num_layers)")
            if not self.recompute_num_layers or self.recompute_num_layers < 1:
                raise ValueError("recompute_granularity='full' needs recompute_num_layers >= 1 "
                                 "(uniform: layers per recomputed chunk; block: how many layers)")
        elif self.recompute_method is not None or self.recompute_num_layers is not None:
            raise ValueError("recompute_method and recompute_num_layers apply to "
                             "recompute_granularity='full' only")
        if self.multi_latent_attention and self.position_embedding_type != "rope":
            raise ValueError("multi_latent_attention needs position_embedding_type='rope'")
        for f in ("vocab_size", "num_layers", "hidden_size", "ffn_hidden_size",
                  "num_attention_heads"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f}={getattr(self, f)} must be positive")

    @property
    def head_dim(self) -> int:
        """Width of one attention head (``kv_channels`` or ``hidden_size // heads``)."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates."""
        return self.qk_pos_emb_head_dim if self.multi_latent_attention else self.head_dim

    def to_dict(self) -> dict:
        """The configuration as a plain dict (for checkpoints' ``config.json``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        """Inverse of :meth:`to_dict`; unknown keys are an error naming the key."""
        known = {f.name for f in fields(cls)}
        bad = sorted(set(d) - known)
        if bad:
            raise ValueError(f"unknown GPTConfig keys {bad}")
        return cls(**d)


_LLAMA = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
              add_bias_linear=False, init_method_std=0.02)
# Llama 3's RoPE: base 500,000, no frequency scaling (Meta-Llama-3-8B/70B, as Megatron-Bridge's
# Llama3ModelProvider8B/70B); Llama 3.1 adds the frequency scaling with factor 8
_LLAMA3 = dict(rotary_base=500000.0, **_LLAMA)
_LLAMA31 = dict(_LLAMA3, rope_scaling_factor=8.0)
# the released Llama 3 models: their tokenizer, context and 8 key/value heads
_RELEASED = dict(vocab_size=128256, max_position_embeddings=8192, num_query_groups=8)
# DeepSeek-V3's attention and router: multi-head latent attention with interleaved rotary
# channels, a sigmoid router with the score-correction bias and the routed scaling factor
_DEEPSEEK = dict(norm_epsilon=1e-6, rotary_interleaved=True, multi_latent_attention=True,
                 moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                 moe_router_topk_scaling_factor=2.5, **_LLAMA)

GPT_PRESETS = {
    # GPT-2-like: LayerNorm with bias, learned positions, multi-head attention, GELU.
    "gpt-tiny": GPTConfig(),
    # Llama 3.1 in miniature (the llama3 presets' code at a CPU size, with 3.1's RoPE scaling so
    # that the tests exercise it).
    "llama-tiny": GPTConfig(num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
                            num_query_groups=2, **_LLAMA31),
    # Llama 3 8B and 70B: RoPE base 500,000 without Llama 3.1's scaling (Meta-Llama-3-8B/70B).
    "llama3-8b": GPTConfig(num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
                           num_attention_heads=32, **_RELEASED, **_LLAMA3),
    "llama3-70b": GPTConfig(num_layers=80, hidden_size=8192, ffn_hidden_size=28672,
                            num_attention_heads=64, **_RELEASED, **_LLAMA3),
    # Llama 3.1 405B: Llama 3.1's RoPE scaling (factor 8); context kept at 8,192 for the presets.
    "llama3.1-405b": GPTConfig(num_layers=126, hidden_size=16384, ffn_hidden_size=53248,
                               num_attention_heads=128, **_RELEASED, **_LLAMA31),
    # DeepSeek-V3 in miniature: multi-head latent attention, a dense first layer, then MoE layers
    # with a shared expert and routed experts behind a sigmoid router with group-limited top-k, the
    # score-correction bias and the routed scaling factor.
    "deepseek-proxy": GPTConfig(num_layers=3, hidden_size=64, ffn_hidden_size=128,
                                num_attention_heads=4, q_lora_rank=32, kv_lora_rank=16,
                                qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
                                num_experts=8, moe_first_dense_layers=1, moe_ffn_hidden_size=32,
                                moe_router_topk=2, moe_router_num_groups=4,
                                moe_router_group_topk=2, moe_shared_expert_intermediate_size=32,
                                moe_aux_loss_coeff=1e-3, **_DEEPSEEK),
    # DeepSeek-V3 (671B) at full size, for the planner and the sbatch preset. Its released
    # checkpoint also uses YaRN rotary scaling, which mfsdp does not implement yet.
    "deepseek-v3": GPTConfig(vocab_size=129280, max_position_embeddings=4096, num_layers=61,
                             hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=128,
                             q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
                             qk_pos_emb_head_dim=64, v_head_dim=128, num_experts=256,
                             moe_first_dense_layers=3, moe_ffn_hidden_size=2048,
                             moe_router_topk=8, moe_router_num_groups=8, moe_router_group_topk=4,
                             moe_shared_expert_intermediate_size=2048, **_DEEPSEEK),
}


def with_overrides(cfg: GPTConfig, **changes) -> GPTConfig:
    """A copy of ``cfg`` with ``changes`` applied (``None`` values are ignored)."""
    return replace(cfg, **{k: v for k, v in changes.items() if v is not None})
