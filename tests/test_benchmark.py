"""``mfsdp bench`` pieces that run here: the Llama model and its FLOPs, throughput and MFU
columns, and the GPU mode's refusal without CUDA (its GPU run is in ``tests/gpu``)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from mfsdp.benchmark_systems import DEFAULTS, LLAMA_1B, model_flops_per_token, reference_parameters
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
    out = launch("mfsdp.benchmark:bench_time", 2, args=(["ddp", "mfsdp-optim_grads_params"], cfg))
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
