"""Small models with the faults ``mfsdp check`` exists to find, one per class of upstream bug.

Each fault comes in through the surface a user writes (a model factory, an optimizer factory),
never through the engine; the tests (``tests/test_check.py``) and the guide (``docs/check.md``)
run the doctor on them and show that it names the layout, the parameter and the step::

    mfsdp check mfsdp.check.faults:tiny                                   # healthy: exit 0
    mfsdp check mfsdp.check.faults:grad_scaled_on_one_rank                # exit 1
    mfsdp check mfsdp.check.faults:loss_averaged_twice
    mfsdp check mfsdp.check.faults:tiny --optimizer-factory mfsdp.check.faults:optimizer_without_final_norm
    mfsdp check mfsdp.check.faults:fused_experts --units Expert --layouts optim_grads_params
    mfsdp check mfsdp.check.faults:tiny --optimizer adamw --resume-fn mfsdp.check.faults:load_weights_only
    mfsdp check mfsdp.check.faults:cancelling_gradients --layouts optim_grads_params bf16_comm
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyLM", "tiny", "grad_scaled_on_one_rank", "loss_averaged_twice",
           "optimizer_without_final_norm", "fused_experts", "FusedMoE", "load_weights_only",
           "cancelling_gradients", "AttentionBlock", "attention", "key_bias_pushed_on_one_rank"]

VOCAB, DIM, HIDDEN, BLOCKS, EXPERTS = 64, 32, 64, 2, 4


def _map_grad(x: torch.Tensor, fn) -> torch.Tensor:
    """``x`` forward; its gradient passes through ``fn`` on the way back."""
    y = x.view_as(x)
    if y.requires_grad:
        y.register_hook(fn)
    return y


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Block(nn.Module):
    """Pre-norm MLP block with a residual; ``grad_factor`` scales ``fc2.weight``'s gradient,
    ``grad_offset`` is added to ``fc1.weight``'s."""

    def __init__(self, grad_factor=None, grad_offset=None):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.grad_factor = grad_factor  # () -> float, or None
        self.grad_offset = grad_offset  # () -> float, or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1 = self.fc1.weight
        if self.grad_offset is not None:
            offset = self.grad_offset()
            w1 = _map_grad(w1, lambda g: g + offset)
        h = F.gelu(F.linear(self.norm(x), w1, self.fc1.bias))
        w = self.fc2.weight
        if self.grad_factor is not None:
            factor = self.grad_factor()
            w = _map_grad(w, lambda g: g * factor)
        return x + F.linear(h, w, self.fc2.bias)


class TinyLM(nn.Module):
    """Token ids ``[B, S]`` to logits ``[B, S, VOCAB]``: embedding, MLP blocks, norm, head."""

    def __init__(self, blocks: list[nn.Module] | None = None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(blocks or [Block() for _ in range(BLOCKS)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.logit_grad_factor = None  # () -> float, or None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        if self.logit_grad_factor is not None:
            factor = self.logit_grad_factor()
            logits = _map_grad(logits, lambda g: g * factor)
        return logits


def tiny() -> TinyLM:
    """The healthy model: every layout passes."""
    return TinyLM()


def grad_scaled_on_one_rank() -> TinyLM:
    """Rank 1 doubles the gradient of ``blocks.1.fc2.weight`` (a per-rank loss scale or token
    count where a global one was meant): the averaged gradient is 1.5x on that parameter only."""
    def factor() -> float:
        return 2.0 if _rank_and_world()[0] == 1 else 1.0

    return TinyLM([Block(), Block(grad_factor=factor)])


def cancelling_gradients() -> TinyLM:
    """``blocks.0.fc1.weight``'s gradient carries a term that is +1 on even ranks and -1 on
    odd ones (zero in one process): per-rank gradients about 100x larger than their sum, as when
    ranks push a shared parameter opposite ways. The sum cancels in fp32; rounded to bf16 before
    the reduction (``bf16_comm``) or computed in bf16 (``bf16``), the true gradient is lost."""
    def offset() -> float:
        rank, world = _rank_and_world()
        return 0.0 if world == 1 else (1.0 if rank % 2 == 0 else -1.0)

    return TinyLM([Block(grad_offset=offset), Block()])


def loss_averaged_twice() -> TinyLM:
    """Divides the gradient by the data-parallel size as if the engine summed over ranks (it
    averages): every update is ``1 / world_size`` of the reference's, the class of upstream's
    NVIDIA/Megatron-LM#5974 (an update 1.3-2x too small)."""
    model = TinyLM()
    model.logit_grad_factor = lambda: 1.0 / _rank_and_world()[1]
    return model


def optimizer_without_final_norm(module: nn.Module, lr: float) -> torch.optim.Optimizer:
    """An optimizer factory that lists the embedding, the blocks and the head, and forgets the
    final norm: ``norm.weight`` and ``norm.bias`` never move."""
    params = [*module.embed.parameters(), *module.blocks.parameters(), *module.head.parameters()]
    return torch.optim.SGD(params, lr=lr)


class Expert(nn.Module):
    """One expert's MLP; its ``forward`` is what a fused parent skips."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(HIDDEN, DIM) * DIM ** -0.5)
        self.w2 = nn.Parameter(torch.randn(DIM, HIDDEN) * HIDDEN ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.gelu(F.linear(x, self.w1)), self.w2)


class FusedMoE(nn.Module):
    """Soft mixture of :class:`Expert` computed in one batched matmul over the stacked expert
    weights: it reads its children's weights and never calls their ``forward``."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        gates = self.router(h).softmax(-1)                              # [B, S, E]
        w1 = torch.stack([e.w1 for e in self.experts])                  # [E, H, D]
        w2 = torch.stack([e.w2 for e in self.experts])                  # [E, D, H]
        flat = h.reshape(1, -1, DIM).expand(EXPERTS, -1, -1)            # [E, T, D]
        out = torch.bmm(F.gelu(torch.bmm(flat, w1.transpose(1, 2))), w2.transpose(1, 2))
        out = (out * gates.reshape(-1, EXPERTS).T.unsqueeze(-1)).sum(0)  # [T, D]
        return x + out.reshape(x.shape)


def fused_experts() -> TinyLM:
    """Two :class:`FusedMoE` blocks. With the experts as FSDP units (``--units Expert``), the
    fused parent bypasses their ``forward``. Passes with
    ``--recursive-gather FusedMoE`` (docs/fused-experts.md)."""
    return TinyLM([FusedMoE() for _ in range(BLOCKS)])


def load_weights_only(path, model, optimizer) -> None:
    """A resume that loads the weights and not the optimizer state: the optimizer starts again
    from empty moments (AdamW's) under the new layout, as when its state was not resharded."""
    from mfsdp.checkpoint import load_checkpoint

    load_checkpoint(path, model)


class AttentionBlock(nn.Module):
    """Pre-norm ``nn.MultiheadAttention`` (causal) with a residual. The key third of its
    ``in_proj_bias`` has a mathematically zero gradient (a bias added to every key shifts every
    score of a query by the same amount, which the softmax cancels): what it gets is rounding.
    ``key_bias_offset`` is added to that third's gradient."""

    def __init__(self, key_bias_offset=None):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, 4, batch_first=True)
        self.key_bias_offset = key_bias_offset  # () -> float, or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        attn = self.attn
        if self.key_bias_offset is None:
            out, _ = attn(h, h, h, attn_mask=mask, need_weights=False)
            return x + out
        offset = self.key_bias_offset()
        extra = torch.zeros(3 * DIM, device=x.device)
        extra[DIM:2 * DIM] = offset
        bias = _map_grad(attn.in_proj_bias, lambda g: g + extra.to(g.dtype))
        out, _ = F.multi_head_attention_forward(
            h.transpose(0, 1), h.transpose(0, 1), h.transpose(0, 1), DIM, attn.num_heads,
            attn.in_proj_weight, bias, None, None, False, 0.0, attn.out_proj.weight,
            attn.out_proj.bias, training=True, need_weights=False, attn_mask=mask)
        return x + out.transpose(0, 1)


def attention() -> TinyLM:
    """Two :class:`AttentionBlock` and two MLP blocks, healthy: under AdamW the key bias moves
    on rounding noise, which ``mfsdp check`` reports as noise-dominated, not as a failure."""
    return TinyLM([AttentionBlock(), Block(), AttentionBlock(), Block()])


def key_bias_pushed_on_one_rank() -> TinyLM:
    """:func:`attention` where rank 1 adds 1e-3 to the key bias's gradient of the first
    attention block (a per-rank term where none should be): a real gradient on a parameter whose
    true gradient is zero. The check must fail it, noise or not."""
    def offset() -> float:
        rank, world = _rank_and_world()
        return 1e-3 if world > 1 and rank == 1 else 0.0

    return TinyLM([AttentionBlock(key_bias_offset=offset), Block(), AttentionBlock(), Block()])
