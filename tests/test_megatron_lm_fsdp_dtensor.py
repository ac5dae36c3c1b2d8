"""Megatron-LM ``--ckpt-format fsdp_dtensor`` checkpoints, written by megatron-core 0.19.2's
Megatron-FSDP on two ranks, read by mfsdp.

``tests/fixtures/megatron_lm/make_fsdp_dtensor.py`` trained megatron-core's ``GPTModel`` wrapped
in its ``FullyShardedDataParallel`` adapter with the distributed optimizer for two iterations
and saved it as Megatron-LM's ``save_checkpoint`` does for ``fsdp_dtensor``; it recorded what
the ranks held (gathered from their shards) and a third iteration. Variants: ``swiglu`` (fp32,
weights only: megatron-core cannot save a SwiGLU model's optimizer state in this format),
``gelu`` (fp32, Adam), ``bf16`` (``--bf16``: one more ``module.`` in the optimizer's keys) and
``moe`` (the MoE model: experts, router with expert bias, shared expert; fp32, Adam) and
``moe-ep2`` (the same with expert parallelism 2: each rank two experts, saved under their
global indices) and ``gelu-tp2`` (``gelu`` with tensor parallelism 2 on four ranks: each
weight a DTensor over data parallelism and TP, saved as its global tensor).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mfsdp.checkpoint.manifest import CheckpointError
from mfsdp.launch import launch

FIXTURE = Path(__file__).parent / "fixtures" / "megatron_lm"
ROOT = FIXTURE / "fsdp_dtensor"
VARIANTS = ["swiglu", "gelu", "bf16", "moe", "moe-ep2", "gelu-tp2"]


def _expected(variant: str) -> dict:
    return torch.load(FIXTURE / f"expected_fsdp_dtensor_{variant}.pt")


def _config(variant: str):
    from dataclasses import replace

    if variant.startswith("moe"):  # the torch_dist MoE fixture's model, with GELU MLPs
        from test_megatron_lm_checkpoints import _moe_config

        return replace(_moe_config(), swiglu=False)

    from mfsdp.models.gpt import GPT_PRESETS

    c = _expected(variant)["config"]
    # (replace, not with_overrides, which ignores None: the preset's Llama-3 RoPE scaling off)
    return replace(GPT_PRESETS["llama-tiny"], num_layers=c["num_layers"],
                          hidden_size=c["hidden_size"], ffn_hidden_size=c["ffn_hidden_size"],
                          num_attention_heads=c["num_attention_heads"],
                          num_query_groups=c["num_query_groups"], vocab_size=c["vocab_size"],
                          rotary_base=float(c["rotary_base"]), rope_scaling_factor=None,
                          norm_epsilon=1e-5, swiglu=variant == "swiglu")


def _ours(mcore: str) -> str:
    """mfsdp's name for a megatron-core parameter name (the test's own mapping)."""
    from mfsdp.checkpoint.megatron_common import mfsdp_name

    name = mfsdp_name(re.sub(r"^(module\.)+", "", mcore))
    return name.replace("mlp.shared_experts.", "mlp.shared_expert.")


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_tensor_equals_what_megatron_fsdp_held(variant, tmp_path):
    """Every weight (SwiGLU's halves joined) and every Adam moment and step equal what
    megatron-core's ranks held, bit for bit; the groups' hyperparameters, the schedule and the
    iteration come along."""
    from mfsdp.checkpoint.dcp import read_full
    from mfsdp.checkpoint.megatron_lm import megatron_lm_to_fsdp

    e = _expected(variant)
    out = megatron_lm_to_fsdp(ROOT / variant, tmp_path / "imported", _config(variant).to_dict(),
                              progress=False)
    tensors, blobs, manifest = read_full(out)
    assert manifest["layout"]["source"] == "megatron_lm_fsdp_dtensor"
    weights = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    assert sorted(weights) == sorted(_ours(k) for k in e["weights"])
    for key, want in e["weights"].items():
        assert torch.equal(weights[_ours(key)], want.float()), key
    state = {k: v for k, v in tensors.items() if k.startswith("optimizer.state.")}
    if variant == "swiglu":  # saved with --no-save-optim
        assert not state and "optimizer.param_groups" not in blobs
    else:
        assert len(state) == 3 * len(e["optimizer_state"])
        for key, fields in e["optimizer_state"].items():
            for field, want in fields.items():
                got = state[f"optimizer.state.{_ours(key)}.{field}"]
                assert torch.equal(got, want.float()), (key, field)
        assert {v.item() for k, v in state.items() if k.endswith(".step")} == {2.0}
        groups = blobs["optimizer.param_groups"]
        assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
        assert {g["lr"] for g in groups} == {e["param_groups"][0]["lr"]}
        group_of = json.loads((out / "param_to_param_group_map.json").read_text())
        assert {n for n, g in group_of.items() if g == 1} == {n for n in weights if "norm" in n}
    assert blobs["extra"]["iteration"] == 2
    assert blobs["extra"]["opt_param_scheduler"] == e["scheduler"]


def test_the_optimizers_prefix_follows_the_jobs_wrapping():
    """The fixtures hold the two key forms Megatron-LM writes: ``module.module.`` without
    ``--bf16`` and ``module.module.module.`` with its ``Float16Module``; SwiGLU halves as ``_w``
    and ``_v``; no ``metadata.json`` (a plain DCP)."""
    from mfsdp.checkpoint.dcp import DCPSource

    def keys(variant):
        source = DCPSource(ROOT / variant / "iter_0000002")
        return set(source.tensors), set(source.blob_keys)

    fp32, _ = keys("gelu")
    bf16, blobs = keys("bf16")
    assert any(k.startswith("optimizer.state.module.module.decoder.") for k in fp32)
    assert any(k.startswith("optimizer.state.module.module.module.decoder.") for k in bf16)
    assert {"args", "iteration", "checkpoint_version"} <= blobs
    assert any(k.startswith("optimizer.param_to_group_meta.") for k in blobs)
    swiglu, _ = keys("swiglu")
    assert "model.module.decoder.layers.0.mlp.linear_fc1.weight_w" in swiglu
    assert not (ROOT / "gelu" / "iter_0000002" / "metadata.json").exists()


def test_recognised_by_what_is_on_disk(tmp_path):
    """Root or iteration directory: Megatron-LM's, not upstream Megatron-FSDP's README layout
    (both have ``model.module.*``); ``describe_unreadable`` has nothing to object to; a plain
    DCP of Megatron-LM's without Megatron-FSDP's keys (``--ckpt-format torch_dcp``) is refused
    with its name and the fix."""
    from mfsdp.checkpoint.detect import megatron_lm_backend, resolve_megatron_lm
    from mfsdp.checkpoint.detect import describe_unreadable, is_megatron_fsdp

    for path in (ROOT / "gelu", ROOT / "gelu" / "iter_0000002"):
        directory, iteration = resolve_megatron_lm(path)
        assert (directory.name, iteration) == ("iter_0000002", 2)
        assert megatron_lm_backend(directory) == "fsdp_dtensor"
        assert not is_megatron_fsdp(path)
        assert describe_unreadable(path) is None
    import torch.distributed.checkpoint as dcp

    dcp_dir = tmp_path / "torch_dcp" / "iter_0000004"
    dcp.save({"model": {"decoder.final_layernorm.weight": torch.ones(4)}, "iteration": 4,
              "checkpoint_version": 3.0}, checkpoint_id=str(dcp_dir), no_dist=True)
    (tmp_path / "torch_dcp" / "latest_checkpointed_iteration.txt").write_text("4")
    message = describe_unreadable(tmp_path / "torch_dcp")
    assert "torch_dcp" in message and "--ckpt-format torch_dist" in message


def test_convert_command_reads_it(tmp_path):
    """``mfsdp convert --from megatron_lm`` (and ``--from torch_dist``, by what is on disk)."""
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(_config("swiglu").to_dict()))
    for fmt in ("megatron_lm", "torch_dist"):
        out = subprocess.run([sys.executable, "-m", "mfsdp.cli", "convert", "--from", fmt,
                              "--to", "fsdp_dtensor", str(ROOT / "swiglu"), str(tmp_path / fmt),
                              "--model-config", str(cfg)], capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr
        assert (tmp_path / fmt / "manifest.json").exists()


def test_a_wrong_config_is_refused_with_the_tensor_named(tmp_path):
    from mfsdp.checkpoint.megatron_lm import megatron_lm_to_fsdp
    from mfsdp.models.gpt import with_overrides

    wrong = with_overrides(_config("gelu"), ffn_hidden_size=128)
    with pytest.raises(CheckpointError, match=r"linear_fc1.*\(176, 64\).*\(128, 64\)"):
        megatron_lm_to_fsdp(ROOT / "gelu", tmp_path / "x", wrong.to_dict(), progress=False)
    swiglu_config_on_gelu = _config("swiglu").to_dict()
    with pytest.raises(CheckpointError, match="linear_fc1"):
        megatron_lm_to_fsdp(ROOT / "gelu", tmp_path / "y", swiglu_config_on_gelu, progress=False)
    assert not list(tmp_path.iterdir())


def _third_iteration(path: str, strategy: str, optimizer: str) -> dict:
    """Every rank: mfsdp's sharded GPT and a torch optimizer loaded from Megatron-LM's directory
    by ``load_checkpoint``, then megatron-core's third iteration: one sequence per rank, mean
    token loss, clipping at 1.0, one step. ``optimizer="sgd"`` loads the weights only and takes
    a plain SGD step (megatron-core's distributed optimizer, which Megatron-FSDP needs, is Adam
    only): the gradient itself, unnormalised."""
    from mfsdp import fully_shard
    from mfsdp.checkpoint import load_checkpoint
    from mfsdp.models.gpt import GPT, TransformerLayer
    from test_megatron_lm_checkpoints import iteration_3

    e = _expected("gelu")
    torch.manual_seed(1)  # other initial values: the checkpoint must replace them all
    model = GPT(_config("gelu"))
    params = list(model.named_parameters())
    wd = 0.5 if optimizer == "adam" else 0.0  # Adam's come from the checkpoint
    groups = [{"params": [p for _, p in params if p.dim() > 1], "weight_decay": wd},
              {"params": [p for _, p in params if p.dim() == 1], "weight_decay": wd}]
    opt = (torch.optim.AdamW(groups, lr=1.0) if optimizer == "adam"
           else torch.optim.SGD(groups, lr=1.0))
    sharded, opt = fully_shard(model, opt, fsdp_unit_modules=[TransformerLayer],
                               zero_dp_strategy=strategy)
    load_checkpoint(path, sharded, opt if optimizer == "adam" else None)
    before = {k: v.clone() for k, v in sharded.full_parameters().items()}
    done = iteration_3(sharded, opt, e)
    return {"before": before, "weights": {k: v.clone() for k, v in
                                          sharded.full_parameters().items()}, **done}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim"])
def test_training_goes_on_as_megatron_fsdp_does(strategy, tmp_path):
    """Megatron-LM's ``fsdp_dtensor`` directory read by ``load_checkpoint`` (2 ranks) continues
    as megatron-core's Megatron-FSDP continued: the third iteration's loss and every weight after
    it. Tolerance, as a fraction of the iteration's update: 1e-4, and 1e-2 for the
    query/key/value weights (float32 sums in another order; Adam divides each element by its own
    size, so nearly cancelling attention gradients show their rounding at full scale). A wrong
    step count (bias correction) or moment moves the update by 10% or more."""
    e = _expected("gelu")
    copy = tmp_path / "megatron"
    shutil.copytree(ROOT / "gelu", copy)
    got = launch(_third_iteration, 2, args=(str(copy), strategy, "adam"))[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["megatron"]  # nothing left behind
    assert abs(got["loss"] - e["loss_3"]) < 1e-5, (got["loss"], e["loss_3"])
    for name, after in got["weights"].items():
        want = e["weights_after_3"][next(k for k in e["weights"] if _ours(k) == name)]
        step = (want - got["before"][name]).norm()
        tol = 1e-2 if "linear_qkv" in name else 1e-4
        assert (after - want).norm() <= tol * step, (name, (after - want).norm() / step)


@pytest.mark.slow
def test_sgd_from_the_imported_weights_follows_the_gradient(tmp_path):
    """The SGD check AdamW cannot make: from the imported weights, the loss is megatron-core's
    third-iteration loss, and one SGD step moves each weight by exactly lr times its clipped
    gradient (2 ranks averaging: a doubled or halved gradient fails). The reference gradient is
    one process's plain PyTorch on the full batch."""
    import torch.nn.functional as F

    from mfsdp.checkpoint.dcp import read_full
    from mfsdp.checkpoint.megatron_lm import megatron_lm_to_fsdp
    from mfsdp.models.gpt import GPT

    e = _expected("gelu")
    got = launch(_third_iteration, 2, args=(str(ROOT / "gelu"), "optim_grads_params", "sgd"))[0]
    assert abs(got["loss"] - e["loss_3"]) < 1e-5, (got["loss"], e["loss_3"])
    out = megatron_lm_to_fsdp(ROOT / "gelu", tmp_path / "w", _config("gelu").to_dict(),
                              weights_only=True, progress=False)
    tensors, _, _ = read_full(out)
    ref = GPT(_config("gelu"))
    ref.load_state_dict({k[len("model."):]: v for k, v in tensors.items()})
    S = e["tokens"].shape[1]
    losses = [F.cross_entropy(ref(t, torch.tensor([0, S])).view(S, -1).float(), lab)
              for t, lab in zip(e["tokens"], e["labels"])]
    (sum(losses) / len(losses)).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    for name, p in ref.named_parameters():  # lr 1: the step is the clipped gradient
        before = got["before"][name]
        assert torch.equal(before, p.detach()), name
        step, want = got["weights"][name] - before, -p.grad
        # float32 sums in another order, and the rounding of weight + step at the weight's scale
        tol = 1e-4 * want.norm() + 2 * torch.finfo(torch.float32).eps * before.norm()
        assert (step - want).norm() <= tol, (name, (step - want).norm() / want.norm())


@pytest.mark.parametrize("variant,precision", [("swiglu", "fp32"), ("gelu", "fp32"),
                                               ("bf16", "bf16"), ("moe", "fp32"),
                                               ("moe-ep2", "fp32"), ("gelu-tp2", "fp32")])
def test_export_of_an_import_is_the_checkpoint_megatron_core_wrote(variant, precision, tmp_path):
    """megatron-core's checkpoint -> mfsdp -> Megatron-LM ``fsdp_dtensor`` (for the job that
    wrote it: local layer spec, its precision) gives back its entries: the tracker, every key
    (SwiGLU halves, the optimizer's prefix), every tensor bit for bit with its dtype, and every
    object but ``args`` (the iteration, the schedule, each parameter's group metadata).
    (``make_fsdp_dtensor.py mcore VARIANT --load DIR`` has megatron-core load such an export:
    every tensor equal and, for the optimizer variants, the third iteration bit for bit.)"""
    from mfsdp.checkpoint.dcp import DCPSource
    from mfsdp.checkpoint.megatron_common import SAFE_TYPES
    from mfsdp.checkpoint.megatron_lm import megatron_lm_to_fsdp
    from mfsdp.checkpoint.megatron_lm_dtensor import fsdp_to_megatron_lm_dtensor

    mid = megatron_lm_to_fsdp(ROOT / variant, tmp_path / "mfsdp", _config(variant).to_dict(),
                              progress=False)
    out = fsdp_to_megatron_lm_dtensor(mid, tmp_path / "mlm", precision=precision,
                                      transformer_impl="local", progress=False)
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "2"
    theirs, ours = DCPSource(ROOT / variant / "iter_0000002"), DCPSource(out / "iter_0000002")
    assert ours.tensors == theirs.tensors  # keys, shapes and dtypes
    for key in theirs.tensors:
        assert torch.equal(ours.get(key), theirs.get(key)), key
    assert sorted(ours.blob_keys) == sorted(theirs.blob_keys)
    for key in theirs.blob_keys:
        if key != "args":
            assert ours.object(key, SAFE_TYPES) == theirs.object(key, SAFE_TYPES), key
    args = ours.object("args", SAFE_TYPES)
    assert (args.ckpt_format, args.use_megatron_fsdp, args.bf16) == (
        "fsdp_dtensor", True, precision == "bf16")


def test_export_follows_the_loading_jobs_flags(tmp_path):
    """``mfsdp convert --to megatron_lm --ckpt-format fsdp_dtensor``: Transformer Engine's fused
    norm names by default, ``--bf16`` adds the ``Float16Module`` prefix; the flags that name the
    loading job are refused where they would be ignored."""
    from mfsdp.checkpoint.convert import main
    from mfsdp.checkpoint.dcp import DCPSource
    from mfsdp.checkpoint.megatron_lm import megatron_lm_to_fsdp

    mid = megatron_lm_to_fsdp(ROOT / "gelu", tmp_path / "m", _config("gelu").to_dict(),
                              progress=False)
    assert main(["--from", "fsdp_dtensor", "--to", "megatron_lm", "--ckpt-format",
                 "fsdp_dtensor", "--bf16", "--no-progress", str(mid), str(tmp_path / "te")]) == 0
    keys = set(DCPSource(tmp_path / "te" / "iter_0000002").tensors)
    assert "model.module.decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in keys
    assert "model.module.decoder.layers.1.input_layernorm.weight" not in keys
    assert ("optimizer.state.module.module.module.decoder.layers.1.mlp.linear_fc1."
            "layer_norm_weight.exp_avg") in keys
    # and it reads back as it was (fused names and the deeper prefix resolved)
    from mfsdp.checkpoint.dcp import read_full

    back, _, _ = read_full(megatron_lm_to_fsdp(tmp_path / "te", tmp_path / "back",
                                               _config("gelu").to_dict(), progress=False))
    first, _, _ = read_full(mid)
    assert back.keys() == first.keys()
    assert all(torch.equal(back[k], first[k]) for k in first)
    for argv, message in (
            (["--bf16"], "--ckpt-format fsdp_dtensor"),
            (["--ckpt-format", "fsdp_dtensor", "--bf16", "--fp16"], "not both")):
        with pytest.raises(SystemExit, match=message):
            main(["--from", "fsdp_dtensor", "--to", "megatron_lm", *argv, str(mid),
                  str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="--ckpt-format chooses"):
        main(["--from", "megatron_lm", "--to", "fsdp_dtensor", "--ckpt-format", "fsdp_dtensor",
              str(ROOT / "gelu"), str(tmp_path / "y")])
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_sgd_state_is_not_exported_to_megatron_fsdp(tmp_path):
    """Megatron-FSDP runs megatron-core's distributed optimizer, which is Adam only: an SGD
    checkpoint's export is refused with the fix, and nothing is left behind."""
    from mfsdp.checkpoint.megatron_lm import megatron_lm_to_fsdp
    from mfsdp.checkpoint.megatron_lm_dtensor import fsdp_to_megatron_lm_dtensor

    from test_megatron_lm_checkpoints import _config as dense_config

    mid = megatron_lm_to_fsdp(FIXTURE / "optim" / "sgd", tmp_path / "m",
                              dense_config().to_dict(), progress=False)
    with pytest.raises(CheckpointError, match="Adam only.*--weights-only"):
        fsdp_to_megatron_lm_dtensor(mid, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    out = fsdp_to_megatron_lm_dtensor(mid, tmp_path / "w", weights_only=True, progress=False)
    assert (out / "iter_0000002" / ".metadata").exists()


def _convert_on_ranks(root: str) -> list[str]:
    """Every rank: both fsdp_dtensor conversions, each rank writing its share of the tensors."""
    from mfsdp.checkpoint.dcp import spread_over_ranks
    from mfsdp.checkpoint.megatron_lm import megatron_lm_to_fsdp
    from mfsdp.checkpoint.megatron_lm_dtensor import fsdp_to_megatron_lm_dtensor

    with spread_over_ranks():
        mid = megatron_lm_to_fsdp(ROOT / "gelu", f"{root}/mfsdp", _config("gelu").to_dict(),
                                  progress=False)
        fsdp_to_megatron_lm_dtensor(mid, f"{root}/megatron", transformer_impl="local",
                                    progress=False)
    return sorted(p.name for p in Path(root, "megatron", "iter_0000002").iterdir())


@pytest.mark.slow
@pytest.mark.extended
def test_conversions_spread_over_ranks(tmp_path):
    """Within ``spread_over_ranks`` (what ``mfsdp convert`` under ``torchrun`` enters) both
    ranks write their share, and the round trip through two ranks is megatron-core's
    checkpoint again, tensor for tensor."""
    from test_megatron_lm_checkpoints import assert_same_tensors

    files = launch(_convert_on_ranks, 2, args=(str(tmp_path / "two"),))[0]
    assert "__0_0.distcp" in files and "__1_0.distcp" in files  # both ranks wrote
    assert_same_tensors(ROOT / "gelu" / "iter_0000002",
                        tmp_path / "two" / "megatron" / "iter_0000002")
