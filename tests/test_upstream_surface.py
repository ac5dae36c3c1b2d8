"""Upstream Megatron-FSDP's public surface: argument names, flattened mesh dimensions, methods.

Behaviours that upstream's own ``fully_shard`` unit tests check, written here against plain
PyTorch on real gloo ranks: every argument name is accepted; CUDA-only features at a non-default
value are refused by name; ``dp_shard_cp``-style flattened dimensions shard; ``outer='optim'`` at an
outer size of 1 is plain FSDP; decoupled gradients; NaN reports; meta-device init of a module with
``_reset_parameters`` only (``nn.MultiheadAttention``).
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mfsdp
from mfsdp.launch import launch

# Argument names of upstream megatron_fsdp's fully_shard_model / fully_shard (0.6 and the
# releases around it), facts about its API (not its code).
UPSTREAM_MODEL_ARGS = [
    "module", "device_mesh", "dp_shard_dim", "dp_outer_dim", "tp_dim", "hybrid_fsdp_group",
    "hybrid_fsdp_expt_group", "expt_device_mesh", "fsdp_group_ag", "expt_fsdp_group_ag",
    "fsdp_unit_modules", "zero_dp_strategy", "outer_dp_sharding_strategy", "device",
    "init_model_with_meta_device", "mixed_precision_policy", "overlap_grad_reduce",
    "overlap_param_gather", "sync_model_each_microbatch", "preproc_state_dict_for_dcp_ckpt",
    "report_nan_in_param_grad", "average_in_collective", "disable_bucketing",
    "calculate_per_token_loss", "keep_fp8_transpose_cache", "nccl_ub", "fsdp_double_buffer",
    "fsdp_db_use_persist_buf_on_alloc_fail", "disable_symmetric_registration",
    "enable_fine_grained_param_gather", "use_decoupled_grad", "grad_reduce_in_fp32",
    "preserve_fp32_weights", "maxpool_double_buffer", "cuda_graph_mode",
]
UPSTREAM_MODEL_METHODS = ["zero_grad_buffer", "start_grad_sync", "finish_grad_sync",
                          "install_optimized_model_weights", "set_model_auto_sync", "sync",
                          "no_sync", "state_dict", "load_state_dict"]


def test_every_upstream_argument_name_is_accepted():
    model_args = set(inspect.signature(mfsdp.fully_shard_model).parameters)
    assert not set(UPSTREAM_MODEL_ARGS) - model_args
    assert "preproc_state_dict_for_dcp_ckpt" in inspect.signature(
        mfsdp.fully_shard_optimizer).parameters
    step = inspect.signature(mfsdp.ShardedOptimizer.step).parameters
    assert {"sync_grad_before_optimizer_step", "install_optimized_model_weights"} <= set(step)
    assert "zero_grad_buffer" in inspect.signature(mfsdp.ShardedOptimizer.zero_grad).parameters
    for name in UPSTREAM_MODEL_METHODS:
        assert callable(getattr(mfsdp.FullyShardedModule, name)), name


class Block(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), Block(), Block(), nn.Linear(16, 2))


def refused(arg: str, value) -> str:
    try:
        mfsdp.fully_shard_model(_net(), fsdp_unit_modules=[Block], **{arg: value})
    except ValueError as e:
        return str(e)
    return ""


@pytest.mark.slow
def test_cuda_only_features_are_refused_by_name():
    cases = [("nccl_ub", True), ("keep_fp8_transpose_cache", True),
             ("disable_symmetric_registration", True), ("enable_fine_grained_param_gather", True),
             ("cuda_graph_mode", "full_iteration")]
    for (arg, value), msg in zip(cases, launch(_refusals, 1, args=(cases,))[0]):
        assert msg.startswith(f"{arg}={value!r}: ") and "not implemented by mfsdp" in msg, msg


def _refusals(cases):
    return [refused(a, v) for a, v in cases]


def _train(model, opt, ref, ropt, steps=2):
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=g)
        n = 8 // world
        model(x[rank * n:(rank + 1) * n]).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    full = model.full_parameters()
    return max(((full[k] - p.detach()).abs().max().item()) for k, p in ref.named_parameters())


def flattened_mesh() -> float:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    mesh["dp", "cp"]._flatten("dp_shard_cp")
    ref = _net()
    model = mfsdp.fully_shard_model(copy.deepcopy(ref), device_mesh=mesh,
                                    dp_shard_dim="dp_shard_cp", fsdp_unit_modules=[Block])
    assert model.fsdp_state().comms.dp.size == 4
    opt = mfsdp.fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    return _train(model, opt, ref, torch.optim.SGD(ref.parameters(), lr=0.1))


@pytest.mark.slow
def test_flattened_dp_shard_cp_dimension_shards_over_both():
    assert max(launch(flattened_mesh, 4)) < 1e-6


def outer_optim_size_one() -> float:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    ref = _net()
    model = mfsdp.fully_shard_model(copy.deepcopy(ref), device_mesh=mesh, dp_shard_dim="dp_shard",
                                    dp_outer_dim="dp_outer", outer_dp_sharding_strategy="optim",
                                    fsdp_unit_modules=[Block])
    opt = mfsdp.fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    return _train(model, opt, ref, torch.optim.SGD(ref.parameters(), lr=0.1))


@pytest.mark.slow
def test_outer_optim_over_one_rank_is_plain_fsdp():
    assert max(launch(outer_optim_size_one, 2)) < 1e-6


def decoupled_and_nan() -> dict:
    model = mfsdp.fully_shard_model(_net(), fsdp_unit_modules=[Block], use_decoupled_grad=True)
    model(torch.randn(2, 4)).sum().backward()
    ps = list(model.parameters())
    out = {"grad_none": all(p.grad is None for p in ps),
           "decoupled": all(getattr(p, "decoupled_grad", None) is not None for p in ps)}
    model = mfsdp.fully_shard_model(_net(), fsdp_unit_modules=[Block],
                                    report_nan_in_param_grad=True)
    x = torch.randn(2, 4)
    if dist.get_rank() == 1:
        x[0, 0] = float("nan")
    try:
        model(x).sum().backward()
        out["nan"] = ""
    except RuntimeError as e:
        out["nan"] = str(e)
    return out


@pytest.mark.slow
def test_decoupled_grads_and_nan_reports():
    for r in launch(decoupled_and_nan, 2):
        assert r["grad_none"] and r["decoupled"], r
        assert "report_nan_in_param_grad: NaN in the reduced gradients" in r["nan"], r


def meta_multihead_attention() -> list:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.TransformerEncoderLayer(8, 2, 16))
    model = mfsdp.fully_shard_model(model, fsdp_unit_modules=[nn.TransformerEncoderLayer],
                                    init_model_with_meta_device=True)
    return [(n, bool(torch.isfinite(p.full_tensor()).all()), float(p.full_tensor().abs().sum()))
            for n, p in model.module.named_parameters()]


@pytest.mark.slow
def test_meta_init_uses_underscore_reset_parameters():
    params = launch(meta_multihead_attention, 2)[0]
    in_proj = dict((n, s) for n, _, s in params)["1.self_attn.in_proj_weight"]
    assert all(finite for _, finite, _ in params) and in_proj > 0


def buffers_and_maxpool(strategy: str) -> dict:
    policy = mfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32,
                                        main_grads_dtype=torch.float32)
    ref = _net()
    net = copy.deepcopy(ref).to(torch.bfloat16)
    model = mfsdp.fully_shard_model(net, fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
                                    mixed_precision_policy=policy, maxpool_double_buffer=True)
    view = model.param_and_grad_buffer
    groups = view.parameter_groups
    out = {
        "n_groups": len(groups), "n_buckets": len(model.fsdp_state().buckets),
        "model": {g.model_weight_buffer.data.dtype for g in groups},
        "main": {g.main_weight_buffer.data.dtype for g in groups if g.main_weight_buffer},
        "grads": {g.main_grad_buffer.data.dtype for g in groups},
        "pool": model.fsdp_state().pool is not None,
    }
    # the grad view is the live gradient shard: after a backward it holds the reduced gradient
    opt = mfsdp.fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.randn(4, 4, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    model.finish_grad_sync()
    out["grad_view_live"] = all(g.main_grad_buffer.data.abs().sum() > 0 for g in groups)
    opt.zero_grad()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["optim_grads_params"])  # (refused elsewhere: no buffer)
def test_param_and_grad_buffer_view_and_maxpool_double_buffer(strategy):
    r = launch(buffers_and_maxpool, 2, args=(strategy,))[0]
    assert r["n_groups"] == r["n_buckets"] > 1
    assert r["model"] == {torch.bfloat16}
    assert r["main"] == {torch.float32} and r["grads"] == {torch.float32}
    assert r["grad_view_live"]
    assert r["pool"]  # maxpool_double_buffer is the double buffer under ZeRO-3
