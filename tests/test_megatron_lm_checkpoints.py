"""Megatron-LM ``torch_dist`` checkpoints, written by megatron-core 0.19.2, read by mfsdp.

``tests/fixtures/megatron_lm/make_fixture.py`` built megatron-core's own ``GPTModel`` (RMSNorm,
SwiGLU, grouped-query attention, RoPE, no biases) and saved it with ``dist_checkpointing`` as
Megatron-LM does; it recorded the model's ``state_dict()`` and its logits on fixed tokens.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mfsdp.checkpoint.manifest import CheckpointError
from mfsdp.launch import launch

FIXTURE = Path(__file__).parent / "fixtures" / "megatron_lm"
EXPECTED = torch.load(FIXTURE / "expected.pt")


def _config():
    from dataclasses import replace

    from mfsdp.models.gpt import GPT_PRESETS

    c = EXPECTED["config"]
    # (replace, not with_overrides, which ignores None: the preset's Llama-3 RoPE scaling off)
    return replace(GPT_PRESETS["llama-tiny"], num_layers=c["num_layers"],
                          hidden_size=c["hidden_size"], ffn_hidden_size=c["ffn_hidden_size"],
                          num_attention_heads=c["num_attention_heads"],
                          num_query_groups=c["num_query_groups"], vocab_size=c["vocab_size"],
                          rotary_base=float(c["rotary_base"]), rope_scaling_factor=None,
                          norm_epsilon=1e-5)


def _imported(tmp_path):
    from mfsdp.checkpoint.megatron_lm import megatron_lm_to_fsdp
    from mfsdp.models.gpt import GPT

    out = megatron_lm_to_fsdp(FIXTURE / "ckpt", tmp_path / "imported", _config().to_dict())
    model = GPT(_config())
    from mfsdp.checkpoint.dcp import read_full

    tensors, blobs, manifest = read_full(out)
    model.load_state_dict({k[len("model."):]: v for k, v in tensors.items()})
    return model, blobs, manifest


def test_every_weight_equals_what_megatron_core_saved(tmp_path):
    model, blobs, manifest = _imported(tmp_path)
    ours = model.state_dict()
    for key, want in EXPECTED["state_dict"].items():
        name = (key.replace("embedding.word_embeddings.", "embedding.")
                .replace("decoder.layers.", "layers.").replace("decoder.final", "final"))
        assert torch.equal(ours[name], want), key
    assert len(ours) == len(EXPECTED["state_dict"])
    assert blobs["extra"]["iteration"] == EXPECTED["iteration"]
    assert manifest["layout"]["source"] == "megatron_lm_torch_dist"


def test_the_imported_model_gives_megatron_cores_logits(tmp_path):
    model, _, _ = _imported(tmp_path)
    tokens = EXPECTED["tokens"]
    B, S = tokens.shape
    with torch.no_grad():  # the two sequences packed, each causal on its own
        logits = model(tokens.reshape(-1), torch.arange(0, B * S + 1, S)).view(B, S, -1)
    want = EXPECTED["logits"]
    rel = ((logits - want).norm() / want.norm()).item()
    assert rel < 1e-6, rel


def test_convert_command_reads_it_by_what_is_on_disk(tmp_path):
    (tmp_path / "cfg.json").write_text(json.dumps(_config().to_dict()))
    out = subprocess.run([sys.executable, "-m", "mfsdp.cli", "convert", "--from", "torch_dist",
                          "--to", "fsdp_dtensor", str(FIXTURE / "ckpt"), str(tmp_path / "out"),
                          "--model-config", str(tmp_path / "cfg.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Megatron-LM" in out.stdout
    missing = subprocess.run([sys.executable, "-m", "mfsdp.cli", "convert", "--from",
                              "torch_dist", "--to", "fsdp_dtensor", str(FIXTURE / "ckpt"),
                              str(tmp_path / "out2")], capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "--model-preset or --model-config" in missing.stderr


def test_a_wrong_config_is_refused_with_the_tensor_named(tmp_path):
    from mfsdp.checkpoint.megatron_lm import megatron_lm_to_fsdp
    from mfsdp.models.gpt import with_overrides

    wrong = with_overrides(_config(), ffn_hidden_size=128).to_dict()
    with pytest.raises(CheckpointError, match="linear_fc1.weight gives"):
        megatron_lm_to_fsdp(FIXTURE / "ckpt", tmp_path / "x", wrong)
    assert not (tmp_path / "x").exists()


# --- optimizer state: megatron-core's distributed optimizer (Adam) and plain SGD, two iterations
OPTIM = FIXTURE / "optim"


def _expected_optim() -> dict:
    """megatron-core's records of the optimizer fixtures by layout: the distributed optimizer's
    Adam (``adam``), SGD and Adam under its plain optimizer (``sgd``, ``adam-ddp``: torch's Adam,
    the step saved once as ``optimizer.state.common_step``); the batch at the top level."""
    record = torch.load(FIXTURE / "expected_optim.pt")
    record["adam-ddp"] = torch.load(FIXTURE / "expected_adam_ddp.pt")
    return record


def _mcore_name(name: str) -> str:
    return ("embedding.word_embeddings.weight" if name == "embedding.weight" else
            name.replace("layers.", "decoder.layers.", 1) if name.startswith("layers.") else
            "decoder." + name if name.startswith("final_layernorm") else name)


@pytest.mark.parametrize("kind", ["adam", "sgd", "adam-ddp"])
def test_optimizer_state_imports_by_name(kind, tmp_path):
    """Every main weight and optimizer tensor equals what megatron-core's optimizer held after
    iteration 2 (bit for bit), with the step, both groups' hyperparameters and the schedule."""
    from mfsdp.checkpoint.dcp import read_full
    from mfsdp.checkpoint.megatron_lm import megatron_lm_to_fsdp

    e = _expected_optim()[kind]
    out = megatron_lm_to_fsdp(OPTIM / kind, tmp_path / "imported", _config().to_dict())
    tensors, blobs, manifest = read_full(out)
    fields = FIELDS[kind]
    names = [k[len("model."):] for k in tensors if k.startswith("model.")]
    assert len(names) == len(e["state_after_2"])
    for name in names:
        want = e["state_after_2"][_mcore_name(name)]
        assert torch.equal(tensors[f"model.{name}"], want["param"]), name
        for field in fields:
            assert torch.equal(tensors[f"optimizer.state.{name}.{field}"], want[field]), (name,
                                                                                          field)
        if kind.startswith("adam"):
            assert tensors[f"optimizer.state.{name}.step"].item() == 2
            assert want.get("step", torch.tensor(2.0)).item() == 2
    groups = blobs["optimizer.param_groups"]
    by_wd = {g["wd_mult"]: g for g in e["param_groups"]}
    for mine, theirs in zip(groups, (by_wd[1.0], by_wd[0.0])):
        assert mine["lr"] == theirs["lr"] and mine["weight_decay"] == theirs["weight_decay"]
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    group_of = json.loads((out / "param_to_param_group_map.json").read_text())
    assert {n for n, g in group_of.items() if g == 1} == {n for n in names if "norm" in n}
    assert blobs["extra"]["iteration"] == 2
    assert blobs["extra"]["opt_param_scheduler"] == e["scheduler"] | {"num_steps": 2}


def iteration_3(sharded, opt, e: dict) -> dict:
    """Megatron-LM's third iteration on this rank: its sequence of the recorded batch, mean
    token loss, gradient clipping at 1.0, one optimizer step. Returns the loss averaged over the
    ranks and the gradient norm."""
    import torch.nn.functional as F

    r = dist.get_rank()
    tokens, labels = e["tokens"][r], e["labels"][r]
    S = tokens.numel()
    loss = F.cross_entropy(sharded(tokens, torch.tensor([0, S])).view(S, -1).float(), labels)
    loss.backward()
    total = torch.nn.utils.clip_grad_norm_(sharded.parameters(), 1.0)
    opt.step()
    losses = [None] * dist.get_world_size()
    dist.all_gather_object(losses, loss.item())
    return {"loss": sum(losses) / len(losses), "grad_norm": float(total)}


def assert_same_tensors(want_dir: Path, got_dir: Path) -> tuple[dict, dict]:
    """Both DCP directories' entries (:func:`_dcp_entries`), having checked that they hold the
    same keys and every tensor bit for bit with its dtype."""
    want, got = _dcp_entries(want_dir), _dcp_entries(got_dir)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if torch.is_tensor(value):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    return want, got


def _decay_groups(model) -> list[dict]:
    """Megatron-LM's two parameter groups (matrices, then vectors); their hyperparameters are
    placeholders the loaded checkpoint replaces."""
    params = list(model.named_parameters())
    return [{"params": [p for _, p in params if p.dim() > 1], "weight_decay": 0.5},
            {"params": [p for _, p in params if p.dim() == 1], "weight_decay": 0.5}]


def assert_third_iteration(got: dict, e: dict, adam: bool) -> None:
    """``got`` (a third iteration run by mfsdp) is megatron-core's (``e``): the loss within
    1e-5, the gradient norm within 1e-5 relative, and every weight within 1e-4 of the
    iteration's update (1e-2 for Adam's query/key/value weights; see the test below)."""
    assert abs(got["loss"] - e["loss_3"]) < 1e-5, (got["loss"], e["loss_3"])
    assert abs(got["grad_norm"] - e["grad_norm_3"]) < 1e-5 * e["grad_norm_3"]
    for name, after in got["weights"].items():
        want = e["weights_after_3"][_mcore_name(name)]
        before = e["state_after_2"][_mcore_name(name)]["param"]
        step = (want - before).norm()
        tol = 1e-2 if adam and "linear_qkv" in name else 1e-4
        assert (after - want).norm() <= tol * step, (name, (after - want).norm() / step)


def _third_iteration(kind: str, path: str, strategy: str) -> dict:
    """Every rank: mfsdp's sharded model and a torch optimizer loaded from the imported
    checkpoint, then Megatron-LM's third iteration: the batch's two sequences, one per rank, mean
    token loss, gradient clipping at 1.0, one optimizer step."""
    from mfsdp import fully_shard
    from mfsdp.checkpoint import load_checkpoint
    from mfsdp.models.gpt import GPT, TransformerLayer

    e = _expected_optim()
    torch.manual_seed(1)  # other initial values: the checkpoint must replace them all
    model = GPT(_config())
    groups = _decay_groups(model)
    opt = (torch.optim.AdamW(groups, lr=1.0) if kind.startswith("adam") else
           torch.optim.SGD(groups, lr=1.0, momentum=0.9))
    sharded, opt = fully_shard(model, opt, fsdp_unit_modules=[TransformerLayer],
                               zero_dp_strategy=strategy)
    load_checkpoint(path, sharded, opt)
    done = iteration_3(sharded, opt, e)
    return {"weights": {k: v.clone() for k, v in sharded.full_parameters().items()}, **done}


@pytest.mark.slow
@pytest.mark.parametrize("kind,strategy", [("adam", "optim_grads_params"), ("sgd", "optim"),
                                           ("adam-ddp", "optim_grads")])
def test_training_goes_on_as_megatron_core_does(kind, strategy, tmp_path):
    """A Megatron-LM checkpoint read by ``load_checkpoint`` continues training as megatron-core
    continued it: the third
    iteration's loss, gradient norm and every weight after it (mfsdp sharded on 2 ranks, the
    reference one megatron-core rank). Tolerances: float32 sums in another order, as a fraction
    of the iteration's update: 1e-4 (measured up to 6.6e-5), and 1e-2 for Adam's query/key/value
    weights (measured 2.7e-3): near-uniform attention makes their gradients a difference of
    nearly equal terms, and Adam divides each element by its own size, so the rounding shows at
    full scale. A wrong step count (bias correction) or moment moves the update by 10% or more."""
    e = _expected_optim()[kind]
    copy = tmp_path / "megatron"  # load_checkpoint reads Megatron-LM's directory as it is
    shutil.copytree(OPTIM / kind, copy)
    got = launch(_third_iteration, 2, args=(kind, str(copy), strategy))[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["megatron"]  # nothing left behind
    assert_third_iteration(got, e, adam=kind.startswith("adam"))


def _dcp_entries(directory: Path) -> dict[str, object]:
    """Every entry of a DCP directory: tensors whole, objects as torch.load gives them."""
    from mfsdp.checkpoint.dcp import DCPSource
    from mfsdp.checkpoint.megatron_common import SAFE_TYPES

    source = DCPSource(directory)
    out: dict[str, object] = {k: source.get(k) for k in source.tensors}
    out.update({k: source.object(k, SAFE_TYPES) for k in source.blob_keys})
    return out


@pytest.mark.parametrize("kind", ["adam", "sgd", "moe-adam", "adam-ddp"])
def test_export_of_an_import_is_the_checkpoint_megatron_core_wrote(kind, tmp_path):
    """megatron-core's checkpoint -> mfsdp -> Megatron-LM layout gives back its files: the
    tracker, metadata.json, every key (weights stacked per layer, fused norm names, optimizer
    state in model space, each linear's extra state), every tensor bit for bit, and in
    common_state the iteration, the schedule, the content metadata and the param groups. (The
    MoE model's experts share the dense optimizer, as megatron-core builds it at expert
    parallelism 1; ``check_export.py mcore DIR moe-adam`` has megatron-core load the export and
    run the third iteration bit for bit.)"""
    from mfsdp.checkpoint.megatron_lm import fsdp_to_megatron_lm, megatron_lm_to_fsdp

    config = _moe_config() if kind == "moe-adam" else _config()
    mid = megatron_lm_to_fsdp(OPTIM / kind, tmp_path / "mfsdp", config.to_dict())
    out = fsdp_to_megatron_lm(mid, tmp_path / "megatron")
    theirs, ours = OPTIM / kind / "iter_0000002", out / "iter_0000002"
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert (json.loads((ours / "metadata.json").read_text())
            == json.loads((theirs / "metadata.json").read_text()))
    want, got = _dcp_entries(theirs), _dcp_entries(ours)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if torch.is_tensor(value):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        elif key != "common_state/shard_0_1":
            assert got[key] == value, key
    mine, reference = got["common_state/shard_0_1"][0], want["common_state/shard_0_1"][0]
    for key in ("iteration", "checkpoint_version", "opt_param_scheduler", "content_metadata"):
        assert mine[key] == reference[key], key
    opt_ours, opt_theirs = mine["optimizer"], reference["optimizer"]
    assert opt_ours.keys() == opt_theirs.keys()
    groups_ours = opt_ours.get("optimizer", opt_ours)["param_groups"]
    groups_theirs = opt_theirs.get("optimizer", opt_theirs)["param_groups"]
    assert len(groups_ours) == len(groups_theirs) == 2
    for a, b in zip(groups_ours, groups_theirs):
        assert {k: a[k] for k in a} == {k: b[k] for k in a}
    args = mine["args"]
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.no_save_rng) == (
        reference["args"].num_layers, reference["args"].hidden_size,
        reference["args"].num_attention_heads, True)


def test_dp_reshardable_optimizer_state_is_read_from_its_buckets(tmp_path):
    """Megatron-LM's default layout for the distributed optimizer keeps its state as the flat
    bucket buffers: mapped back onto the weights, every main weight and both Adam moments equal
    (bit for bit: a copy) what megatron-core's optimizer held after iteration 2, with the step
    and both groups. The fixture is the same deterministic run as the ``adam`` one: its model
    weights are that fixture's, bit for bit. ``--weights-only`` reads the weights alone."""
    from mfsdp.checkpoint.dcp import DCPSource, read_full
    from mfsdp.checkpoint.megatron_lm import megatron_lm_to_fsdp

    src = OPTIM / "adam-dp-reshardable"
    theirs, ours = DCPSource(OPTIM / "adam" / "iter_0000002"), DCPSource(src / "iter_0000002")
    model_keys = [k for k in ours.tensors if not k.startswith("optimizer.")]
    assert model_keys and all(torch.equal(ours.get(k), theirs.get(k)) for k in model_keys)
    e = _expected_optim()["adam"]
    tensors, blobs, _ = read_full(megatron_lm_to_fsdp(src, tmp_path / "m", _config().to_dict(),
                                                      progress=False))
    names = [k[len("model."):] for k in tensors if k.startswith("model.")]
    assert len(names) == len(e["state_after_2"])
    for name in names:
        want = e["state_after_2"][_mcore_name(name)]
        assert torch.equal(tensors[f"model.{name}"], want["param"]), name
        for field in ("exp_avg", "exp_avg_sq"):
            got = tensors[f"optimizer.state.{name}.{field}"]
            assert torch.equal(got, want[field]), (name, field)
        assert tensors[f"optimizer.state.{name}.step"].item() == want["step"].item() == 2
    _assert_groups_and_schedule(blobs, e)
    tensors, blobs, _ = read_full(megatron_lm_to_fsdp(src, tmp_path / "w", _config().to_dict(),
                                                      weights_only=True, progress=False))
    assert not [k for k in tensors if k.startswith("optimizer.")]
    assert "optimizer.param_groups" not in blobs
    for key, value in tensors.items():
        assert torch.equal(value, e["state_after_2"][_mcore_name(key[len("model."):])]["param"])


def test_dp_reshardable_at_tp2_is_read_from_each_tp_ranks_buckets(tmp_path):
    """At tensor parallelism 2 each TP rank's data-parallel group saves its own buckets, of its
    pieces of the weights (query groups, the gate and up halves of ``linear_fc1``, the
    vocabulary, ``linear_proj``'s and ``linear_fc2``'s input columns): joined, every main weight
    and both Adam moments equal what megatron-core's optimizer held after iteration 2 (bit for
    bit: a copy; ``make_tp_fixture.py`` joined the ranks' pieces itself), with the step, both
    groups and the schedule. The run is the ``adam-tp2`` fixture's (the same losses); that
    fixture was recorded in another environment, so its state is within 1e-6 (float32
    round-off, the largest difference 1.9e-7)."""
    from mfsdp.checkpoint.dcp import read_full
    from mfsdp.checkpoint.megatron_lm import megatron_lm_to_fsdp

    e = torch.load(FIXTURE / "expected_dp_reshardable_tp2.pt")
    adam = torch.load(FIXTURE / "expected_tp2.pt")
    assert e["losses"] == adam["losses"]
    src = OPTIM / "adam-dp-reshardable-tp2"
    tensors, blobs, _ = read_full(megatron_lm_to_fsdp(src, tmp_path / "m", _config().to_dict(),
                                                      progress=False))
    names = [k[len("model."):] for k in tensors if k.startswith("model.")]
    assert len(names) == len(e["state_after_2"])
    for name in names:
        want, near = e["state_after_2"][_mcore_name(name)], adam["state_after_2"][_mcore_name(name)]
        got = {"param": tensors[f"model.{name}"]} | {
            f: tensors[f"optimizer.state.{name}.{f}"] for f in ("exp_avg", "exp_avg_sq")}
        for field, value in got.items():
            assert torch.equal(value, want[field]), (name, field)
            torch.testing.assert_close(value, near[field], rtol=0, atol=1e-6)
        assert tensors[f"optimizer.state.{name}.step"].item() == want["step"].item() == 2
    _assert_groups_and_schedule(blobs, e)


def _assert_groups_and_schedule(blobs: dict, e: dict) -> None:
    """The converted param groups (decay, then no decay) carry megatron-core's hyper-parameters,
    and the schedule is its scheduler state after iteration 2."""
    by_wd = {g["wd_mult"]: g for g in e["param_groups"]}
    for mine, ref in zip(blobs["optimizer.param_groups"], (by_wd[1.0], by_wd[0.0])):
        assert {k: mine[k] for k in ("lr", "betas", "eps", "weight_decay")} == {
            k: ref[k] for k in ("lr", "betas", "eps", "weight_decay")}
    assert blobs["extra"]["opt_param_scheduler"] == e["scheduler"] | {"num_steps": 2}


def _damaged_dp_reshardable(root: Path, what: str, fixture: str = "adam-dp-reshardable") -> Path:
    """A copy of a ``dp_reshardable`` fixture re-saved with one thing wrong: ``short``, the
    bucket's ``exp_avg`` one parameter (64 elements) short; ``swapped``, the two layers' input
    norms exchanged in every bucket field (the sizes add up, the order does not);
    ``pipeline``, the buckets twice, as a second pipeline stage's, with the arguments saying
    pipeline parallelism 2; ``two-buffers``, the buckets twice in one group, as a second
    buffer's (experts, another dtype); ``ranks-swapped`` (of the TP 2 fixture), the two TP ranks' buckets
    exchanged; anything else, nothing."""
    import torch.distributed.checkpoint as dcp

    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from mfsdp.checkpoint.dcp import DCPSource
    from mfsdp.checkpoint.megatron_common import SAFE_TYPES

    source = DCPSource(OPTIM / fixture / "iter_0000002")
    state: dict[str, object] = {k: source.get(k) for k in source.tensors}
    state.update({k: source.object(k, SAFE_TYPES) for k in source.blob_keys})
    if what == "pipeline":
        state["common_state/shard_0_1"][0]["args"].pipeline_model_parallel_size = 2
    for key in [k for k in source.tensors if k.startswith("optimizer.distributed.")]:
        flat = state[key]
        if what == "short" and key.endswith(".exp_avg"):
            state[key] = flat[:-64].clone()
        elif what == "swapped":  # layer 1's input norm at [62592:62656], layer 0's at [108800:]
            a, b = flat[62592:62656].clone(), flat[108800:108864].clone()
            flat[62592:62656], flat[108800:108864] = b, a
        elif what == "pipeline":  # a second stage's buckets (another data-parallel group)
            state[key.replace("dp_group_idx_0", "dp_group_idx_1")] = flat.clone()
        elif what == "two-buffers":
            state[key.replace("gbuf_idx_0", "gbuf_idx_1")] = flat.clone()
        elif what == "ranks-swapped" and "dp_group_idx_0" in key:
            other = key.replace("dp_group_idx_0", "dp_group_idx_1")
            state[key], state[other] = state[other], flat
    out = root / what / "iter_0000002"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(out)), no_dist=True,
             planner=DefaultSavePlanner(flatten_state_dict=False))  # objects as megatron-core
    shutil.copy(OPTIM / fixture / "iter_0000002" / "metadata.json", out)
    (root / what / "latest_checkpointed_iteration.txt").write_text("2")
    return root / what


@pytest.mark.parametrize("what,error", [
    ("short", "bucket 0 .* holds \\[125184, 125248\\] elements per field where "
              "per_bucket_numel_unpadded says 125248"),
    ("swapped", "main weights at \\[62592:62656\\] of bucket 0 are not "
                "decoder.layers.self_attention.linear_qkv.layer_norm_weight"),
    ("pipeline", "is of 2 data-parallel groups, its arguments say tensor parallelism 1 and "
                 "pipeline parallelism 2; mfsdp maps the buckets of one pipeline stage"),
    ("two-buffers", "has 2 buffers in 1 data-parallel groups \\(dp_group_idx_0.gbuf_idx_0, "
                    "dp_group_idx_0.gbuf_idx_1: experts, mixed dtypes"),
    ("ranks-swapped", "main weights at \\[0:8192\\] of bucket 0 \\(TP rank 0\\) are not "
                      "output_layer.weight \\(mfsdp's output_layer.weight, split 2 ways along "
                      "dimension 0\\)")])
def test_a_damaged_dp_reshardable_layout_is_refused_in_one_line(what, error, tmp_path):
    """A bucket of the wrong length, one whose parameters are not where megatron-core's
    order puts them (the main weights no longer equal the model's), buckets of several
    pipeline stages (each stage's hold its own layers) or buffers, or TP ranks' buckets in the wrong
    order (each rank's main weights are checked against its own piece), are refused in one
    line naming what and the fix, and nothing is written (the copy re-saved intact reads)."""
    from mfsdp.checkpoint.megatron_lm import megatron_lm_to_fsdp

    fixture = "adam-dp-reshardable-tp2" if what == "ranks-swapped" else "adam-dp-reshardable"
    intact = _damaged_dp_reshardable(tmp_path / "src", "intact", fixture)
    assert megatron_lm_to_fsdp(intact, tmp_path / "ok", _config().to_dict(), progress=False)
    src = _damaged_dp_reshardable(tmp_path / "src", what, fixture)
    with pytest.raises(CheckpointError, match=error) as exc:
        megatron_lm_to_fsdp(src, tmp_path / "x", _config().to_dict(), progress=False)
    assert "\n" not in str(exc.value) and "--dist-ckpt-optim-fully-reshardable" in str(exc.value)
    assert "--weights-only" in str(exc.value)
    assert not (tmp_path / "x").exists()


def test_convert_command_both_ways(tmp_path):
    """``mfsdp convert --from megatron_lm`` and ``--to megatron_lm`` on the command line (and
    ``--weights-only`` both ways, through the same entry point in this process)."""
    (tmp_path / "cfg.json").write_text(json.dumps(_config().to_dict()))

    def convert(*argv):
        return subprocess.run([sys.executable, "-m", "mfsdp.cli", "convert", *map(str, argv)],
                              capture_output=True, text=True, timeout=300)

    out = convert("--from", "megatron_lm", "--to", "fsdp_dtensor", OPTIM / "adam",
                  tmp_path / "m", "--model-config", tmp_path / "cfg.json")
    assert out.returncode == 0, out.stderr
    out = convert("--from", "fsdp_dtensor", "--to", "megatron_lm", tmp_path / "m",
                  tmp_path / "mlm")
    assert out.returncode == 0, out.stderr
    assert "--use-distributed-optimizer" in out.stdout
    assert (tmp_path / "mlm" / "latest_checkpointed_iteration.txt").read_text() == "2"
    from mfsdp.checkpoint.convert import main
    from mfsdp.checkpoint.dcp import DCPSource

    assert main(["--from", "fsdp_dtensor", "--to", "megatron_lm", "--no-progress",
                 str(tmp_path / "m"), str(tmp_path / "weights"), "--weights-only"]) == 0
    keys = DCPSource(tmp_path / "weights" / "iter_0000002").tensors
    assert keys and not [k for k in keys if k.startswith("optimizer.")]
    # Megatron-LM's default distributed-optimizer layout, dp_reshardable, converts too
    assert main(["--from", "megatron_lm", "--to", "fsdp_dtensor", "--no-progress",
                 str(OPTIM / "adam-dp-reshardable"), str(tmp_path / "dp"),
                 "--model-config", str(tmp_path / "cfg.json")]) == 0
    keys = DCPSource(tmp_path / "dp").tensors
    assert len([k for k in keys if k.endswith(".exp_avg_sq")]) == len(
        [k for k in keys if k.startswith("model.")])


@pytest.mark.slow
def test_trainer_resumes_a_megatron_lm_checkpoint(tmp_path):
    """``mfsdp train --load`` of Megatron-LM's directory, the distributed optimizer's state in
    model space (``fully_reshardable``) or in its buckets (``dp_reshardable``): it continues at
    iteration 3 with the checkpoint's schedule, weights and Adam state."""
    import os

    c = EXPECTED["config"]
    model_flags = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
                   "--disable-bias-linear", "--group-query-attention", "--num-query-groups",
                   str(c["num_query_groups"]), "--num-layers", str(c["num_layers"]),
                   "--hidden-size", str(c["hidden_size"]), "--ffn-hidden-size",
                   str(c["ffn_hidden_size"]), "--num-attention-heads",
                   str(c["num_attention_heads"]), "--vocab-size", str(c["vocab_size"]),
                   "--norm-epsilon", "1e-5", "--rotary-base", str(c["rotary_base"]),
                   "--untie-embeddings-and-output-weights"]
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "mfsdp.train", "--use-megatron-fsdp", "--train-iters", "3", "--mock-data",
           "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
           "--log-interval", "1", "--use-checkpoint-opt_param-scheduler", *model_flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for kind in ("adam", "adam-dp-reshardable"):
        shutil.copytree(OPTIM / kind, tmp_path / kind)
        out = subprocess.run(run + ["--load", str(tmp_path / kind)], capture_output=True,
                             text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "resumed from iteration 2" in out.stdout, out.stdout
        import re

        # iteration 3 only, at the checkpoint's schedule (cosine from 1e-3 over 8 steps)
        assert re.findall(r"iteration +(\d+)/3 .*\| lr ([0-9.e+-]+)", out.stdout) == [
            ("3", f"{_expected_optim()['adam']['param_groups'][0]['lr']:.2e}")], out.stdout
        assert not [p for p in (tmp_path / kind).iterdir() if p.name.startswith(".from-")]


def test_megatron_lms_parameter_map_is_read(tmp_path):
    """The map megatron-core's ``--dump-param-to-param-group-map`` wrote (a DCP of Megatron-LM
    names), and the JSON upstream's checkpoint inspector makes of it (``model.module.`` names),
    read under mfsdp's names: the groups the import gives each parameter."""
    from mfsdp.checkpoint.megatron_lm import megatron_lm_to_fsdp
    from mfsdp.checkpoint.state import read_param_to_param_group_map

    out = megatron_lm_to_fsdp(OPTIM / "adam", tmp_path / "m", _config().to_dict())
    ours = json.loads((out / "param_to_param_group_map.json").read_text())
    theirs = read_param_to_param_group_map(OPTIM / "param_map")
    assert theirs == ours
    assert list(theirs.values()) == sorted(theirs.values())  # the optimizer's order: by group
    from mfsdp.checkpoint.dcp import DCPSource

    source = DCPSource(OPTIM / "param_map")
    inspector = {"model.module." + k.removeprefix("module."): source.object(k)
                 for k in source.blob_keys}
    (tmp_path / "map.json").write_text(json.dumps(inspector))
    assert read_param_to_param_group_map(tmp_path / "map.json") == ours


# --- a DeepSeek-V3-style MoE model (dense first layer, sigmoid router with expert bias and
# group-limited routing, a shared expert): megatron-core writes its layers one key per layer,
# experts stacked by expert
MOE = torch.load(FIXTURE / "expected_moe.pt")


def _moe_config():
    from mfsdp.models.gpt import with_overrides

    c = MOE["config"]
    return with_overrides(_config(), ffn_hidden_size=c["ffn_hidden_size"],
                          num_experts=c["num_experts"], moe_first_dense_layers=1,
                          moe_ffn_hidden_size=c["moe_ffn_hidden_size"],
                          moe_router_topk=c["moe_router_topk"], moe_router_score_function="sigmoid",
                          moe_router_enable_expert_bias=True,
                          moe_router_num_groups=c["moe_router_num_groups"],
                          moe_router_group_topk=c["moe_router_group_topk"],
                          moe_router_topk_scaling_factor=c["moe_router_topk_scaling_factor"],
                          moe_shared_expert_intermediate_size=c[
                              "moe_shared_expert_intermediate_size"])


def test_moe_checkpoint_imports_with_megatron_cores_logits(tmp_path):
    """Every weight, expert (one slice of the stacked tensor each), shared expert, router weight
    and expert bias equals megatron-core's, and the model gives its logits."""
    from mfsdp.checkpoint.dcp import read_full
    from mfsdp.checkpoint.megatron_lm import megatron_lm_to_fsdp
    from mfsdp.models.gpt import GPT

    out = megatron_lm_to_fsdp(FIXTURE / "moe" / "ckpt", tmp_path / "imported",
                              _moe_config().to_dict())
    tensors, blobs, _ = read_full(out)
    assert blobs["extra"]["iteration"] == MOE["iteration"]
    model = GPT(_moe_config())
    model.load_state_dict({k[len("model."):]: v for k, v in tensors.items()})
    ours = model.state_dict()
    assert len(ours) == len(MOE["state_dict"])
    for key, want in MOE["state_dict"].items():
        name = _mcore_name_back(key)
        assert torch.equal(ours[name], want), key
    assert ours["layers.1.mlp.router.expert_bias"].abs().sum() > 0  # the bias came along
    model.eval()
    tokens = MOE["tokens"]
    B, S = tokens.shape
    with torch.no_grad():
        logits = model(tokens.reshape(-1), torch.arange(0, B * S + 1, S)).view(B, S, -1)
    rel = ((logits - MOE["logits"]).norm() / MOE["logits"].norm()).item()
    assert rel < 1e-6, rel


def _mcore_name_back(key: str) -> str:
    """megatron-core's module name -> mfsdp's (the state_dict names, not the on-disk keys)."""
    return (key.replace("embedding.word_embeddings.", "embedding.")
            .replace("decoder.layers.", "layers.").replace("decoder.final", "final")
            .replace("mlp.shared_experts.", "mlp.shared_expert."))


def test_moe_export_of_an_import_is_the_checkpoint_megatron_core_wrote(tmp_path):
    """The MoE layout written back: per-layer keys, experts stacked, extra state per expert, the
    expert bias; every tensor bit for bit. With optimizer state it is refused (Megatron-LM keeps
    experts in an optimizer of their own)."""
    from mfsdp.checkpoint.megatron_lm import fsdp_to_megatron_lm, megatron_lm_to_fsdp

    mid = megatron_lm_to_fsdp(FIXTURE / "moe" / "ckpt", tmp_path / "mfsdp",
                              _moe_config().to_dict())
    out = fsdp_to_megatron_lm(mid, tmp_path / "megatron")
    want, got = assert_same_tensors(FIXTURE / "moe" / "ckpt" / "iter_0000003",
                                    out / "iter_0000003")
    for key, value in want.items():
        if not torch.is_tensor(value) and key != "common_state/shard_0_1":
            assert got[key] == value, key
    assert got["common_state/shard_0_1"][0]["iteration"] == 3


MLA = torch.load(FIXTURE / "expected_mla.pt")


def _mla_config(**overrides):
    from dataclasses import replace

    c = MLA["config"]
    fields = dict(num_attention_heads=c["num_attention_heads"], num_query_groups=None,
                  ffn_hidden_size=c["ffn_hidden_size"], norm_epsilon=1e-6,
                  multi_latent_attention=True, q_lora_rank=c["q_lora_rank"],
                  kv_lora_rank=c["kv_lora_rank"], qk_head_dim=c["qk_head_dim"],
                  qk_pos_emb_head_dim=c["qk_pos_emb_head_dim"], v_head_dim=c["v_head_dim"],
                  rotary_interleaved=True)
    return replace(_config(), **(fields | overrides))


def test_multi_latent_attention_imports_with_megatron_cores_logits(tmp_path):
    """DeepSeek's multi-latent attention as megatron-core's ``MLASelfAttention`` holds it (query
    and key/value latents, their norms, decoupled rotary channels): every weight equal and the
    model's logits within 1e-6 of megatron-core's. megatron-core rotates MLA's rotary channels
    as DeepSeek's interleaved pairs: the same config with plain halves is off by far more."""
    from mfsdp.checkpoint.dcp import read_full
    from mfsdp.checkpoint.megatron_lm import megatron_lm_to_fsdp
    from mfsdp.models.gpt import GPT

    def logits_of(cfg, out):
        tensors, blobs, _ = read_full(megatron_lm_to_fsdp(FIXTURE / "mla" / "ckpt", out,
                                                          cfg.to_dict(), progress=False))
        model = GPT(cfg)
        model.load_state_dict({k[len("model."):]: v for k, v in tensors.items()})
        model.eval()
        tokens = MLA["tokens"]
        B, S = tokens.shape
        with torch.no_grad():
            logits = model(tokens.reshape(-1), torch.arange(0, B * S + 1, S)).view(B, S, -1)
        return model, blobs, ((logits - MLA["logits"]).norm() / MLA["logits"].norm()).item()

    model, blobs, rel = logits_of(_mla_config(), tmp_path / "imported")
    assert blobs["extra"]["iteration"] == MLA["iteration"]
    ours = model.state_dict()
    assert len(ours) == len(MLA["state_dict"])
    for key, want in MLA["state_dict"].items():
        assert torch.equal(ours[_mcore_name_back(key)], want), key
    assert rel < 1e-6, rel
    _, _, wrong = logits_of(_mla_config(rotary_interleaved=False), tmp_path / "halves")
    assert wrong > 100 * max(rel, 1e-7), (wrong, rel)


def test_multi_latent_attention_export_of_an_import_is_the_checkpoint(tmp_path):
    """Written back for the local layer spec (every norm by its own name, as megatron-core's
    local MLA spec saves it): the same keys and tensors bit for bit (megatron-core loads such an
    export and gives the fixture's logits exactly: ``check_export.py mcore DIR mla``). For
    Transformer Engine's spec the latents' norms take its fused names."""
    from mfsdp.checkpoint.dcp import DCPSource
    from mfsdp.checkpoint.megatron_lm import fsdp_to_megatron_lm, megatron_lm_to_fsdp

    mid = megatron_lm_to_fsdp(FIXTURE / "mla" / "ckpt", tmp_path / "mfsdp",
                              _mla_config().to_dict(), progress=False)
    out = fsdp_to_megatron_lm(mid, tmp_path / "local", transformer_impl="local", progress=False)
    assert_same_tensors(FIXTURE / "mla" / "ckpt" / "iter_0000005", out / "iter_0000005")
    te = fsdp_to_megatron_lm(mid, tmp_path / "te", progress=False)
    keys = set(DCPSource(te / "iter_0000005").tensors)
    assert "decoder.layers.self_attention.linear_q_up_proj.layer_norm_weight" in keys
    assert "decoder.layers.self_attention.linear_kv_up_proj.layer_norm_weight" in keys
    assert "decoder.layers.input_layernorm.weight" in keys  # MLA has no linear_qkv to fuse into
    assert "decoder.layers.self_attention.q_layernorm.weight" not in keys
    back = megatron_lm_to_fsdp(te, tmp_path / "back", _mla_config().to_dict(), progress=False)
    assert DCPSource(back).tensors == DCPSource(mid).tensors


MOE_OPTIM = FIXTURE / "optim" / "moe-adam"


def test_moe_optimizer_state_imports_by_name(tmp_path):
    """The MoE model trained by megatron-core (distributed optimizer, Adam): every main weight,
    expert included, and every moment equal bit for bit after import, with the step."""
    from mfsdp.checkpoint.dcp import read_full
    from mfsdp.checkpoint.megatron_lm import megatron_lm_to_fsdp

    e = torch.load(FIXTURE / "expected_moe_optim.pt")
    out = megatron_lm_to_fsdp(MOE_OPTIM, tmp_path / "imported", _moe_config().to_dict(),
                              progress=False)
    tensors, blobs, _ = read_full(out)
    names = [k[len("model."):] for k in tensors if k.startswith("model.")]
    params = [n for n in names if not n.endswith("expert_bias")]
    assert len(params) == len(e["state_after_2"])
    assert any(".local_experts." in n for n in params)
    for key, want in e["state_after_2"].items():
        name = _mcore_name_back(key)
        assert torch.equal(tensors[f"model.{name}"], want["param"]), name
        for field in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(tensors[f"optimizer.state.{name}.{field}"], want[field]), name
        assert tensors[f"optimizer.state.{name}.step"].item() == 2
    assert [g["weight_decay"] for g in blobs["optimizer.param_groups"]] == [0.1, 0.0]


def _moe_third_iteration(path: str, expected: str = "expected_moe_optim.pt") -> dict:
    """Every rank: mfsdp's sharded MoE GPT and AdamW loaded from megatron-core's checkpoint,
    then the third iteration (one sequence per rank, mean token loss, clipping at 1.0)."""

    from mfsdp import fully_shard
    from mfsdp.checkpoint import load_checkpoint
    from mfsdp.models.gpt import GPT, TransformerLayer

    e = torch.load(FIXTURE / expected)
    torch.manual_seed(1)
    model = GPT(_moe_config())
    sharded, opt = fully_shard(model, torch.optim.AdamW(_decay_groups(model), lr=1.0),
                               fsdp_unit_modules=[TransformerLayer])
    load_checkpoint(path, sharded, opt)
    loss = iteration_3(sharded, opt, e)["loss"]
    return {"weights": {k: v.clone() for k, v in sharded.full_parameters().items()},
            "loss": loss}


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 2])
def test_moe_training_goes_on_as_megatron_core_does(ep, tmp_path):
    """The MoE checkpoint read by ``load_checkpoint`` on 2 ranks runs the third iteration as
    megatron-core ran it: the loss within 1e-5 and every weight, experts and router included,
    within 1e-4 of the iteration's update (1e-2 for the attention projection, as for the dense
    model). ``ep=2``: written by an expert-parallel job (2 experts per rank, the experts'
    optimizer chained), read into mfsdp without expert parallelism."""
    expected = "expected_moe_optim.pt" if ep == 1 else "expected_moe_ep2.pt"
    e = torch.load(FIXTURE / expected)
    got = launch(_moe_third_iteration, 2,
                 args=(str(MOE_OPTIM if ep == 1 else FIXTURE / "optim" / "moe-ep2"),
                       expected))[0]
    assert abs(got["loss"] - e["loss_3"]) < 1e-5, (got["loss"], e["loss_3"])
    for name, after in got["weights"].items():
        key = next(k for k in e["state_after_2"] if _mcore_name_back(k) == name)
        want, before = e["weights_after_3"][key], e["state_after_2"][key]["param"]
        tol = 1e-2 if "linear_qkv" in name else 1e-4
        assert (after - want).norm() <= tol * (want - before).norm(), name


def test_expert_parallel_checkpoint_both_ways(tmp_path):
    """megatron-core's EP 2 checkpoint (experts stacked globally, the experts' optimizer chained
    after the dense one): every main weight and moment equal after import; exported for an EP 2
    job (``expert_model_parallel_size=2``) it is megatron-core's checkpoint again, tensors and
    both optimizers' groups (``make_ep_fixture.py mcore --load DIR`` has megatron-core at EP 2
    load the export and run the third iteration bit for bit); exported for EP 1, one optimizer."""
    from mfsdp.checkpoint.dcp import read_full
    from mfsdp.checkpoint.megatron_common import read_common_state
    from mfsdp.checkpoint.megatron_lm import fsdp_to_megatron_lm, megatron_lm_to_fsdp

    src = FIXTURE / "optim" / "moe-ep2"
    e = torch.load(FIXTURE / "expected_moe_ep2.pt")
    mid = megatron_lm_to_fsdp(src, tmp_path / "m", _moe_config().to_dict(), progress=False)
    tensors, _, _ = read_full(mid)
    for key, want in e["state_after_2"].items():
        name = _mcore_name_back(key)
        assert torch.equal(tensors[f"model.{name}"], want["param"]), name
        for field in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(tensors[f"optimizer.state.{name}.{field}"], want[field]), name
    out = fsdp_to_megatron_lm(mid, tmp_path / "ep2", progress=False,
                              expert_model_parallel_size=2)
    want, got = assert_same_tensors(src / "iter_0000002", out / "iter_0000002")
    theirs = want["common_state/shard_0_1"][0]["optimizer"]
    ours = got["common_state/shard_0_1"][0]["optimizer"]
    assert sorted(ours) == sorted(theirs) == [0, 1]
    for i in (0, 1):
        a, b = ours[i]["optimizer"]["param_groups"], theirs[i]["optimizer"]["param_groups"]
        assert len(a) == len(b) and all({k: y[k] for k in x} == x for x, y in zip(a, b))
    assert [g["is_expert_parallel"] for g in ours[1]["optimizer"]["param_groups"]] == [True]
    one = read_common_state(fsdp_to_megatron_lm(mid, tmp_path / "ep1", progress=False)
                            / "iter_0000002")["optimizer"]
    assert len(one["optimizer"]["param_groups"]) == 2


# --- a tensor-parallel job: megatron-core at TP 2 (make_tp_fixture.py): Adam (the distributed
# optimizer, fully reshardable) and SGD with momentum (the plain optimizer)
TP2 = {"adam": FIXTURE / "optim" / "adam-tp2", "sgd": FIXTURE / "optim" / "sgd-tp2",
       "adam-ddp": FIXTURE / "optim" / "adam-ddp-tp2"}
TP2_EXPECTED = {"adam": "expected_tp2.pt", "sgd": "expected_tp2_sgd.pt",
                "adam-ddp": "expected_adam_ddp_tp2.pt"}
FIELDS = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",),
          "adam-ddp": ("exp_avg", "exp_avg_sq")}


@pytest.mark.parametrize("kind", ["adam", "sgd", "adam-ddp"])
def test_tensor_parallel_checkpoint_both_ways(kind, tmp_path):
    """megatron-core's TP 2 checkpoint (each rank wrote its piece of every split weight: query
    groups, the gate and up halves of ``linear_fc1``, the vocabulary) reads as global tensors:
    every main weight and moment (Adam's, SGD's momentum) equals megatron-core's, the ranks'
    pieces joined as it
    splits them. Exported for a TP 2 job it is megatron-core's checkpoint again, every tensor
    bit for bit (``make_tp_fixture.py mcore --load DIR`` has megatron-core at TP 2 load the
    export and run the third iteration bit for bit), with ``args`` naming TP 2; a TP size the
    model cannot be split by is refused with the size named."""
    from mfsdp.checkpoint.dcp import read_full
    from mfsdp.checkpoint.megatron_common import read_common_state
    from mfsdp.checkpoint.megatron_lm import fsdp_to_megatron_lm, megatron_lm_to_fsdp

    e = torch.load(FIXTURE / TP2_EXPECTED[kind])
    mid = megatron_lm_to_fsdp(TP2[kind], tmp_path / "m", _config().to_dict(), progress=False)
    tensors, blobs, _ = read_full(mid)
    names = [k[len("model."):] for k in tensors if k.startswith("model.")]
    assert len(names) == len(e["state_after_2"])
    for name in names:
        want = e["state_after_2"][_mcore_name(name)]
        assert torch.equal(tensors[f"model.{name}"], want["param"]), name
        for field in FIELDS[kind]:
            assert torch.equal(tensors[f"optimizer.state.{name}.{field}"], want[field]), name
    assert blobs["extra"]["opt_param_scheduler"] == e["scheduler"] | {"num_steps": 2}
    out = fsdp_to_megatron_lm(mid, tmp_path / "tp2", progress=False, tensor_model_parallel_size=2)
    want, got = assert_same_tensors(TP2[kind] / "iter_0000002", out / "iter_0000002")
    assert read_common_state(out / "iter_0000002")["args"].tensor_model_parallel_size == 2
    # (the distributed optimizer nests its groups one level deeper than the plain one)
    a, b = (d["common_state/shard_0_1"][0]["optimizer"] for d in (got, want))
    a, b = (o.get("optimizer", o)["param_groups"] for o in (a, b))
    assert len(a) == len(b) and all({k: y[k] for k in x} == x for x, y in zip(a, b))
    with pytest.raises(CheckpointError, match="num_attention_heads=4 is not divisible by the "
                                               "tensor-parallel size 3; num_query_groups=2"):
        fsdp_to_megatron_lm(mid, tmp_path / "tp3", progress=False, tensor_model_parallel_size=3)
    assert not (tmp_path / "tp3").exists()


def _third_iteration_tp(path: str, kind: str) -> dict:
    """Both ranks: mfsdp's model split at TP 2 (``apply_tensor_parallel``, the vocabulary-parallel
    loss) and sharded over data parallelism 1, loaded from megatron-core's TP 2 checkpoint, then
    the fixture's third iteration (both sequences on both ranks, mean token loss, clipping at
    1.0, one Adam or SGD step)."""
    from torch.distributed.device_mesh import init_device_mesh

    from mfsdp import fully_shard
    from mfsdp.checkpoint import load_checkpoint
    from mfsdp.models.gpt import GPT, TransformerLayer
    from mfsdp.models.tensor_parallel import (apply_tensor_parallel, loss_parallel_context,
                                              vocab_parallel_cross_entropy)

    e = torch.load(FIXTURE / TP2_EXPECTED[kind])
    torch.manual_seed(1)  # other initial values: the checkpoint must replace them all
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    net = apply_tensor_parallel(GPT(_config()), mesh["tp"], vocab_parallel_loss=True)
    groups = _decay_groups(net)
    opt = (torch.optim.AdamW(groups, lr=1.0) if kind.startswith("adam") else
           torch.optim.SGD(groups, lr=1.0, momentum=0.9))
    sharded, opt = fully_shard(net, opt, device_mesh=mesh, dp_shard_dim="dp", tp_dim="tp",
                               fsdp_unit_modules=[TransformerLayer],
                               zero_dp_strategy="optim_grads_params")
    load_checkpoint(path, sharded, opt)
    tokens, labels = e["tokens"], e["labels"]
    B, S = tokens.shape
    logits = sharded(tokens.reshape(-1), torch.arange(0, B * S + 1, S))
    loss = vocab_parallel_cross_entropy(logits, labels.reshape(-1),
                                        torch.ones(B * S, dtype=torch.bool)) / (B * S)
    with loss_parallel_context(2):
        loss.backward()
    total = opt.clip_grad_norm_(1.0)
    opt.step()
    return {"loss": loss.item(), "grad_norm": float(total),
            "weights": {k: v.clone() for k, v in sharded.full_parameters().items()}}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["adam", "sgd", pytest.param("adam-ddp", marks=[
    pytest.mark.extended])])  # (`make test`'s budget; its TP 1 case and TP 2 siblings stay)
def test_training_goes_on_at_tp2_as_megatron_core_does(kind, tmp_path):
    """mfsdp's own tensor parallelism continues megatron-core's TP 2 run: the third iteration's
    loss (1e-5), gradient norm (1e-5 relative) and every weight after it (the tolerances of
    ``test_training_goes_on_as_megatron_core_does``: float32 sums in another order)."""
    e = torch.load(FIXTURE / TP2_EXPECTED[kind])
    copy = tmp_path / "megatron"
    shutil.copytree(TP2[kind], copy)
    got = launch(_third_iteration_tp, 2, args=(str(copy), kind))[0]
    assert_third_iteration(got, e, adam=kind.startswith("adam"))


@pytest.mark.slow
@pytest.mark.extended
def test_trainer_resumes_an_expert_parallel_checkpoint_at_ep2(tmp_path):
    """``mfsdp train --expert-model-parallel-size 2 --load`` of megatron-core's EP 2 directory:
    it continues at iteration 3 with the checkpoint's schedule."""
    import os
    import re

    c = MOE["config"]
    shutil.copytree(FIXTURE / "optim" / "moe-ep2", tmp_path / "ckpt")
    flags = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
             "--disable-bias-linear", "--group-query-attention", "--num-query-groups",
             str(c["num_query_groups"]), "--num-layers", str(c["num_layers"]), "--hidden-size",
             str(c["hidden_size"]), "--ffn-hidden-size", str(c["ffn_hidden_size"]),
             "--num-attention-heads", str(c["num_attention_heads"]), "--vocab-size",
             str(c["vocab_size"]), "--norm-epsilon", "1e-5", "--rotary-base",
             str(c["rotary_base"]), "--num-experts", str(c["num_experts"]),
             "--moe-ffn-hidden-size", str(c["moe_ffn_hidden_size"]), "--moe-router-topk",
             str(c["moe_router_topk"]), "--moe-first-dense-layers", "1",
             "--moe-shared-expert-intermediate-size",
             str(c["moe_shared_expert_intermediate_size"]), "--moe-router-score-function",
             "sigmoid", "--moe-router-topk-scaling-factor",
             str(c["moe_router_topk_scaling_factor"]), "--moe-router-num-groups",
             str(c["moe_router_num_groups"]), "--moe-router-group-topk",
             str(c["moe_router_group_topk"]), "--moe-router-enable-expert-bias",
             "--moe-aux-loss-coeff", "0", "--untie-embeddings-and-output-weights"]
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "mfsdp.train", "--use-megatron-fsdp", "--train-iters", "3", "--mock-data",
           "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
           "--log-interval", "1", "--use-checkpoint-opt_param-scheduler",
           "--expert-model-parallel-size", "2", "--load", str(tmp_path / "ckpt"), *flags]
    out = subprocess.run(run, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from iteration 2" in out.stdout and "EP 2" in out.stdout, out.stdout
    lr = torch.load(FIXTURE / "expected_moe_ep2.pt")["param_groups"][0][0]["lr"]
    assert re.findall(r"iteration +(\d+)/3 .*\| lr ([0-9.e+-]+)", out.stdout) == [
        ("3", f"{lr:.2e}")], out.stdout


def test_stacked_tensors_are_read_and_written_one_layer_at_a_time(tmp_path):
    """Reading one layer (or expert) of a stacked tensor equals slicing the whole tensor and
    touches only that layer's chunks; the export writes one chunk per layer and per expert, as
    megatron-core does (what keeps a conversion's memory at one weight: measured by
    ``mfsdp.testing.experiments.megatron_lm_conversion_memory``)."""
    from torch.distributed.checkpoint import FileSystemReader

    from mfsdp.checkpoint.dcp import DCPSource
    from mfsdp.checkpoint.megatron_lm import fsdp_to_megatron_lm, megatron_lm_to_fsdp

    source = DCPSource(OPTIM / "adam" / "iter_0000002")
    key = "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"
    whole = source.get(key)
    loads = []
    real_load = torch.load

    def counting_load(*args, **kwargs):
        out = real_load(*args, **kwargs)
        loads.append(out.numel())
        return out

    torch.load = counting_load
    try:
        layer = source.get(key, (1,))
    finally:
        torch.load = real_load
    assert torch.equal(layer, whole[1])
    assert sum(loads) == whole[1].numel()  # only layer 1's chunks were read
    moe = DCPSource(FIXTURE / "moe" / "ckpt" / "iter_0000003")
    experts = "decoder.layers.1.mlp.experts.experts.linear_fc2.weight"
    assert torch.equal(moe.get(experts, (2,)), moe.get(experts)[2])
    mid = megatron_lm_to_fsdp(FIXTURE / "moe" / "ckpt", tmp_path / "m", _moe_config().to_dict())
    out = fsdp_to_megatron_lm(mid, tmp_path / "x") / "iter_0000003"
    chunks = FileSystemReader(str(out)).read_metadata().state_dict_metadata[experts].chunks
    assert [tuple(c.offsets)[0] for c in chunks] == [0, 1, 2, 3]
    assert all(tuple(c.sizes) == (1, 64, 32) for c in chunks)


def _convert_on_ranks(root: str) -> list[str]:
    """Every rank: both conversions, each rank writing its share of the tensors."""
    from mfsdp.checkpoint.dcp import spread_over_ranks
    from mfsdp.checkpoint.megatron_lm import fsdp_to_megatron_lm, megatron_lm_to_fsdp

    with spread_over_ranks():
        mid = megatron_lm_to_fsdp(OPTIM / "adam", f"{root}/mfsdp", _config().to_dict(),
                                  progress=False)
        fsdp_to_megatron_lm(mid, f"{root}/megatron", progress=False)
    return sorted(p.name for p in Path(root, "megatron", "iter_0000002").iterdir())


@pytest.mark.slow
@pytest.mark.extended
def test_conversion_spreads_over_ranks(tmp_path):
    """Under ``torchrun`` (and ``launch``) every rank converts a share of the tensors: the files
    of both ranks make the same checkpoint as one process does, and the command line runs so."""
    from mfsdp.checkpoint.megatron_lm import megatron_lm_to_fsdp

    files = launch(_convert_on_ranks, 2, args=(str(tmp_path / "two"),))[0]
    assert "__0_0.distcp" in files and "__1_0.distcp" in files  # both ranks wrote
    one = megatron_lm_to_fsdp(OPTIM / "adam", tmp_path / "one", _config().to_dict(),
                              progress=False)
    for a, b in ((one, tmp_path / "two" / "mfsdp"),
                 (OPTIM / "adam" / "iter_0000002", tmp_path / "two" / "megatron" / "iter_0000002")):
        want, got = _dcp_entries(a), _dcp_entries(b)
        assert sorted(got) == sorted(want)
        for key, value in want.items():
            if torch.is_tensor(value):
                assert torch.equal(got[key], value), key
    (tmp_path / "cfg.json").write_text(json.dumps(_config().to_dict()))
    import os

    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", "-m", "mfsdp.cli", "convert", "--from",
                          "megatron_lm", "--to", "fsdp_dtensor", str(OPTIM / "adam"),
                          str(tmp_path / "cli"), "--model-config", str(tmp_path / "cfg.json")],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("wrote fsdp_dtensor checkpoint") == 1  # rank 0 reports
    got = _dcp_entries(tmp_path / "cli")
    for key, value in _dcp_entries(one).items():
        if torch.is_tensor(value):
            assert torch.equal(got[key], value), key


@pytest.mark.parametrize("kind", ["dense", "moe", "mla"])
def test_an_export_converts_back_without_a_model_config(kind, tmp_path):
    """#29: mfsdp's Megatron-LM export carries the architecture in Megatron-LM's argument names,
    so ``--from megatron_lm`` needs no --model-config (as Megatron-LM's --use-checkpoint-args):
    converted back from those arguments alone, every tensor equals the import's (the dense, MoE
    and MLA models that megatron-core saved)."""
    from mfsdp.checkpoint.dcp import read_full
    from mfsdp.checkpoint.megatron_lm import fsdp_to_megatron_lm, megatron_lm_to_fsdp

    src, config = {"dense": (FIXTURE / "ckpt", _config), "moe": (FIXTURE / "moe" / "ckpt",
                                                                _moe_config),
                   "mla": (FIXTURE / "mla" / "ckpt", _mla_config)}[kind]
    mid = megatron_lm_to_fsdp(src, tmp_path / "mfsdp", config().to_dict(), progress=False)
    exported = fsdp_to_megatron_lm(mid, tmp_path / "megatron", progress=False)
    back = megatron_lm_to_fsdp(exported, tmp_path / "back", progress=False)
    want, _, want_manifest = read_full(mid)
    got, _, got_manifest = read_full(back)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    read = json.loads((back / "model_config.json").read_text())
    assert read == config().to_dict() | {k: read[k] for k in (
        "recompute_granularity", "recompute_method", "recompute_num_layers",
        "moe_token_dispatcher_type", "moe_flex_dispatcher_backend", "init_method_std",
        "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_expert_capacity_factor",
        "moe_token_drop_policy", "moe_pad_expert_input_to_capacity")}


def test_a_checkpoint_without_its_arguments_asks_for_a_model_config(tmp_path):
    """megatron-core's fixture carries a partial ``args`` (no vocabulary): the error names what is
    missing and the flags that supply the model."""
    from mfsdp.checkpoint.megatron_lm import megatron_lm_to_fsdp

    with pytest.raises(CheckpointError, match="lack padded_vocab_size.*--model-preset or "
                                              "--model-config"):
        megatron_lm_to_fsdp(OPTIM / "adam", tmp_path / "x", progress=False)
    with pytest.raises(CheckpointError, match="without its arguments; name its model with the "
                                              "model flags of mfsdp train"):
        megatron_lm_to_fsdp(FIXTURE / "ckpt", tmp_path / "y", progress=False)
