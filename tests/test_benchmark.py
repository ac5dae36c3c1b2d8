"""``mfsdp bench`` pieces that run here: the Llama model and its FLOPs, throughput and MFU
columns, and the GPU mode's refusal without CUDA (its GPU run is in ``tests/gpu``)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from mfsdp.tools.benchmark_systems import DEFAULTS, LLAMA_1B, model_flops_per_token, reference_parameters
from mfsdp.launch import launch


def test_llama_1b_is_tinyllamas_size():
    cfg = dict(DEFAULTS, **LLAMA_1B)
    n = sum(p.numel() for p in reference_parameters(cfg))
    assert abs(n - 1.1e9) / 1.1e9 < 0.01  # TinyLlama-1.1B: 1,100,048,384 parameters
    # 6 FLOPs per weight (the embedding lookup excluded) plus causal attention
    assert model_flops_per_token(cfg) == 6 * (n - 32000 * 2048) + 6 * 22 * 2048 * 2048


@pytest.mark.slow
def test_llama_bench_reports_tokens_and_mfu_on_cpu():
    cfg = dict(model="llama", dim=64, hidden=176, blocks=2, heads=4, kv_heads=2, seq_length=32,
               vocab_size=256, local_batch=2, warmup=1, rounds=2, peak_tflops=1.0)
    out = launch("mfsdp.tools.benchmark:bench_time", 2, args=(["ddp", "mfsdp-optim_grads_params"], cfg))
    systems = out[0]["systems"]
    for s in ("ddp", "mfsdp-optim_grads_params"):
        tokens = 2 * 32 * 2
        assert systems[s]["tokens_per_s"] == pytest.approx(tokens / systems[s]["median_s"])
        flops = model_flops_per_token(dict(DEFAULTS, **cfg)) * tokens
        assert systems[s]["mfu"] == pytest.approx(flops / systems[s]["median_s"] / 2 / 1e12)
    # the same model, data and optimizer: the same loss
    assert systems["ddp"]["final_loss"] == pytest.approx(
        systems["mfsdp-optim_grads_params"]["final_loss"], rel=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_mode_without_cuda_is_a_clear_error():
    out = subprocess.run([sys.executable, "-m", "mfsdp.cli", "bench", "--device", "cuda"],
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert "--device cuda, but CUDA is not available here" in out.stderr


def test_a_presets_shape_yields_to_the_size_flags_given():
    from mfsdp.tools.benchmark import build_parser, config_of
    from mfsdp.tools.benchmark_systems import LLAMA_3B

    cfg = config_of(build_parser().parse_args(["--model", "llama-3b", "--seq-length", "4096",
                                               "--num-layers", "4", "--recompute"]))
    assert (cfg["dim"], cfg["hidden"], cfg["heads"], cfg["kv_heads"]) == (3072, 8192, 24, 8)
    assert (cfg["seq_length"], cfg["blocks"], cfg["recompute"]) == (4096, 4, True)
    full = dict(DEFAULTS, **LLAMA_3B)
    n = sum(p.numel() for p in reference_parameters(full))
    assert abs(n - 3.0e9) / 3.0e9 < 0.02  # Llama 3.2 3B's layers with a 32,000-word vocabulary
    # without a preset the defaults apply, and a size flag still wins
    cfg = config_of(build_parser().parse_args(["--model", "gpt", "--hidden-size", "96"]))
    assert (cfg["dim"], cfg["blocks"], cfg["seq_length"]) == (96, DEFAULTS["blocks"], 64)


def test_a_bare_gpt_bench_builds_its_model():
    """``mfsdp bench --model gpt`` with no size flags: heads of 64 channels divide the default
    width (6 fixed heads did not divide 512, and the model refused to build)."""
    from mfsdp.models.gpt import GPT
    from mfsdp.tools.benchmark import build_parser, config_of
    from mfsdp.tools.benchmark_systems import _gpt_config

    cfg = config_of(build_parser().parse_args(["--model", "gpt"]))
    assert cfg["heads"] == cfg["dim"] // 64 == 8
    GPT(_gpt_config(cfg))
    cfg = config_of(build_parser().parse_args(["--model", "gpt", "--hidden-size", "384"]))
    assert cfg["heads"] == 6


def test_fused_adam_runs_on_cpu_as_the_default_adamw():
    """``--fused-adam`` on the CPU (PyTorch's fused AdamW has a CPU kernel since 2.4): the
    bench's AdamW is built fused, and three steps give the default (for-loop) AdamW's weights to
    1e-6 relative (the kernel orders the update's arithmetic differently)."""
    from mfsdp.tools.benchmark import build_parser, config_of
    from mfsdp.tools.benchmark_systems import _adamw

    cfg = config_of(build_parser().parse_args(["--fused-adam"]))
    assert cfg["device"] == "cpu" and cfg["fused_adam"]
    def flat(model):
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    weights = {}
    for fused in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                    torch.nn.Linear(32, 4))
        start = flat(model)
        opt = _adamw(dict(cfg, lr=1e-2, fused_adam=fused))(model.parameters())
        assert opt.defaults["fused"] is (True if fused else None)
        for step in range(3):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        weights[fused] = flat(model)
        assert (weights[fused] - start).abs().max() > 1e-3  # the steps moved the weights
    assert torch.allclose(weights[True], weights[False], rtol=1e-6, atol=1e-7)


def test_grouped_query_attention_reads_each_group_once():
    """The causal kernels take one key/value head per group (``enable_gqa``); the reference
    copies each group's head for every query head it serves (PyTorch's documented equivalent)."""
    import torch.nn.functional as F

    from mfsdp.models.gpt import PackedSequences, _sdpa

    g = torch.Generator().manual_seed(0)
    T, H, G, D = 48, 8, 2, 16
    q, k, v = (torch.randn(T, h, D, generator=g, dtype=torch.float64) for h in (H, G, G))

    def reference(lengths):
        kk, vv = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)
        outs, i = [], 0
        for n in lengths:
            qi, ki, vi = (t[i:i + n].transpose(0, 1) for t in (q, kk, vv))
            outs.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True).transpose(0, 1))
            i += n
        return torch.cat(outs)

    for lengths in ([24, 24], [10, 38], [48]):  # [B, S], packed THD, one sequence
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        got = _sdpa(q, k, v, PackedSequences.from_cu_seqlens(cu))
        assert (got - reference(lengths)).abs().max() < 1e-12, lengths
    mask = torch.ones(T, T, dtype=torch.bool).tril()  # an explicit mask: the copies
    assert (_sdpa(q, k, v, mask) - reference([T])).abs().max() < 1e-12


def _compiled_losses(compiled: bool) -> dict[str, list[float]]:
    import torch.distributed as dist

    from mfsdp import fully_shard
    from mfsdp.models.gpt import GPT, GPTConfig, TransformerLayer

    cfg = GPTConfig(vocab_size=128, num_layers=2, hidden_size=64, ffn_hidden_size=128,
                    num_attention_heads=4, num_query_groups=2, max_position_embeddings=32,
                    normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                    add_bias_linear=False, init_method_std=0.02)
    rank = dist.get_rank()
    out = {}
    for optimizer in ("sgd", "adamw"):  # (the second model reuses the first one's compiled graph)
        torch.manual_seed(0)
        model = GPT(cfg)
        if compiled:
            model.compile_layers()
        opt = (torch.optim.SGD(model.parameters(), lr=0.5) if optimizer == "sgd"
               else torch.optim.AdamW(model.parameters(), lr=1e-2))
        model, opt = fully_shard(model, opt, fsdp_unit_modules=[TransformerLayer],
                                 zero_dp_strategy="optim_grads_params")
        losses = []
        for step in range(3):
            tokens = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(step))
            tokens = tokens[rank * 2:(rank + 1) * 2]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(tokens).float(),
                                                     tokens.roll(-1, 1).reshape(-1))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        out[optimizer] = losses
    return out


@pytest.mark.extended  # inductor compiles the layer on the CPU (a minute or two here)
@pytest.mark.timeout(2400)
def test_compiled_layers_train_as_eager_ones_under_fully_shard():
    eager = launch(_compiled_losses, 2, args=(False,))
    compiled = launch(_compiled_losses, 2, args=(True,), timeout=2000)
    for e, c in zip(eager, compiled):  # each rank, SGD and AdamW, three steps
        for optimizer in ("sgd", "adamw"):
            assert c[optimizer] == pytest.approx(e[optimizer], rel=1e-5, abs=1e-6), optimizer
        assert e["sgd"][2] != e["sgd"][0]  # the steps changed the weights
