"""Bad input raises the documented error: which argument, what was wrong, what to do."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mfsdp import MixedPrecisionPolicy, ShardingStrategy
from mfsdp.launch import launch
from mfsdp.models.toy import Block, ToyModel


def _bad_inputs() -> dict[str, str]:
    """Run every bad call on a real 2-rank group; return case -> 'ExcType: message'."""
    from torch.distributed.device_mesh import init_device_mesh

    import mfsdp

    def attempt(fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the message is what the test checks
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    tp_mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    cases = {
        "strategy": lambda: mfsdp.fully_shard_model(ToyModel(), zero_dp_strategy="zero4"),
        "meta_no_shard": lambda: mfsdp.fully_shard_model(
            _meta(), zero_dp_strategy="no_shard",
            init_model_with_meta_device=True),
        "unit_matches_nothing": lambda: mfsdp.fully_shard_model(
            ToyModel(), fsdp_unit_modules=[torch.nn.GRU]),
        "unit_string_unknown": lambda: mfsdp.fully_shard_model(
            ToyModel(), fsdp_unit_modules=["no.such.Module"]),
        "mesh_dim": lambda: mfsdp.fully_shard_model(ToyModel(), device_mesh=mesh,
                                                    dp_shard_dim="data"),
        "mesh_dim_missing": lambda: mfsdp.fully_shard_model(ToyModel(), device_mesh=mesh),
        "tp_without_tp_dim": lambda: mfsdp.fully_shard_model(
            _tensor_parallel(tp_mesh["tp"]), device_mesh=tp_mesh, dp_shard_dim="dp"),
        "meta_without_flag": lambda: mfsdp.fully_shard_model(_meta()),
        "wrong_device": lambda: mfsdp.fully_shard_model(ToyModel(), device="meta"),
        "optimizer_first": lambda: mfsdp.fully_shard_optimizer(
            torch.optim.AdamW(ToyModel().parameters())),
        "outer_optim": lambda: mfsdp.fully_shard_model(
            ToyModel(), zero_dp_strategy="optim_grads", outer_dp_sharding_strategy="optim"),
        "double_buffer": lambda: mfsdp.fully_shard_model(
            ToyModel(), zero_dp_strategy="optim", fsdp_double_buffer=True),
        "step_after_no_sync": lambda: _step_after_no_sync(),
        "no_reset_parameters": lambda: mfsdp.fully_shard_model(
            _meta_custom(), init_model_with_meta_device=True),
    }
    out = {name: attempt(fn) for name, fn in cases.items()}
    dist.barrier()
    return out


def _tensor_parallel(tp_mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    return parallelize_module(torch.nn.Sequential(torch.nn.Linear(4, 4)), tp_mesh,
                              {"0": ColwiseParallel()})


def _meta():
    with torch.device("meta"):
        return ToyModel()


class _Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(4))


def _meta_custom():
    with torch.device("meta"):
        return _Scale()


def _step_after_no_sync():
    import mfsdp

    model = ToyModel()
    model, opt = mfsdp.fully_shard(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   fsdp_unit_modules=[Block], zero_dp_strategy="optim")
    with model.no_sync():
        model(torch.randn(2, 32)).sum().backward()
    opt.step()


EXPECTED = {
    "strategy": "ValueError: zero_dp_strategy='zero4' is not a sharding strategy",
    "meta_no_shard": "ValueError: init_model_with_meta_device=True needs a sharded strategy",
    "unit_matches_nothing": "ValueError: fsdp_unit_modules=(GRU) matches no module of ToyModel",
    "unit_string_unknown": "ValueError: fsdp_unit_modules[0]='no.such.Module' cannot be imported",
    "mesh_dim": "ValueError: dp_shard_dim='data' is not a dimension of device_mesh; its "
                "dimensions are ('dp', 'tp')",
    "mesh_dim_missing": "ValueError: dp_shard_dim is required for a 2-D device_mesh",
    "tp_without_tp_dim": "ValueError: parameter '0.weight' is a DTensor over DeviceMesh",
    "meta_without_flag": "ValueError: parameter 'inp.weight' is on the meta device; pass "
                         "init_model_with_meta_device=True",
    "wrong_device": "ValueError: parameter 'inp.weight' is on cpu but the mesh device is meta",
    "optimizer_first": "ValueError: fully_shard_optimizer: param_groups[0]['params'][0] (shape "
                       "(32, 32)) is not managed by mfsdp; call fully_shard_model(model) first",
    "outer_optim": "ValueError: outer_dp_sharding_strategy='optim' needs "
                   "zero_dp_strategy='optim_grads_params', got 'optim_grads'",
    "double_buffer": "ValueError: fsdp_double_buffer=True needs zero_dp_strategy="
                     "'optim_grads_params'",
    "step_after_no_sync": "RuntimeError: the last backward ran under no_sync()",
    "no_reset_parameters": "ValueError: module '_Scale' (_Scale) has parameters but no "
                           "reset_parameters()",
}


@pytest.fixture(scope="module")
def messages():
    return launch(_bad_inputs, 2, timeout=120)


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_input_raises_documented_error(messages, case):
    for rank_messages in messages:
        assert rank_messages[case].startswith(EXPECTED[case]), rank_messages[case]


def test_config_errors_in_process():
    with pytest.raises(ValueError, match=r"main_grads_dtype=torch.int32 must be a floating"):
        MixedPrecisionPolicy(main_grads_dtype=torch.int32)
    assert ShardingStrategy.parse(3) is ShardingStrategy.OPTIM_GRADS_PARAMS
    assert ShardingStrategy.parse("optim").zero_stage == 1
    with pytest.raises(ValueError, match="outer_dp_sharding_strategy=7"):
        ShardingStrategy.parse(7, "outer_dp_sharding_strategy")
    with pytest.raises(RuntimeError, match="needs an initialised process group"):
        import mfsdp

        mfsdp.fully_shard_model(ToyModel())


def _shard_twice() -> list[str]:
    import mfsdp
    from mfsdp.models import Block, ToyModel

    model = ToyModel(dim=8, hidden=16, num_blocks=2)
    wrapped = mfsdp.fully_shard_model(model, fsdp_unit_modules=[Block])
    said = []
    for again in (model, wrapped, wrapped.module):
        try:
            mfsdp.fully_shard_model(again, fsdp_unit_modules=[Block])
        except ValueError as exc:
            said.append(str(exc))
    return said


def test_sharding_a_model_twice_is_refused_by_name():
    # was: "shape '[512]' is invalid for input of size 0"
    said = launch(_shard_twice, 2)[0]
    assert len(said) == 3 and all("already sharded by an earlier fully_shard call" in s
                                  for s in said), said
