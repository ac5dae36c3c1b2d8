"""Hugging Face ``transformers`` models (tiny random configs, nothing downloaded) trained sharded on
real gloo ranks against the same model trained in one process on the whole batch.

Llama (RMSNorm, RoPE, grouped-query attention, SwiGLU), GPT-2 with tied embeddings, Mixtral
(top-2 MoE: expert weights are ``.experts.`` parameters). Every strategy, SGD (a wrong gradient
scale would show: AdamW normalises it away), 2 steps; also Llama with the library's own activation
checkpointing and with a frozen subset (attention projections). Tolerance 1e-5 relative on every
parameter after the steps (only the reduction order differs).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from mfsdp import fully_shard
from mfsdp.launch import launch

transformers = pytest.importorskip("transformers")

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


def _model(family: str):
    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=48, max_position_embeddings=64, attn_implementation="eager")
    if family == "llama":
        cfg = transformers.LlamaConfig(num_key_value_heads=2, **common)
        return transformers.LlamaForCausalLM(cfg), "LlamaDecoderLayer"
    if family == "mixtral":
        cfg = transformers.MixtralConfig(num_key_value_heads=2, num_local_experts=4,
                                         num_experts_per_tok=2, **common)
        return transformers.MixtralForCausalLM(cfg), "MixtralDecoderLayer"
    if family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                      tie_word_embeddings=True, attn_implementation="eager",
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg), "GPT2Block"
    raise ValueError(family)


def _train(family: str, strategy: str, variant: str, steps: int = 2) -> float:
    """Max relative error of any parameter after ``steps`` SGD steps, sharded vs one process."""
    ref, unit = _model(family)
    if variant == "checkpointing":
        ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if variant == "frozen":
        for name, p in ref.named_parameters():
            if any(k in name for k in ("q_proj", "k_proj", "v_proj")):
                p.requires_grad_(False)
    ref.train()
    net = copy.deepcopy(ref)
    params = [p for p in net.parameters() if p.requires_grad]
    model, opt = fully_shard(net, torch.optim.SGD(params, lr=0.5), fsdp_unit_modules=[unit],
                             zero_dp_strategy=strategy)
    ropt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.5)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        ids = torch.randint(0, 64, (4, 16), generator=g)
        n = ids.shape[0] // world
        mine = ids[rank * n:(rank + 1) * n]
        model(input_ids=mine, labels=mine).loss.backward()
        ref(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    full = model.full_parameters()
    worst = 0.0
    for name, p in ref.named_parameters():
        err = ((full[name] - p.detach()).norm() / p.detach().norm().clamp_min(1e-12)).item()
        worst = max(worst, err)
    moved = [name for name, p in ref.named_parameters() if p.requires_grad]
    assert moved
    return worst


def hf_family(family: str) -> dict:
    out = {s: _train(family, s, "plain") for s in STRATEGIES}
    if family == "llama":
        out["checkpointing"] = _train(family, "optim_grads_params", "checkpointing")
        out["frozen"] = _train(family, "optim_grads_params", "frozen")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gpt2", "mixtral"])
def test_transformers_models_match_one_process(family):
    errors = launch(hf_family, 2, args=(family,), timeout=600)[0]
    for case, err in errors.items():
        assert err < 1e-5, f"{family} {case}: parameters differ by {err:.2e} (relative L2)"
