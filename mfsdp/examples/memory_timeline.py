"""What one ZeRO-3 training step holds, event by event, against the planner's bounds.

The guide's recipe (``recipes/plot_step_memory_timeline.py``) runs :func:`step_timeline` on 2
gloo ranks and plots it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["step_timeline"]


def step_timeline(num_layers: int = 6, hidden: int = 128, vocab: int = 2048,
                  seq_length: int = 64) -> dict:
    """Shard a small Llama-style GPT (ZeRO-3, fp32, one unit per layer), record
    the memory timeline of one training step, and return it with the planner's
    bounds for the same model and layout and the engine's own peak counters."""
    import mfsdp
    from mfsdp.models.gpt import GPT, GPT_PRESETS, TransformerLayer, with_overrides
    from mfsdp.tools.memory_timeline import record_memory_timeline
    from mfsdp.tools.plan import Layout, ModelConfig, plan

    cfg = with_overrides(GPT_PRESETS["llama-tiny"], num_layers=num_layers,
                         hidden_size=hidden, ffn_hidden_size=11 * hidden // 4,
                         vocab_size=vocab)
    torch.manual_seed(0)  # every rank builds the same model
    model = GPT(cfg)
    model, optimizer = mfsdp.fully_shard(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3),
        fsdp_unit_modules=[TransformerLayer], zero_dp_strategy="optim_grads_params")
    torch.manual_seed(dist.get_rank())  # each rank its own batches

    def step() -> None:
        tokens = torch.randint(0, vocab, (2, seq_length))
        # (the model's output is [B x S, V])
        logits = model(tokens).view(*tokens.shape, vocab)
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # the first forward records the units' order, which later ones prefetch by
    with record_memory_timeline(model) as timeline:
        step()

    # the planner's two peak terms for this model on this layout (fp32 throughout)
    layout = Layout(world_size=dist.get_world_size(), strategy="optim_grads_params",
                    compute_bytes=4, main_bytes=4, grad_bytes=4,
                    seq_length=seq_length, micro_batch=2)
    bounds = plan(ModelConfig.from_gpt(cfg), layout).memory
    engine = model.fsdp_state().memory
    return {"samples": [tuple(s) for s in timeline],
            "bounds": {k: bounds[k] for k in ("gathered", "grad_buffers")},
            "peaks": timeline.peaks(), "peaks_without_root": timeline.peaks(root=False),
            "engine": {"gathered": engine["peak_gathered_bytes"],
                       "grad_buffers": engine["peak_grad_full_bytes"]}}
