"""The decoder-only transformer families people train, on packed THD sequences: one configurable
model (as Megatron-LM's ``GPTModel`` is one class) that builds GPT-2-like, Llama / Qwen2 / Qwen3
dense, Mixtral / Qwen2-MoE / Qwen3-MoE and DeepSeek-V3 (multi-head latent attention) architectures.

Each architecture maps one to one onto a Hugging Face ``transformers`` class
(:mod:`mfsdp.models.hf` converts configurations and weights both ways): RMSNorm or LayerNorm,
rotary (with Llama-3 frequency scaling, interleaved for DeepSeek) or learned positions,
grouped-query attention with Megatron-LM's fused ``linear_qkv`` layout (per query group: the
group's query heads, then its key head, then its value head), SwiGLU or GELU, optional biases,
QK-norm, tied or untied output, and MoE layers with softmax or sigmoid group-limited routing,
an expert score-correction bias, a routed scaling factor and shared experts (gated or not).

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
>>> llama = GPT(GPT_PRESETS["llama-tiny"])      # RMSNorm, RoPE, GQA, SwiGLU, no biases
>>> [n for n, _ in llama.layers[0].named_parameters()]
['input_layernorm.weight', 'self_attention.linear_qkv.weight', 'self_attention.linear_proj.weight', 'pre_mlp_layernorm.weight', 'mlp.linear_fc1.weight', 'mlp.linear_fc2.weight']
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from mfsdp.models.config import GPT_PRESETS, GPTConfig, with_overrides
from mfsdp.models.context_parallel import next_token_targets
from mfsdp.moe.experts import FusedExperts
from mfsdp.moe.layer import MoELayer

__all__ = ["GPT", "GPTConfig", "GPT_PRESETS", "MLAttention", "PackedSequences", "RMSNorm",
           "TransformerLayer",
           "apply_rotary", "gpt_loss", "pack_sequences", "position_ids", "rope_inv_freq",
           "thd_attention_mask", "with_overrides"]

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


class RMSNorm(nn.Module):
    """Root-mean-square normalisation computed in fp32, scaled by a learned ``weight`` (as Llama)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        """Weight back to ones."""
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _norm(cfg: GPTConfig, dim: int) -> nn.Module:
    if cfg.normalization == "RMSNorm":
        return RMSNorm(dim, cfg.norm_epsilon)
    return nn.LayerNorm(dim, eps=cfg.norm_epsilon)


def rope_inv_freq(cfg: GPTConfig, device=None) -> torch.Tensor:
    """RoPE's inverse frequencies ``[rotary_dim / 2]`` with Llama-3 scaling when configured.

    >>> cfg = GPTConfig(position_embedding_type="rope", hidden_size=8,
    ...                 num_attention_heads=2)
    >>> rope_inv_freq(cfg)
    tensor([1.0000, 0.0100])
    """
    dim = cfg.rotary_dim
    inv = 1.0 / (cfg.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device)
                                     .float() / dim))
    if cfg.rope_scaling_factor is not None:
        factor, low, high = (cfg.rope_scaling_factor, cfg.rope_low_freq_factor,
                             cfg.rope_high_freq_factor)
        old = cfg.rope_original_max_position_embeddings
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 interleaved: bool = False) -> torch.Tensor:
    """Rotate ``x`` (``[T, heads, dim]``) by the angles whose ``cos``/``sin`` are ``[T, dim]``.

    The two halves of the channels form the pairs (Llama), or with ``interleaved`` the even and
    odd channels do (DeepSeek), whose output lists the rotated even channels then the odd ones.
    """
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    if interleaved:
        half = cos.shape[-1] // 2
        c, s = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


@dataclass(frozen=True)
class PackedSequences:
    """Where each packed sequence starts and ends: what attention needs instead of a ``[T, T]`` mask.

    Causal attention runs per sequence (``is_causal``, so the fused flash or memory-efficient
    kernels apply), never over the whole packed batch: a ``[T, T]`` mask costs ``T**2`` memory
    and compute (8 GiB of fp32 scores per layer for 4 x 2,048 tokens and 32 heads).
    """

    cu_seqlens: torch.Tensor
    lengths: tuple[int, ...]

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor) -> "PackedSequences":
        """Build from cumulative offsets (one host read of them per forward)."""
        bounds = cu_seqlens.tolist()
        return cls(cu_seqlens, tuple(b - a for a, b in zip(bounds[:-1], bounds[1:])))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          mask: "torch.Tensor | PackedSequences") -> torch.Tensor:
    if not isinstance(mask, (torch.Tensor, PackedSequences)):  # context parallel: every rank's
        k, v = mask.gather(k), mask.gather(v)                   # keys and values, masked by place
        mask = mask.mask
    # Grouped-query attention: ``k``/``v`` may hold fewer heads than ``q`` (each serving
    # ``H // G`` query heads). The causal kernels read them as they are (``enable_gqa``: no copy
    # of the keys and values per query head); an explicit mask gets the copies.
    gqa = k.shape[1] != q.shape[1]
    if isinstance(mask, torch.Tensor):  # an explicit [T, T] mask
        if gqa:
            per = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(per, dim=1), v.repeat_interleave(per, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                             v.transpose(0, 1), attn_mask=mask)
        return out.transpose(0, 1)
    lengths = [n for n in mask.lengths if n > 0]
    T, H = q.shape[0], q.shape[1]
    if len(set(lengths)) == 1:  # [B, S]: one batched causal call
        B, S = len(lengths), lengths[0]
        out = F.scaled_dot_product_attention(
            *(t.reshape(B, S, t.shape[1], t.shape[-1]).transpose(1, 2) for t in (q, k, v)),
            is_causal=True, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(T, H, v.shape[-1])
    outs = [F.scaled_dot_product_attention(qi.transpose(0, 1).unsqueeze(0),
                                           ki.transpose(0, 1).unsqueeze(0),
                                           vi.transpose(0, 1).unsqueeze(0), is_causal=True,
                                           enable_gqa=gqa)
            .squeeze(0).transpose(0, 1)
            for qi, ki, vi in zip(*(t.split(lengths) for t in (q, k, v)))]
    return torch.cat(outs)


def _core_attention(q, k, v, mask, recompute: bool) -> torch.Tensor:
    """Scores, softmax and weighted sum (``[T, heads, dim]`` each); with ``recompute`` nothing
    inside is kept for backward (Megatron-LM's selective recomputation)."""
    if recompute and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(_sdpa, q, k, v, mask, use_reentrant=False)
    return _sdpa(q, k, v, mask)


def _linear(cfg: GPTConfig, n_in: int, n_out: int, bias: bool | None = None) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=cfg.add_bias_linear if bias is None else bias)


class Attention(nn.Module):
    """Self-attention on packed tokens with a block-diagonal causal mask: multi-head or grouped-query.

    ``linear_qkv`` stacks, for each of the ``num_query_groups`` groups, the group's query heads, its
    key head and its value head (Megatron-LM's layout); ``q_layernorm`` / ``k_layernorm`` (QK-norm,
    Qwen3) normalise each head before RoPE.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads, self.groups = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads
        self.dim, self.interleaved = cfg.head_dim, cfg.rotary_interleaved
        self.linear_qkv = _linear(cfg, cfg.hidden_size, (self.heads + 2 * self.groups) * self.dim,
                                  cfg.add_bias_linear or cfg.add_qkv_bias)
        if cfg.qk_layernorm:
            self.q_layernorm = RMSNorm(self.dim, cfg.norm_epsilon)
            self.k_layernorm = RMSNorm(self.dim, cfg.norm_epsilon)
        self.linear_proj = _linear(cfg, self.heads * self.dim, cfg.hidden_size)
        self.selective = cfg.recompute_granularity == "selective"

    def forward(self, x: torch.Tensor, mask: torch.Tensor, rope=None) -> torch.Tensor:
        T = x.shape[0]
        per = self.heads // self.groups
        # (-1: the groups this rank holds, all of them unless linear_qkv is column-parallel)
        qkv = self.linear_qkv(x).view(T, -1, per + 2, self.dim)
        q = qkv[:, :, :per].reshape(T, -1, self.dim)
        k, v = qkv[:, :, per], qkv[:, :, per + 1]
        if hasattr(self, "q_layernorm"):
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rope is not None:
            q, k = apply_rotary(q, *rope, self.interleaved), apply_rotary(k, *rope, self.interleaved)
        out = _core_attention(q, k, v, mask, self.selective)  # (k, v: one head per group)
        return self.linear_proj(out.reshape(T, -1))


class MLAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3): queries and keys/values through low-rank latents.

    Queries: ``linear_q_down_proj`` -> ``q_layernorm`` -> ``linear_q_up_proj`` (or one
    ``linear_q_proj`` without ``q_lora_rank``), ``qk_head_dim`` plain and ``qk_pos_emb_head_dim``
    rotary channels per head. Keys and values: ``linear_kv_down_proj`` gives the latent and one
    rotary key shared by all heads; ``kv_layernorm`` -> ``linear_kv_up_proj`` gives each head's
    plain key and value.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        h, n = cfg.hidden_size, cfg.num_attention_heads
        self.heads, self.kv_lora_rank = n, cfg.kv_lora_rank
        self.dn, self.dr, self.dv = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        self.interleaved = cfg.rotary_interleaved
        if cfg.q_lora_rank:
            self.linear_q_down_proj = nn.Linear(h, cfg.q_lora_rank, bias=False)
            self.q_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
            self.linear_q_up_proj = nn.Linear(cfg.q_lora_rank, n * (self.dn + self.dr), bias=False)
        else:
            self.linear_q_proj = nn.Linear(h, n * (self.dn + self.dr), bias=False)
        self.linear_kv_down_proj = nn.Linear(h, cfg.kv_lora_rank + self.dr, bias=False)
        self.kv_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        self.linear_kv_up_proj = nn.Linear(cfg.kv_lora_rank, n * (self.dn + self.dv), bias=False)
        self.linear_proj = nn.Linear(n * self.dv, h, bias=False)
        self.selective = cfg.recompute_granularity == "selective"

    def forward(self, x: torch.Tensor, mask: torch.Tensor, rope=None) -> torch.Tensor:
        T, n = x.shape[0], self.heads
        if hasattr(self, "linear_q_proj"):
            q = self.linear_q_proj(x)
        else:
            q = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x)))
        # (-1: the heads this rank holds, all of them unless the up-projections are split)
        q_nope, q_rot = q.view(T, -1, self.dn + self.dr).split([self.dn, self.dr], dim=-1)
        n = q_nope.shape[1]
        latent, k_rot = self.linear_kv_down_proj(x).split([self.kv_lora_rank, self.dr], dim=-1)
        kv = self.linear_kv_up_proj(self.kv_layernorm(latent)).view(T, n, self.dn + self.dv)
        k_nope, v = kv.split([self.dn, self.dv], dim=-1)
        q_rot = apply_rotary(q_rot, *rope, self.interleaved)
        k_rot = apply_rotary(k_rot.view(T, 1, self.dr), *rope, self.interleaved)
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(T, n, self.dr)], dim=-1)
        out = _core_attention(q, k, v, mask, self.selective)
        return self.linear_proj(out.reshape(T, n * self.dv))


class MLP(nn.Module):
    """The dense feed-forward block (SwiGLU stacks gate and up in ``linear_fc1``)."""

    def __init__(self, hidden: int, ffn: int, swiglu: bool, bias: bool = True):
        super().__init__()
        self.swiglu = swiglu
        self.linear_fc1 = nn.Linear(hidden, 2 * ffn if swiglu else ffn, bias=bias)
        self.linear_fc2 = nn.Linear(ffn, hidden, bias=bias)

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
        self.input_layernorm = _norm(cfg, h)
        self.self_attention = MLAttention(cfg) if cfg.multi_latent_attention else Attention(cfg)
        self.pre_mlp_layernorm = _norm(cfg, h)
        if moe:
            self.mlp = MoELayer(
                h, cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size, cfg.num_experts,
                cfg.moe_router_topk, dispatcher=cfg.moe_token_dispatcher_type,
                flex_backend=cfg.moe_flex_dispatcher_backend, fused=False,  # GPT fuses them
                swiglu=cfg.swiglu, shared_ffn=cfg.moe_shared_expert_intermediate_size,
                shared_gate=cfg.moe_shared_expert_gate,
                score_func=cfg.moe_router_score_function, num_groups=cfg.moe_router_num_groups,
                group_topk=cfg.moe_router_group_topk,
                expert_bias=cfg.moe_router_enable_expert_bias,
                aux_loss_coeff=cfg.moe_aux_loss_coeff, z_loss_coeff=cfg.moe_z_loss_coeff,
                capacity_factor=cfg.moe_expert_capacity_factor,
                drop_policy=cfg.moe_token_drop_policy,
                pad_to_capacity=cfg.moe_pad_expert_input_to_capacity,
                scaling_factor=cfg.moe_router_topk_scaling_factor or 1.0,
                normalize=(cfg.moe_router_score_function == "sigmoid"
                           or not cfg.moe_router_pre_softmax))
        else:
            self.mlp = MLP(h, cfg.ffn_hidden_size, cfg.swiglu, cfg.add_bias_linear)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, rope=None) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x), mask, rope)
        return x + self.mlp(self.pre_mlp_layernorm(x))


def _fork_rng_here():
    """``fork_rng`` over the CPU generator and the generator of the default device, if CUDA."""
    dev = torch.get_default_device()
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return torch.random.fork_rng(devices=[index], device_type="cuda")
    return torch.random.fork_rng(devices=[])


class TiedOutput(nn.Module):
    """The output projection of a model whose output layer is its embedding: ``x @ weight.T``
    with the embedding's weight passed in. A module of its own (with no parameter) so that a
    parallelisation plan can place its input and output, as it does an ``output_layer``'s
    (see :func:`mfsdp.models.tensor_parallel.tp_plan`)."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)


class GPT(nn.Module):
    """Embeddings, a :class:`~mfsdp.models.gpt.TransformerLayer` stack, final norm and output head.

    With ``share_embeddings_and_output_weights`` the output projection reuses
    ``embedding.weight`` (there is no ``output_layer``; :class:`TiedOutput`, which holds no
    weight, applies it).
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        # With init_method_std the constructors' own draws are discarded and init_weights draws
        # module by module: eager construction and meta-device init (param_init_fn=init_weights,
        # same order) give the same weights.
        # The fork covers the generator of the device being built on (CUDA too), so the
        # constructors' draws leave no trace there either.
        with (_fork_rng_here() if cfg.init_method_std is not None else contextlib.nullcontext()):
            self._build(cfg)
        if cfg.init_method_std is not None:
            self.apply(self.init_weights)
        if cfg.moe_grouped_gemm:  # fuse after initialising: fused and sequential experts agree
            for layer in self.layers:
                if isinstance(layer.mlp, MoELayer):
                    layer.mlp.experts = FusedExperts.from_sequential(layer.mlp.experts)

    def _build(self, cfg: GPTConfig) -> None:
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if cfg.position_embedding_type == "learned_absolute":
            self.position_embedding = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.layers = nn.ModuleList(
            TransformerLayer(cfg, moe=cfg.num_experts > 0 and i >= cfg.moe_first_dense_layers)
            for i in range(cfg.num_layers))
        self.final_layernorm = _norm(cfg, cfg.hidden_size)
        if cfg.share_embeddings_and_output_weights:
            self.tied_output = TiedOutput()
        else:
            self.output_layer = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def init_weights(self, module: nn.Module) -> None:
        """Initialise ``module``'s own weights as Megatron-LM does with ``init_method_std``.

        Linear and embedding weights from N(0, std), biases zero, norms to one; other modules
        keep their ``reset_parameters``. Usable as ``param_init_fn`` for meta-device init.
        """
        std = self.config.init_method_std
        if std is None:
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
            return
        from mfsdp.moe.experts import GroupedLinear

        with torch.no_grad():
            if isinstance(module, GroupedLinear):  # fused experts (meta-device init)
                module.weight.normal_(0.0, std)
                return
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, (RMSNorm, nn.LayerNorm)):
                module.reset_parameters()
            elif hasattr(module, "reset_parameters") and not list(module.children()):
                module.reset_parameters()

    def compile_layers(self, **options) -> "GPT":
        """Compile each layer's ``forward`` with :func:`torch.compile` (torchtitan's per-block
        compile), so that normalisation, rotary embedding, SwiGLU and the residual additions run
        as fused kernels; returns the model.

        Only ``forward`` is compiled: a layer's module hooks (an FSDP unit's all-gather before it
        and reduce-scatter after it) stay outside the compiled code, so this composes with
        :func:`mfsdp.fully_shard`, PyTorch's FSDP2 and activation recompute, called before or
        after sharding. Layers of one shape share one compiled graph. ``options`` go to
        :func:`torch.compile` (e.g. ``mode="max-autotune-no-cudagraphs"``).

        >>> cfg = GPTConfig(vocab_size=64, num_layers=2, hidden_size=32,
        ...                 ffn_hidden_size=64, num_attention_heads=4)
        >>> model = GPT(cfg).compile_layers()
        >>> kinds = [type(layer.forward).__name__ for layer in model.layers]
        >>> kinds != ["method", "method"]
        True
        """
        for layer in self.layers:
            layer.forward = torch.compile(layer.forward, **options)
        return self

    def _layers(self, x: torch.Tensor, mask: torch.Tensor, rope) -> torch.Tensor:
        cfg = self.config
        full = cfg.recompute_granularity == "full" and torch.is_grad_enabled()
        if not full:
            for layer in self.layers:
                x = layer(x, mask, rope)
            return x
        n, layers = cfg.recompute_num_layers, list(self.layers)
        ckpt = torch.utils.checkpoint.checkpoint
        if cfg.recompute_method == "block":
            for i, layer in enumerate(layers):
                x = ckpt(layer, x, mask, rope, use_reentrant=False) if i < n else layer(x, mask, rope)
            return x

        def chunk(x, *group):
            for layer in group:
                x = layer(x, mask, rope)
            return x

        for start in range(0, len(layers), n):
            x = ckpt(chunk, x, *layers[start:start + n], use_reentrant=False)
        return x

    def forward(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                context=None) -> torch.Tensor:
        """Logits ``[T, vocab]`` for packed ``tokens`` ``[T]`` (or ``[B, S]``, flattened).

        With ``context`` (a :class:`~mfsdp.models.context_parallel.ContextParallelSplit`),
        ``tokens`` are this CP rank's share of the packed batch whose offsets the split holds.
        """
        if tokens.dim() == 2:
            B, S = tokens.shape
            if cu_seqlens is None:
                cu_seqlens = torch.arange(0, B * S + 1, S, device=tokens.device)
            tokens = tokens.reshape(-1)
        if cu_seqlens is None:
            cu_seqlens = torch.tensor([0, tokens.numel()], device=tokens.device)
        pos = position_ids(cu_seqlens)
        if context is not None:  # this rank's tokens of the whole packed batch
            pos = position_ids(context.cu_seqlens)[context.index]
        cfg = self.config
        if int(pos.max()) >= cfg.max_position_embeddings and \
                cfg.position_embedding_type == "learned_absolute":
            raise ValueError(f"a sequence of {int(pos.max()) + 1} tokens exceeds "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
        mask = PackedSequences.from_cu_seqlens(cu_seqlens) if context is None else context
        x = self.embedding(tokens)
        rope = None
        if cfg.position_embedding_type == "learned_absolute":
            x = x + self.position_embedding(pos)
        else:
            freqs = pos.float().unsqueeze(1) * rope_inv_freq(cfg, tokens.device).unsqueeze(0)
            emb = torch.cat([freqs, freqs], dim=-1)
            rope = (emb.cos(), emb.sin())
        x = self._layers(x, mask, rope)
        x = self.final_layernorm(x)
        if cfg.share_embeddings_and_output_weights:
            return self.tied_output(x, self.embedding.weight)
        return self.output_layer(x)


def gpt_loss(logits: torch.Tensor, tokens: torch.Tensor,
             cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Next-token cross-entropy summed over predicted tokens, and their count.

    The last token of each sequence predicts nothing (its successor belongs to another sequence).
    """
    tokens = tokens.reshape(-1)
    target, valid = next_token_targets(tokens, cu_seqlens,
                                       torch.ones_like(tokens, dtype=torch.bool))
    loss = F.cross_entropy(logits[valid].float(), target[valid], reduction="sum")
    return loss, int(valid.sum())
