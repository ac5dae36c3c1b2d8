"""Checkpoints written by the real upstream Megatron-FSDP package (``megatron_fsdp`` 0.6.1).

The fixture ``tests/fixtures/megatron_fsdp`` was written by ``make_fixture.py`` there (upstream's
package on 2 gloo ranks, its README's ``dcp.save`` of the model and optimizer state dicts, two
AdamW parameter groups); ``expected.pt`` holds what upstream's ranks held, assembled from their
own shards. Every tensor must come back exactly (bit for bit), by name, including the AdamW
moments that upstream keys by position.
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

from mfsdp.launch import launch

FIXTURE = Path(__file__).parent / "fixtures" / "megatron_fsdp"
CKPT = FIXTURE / "ckpt"


def _expected() -> dict:
    return torch.load(FIXTURE / "expected.pt")


def _group_map(e: dict) -> dict[str, int]:
    first = {e["param_order"][i] for i in e["group_params"][0]}
    return {n: 0 if n in first else 1 for n in e["model_names"]}


def test_the_fixture_is_upstreams_layout():
    from mfsdp.checkpoint.dcp import DCPSource
    from mfsdp.checkpoint.detect import is_megatron_fsdp

    assert is_megatron_fsdp(CKPT)
    keys = DCPSource(CKPT).tensors
    assert "model.module.embedding.weight" in keys and "optimizer.state.0.exp_avg" in keys
    assert not (CKPT / "manifest.json").exists()


def test_convert_to_fsdp_dtensor_gives_every_tensor_by_name(tmp_path):
    from mfsdp.checkpoint.convert import main
    from mfsdp.checkpoint.dcp import DCPSource

    e = _expected()
    (tmp_path / "map.json").write_text(json.dumps(_group_map(e)))
    main(["--from", "megatron_fsdp", "--to", "fsdp_dtensor", str(CKPT), str(tmp_path / "ours"),
          "--param-to-param-group-map-json", str(tmp_path / "map.json"),
          "--model-config", str(_config_file(tmp_path, e))])
    got = DCPSource(tmp_path / "ours")
    for name, value in e["weights"].items():
        assert torch.equal(got.get(f"model.{name}"), value), name
    for key, value in e["optimizer_state"].items():
        assert torch.equal(got.get(f"optimizer.state.{key}"), value), key
    groups = got.blob("optimizer.param_groups")
    assert [g["weight_decay"] for g in groups] == [g["weight_decay"] for g in e["param_groups"]]


def _config_file(tmp_path: Path, e: dict) -> Path:
    f = tmp_path / "model_config.json"
    f.write_text(json.dumps(e["config"]))
    return f


def test_round_trip_gives_back_what_upstream_wrote(tmp_path):
    """megatron_fsdp -> fsdp_dtensor -> megatron_fsdp: the same keys, values and groups."""
    from mfsdp.checkpoint.dcp import DCPSource
    from mfsdp.checkpoint.upstream import fsdp_to_megatron_fsdp, megatron_fsdp_to_fsdp

    e = _expected()
    megatron_fsdp_to_fsdp(CKPT, tmp_path / "ours", model_names=e["model_names"],
                          group_of=_group_map(e))
    fsdp_to_megatron_fsdp(tmp_path / "ours", tmp_path / "back")
    a, b = DCPSource(CKPT), DCPSource(tmp_path / "back")
    assert a.tensors == b.tensors
    for key in a.tensors:
        assert torch.equal(a.get(key), b.get(key)), key
    assert sorted(a.blob_keys) == sorted(b.blob_keys)
    for key in a.blob_keys:
        assert a.blob(key) == b.blob(key), key


def test_several_groups_without_a_map_is_an_error(tmp_path):
    from mfsdp.checkpoint.manifest import CheckpointError
    from mfsdp.checkpoint.upstream import megatron_fsdp_to_fsdp

    with pytest.raises(CheckpointError, match="2 optimizer parameter groups"):
        megatron_fsdp_to_fsdp(CKPT, tmp_path / "x")
    assert not (tmp_path / "x").exists() and not list(tmp_path.iterdir())  # nothing left


def _load_sharded(strategy: str, root: str) -> dict:
    """Every rank: our model and optimizer (the same groups), loaded from upstream's files."""
    from mfsdp import fully_shard
    from mfsdp.checkpoint import load_checkpoint, save_checkpoint
    from mfsdp.models.gpt import GPT, GPTConfig, TransformerLayer

    e = _expected()
    torch.manual_seed(5)  # other initial values: the checkpoint must replace them all
    model = GPT(GPTConfig.from_dict(e["config"]))
    params = list(model.named_parameters())
    groups = [{"params": [p for _, p in params if p.dim() > 1], "weight_decay": 0.1},
              {"params": [p for _, p in params if p.dim() == 1], "weight_decay": 0.0}]
    sharded, opt = fully_shard(model, torch.optim.AdamW(groups, lr=1e-2),
                               fsdp_unit_modules=[TransformerLayer], zero_dp_strategy=strategy)
    load_checkpoint(str(CKPT), sharded, opt)
    save_checkpoint(root, sharded, opt, iteration=0)  # what the ranks hold now, by name
    return {"rank": dist.get_rank(), "weights": {k: v.clone() for k, v in
                                                 sharded.full_parameters().items()}}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim"])
def test_load_checkpoint_reads_it_into_a_sharded_model(strategy, tmp_path):
    from mfsdp.checkpoint.dcp import DCPSource
    from mfsdp.checkpoint.manifest import resolve_checkpoint

    e = _expected()
    out = launch(_load_sharded, 2, args=(strategy, str(tmp_path / "after")))[0]
    for name, value in e["weights"].items():
        assert torch.equal(out["weights"][name], value), name
    saved = DCPSource(resolve_checkpoint(tmp_path / "after"))
    for key, value in e["optimizer_state"].items():
        assert torch.equal(saved.get(f"optimizer.state.{key}"), value), key
    assert not [p for p in CKPT.parent.iterdir() if p.name.startswith(".from-")]  # cleaned up


@pytest.mark.slow
def test_trainer_loads_it_and_refuses_a_megatron_lm_directory(tmp_path):
    e = _expected()
    c = e["config"]
    model_flags = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
                   "--disable-bias-linear", "--group-query-attention", "--num-query-groups",
                   str(c["num_query_groups"]), "--num-layers", str(c["num_layers"]),
                   "--hidden-size", str(c["hidden_size"]), "--ffn-hidden-size",
                   str(c["ffn_hidden_size"]), "--num-attention-heads",
                   str(c["num_attention_heads"]), "--vocab-size", str(c["vocab_size"])]
    copy = tmp_path / "upstream"
    shutil.copytree(CKPT, copy)
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "mfsdp.train", "--use-megatron-fsdp", "--train-iters", "2", "--mock-data",
           "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
           *model_flags]
    out = subprocess.run(run + ["--load", str(copy)], capture_output=True, text=True,
                         timeout=300, env={"OMP_NUM_THREADS": "1", **__import__("os").environ})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "loaded an upstream Megatron-FSDP checkpoint" in out.stdout
    megatron = tmp_path / "megatron"
    (megatron / "iter_0000010").mkdir(parents=True)
    (megatron / "latest_checkpointed_iteration.txt").write_text("10")
    out = subprocess.run(run + ["--load", str(megatron)], capture_output=True, text=True,
                         timeout=300, env={"OMP_NUM_THREADS": "1", **__import__("os").environ})
    assert out.returncode != 0
    assert "holds a Megatron-LM checkpoint" in out.stderr
    assert "| loss" not in out.stdout  # it did not start training from scratch
