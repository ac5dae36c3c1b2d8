"""What one transformer layer of the trainer's model keeps for backward, measured on CPU.

:func:`saved_bytes` runs one :class:`~mfsdp.models.gpt.TransformerLayer` forward in bf16 under
``torch.autograd.graph.saved_tensors_hooks`` and adds up the distinct storages it saves (a view
counts its whole storage once; the layer's parameters and the input it was given are left
out). The planner's per-layer term (:func:`mfsdp.tools.plan_terms.layer_activations`) is
checked against it (``tests/test_layer_bytes.py``).

Its coefficients came from seven shapes at 512 and 1,024 tokens, each varying one of hidden
(256, 512), ffn_hidden (688, 1,024), heads (4, 8), kv heads (2, 8) and head width (32, 64)
from hidden 256, ffn_hidden 688, 8 heads, 2 kv heads, head width 32; the test uses another.
"""

from __future__ import annotations

import torch

__all__ = ["saved_bytes"]


def saved_bytes(hidden: int, ffn_hidden: int, num_heads: int, num_kv_heads: int,
                tokens: int, head_dim: int | None = None) -> int:
    """Bytes of the distinct storages one bf16 Llama layer (RMSNorm, RoPE, grouped-query
    attention through SDPA's causal kernel, SwiGLU, no biases) saves for backward, for
    ``tokens`` tokens of one sequence (``head_dim``: ``hidden / num_heads`` unless given)."""
    from mfsdp.models.gpt import GPTConfig, PackedSequences, TransformerLayer, rope_inv_freq

    cfg = GPTConfig(num_layers=1, hidden_size=hidden, ffn_hidden_size=ffn_hidden,
                    num_attention_heads=num_heads, num_query_groups=num_kv_heads,
                    kv_channels=head_dim,
                    vocab_size=64, swiglu=True, add_bias_linear=False,
                    normalization="RMSNorm", position_embedding_type="rope")
    torch.manual_seed(0)
    layer = TransformerLayer(cfg, moe=False).to(torch.bfloat16)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(tokens)
    freqs = pos.float().unsqueeze(1) * rope_inv_freq(cfg).unsqueeze(0)
    emb = torch.cat([freqs, freqs], dim=-1)
    rope = (emb.cos(), emb.sin())
    mask = PackedSequences.from_cu_seqlens(torch.tensor([0, tokens]))
    skip = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    skip |= {x.untyped_storage().data_ptr()} | {r.untyped_storage().data_ptr() for r in rope}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x, mask, rope)
    out.float().sum().backward()  # the saved tensors were real ones: backward runs
    return sum(seen.values())
