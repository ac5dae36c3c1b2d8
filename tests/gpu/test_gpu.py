"""The CUDA/NCCL path, on one GPU: ``make test-gpu`` (marker ``gpu``).

Every test here skips cleanly without CUDA, with the reason. What runs on the GPU machine:
every strategy at world size 1 on NCCL (fp32 and bf16) against the same model trained without
mfsdp; two ranks on the one GPU where NCCL allows it; meta-device init straight onto CUDA;
checkpoints saved on the GPU and loaded on CPU (gloo, 2 ranks) and back; the trainer with the
Llama and DeepSeek miniatures; the three MoE dispatchers; CUDA-event timing of exposed
communication; backend detection with ``init_process_group()`` and no backend; DeepEP only if
its package imports.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from mfsdp.launch import RankError, launch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU: run `make test-gpu` on a GPU machine")]
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


def _cfg(preset: str = "llama-tiny", **changes):
    from mfsdp.models.gpt import GPT_PRESETS

    return replace(GPT_PRESETS[preset], **changes)


def _tokens(step: int, rank: int = 0, world: int = 1, device="cuda"):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 256, (4, 32), generator=g)
    n = ids.shape[0] // world
    return ids[rank * n:(rank + 1) * n].to(device)


def _train(model, opt, steps: int, rank: int = 0, world: int = 1) -> list[float]:
    from mfsdp.models.gpt import gpt_loss

    losses = []
    for step in range(steps):
        ids = _tokens(step, rank, world)
        cu = torch.arange(0, ids.numel() + 1, ids.shape[1], device=ids.device)
        loss, n = gpt_loss(model(ids), ids, cu)
        (loss / n).backward()  # this rank's mean: mfsdp averages gradients over the ranks
        opt.step()
        opt.zero_grad()
        losses.append(loss.item() / n)
    return losses


def _sharded(strategy: str, bf16: bool, steps: int = 3) -> dict:
    from mfsdp import MixedPrecisionPolicy, fully_shard
    from mfsdp.models.gpt import GPT, TransformerLayer

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(_cfg())
    if bf16:
        model = model.to(torch.bfloat16)
    policy = MixedPrecisionPolicy(main_params_dtype=torch.float32,
                                  main_grads_dtype=torch.float32) if bf16 else None
    sharded, opt = fully_shard(model, torch.optim.SGD(model.parameters(), lr=0.5),
                               fsdp_unit_modules=[TransformerLayer], zero_dp_strategy=strategy,
                               **({"mixed_precision_policy": policy} if policy else {}))
    assert sharded.device.type == "cuda"
    losses = _train(sharded, opt, steps, rank, world)
    return {"losses": losses, "params": {k: v.float().cpu()
                                         for k, v in sharded.full_parameters().items()}}


def _reference(steps: int = 3) -> dict:
    from mfsdp.models.gpt import GPT

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(_cfg())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = _train(model, opt, steps)
    return {"losses": losses, "params": {k: v.detach().cpu() for k, v in model.named_parameters()}}


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_every_strategy_on_nccl(strategy, bf16):
    got = launch(_sharded, 1, args=(strategy, bf16), backend="nccl")[0]
    want = _reference()
    tol = 3e-2 if bf16 else 1e-5  # bf16: compute in bf16, fp32 main weights and gradients
    assert got["losses"] == pytest.approx(want["losses"], rel=tol)
    for name, p in want["params"].items():
        assert _rel(got["params"][name], p) < tol, name


def test_two_ranks_share_the_gpu():
    """Two ranks on the one GPU: NCCL where it allows that, else gloo on the CUDA tensors."""
    try:
        got = launch(_sharded, 2, args=("optim_grads_params", False), backend="nccl")[0]
    except RankError as e:
        if "uplicate GPU" not in str(e) and "invalid usage" not in str(e):
            raise
        # NCCL 2.x refuses two communicators' ranks on one device ("invalid usage")
        got = launch(_sharded, 2, args=("optim_grads_params", False), backend="gloo")[0]
    want = _reference()
    for name, p in want["params"].items():
        assert _rel(got["params"][name], p) < 1e-5, name


def _meta_on_cuda(preset: str) -> dict:
    from mfsdp import fully_shard
    from mfsdp.models.gpt import GPT, TransformerLayer

    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(_cfg(preset))
    sharded, _ = fully_shard(model, torch.optim.AdamW(model.parameters()),
                             fsdp_unit_modules=[TransformerLayer], zero_dp_strategy=3,
                             device=torch.device("cuda"), init_model_with_meta_device=True,
                             param_init_fn=model.init_weights)
    return {k: v.cpu() for k, v in sharded.full_parameters().items()}


@pytest.mark.parametrize("preset", ["llama-tiny", "deepseek-proxy"])
def test_meta_init_straight_onto_cuda(preset):
    from mfsdp.models.gpt import GPT

    got = launch(_meta_on_cuda, 1, args=(preset,), backend="nccl")[0]
    torch.manual_seed(0)
    with torch.device("cuda"):
        eager = GPT(_cfg(preset))
    for name, p in eager.named_parameters():
        assert torch.equal(got[name], p.detach().cpu()), name


def _save_on_gpu(root: str) -> dict:
    from mfsdp import fully_shard
    from mfsdp.checkpoint import save_checkpoint
    from mfsdp.models.gpt import GPT, TransformerLayer

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(_cfg("deepseek-proxy"))
    sharded, opt = fully_shard(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                               fsdp_unit_modules=[TransformerLayer], zero_dp_strategy=3)
    _train(sharded, opt, 2)
    save_checkpoint(root, sharded, opt, iteration=2)
    return {k: v.cpu() for k, v in sharded.full_parameters().items()}


def _load(root: str, device: str) -> dict:
    from mfsdp import fully_shard
    from mfsdp.checkpoint import load_checkpoint
    from mfsdp.models.gpt import GPT, TransformerLayer

    torch.manual_seed(1)  # different initial weights: the checkpoint must overwrite them
    with torch.device(device):
        model = GPT(_cfg("deepseek-proxy"))
    sharded, opt = fully_shard(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                               fsdp_unit_modules=[TransformerLayer], zero_dp_strategy=3)
    extra = load_checkpoint(root, sharded, opt)
    assert extra["iteration"] == 2
    return {k: v.cpu() for k, v in sharded.full_parameters().items()}


def test_checkpoint_from_gpu_to_cpu_and_back(tmp_path):
    saved = launch(_save_on_gpu, 1, args=(str(tmp_path),), backend="nccl")[0]
    on_cpu = launch(_load, 2, args=(str(tmp_path), "cpu"))[0]  # gloo, another world size
    back = launch(_load, 1, args=(str(tmp_path), "cuda"), backend="nccl")[0]
    for name, p in saved.items():
        assert torch.equal(on_cpu[name], p), name
        assert torch.equal(back[name], p), name


@pytest.mark.parametrize("preset", ["llama-tiny", "deepseek-proxy"])
def test_trainer_on_the_gpu(preset, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
         "-m", "mfsdp.train", "--use-megatron-fsdp", "--model-preset", preset, "--bf16",
         "--train-iters", "8", "--mock-data", "--seq-length", "64", "--micro-batch-size", "4",
         "--global-batch-size", "8", "--lr", "3e-3", "--log-jsonl", str(tmp_path / "log.jsonl"),
         "--save", str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "(nccl)" in out.stdout
    import json

    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in log)
    assert log[-1]["loss"] < log[0]["loss"]


def _dispatch(dispatcher: str) -> torch.Tensor:
    from mfsdp.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(_cfg("deepseek-proxy", moe_token_dispatcher_type=dispatcher)).cuda()
    with torch.no_grad():
        return model(_tokens(0)).cpu()


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall", "flex"])
def test_dispatchers_on_the_gpu(dispatcher):
    from mfsdp.models.gpt import GPT

    got = launch(_dispatch, 1, args=(dispatcher,), backend="nccl")[0]
    torch.manual_seed(0)
    cpu = GPT(_cfg("deepseek-proxy"))
    with torch.no_grad():
        want = cpu(_tokens(0, device="cpu"))
    assert _rel(got, want) < 1e-4


def test_deepep_when_installed():
    pytest.importorskip("deep_ep", reason="DeepEP's package is not installed")
    got = launch(_dispatch_deepep, 1, backend="nccl")[0]
    assert torch.isfinite(got).all()


def _dispatch_deepep() -> torch.Tensor:
    from mfsdp.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(_cfg("deepseek-proxy", moe_token_dispatcher_type="flex",
                     moe_flex_dispatcher_backend="deepep")).cuda()
    with torch.no_grad():
        return model(_tokens(0)).cpu()


def _exposed_wait() -> dict:
    from mfsdp.fsdp.collectives import CommLog, Handle

    t = torch.ones(1 << 20, device="cuda")
    log = CommLog()
    record = log.add(op="all_reduce", group="dp", sent_bytes=0)
    work = dist.all_reduce(t, async_op=True)
    Handle(work, None, record, cuda=True).wait()
    return {"events": len(record.get("wait_events", [])), "seconds": log.wait_seconds()}


def test_exposed_communication_is_timed_with_cuda_events():
    got = launch(_exposed_wait, 1, backend="nccl")[0]
    assert got["events"] == 1
    assert 0.0 <= got["seconds"] < 1.0


def _default_backend() -> dict:
    from mfsdp.fsdp.collectives import backend_of

    return {"cuda": backend_of(None, torch.device("cuda")),
            "cpu": backend_of(None, torch.device("cpu"))}


def test_init_process_group_without_a_backend_uses_nccl_for_cuda_tensors():
    got = launch(_default_backend, 1, backend=None)[0]  # init_process_group() with no backend
    assert got == {"cuda": "nccl", "cpu": "gloo"}


def test_bench_gpu_mode_reports_throughput_and_mfu(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "mfsdp.cli", "bench", "--device", "cuda", "--world-sizes", "1",
         "--model", "llama", "--dim", "256", "--hidden", "704", "--blocks", "2", "--heads", "4",
         "--kv-heads", "2", "--seq-length", "256", "--vocab-size", "1024", "--local-batch", "4",
         "--rounds", "3", "--bf16", "--systems", "ddp", "fsdp2", "mfsdp-optim_grads_params"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "MFU" in out.stdout and "peak GPU MiB" in out.stdout
