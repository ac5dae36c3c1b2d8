"""Every argument of ``fully_shard_model`` / ``fully_shard`` acts or is refused by name.

``ARGUMENTS`` lists each parameter with where its effect is tested (``"file::test"``, checked to
exist) or the refusal a non-default value gets (executed here). The table must equal the
signature: a parameter added without a row fails ``test_the_table_is_the_signature``. The
arguments that were once accepted and ignored (``average_in_collective`` on gloo, ``set_to_none``,
the hybrid groups) are tested here against plain PyTorch on real gloo ranks.
"""

from __future__ import annotations

import ast
import copy
import inspect
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mfsdp
from mfsdp.config import CONFIG_ARGUMENTS, ShardingConfig
from mfsdp.fsdp.api import API_ARGUMENTS
from mfsdp.launch import launch
from mfsdp.models.toy import ToyModel

HERE = "tests/test_engine_arguments.py"
COMM_LOG = "test_overlap_and_bucketing_show_in_the_communication_log"
ARGUMENTS: dict[str, tuple] = {
    # name: ("acts", "tests/file.py::test_name") or ("refused", value, message start)
    "module": ("acts", "tests/test_engine.py::test_matches_single_process_reference"),
    "device_mesh": ("acts", "tests/test_tensor_parallel.py::test_upstream_meshes_with_cp_and_hsdp"),
    "dp_shard_dim": ("acts", "tests/test_upstream_surface.py::"
                             "test_flattened_dp_shard_cp_dimension_shards_over_both"),
    "dp_outer_dim": ("acts", "tests/test_idioms.py::test_pytorch_idioms_under_hsdp_and_hfsdp"),
    "tp_dim": ("acts", "tests/test_tensor_parallel.py::test_upstream_meshes_with_cp_and_hsdp"),
    "hybrid_fsdp_group": ("acts", f"{HERE}::test_hybrid_groups_are_used_or_refused"),
    "hybrid_fsdp_expt_group": ("acts", f"{HERE}::test_hybrid_groups_are_used_or_refused"),
    "expt_device_mesh": ("acts", "tests/test_hsdp_ep.py::test_eight_ranks_ep_with_hsdp_match_reference"),
    "fsdp_unit_modules": ("acts", "tests/test_engine.py::test_matches_single_process_reference"),
    "zero_dp_strategy": ("acts", "tests/test_engine_memory.py::test_state_memory_matches_strategy_table"),
    "outer_dp_sharding_strategy": ("acts", "tests/test_idioms.py::"
                                           "test_pytorch_idioms_under_hsdp_and_hfsdp"),
    "device": ("acts", "tests/test_engine_errors.py::test_bad_input_raises_documented_error"),
    "init_model_with_meta_device": ("acts", "tests/test_engine_memory.py::"
                                            "test_meta_device_init_equals_eager_and_never_holds_the_model"),
    "param_init_fn": ("acts", "tests/test_model_families.py::test_meta_init_of_a_transformers_llama"),
    "mixed_precision_policy": ("acts", "tests/test_upstream_surface.py::"
                                       "test_param_and_grad_buffer_view_and_maxpool_double_buffer"),
    "overlap_grad_reduce": ("acts", f"{HERE}::{COMM_LOG}"),
    "overlap_param_gather": ("acts", "tests/test_engine_memory.py::"
                                     "test_zero3_gathered_weights_never_exceed_two_units"),
    "sync_model_each_microbatch": ("acts", f"{HERE}::test_bookkeeping_arguments_take_effect"),
    "average_in_collective": ("acts", f"{HERE}::test_average_in_collective_sums_then_divides"),
    "calculate_per_token_loss": ("acts", "tests/test_engine.py::test_matches_single_process_reference"),
    "fsdp_double_buffer": ("acts", "tests/test_double_buffer.py::"
                                   "test_gradients_of_every_non_root_unit_live_in_the_two_slots"),
    "disable_bucketing": ("acts", f"{HERE}::{COMM_LOG}"),
    "fsdp_group_ag": ("acts", f"{HERE}::test_bookkeeping_arguments_take_effect"),
    "expt_fsdp_group_ag": ("acts", f"{HERE}::test_bookkeeping_arguments_take_effect"),
    "max_inflight_reduce": ("acts", "tests/test_backward_idioms.py::"
                                    "test_unused_parameter_does_not_hold_back_reductions"),
    "prefetch_depth": ("acts", "tests/test_hsdp_ep.py::test_prefetch_depth_bounds_gathered_weights"),
    "process_groups": ("acts", "tests/test_hsdp_ep.py::test_four_ranks_match_reference"),
    "recursive_gather_modules": ("acts", "tests/test_moe.py::"
                                         "test_fused_experts_with_replay_or_recursive_gather_match_reference"),
    "preproc_state_dict_for_dcp_ckpt": ("acts", f"{HERE}::test_bookkeeping_arguments_take_effect"),
    "report_nan_in_param_grad": ("acts", "tests/test_upstream_surface.py::"
                                         "test_decoupled_grads_and_nan_reports"),
    "use_decoupled_grad": ("acts", "tests/test_upstream_surface.py::"
                                   "test_decoupled_grads_and_nan_reports"),
    "grad_reduce_in_fp32": ("acts", f"{HERE}::test_bookkeeping_arguments_take_effect"),
    "preserve_fp32_weights": ("acts", f"{HERE}::test_bookkeeping_arguments_take_effect"),
    "fsdp_db_use_persist_buf_on_alloc_fail": ("acts", "tests/test_double_buffer.py::"
                                                      "test_held_slot_falls_back_only_when_asked"),
    "keep_fp8_transpose_cache": ("refused", True, "keep_fp8_transpose_cache=True: the FP8"),
    "nccl_ub": ("refused", True, "nccl_ub=True: NCCL user-buffer registration"),
    "disable_symmetric_registration": ("refused", True, "disable_symmetric_registration=True"),
    "enable_fine_grained_param_gather": ("refused", True, "enable_fine_grained_param_gather=True"),
    "maxpool_double_buffer": ("acts", "tests/test_upstream_surface.py::"
                                      "test_param_and_grad_buffer_view_and_maxpool_double_buffer"),
    "cuda_graph_mode": ("refused", "full", "cuda_graph_mode='full': CUDA graph capture"),
}
# Arguments that act in some settings and are refused in others (the refusal is tested here too).
ALSO_REFUSED = {
    "fsdp_db_use_persist_buf_on_alloc_fail": (
        dict(fsdp_db_use_persist_buf_on_alloc_fail=True),
        "fsdp_db_use_persist_buf_on_alloc_fail=True is the double buffer's fallback"),
    "average_in_collective": (dict(average_in_collective=True, calculate_per_token_loss=True),
                              "average_in_collective=True divides by the data-parallel size, "
                              "but calculate_per_token_loss=True needs summed gradients"),
}


def test_the_table_is_the_signature():
    model_args = list(inspect.signature(mfsdp.fully_shard_model).parameters)
    assert sorted(model_args) == sorted(ARGUMENTS)
    shard_args = list(inspect.signature(mfsdp.fully_shard).parameters)
    assert shard_args == [model_args[0], "optimizer", *model_args[1:]]
    # fully_shard_model resolves some arguments itself and hands the rest to the config, which
    # reads every one of them: the two sets split the signature exactly
    assert not API_ARGUMENTS & CONFIG_ARGUMENTS
    assert API_ARGUMENTS | CONFIG_ARGUMENTS == set(model_args)


@pytest.mark.parametrize("name", sorted(n for n, row in ARGUMENTS.items() if row[0] == "acts"))
def test_each_acting_argument_names_a_test_that_exists(name):
    path, test = ARGUMENTS[name][1].split("::")
    tree = ast.parse(Path(path).read_text())
    assert test in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, (name, path, test)


@pytest.mark.parametrize("name", sorted(n for n, row in ARGUMENTS.items() if row[0] == "refused")
                         + sorted(ALSO_REFUSED))
def test_refused_arguments_name_themselves_and_the_fix(name):
    if name in ALSO_REFUSED:
        kwargs, message = ALSO_REFUSED[name]
    else:
        kwargs, message = {name: ARGUMENTS[name][1]}, ARGUMENTS[name][2]
    with pytest.raises(ValueError) as err:  # refused before any process group is needed
        mfsdp.fully_shard_model(ToyModel(), **kwargs)
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_keyword_arguments_raise_type_error():
    with pytest.raises(TypeError, match=r"^fully_shard_model\(\) got an unexpected keyword "
                                        r"argument 'foo'$"):
        mfsdp.fully_shard_model(ToyModel(), foo=1)
    with pytest.raises(TypeError, match=r"^fully_shard\(\) got an unexpected keyword argument "
                                        r"'average_in_colective'$"):
        mfsdp.fully_shard(ToyModel(), None, average_in_colective=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'device_mesh'"):
        ShardingConfig.from_arguments(device_mesh=None)  # resolved by the API, not here


# -- average_in_collective ------------------------------------------------------------------------
TINY = 2.0 ** -24  # the smallest float16 subnormal: half of it rounds to 0 in float16


def _average(strategy: str) -> tuple[float, float]:
    return _average_one(strategy, True), _average_one(strategy, False)


def _average_one(strategy: str, average: bool) -> float:
    net = nn.Linear(1, 1, bias=False)
    nn.init.ones_(net.weight)
    policy = mfsdp.MixedPrecisionPolicy(main_grads_dtype=torch.float32,
                                        grad_comm_dtype=torch.float16)
    model = mfsdp.fully_shard_model(net, zero_dp_strategy=strategy, mixed_precision_policy=policy,
                                    average_in_collective=average)
    model(torch.full((1, 1), TINY)).sum().backward()  # every rank's gradient is TINY
    model.finish_grad_sync()
    grad = next(iter(model.parameters())).grad
    grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return float(grad.item())


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads"])
def test_average_in_collective_sums_then_divides(strategy):
    # plain PyTorch: the mean of two equal gradients is that gradient
    reference = torch.tensor([TINY, TINY], dtype=torch.float32).mean().item()
    assert reference == TINY
    for averaged, prescaled in launch(_average, 2, args=(strategy,)):
        assert averaged == reference  # summed, then divided
        # dividing each rank's float16 gradient by 2 before the sum flushes it to zero: the
        # option changes the result, as upstream documents (average in the collective vs
        # pre-scaling)
        assert prescaled == 0.0


# -- set_to_none ----------------------------------------------------------------------------------
def _zero_grad(set_to_none: bool, via: str) -> dict:
    torch.manual_seed(0)
    ref = ToyModel()
    net = copy.deepcopy(ref)
    model, opt = mfsdp.fully_shard(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                   zero_dp_strategy="optim_grads")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    grads_after_zero = []
    for _ in range(2):
        model(x).pow(2).mean().backward()
        opt.step()
        (opt if via == "optimizer" else model).zero_grad(set_to_none=set_to_none)
        grads_after_zero.append([None if p.grad is None else float(p.grad.abs().sum())
                                 for p in model.parameters()])
        ref(x).pow(2).mean().backward()  # each rank sees the same batch: the mean is the same
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=set_to_none)
    full = model.full_parameters()
    err = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    return {"grads": grads_after_zero, "err": err}


@pytest.mark.parametrize("via", ["model", "optimizer"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_set_to_none(set_to_none, via):
    for r in launch(_zero_grad, 2, args=(set_to_none, via)):
        for grads in r["grads"]:
            if set_to_none:
                assert grads == [None] * len(grads)
            else:  # zeroed in place: a zero tensor, as torch.optim and nn.Module do
                assert grads == [0.0] * len(grads)
        assert r["err"] < 1e-6  # SGD: the next step starts from zero gradients, not stale ones


# -- hybrid groups --------------------------------------------------------------------------------
def _hybrid(outer_strategy: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    hybrid = mesh["dp_outer", "dp_shard"]._flatten("hybrid").get_group()
    kwargs = dict(device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
                  zero_dp_strategy="optim_grads_params", outer_dp_sharding_strategy=outer_strategy)
    torch.manual_seed(0)
    ref = ToyModel()
    model = mfsdp.fully_shard_model(copy.deepcopy(ref), hybrid_fsdp_group=hybrid, **kwargs)
    model.fsdp_state().comms.log.clear()
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).pow(2).mean().backward()
    model.finish_grad_sync()
    flags = sorted({r["group"] for r in model.fsdp_state().comms.log.records if r["op"] == "flags"})
    out = {"flags_on": flags,
           "main_group_is_given": all(sp.group is hybrid for sp in model.fsdp_state().sparams)}
    try:
        mfsdp.fully_shard_model(ToyModel(), hybrid_fsdp_group=mesh.get_group("dp_shard"), **kwargs)
        out["wrong_group"] = "no error"
    except ValueError as exc:
        out["wrong_group"] = str(exc)
    return out


@pytest.mark.parametrize("outer_strategy", ["no_shard", "optim"])
def test_hybrid_groups_are_used_or_refused(outer_strategy):
    for r in launch(_hybrid, 4, args=(outer_strategy,)):
        # which parameters got a gradient is agreed in one collective over the given group
        assert r["flags_on"] == ["hybrid"]
        # under HFSDP main weights are sharded over it (no group of mfsdp's own is made)
        assert r["main_group_is_given"] == (outer_strategy == "optim")
        assert r["wrong_group"].startswith("hybrid_fsdp_group has 2 ranks but the shard group "
                                           "x dp_outer is 2 x 2; it must span both")


# -- bookkeeping arguments ------------------------------------------------------------------------
def _bookkeeping() -> dict:
    ag = dist.new_group([0, 1])
    out = {}
    m = mfsdp.fully_shard_model(ToyModel(), sync_model_each_microbatch=False)
    out["auto_sync"] = m.model_auto_sync
    m = mfsdp.fully_shard_model(ToyModel(), fsdp_group_ag=ag, expt_fsdp_group_ag=ag)
    m.fsdp_state().comms.log.clear()
    m(torch.randn(2, 32))
    out["ag_groups"] = sorted({r["group"] for r in m.fsdp_state().comms.log.records
                               if r["op"] == "all_gather"})
    out["expt_ag"] = m.fsdp_state().comms.expt_ag.group is ag
    for preproc in (True, False):  # False: the sharded parameters themselves, as upstream
        m = mfsdp.fully_shard_model(ToyModel(), preproc_state_dict_for_dcp_ckpt=preproc)
        params = {id(p) for p in m.parameters()}
        out[f"params_handed_out_{preproc}"] = all(id(v) in params
                                                  for v in m.state_dict(keep_vars=True).values())
    m = mfsdp.fully_shard_model(ToyModel().to(torch.bfloat16), grad_reduce_in_fp32=True,
                                preserve_fp32_weights=False)
    out["dtypes"] = {(b.grad_dtype, b.main_dtype) for b in m.fsdp_state().buckets}
    return out


def test_bookkeeping_arguments_take_effect():
    for r in launch(_bookkeeping, 2):
        assert r["auto_sync"] is False
        assert r["ag_groups"] == ["dp_shard_ag"] and r["expt_ag"]
        assert r["params_handed_out_False"] and not r["params_handed_out_True"]
        assert r["dtypes"] == {(torch.float32, torch.bfloat16)}


# -- overlap_grad_reduce and disable_bucketing, read in the communication log -------------------
BLOCKS = 4  # ToyModel's Block units; the root unit (input projection, head) is one more
SCHEDULES = {"overlap": {}, "no overlap": {"overlap_grad_reduce": False},
             "one bucket": {"disable_bucketing": True},
             "one bucket, no overlap": {"disable_bucketing": True, "overlap_grad_reduce": False}}


def _reduction_schedules() -> dict:
    """One SGD step of ToyModel per schedule; its communication log with markers added from
    autograd hooks: when the gradient of block 0's output is computed (blocks 1..3 and the head
    have run their backward), when the input projection's output's is (every block has) and when
    the input's is (the graph's last node); a fourth after ``loss.backward()`` returns."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, kwargs in SCHEDULES.items():
        torch.manual_seed(0)
        inner = ToyModel(32, 64, BLOCKS)
        opt = torch.optim.SGD(inner.parameters(), lr=0.1)
        model, opt = mfsdp.fully_shard(inner, opt, fsdp_unit_modules=[type(inner.blocks[0])],
                                       zero_dp_strategy="optim_grads_params", **kwargs)
        log = model.fsdp_state().comms.log

        def mark(label: str):
            return lambda grad: log.add(op=label) and None  # (a hook returning None keeps grad)

        for module, label in ((inner.blocks[0], "blocks 1-3 done"), (inner.inp, "blocks done")):
            module.register_forward_hook(  # the gradient of the module's output: a marker
                lambda m, args, output, label=label: output.register_hook(mark(label)) and None)
        x, y = _schedule_batch(world)
        x = x[rank * 4:(rank + 1) * 4].requires_grad_()
        x.register_hook(mark("input gradient"))
        log.clear()
        torch.nn.functional.mse_loss(model(x), y[rank * 4:(rank + 1) * 4]).backward()
        log.add(op="backward returned")
        opt.step()
        out[name] = {"ops": [r["op"] for r in log.records if r["op"] != "all_gather"],
                     "params": model.full_parameters()}
    return out


def _schedule_batch(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4 * world, 32, generator=g), torch.randn(4 * world, 32, generator=g)


def test_overlap_and_bucketing_show_in_the_communication_log():
    """``overlap_grad_reduce`` launches each bucket's reduce-scatter during backward, as soon as
    its gradients are ready: blocks 3, 2 and 1 are reduced before block 0's output has its
    gradient, all four blocks before the input projection's output has its, and the root unit
    before the input has its. Without it every reduce-scatter is launched after the graph's last
    gradient (still inside ``loss.backward()``: in its end-of-backward callback).
    ``disable_bucketing`` puts every parameter in one bucket (upstream: "force assign all
    parameters to a single bucket"): one reduce-scatter instead of one per unit. All four match
    one step of plain single-process SGD on the whole batch (1e-5 relative)."""
    got = launch(_reduction_schedules, 2, timeout=300)[0]

    def before(ops: list[str], marker: str) -> int:
        return ops[:ops.index(marker)].count("reduce_scatter")

    for name, run in got.items():
        ops = run["ops"]
        buckets = 1 if SCHEDULES[name].get("disable_bucketing") else BLOCKS + 1
        assert ops.count("reduce_scatter") == buckets, (name, ops)
        assert before(ops, "backward returned") == buckets, (name, ops)  # all within backward
        overlap = SCHEDULES[name].get("overlap_grad_reduce", True) and buckets > 1
        assert before(ops, "blocks 1-3 done") == (BLOCKS - 1 if overlap else 0), (name, ops)
        assert before(ops, "blocks done") == (BLOCKS if overlap else 0), (name, ops)
        # the root unit's (or the one bucket's) gradients are complete before the input's
        launched = SCHEDULES[name].get("overlap_grad_reduce", True)
        assert before(ops, "input gradient") == (buckets if launched else 0), (name, ops)

    torch.manual_seed(0)
    ref = ToyModel(32, 64, BLOCKS)
    x, y = _schedule_batch(2)
    torch.nn.functional.mse_loss(ref(x), y).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    for name, run in got.items():
        for n, p in ref.named_parameters():
            err = (run["params"][n] - p.detach()).norm() / p.detach().norm()
            assert err < 1e-5, (name, n, err.item())
