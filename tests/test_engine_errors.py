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
            ToyModel(), fsdp_db_use_persist_buf_on_alloc_fail=True),
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
    "double_buffer": "ValueError: fsdp_db_use_persist_buf_on_alloc_fail=True is the double "
                     "buffer's fallback; pass fsdp_double_buffer=True",
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


def _disagreeing_ranks() -> dict[str, object]:
    """Each case on a real 2-rank group: what fully_shard says and does when the ranks disagree."""
    import logging

    import mfsdp
    from mfsdp.models import Block, ToyModel

    rank = dist.get_rank()
    said: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    logging.getLogger("mfsdp").addHandler(Catch())

    def seeded(seed, **kw):
        torch.manual_seed(seed)
        return ToyModel(dim=8, hidden=16, num_blocks=2, **kw)

    def wrap(build, **kw):
        """(error or None, what rank 0 built, the wrapped model's full weights, lines said)"""
        said.clear()
        model = build()
        reference = [None]
        if rank == 0:
            reference[0] = {k: v.clone() for k, v in model.state_dict().items()}
        dist.broadcast_object_list(reference, src=0)
        try:
            wrapped = mfsdp.fully_shard_model(model, fsdp_unit_modules=[Block], **kw)
        except ValueError as exc:
            return str(exc), None, None, list(said)
        full = {k.removeprefix("module."): v.full_tensor() if hasattr(v, "full_tensor") else v
                for k, v in wrapped.state_dict().items()}
        same = all(torch.equal(full[k], reference[0][k]) for k in reference[0])
        return None, same, full, list(said)

    out = {}
    for strategy in ("no_shard", "optim_grads_params"):
        out[f"same-{strategy}"] = wrap(lambda: seeded(0), zero_dp_strategy=strategy)[::3]
        out[f"seed-{strategy}"] = wrap(lambda: seeded(rank), zero_dp_strategy=strategy)[::3]
        out[f"seed-{strategy}-equal"] = wrap(lambda: seeded(rank), zero_dp_strategy=strategy)[1]

    def one_tensor():  # weights loaded on one rank differ in one element
        m = seeded(0)
        if rank == 0:
            with torch.no_grad():
                m.blocks[1].fc2.bias[3] += 1e-7
        return m

    err, same, _, lines = wrap(one_tensor)
    out["one-element"] = (err, same, lines)
    out["blocks"] = wrap(lambda: seeded(0) if rank == 0 else ToyModel(dim=8, hidden=16,
                                                                       num_blocks=3))[0]
    out["shape"] = wrap(lambda: seeded(0) if rank == 0 else ToyModel(dim=8, hidden=24,
                                                                      num_blocks=2))[0]
    out["dtype"] = wrap(lambda: seeded(0) if rank == 0 else seeded(0).double())[0]
    # meta-device initialisation with different generator states across HSDP replicas
    from mfsdp import ParallelLayout

    groups = ParallelLayout(2, 2, 1, None).create_groups()
    said.clear()
    torch.manual_seed(rank)
    with torch.device("meta"):
        meta = ToyModel(dim=8, hidden=16, num_blocks=2)
    wrapped = mfsdp.fully_shard_model(meta, fsdp_unit_modules=[Block],
                                      init_model_with_meta_device=True, process_groups=groups)
    mine = torch.cat([v.full_tensor().flatten() for v in wrapped.state_dict().values()])
    everyone = [None, None]
    dist.all_gather_object(everyone, mine)
    out["meta-rng-outer"] = (bool(torch.equal(everyone[0], everyone[1])), list(said))
    return out


def test_ranks_that_disagree_are_refused_or_aligned_at_wrap_time():
    """Different models (which would hang in mismatched collectives): one ValueError on every
    rank naming the first difference. Different initial values (PyTorch seeds each process at
    random; under no_shard the replicas would train apart while the logged loss looks fine, and
    weights loaded on one rank only would be mixed with random rows): the group's first rank
    broadcasts, as Megatron-LM's DDP does, and rank 0 says so in one line."""
    said = launch(_disagreeing_ranks, 2)
    out, other = said
    for strategy in ("no_shard", "optim_grads_params"):
        assert out[f"same-{strategy}"] == (None, []) and other[f"same-{strategy}"] == (None, [])
        err, lines = out[f"seed-{strategy}"]
        assert err is None and len(lines) == 1, lines
        assert "the ranks held different initial values of" in lines[0]
        assert "as Megatron-LM's DDP does" in lines[0]
        assert other[f"seed-{strategy}"] == (None, [])  # rank 1 says nothing
        assert out[f"seed-{strategy}-equal"] and other[f"seed-{strategy}-equal"]
    err, same, lines = other["one-element"]
    assert err is None and same  # rank 1 now holds rank 0's value
    assert out["one-element"][2] == ["fully_shard: the ranks held different initial values of 1 "
                                     "parameter copy (e.g. 'blocks.1.fc2.bias'); every "
                                     "data-parallel replica now starts from its group's first "
                                     "rank, as Megatron-LM's DDP does. Seed every rank alike "
                                     "(torch.manual_seed) or load the weights on every rank to "
                                     "start from your own"]
    for r in (out, other):
        assert ("the ranks wrapped different models: rank 1 has parameter 'blocks.2."
                in r["blocks"]), r["blocks"]
        assert ("is (16, 8) torch.float32 on rank 0 but (24, 8) torch.float32 on rank 1"
                in r["shape"]), r["shape"]
        assert "(8, 8) torch.float32 on rank 0 but (8, 8) torch.float64 on rank 1" in r["dtype"]
    assert out["meta-rng-outer"][0] and other["meta-rng-outer"][0]
    assert len(out["meta-rng-outer"][1]) == 1 and "random-number generator state" in \
        out["meta-rng-outer"][1][0]
