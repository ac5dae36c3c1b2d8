"""A small GPT and a small MoE GPT (a "DeepSeek-proxy"), both on packed THD sequences.

Every batch is *packed*: the tokens of several sequences are concatenated into one ``[T]`` tensor
(T = total tokens) and ``cu_seqlens`` (``[0, len_0, len_0 + len_1, ...]``) marks where each starts.
Attention is causal *within* a sequence and never crosses a boundary, and positions restart at 0 in
every sequence, so a packed batch computes exactly what the sequences would compute one by one. A
fixed-length batch ``[B, S]`` is the special case of equal lengths.

>>> tokens, cu = pack_sequences([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
>>> tokens.tolist(), cu.tolist(), position_ids(cu).tolist()
([1, 2, 3, 4, 5], [0, 3, 5], [0, 1, 2, 0, 1])
>>> thd_attention_mask(cu).int().tolist()[3]  # token 3 (first of sequence 2) sees only itself
[0, 0, 0, 1, 0]
>>> model = GPT(GPTConfig(vocab_size=32, hidden_size=16, ffn_hidden_size=32, num_layers=2,
...                       num_attention_heads=2))
>>> model(tokens, cu).shape
torch.Size([5, 32])
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import nn

from mfsdp.moe.layer import MoELayer

__all__ = ["GPT", "GPTConfig", "GPT_PRESETS", "TransformerLayer", "gpt_loss", "pack_sequences",
           "position_ids", "thd_attention_mask"]


@dataclass(frozen=True)
class GPTConfig:
    """Sizes and MoE options of :class:`~mfsdp.models.gpt.GPT` (names follow Megatron-LM's flags)."""

    vocab_size: int = 256
    max_position_embeddings: int = 1024
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 128
    num_attention_heads: int = 4
    swiglu: bool = False
    num_experts: int = 0
    """How many routed experts each MoE layer has (a dense model has none). Layers from
    ``moe_first_dense_layers`` on are MoE layers."""
    moe_first_dense_layers: int = 0
    moe_ffn_hidden_size: int | None = None
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_enable_expert_bias: bool = False
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0
    moe_shared_expert_intermediate_size: int = 0
    moe_token_dispatcher_type: str = "alltoall"
    moe_flex_dispatcher_backend: str = "torch"
    moe_expert_capacity_factor: float | None = None
    moe_token_drop_policy: str = "probs"
    moe_pad_expert_input_to_capacity: bool = False
    moe_grouped_gemm: bool = False
    """Fused experts (:class:`mfsdp.moe.FusedExperts`) instead of one module per expert."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by "
                             f"num_attention_heads={self.num_attention_heads}")
        for f in ("vocab_size", "num_layers", "hidden_size", "ffn_hidden_size",
                  "num_attention_heads"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f}={getattr(self, f)} must be positive")

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


GPT_PRESETS = {
    "gpt-tiny": GPTConfig(),
    # DeepSeek-V3 in miniature: a dense first layer, then MoE layers with a shared expert and
    # routed experts behind a sigmoid router with group-limited top-k and a balancing bias.
    "deepseek-proxy": GPTConfig(num_layers=3, swiglu=True, num_experts=8, moe_first_dense_layers=1,
                                moe_ffn_hidden_size=32, moe_router_topk=2,
                                moe_router_score_function="sigmoid", moe_router_num_groups=4,
                                moe_router_group_topk=2, moe_router_enable_expert_bias=True,
                                moe_shared_expert_intermediate_size=32, moe_aux_loss_coeff=1e-3),
}


def pack_sequences(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate 1-D token tensors; return ``(tokens, cu_seqlens)``."""
    if not seqs:
        raise ValueError("pack_sequences needs at least one sequence")
    lengths = torch.tensor([len(s) for s in seqs])
    if (lengths == 0).any():
        raise ValueError("empty sequence in pack_sequences: every sequence needs a token")
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    return torch.cat(seqs), cu


def _sequence_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    total = int(cu_seqlens[-1])
    return torch.searchsorted(cu_seqlens[1:], torch.arange(total, device=cu_seqlens.device),
                              right=True)


def position_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Each token's position inside its own sequence."""
    ids = _sequence_ids(cu_seqlens)
    return torch.arange(len(ids), device=ids.device) - cu_seqlens[ids]


def thd_attention_mask(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[T, T]`` boolean mask: token ``i`` may attend to ``j`` iff same sequence and ``j <= i``."""
    ids = _sequence_ids(cu_seqlens)
    causal = torch.ones(len(ids), len(ids), dtype=torch.bool, device=ids.device).tril()
    return causal & (ids.unsqueeze(0) == ids.unsqueeze(1))


class Attention(nn.Module):
    """Multi-head self-attention on packed tokens with a block-diagonal causal mask."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.linear_qkv = nn.Linear(hidden, 3 * hidden)
        self.linear_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        T, H = x.shape
        q, k, v = self.linear_qkv(x).view(T, 3, self.heads, H // self.heads).unbind(1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                             v.transpose(0, 1), attn_mask=mask)
        return self.linear_proj(out.transpose(0, 1).reshape(T, H))


class MLP(nn.Module):
    """The dense feed-forward block (SwiGLU stacks gate and up in ``linear_fc1``)."""

    def __init__(self, hidden: int, ffn: int, swiglu: bool):
        super().__init__()
        self.swiglu = swiglu
        self.linear_fc1 = nn.Linear(hidden, 2 * ffn if swiglu else ffn)
        self.linear_fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return self.linear_fc2(h)


class TransformerLayer(nn.Module):
    """Pre-norm attention and MLP (or MoE) with residuals: the FSDP unit of :class:`~mfsdp.models.gpt.GPT`."""

    def __init__(self, cfg: GPTConfig, moe: bool):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = nn.LayerNorm(h)
        self.self_attention = Attention(h, cfg.num_attention_heads)
        self.pre_mlp_layernorm = nn.LayerNorm(h)
        if moe:
            self.mlp = MoELayer(
                h, cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size, cfg.num_experts,
                cfg.moe_router_topk, dispatcher=cfg.moe_token_dispatcher_type,
                flex_backend=cfg.moe_flex_dispatcher_backend, fused=cfg.moe_grouped_gemm,
                swiglu=cfg.swiglu, shared_ffn=cfg.moe_shared_expert_intermediate_size,
                score_func=cfg.moe_router_score_function, num_groups=cfg.moe_router_num_groups,
                group_topk=cfg.moe_router_group_topk,
                expert_bias=cfg.moe_router_enable_expert_bias,
                aux_loss_coeff=cfg.moe_aux_loss_coeff, z_loss_coeff=cfg.moe_z_loss_coeff,
                capacity_factor=cfg.moe_expert_capacity_factor,
                drop_policy=cfg.moe_token_drop_policy,
                pad_to_capacity=cfg.moe_pad_expert_input_to_capacity)
        else:
            self.mlp = MLP(h, cfg.ffn_hidden_size, cfg.swiglu)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x), mask)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class GPT(nn.Module):
    """Token and position embeddings, :class:`~mfsdp.models.gpt.TransformerLayer` stack, final norm, output head."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embedding = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.layers = nn.ModuleList(
            TransformerLayer(cfg, moe=cfg.num_experts > 0 and i >= cfg.moe_first_dense_layers)
            for i in range(cfg.num_layers))
        self.final_layernorm = nn.LayerNorm(cfg.hidden_size)
        self.output_layer = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[T, vocab]`` for packed ``tokens`` ``[T]`` (or ``[B, S]``, flattened)."""
        if tokens.dim() == 2:
            B, S = tokens.shape
            if cu_seqlens is None:
                cu_seqlens = torch.arange(0, B * S + 1, S, device=tokens.device)
            tokens = tokens.reshape(-1)
        if cu_seqlens is None:
            cu_seqlens = torch.tensor([0, tokens.numel()], device=tokens.device)
        pos = position_ids(cu_seqlens)
        if int(pos.max()) >= self.config.max_position_embeddings:
            raise ValueError(f"a sequence of {int(pos.max()) + 1} tokens exceeds "
                             f"max_position_embeddings={self.config.max_position_embeddings}")
        mask = thd_attention_mask(cu_seqlens)
        x = self.embedding(tokens) + self.position_embedding(pos)
        for layer in self.layers:
            x = layer(x, mask)
        return self.output_layer(self.final_layernorm(x))


def gpt_loss(logits: torch.Tensor, tokens: torch.Tensor,
             cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Next-token cross-entropy summed over predicted tokens, and their count.

    The last token of each sequence predicts nothing (its successor belongs to another sequence).
    """
    target = torch.roll(tokens.reshape(-1), -1)
    valid = torch.ones_like(target, dtype=torch.bool)
    valid[cu_seqlens[1:] - 1] = False
    loss = F.cross_entropy(logits[valid].float(), target[valid], reduction="sum")
    return loss, int(valid.sum())


def with_overrides(cfg: GPTConfig, **changes) -> GPTConfig:
    """A copy of ``cfg`` with ``changes`` applied (``None`` values are ignored)."""
    return replace(cfg, **{k: v for k, v in changes.items() if v is not None})
