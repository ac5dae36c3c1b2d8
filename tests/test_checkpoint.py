"""fsdp_dtensor checkpoints: bit-exact resume, resharding, conversion round trips, corruption."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mfsdp.checkpoint import CheckpointError
from mfsdp.checkpoint.dcp import read_full
from mfsdp.checkpoint.full import fsdp_to_full, full_to_fsdp
from mfsdp.checkpoint.safetensors_format import fsdp_to_safetensors, safetensors_to_fsdp
from mfsdp.launch import RankError, launch
from mfsdp.testing import train_reference, train_sharded, train_sharded_many

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
BASE = dict(optimizer="adamw", global_batch=16, steps=6)


def _resume(world, cfg, tmp_path, save_at=3):
    """(uninterrupted run, run resumed from a checkpoint saved at ``save_at``)."""
    straight, first = launch(train_sharded_many, world, args=(
        [cfg, dict(cfg, save_at=save_at, save_dir=str(tmp_path))],))[0]
    second = launch(train_sharded, world, args=(dict(cfg, load_dir=str(tmp_path)),))[0]
    return straight, second


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [dict(BASE, strategy=s) for s in STRATEGIES] + [
    pytest.param(dict(BASE, model="moe", strategy="optim_grads_params", ep=2, dp_outer=2),
                 marks=pytest.mark.extended),  # (the HFSDP case below covers its path)
    dict(BASE, model="moe", strategy="optim_grads_params", ep=2, dp_outer=2,
         outer_strategy="optim")], ids=lambda c: "-".join(
    [c["strategy"]] + [f"{k}{c[k]}" for k in ("ep", "dp_outer", "outer_strategy") if k in c]))
def test_resume_is_bit_identical(cfg, tmp_path):
    world = 4 if cfg.get("ep") else 2
    straight, resumed = _resume(world, cfg, tmp_path)
    assert resumed["losses"] == straight["losses"][3:]
    for name, value in straight["params"].items():
        assert torch.equal(resumed["params"][name], value), name


RESHARD = [
    pytest.param(2, dict(BASE), 4, dict(BASE), id="2to4"),
    # (make test-extended: the inverse directions and combinations of the cases above)
    pytest.param(4, dict(BASE), 2, dict(BASE), id="4to2", marks=pytest.mark.extended),
    pytest.param(4, dict(BASE), 4, dict(BASE, dp_outer=2), id="fsdp_to_hsdp"),
    pytest.param(2, dict(BASE, strategy="optim"), 4,
                 dict(BASE, dp_outer=2, outer_strategy="optim"), id="zero1_to_hfsdp",
                 marks=pytest.mark.extended),
    pytest.param(4, dict(BASE, model="moe", ep=2), 4, dict(BASE, model="moe", ep=1),
                 id="ep2_to_ep1", marks=pytest.mark.extended),
    pytest.param(4, dict(BASE, model="moe", ep=2), 4,
                 dict(BASE, model="moe", ep=2, dp_outer=2), id="ep2_fsdp_to_ep2_hsdp",
                 marks=pytest.mark.extended),
]


@pytest.mark.slow
@pytest.mark.parametrize("w1, cfg1, w2, cfg2", RESHARD)
def test_reshard_keeps_state_and_training(w1, cfg1, w2, cfg2, tmp_path):
    straight, saved = launch(train_sharded_many, w1, args=(
        [cfg1, dict(cfg1, steps=3, save_at=3, save_dir=str(tmp_path))],))[0]
    loaded, resumed = launch(train_sharded_many, w2, args=(
        [dict(cfg2, steps=3, load_dir=str(tmp_path)), dict(cfg2, load_dir=str(tmp_path))],))[0]
    for name, value in saved["params"].items():  # the full state, gathered: identical
        assert torch.equal(loaded["params"][name], value), name
    # training continues as the original layout would have (reduction order differs: fp32 noise)
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(straight["losses"][3:]),
                               rtol=1e-5, atol=0)
    for name, value in straight["params"].items():
        torch.testing.assert_close(resumed["params"][name], value, rtol=0, atol=1e-5)


CONVERT = dict(optimizer="adamw2", model_kwargs={"swiglu": True}, global_batch=8, steps=4)


@pytest.mark.slow
def test_conversion_round_trips(tmp_path):
    """mfsdp_full -> fsdp_dtensor -> mfsdp_full and fsdp_dtensor -> safetensors -> fsdp_dtensor.

    Two optimizer groups (decay on matrices only) and fused swiglu weights.
    """
    straight = train_reference(CONVERT, world_size=2)
    train_reference(dict(CONVERT, save_at=2, save_dir=str(tmp_path / "A")), world_size=2)
    # mfsdp_full -> fsdp_dtensor with the CLI, as users run it
    subprocess.run([sys.executable, "-m", "mfsdp.checkpoint.convert", "--from", "mfsdp_full",
                    "--to", "fsdp_dtensor", str(tmp_path / "A"), str(tmp_path / "B")], check=True)
    # the converted optimizer state is placed right: training continues as the original would
    sharded = launch(train_sharded, 2, args=(dict(CONVERT, load_dir=str(tmp_path / "B")),))[0]
    torch.testing.assert_close(torch.tensor(sharded["losses"]),
                               torch.tensor(straight["losses"][2:]), rtol=1e-5, atol=0)
    fsdp_to_full(tmp_path / "B", tmp_path / "C")
    a, a_blobs, _ = read_full(tmp_path / "A")
    c, c_blobs, _ = read_full(tmp_path / "C")
    assert a.keys() == c.keys() and all(torch.equal(a[k], c[k]) for k in a)
    assert a_blobs == c_blobs
    assert any(k.startswith("optimizer.state.") for k in a)
    assert len(a_blobs["optimizer.param_groups"]) == 2
    fsdp_to_safetensors(tmp_path / "B", tmp_path / "D", swiglu=True)
    safetensors_to_fsdp(tmp_path / "D", tmp_path / "E")
    b, _, _ = read_full(tmp_path / "B")
    e, _, _ = read_full(tmp_path / "E")
    assert set(e) == {k for k in b if k.startswith("model.")}
    assert all(torch.equal(b[k], e[k]) for k in e)
    from mfsdp.checkpoint.safetensors import load_file

    hf, _ = load_file(tmp_path / "D" / "model.safetensors")
    assert "blocks.0.gate_proj.weight" in hf and "blocks.0.fc1.weight" not in hf
    torch.testing.assert_close(torch.cat([hf["blocks.0.gate_proj.weight"],
                                          hf["blocks.0.up_proj.weight"]]),
                               b["model.blocks.0.fc1.weight"], rtol=0, atol=0)


def test_mfsdp_full_with_two_groups_needs_the_map(tmp_path):
    train_reference(dict(CONVERT, steps=1, save_at=1, save_dir=str(tmp_path / "A")), world_size=1)
    # an mfsdp_full checkpoint from elsewhere: no map (and none in its manifest)
    (tmp_path / "A" / "param_to_param_group_map.json").unlink()
    manifest = json.loads((tmp_path / "A" / "manifest.json").read_text())
    del manifest["files"]["param_to_param_group_map.json"]
    del manifest["sha256"]["param_to_param_group_map.json"]
    (tmp_path / "A" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="2 optimizer parameter groups but no "
                                              "param_to_param_group_map.json"):
        full_to_fsdp(tmp_path / "A", tmp_path / "B")


@pytest.mark.extended  # `make test`'s 25-minute budget
def test_the_old_name_of_mfsdp_full_still_converts_with_a_notice(tmp_path):
    """``torch_dist`` names Megatron-LM's format now; mfsdp's full-tensor checkpoints, which had
    that name, still convert with ``--from torch_dist`` for one release (one line on stderr), and
    the old function names warn and do the same as the new ones."""
    train_reference(dict(CONVERT, steps=1, save_at=1, save_dir=str(tmp_path / "A")), world_size=1)
    proc = subprocess.run([sys.executable, "-m", "mfsdp.checkpoint.convert", "--from",
                           "torch_dist", "--to", "fsdp_dtensor", str(tmp_path / "A"),
                           str(tmp_path / "B")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    notice = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(notice) == 1 and "--from mfsdp_full" in notice[0], proc.stderr
    full_to_fsdp(tmp_path / "A", tmp_path / "C")
    b, _, _ = read_full(tmp_path / "B")
    c, _, _ = read_full(tmp_path / "C")
    assert b.keys() == c.keys() and all(torch.equal(b[k], c[k]) for k in b)
    from mfsdp.checkpoint.full import fsdp_to_torch_dist

    with pytest.warns(FutureWarning, match="fsdp_to_full"):
        fsdp_to_torch_dist(tmp_path / "B", tmp_path / "D")
    assert json.loads((tmp_path / "D" / "manifest.json").read_text())["format"] == "mfsdp_full"
    # a directory that is neither Megatron-LM's torch_dist nor mfsdp's is refused by name
    proc = subprocess.run([sys.executable, "-m", "mfsdp.checkpoint.convert", "--from",
                           "torch_dist", "--to", "fsdp_dtensor", str(tmp_path / "B"),
                           str(tmp_path / "E")], capture_output=True, text=True)
    assert proc.returncode != 0 and "is not a Megatron-LM torch_dist checkpoint" in proc.stderr


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    launch(train_sharded, 2, args=(dict(BASE, steps=2, save_at=2, save_dir=str(root)),))
    return root


def _load(root, **cfg):
    return launch(train_sharded, 2, args=(dict(BASE, steps=2, load_dir=str(root), **cfg),))


def _copy(saved, tmp_path):
    import shutil

    dst = tmp_path / "copy"
    shutil.copytree(saved, dst)
    return dst, dst / (dst / "latest").read_text().strip()


@pytest.mark.slow
@pytest.mark.parametrize("case, message", [
    ("missing", "has no key 'model.blocks.4.fc1.bias'"),
    ("unexpected", "has unexpected key 'model.blocks.3.fc1.bias'"),
    ("shape", "key 'model.blocks.0.fc1.weight' has shape (64, 32) in checkpoint"),
    ("truncated", "is truncated or was modified"),
    ("zeroed", "does not match the SHA-256 its manifest records"),
    ("version", "format_version=99, newer than this mfsdp reads (1)"),
])
def test_corrupt_checkpoints_fail_with_a_message(saved, tmp_path, case, message):
    root, ckpt = _copy(saved, tmp_path)
    cfg = {}
    if case == "missing":
        cfg = dict(blocks=5)
    elif case == "unexpected":
        cfg = dict(blocks=3)
    elif case == "shape":
        cfg = dict(hidden=48)
    elif case == "truncated":
        victim = next(f for f in sorted(ckpt.iterdir()) if f.suffix == ".distcp")
        victim.write_bytes(victim.read_bytes()[:100])
        message = f"{victim.name} has 100 bytes"
    elif case == "zeroed":  # 4 KiB zeroed in place: the same size, other bytes
        victim = max((f for f in ckpt.iterdir() if f.suffix == ".distcp"),
                     key=lambda f: f.stat().st_size)
        data = bytearray(victim.read_bytes())
        data[512:512 + 4096] = bytes(4096)
        victim.write_bytes(bytes(data))
        message = f"{victim} does not match the SHA-256"
    elif case == "version":
        manifest = json.loads((ckpt / "manifest.json").read_text())
        manifest["format_version"] = 99
        (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RankError) as info:
        _load(root, **cfg)
    assert info.value.exc_type == "CheckpointError"
    assert message in info.value.message, info.value.message


def test_manifest_checksums_are_what_sha256sum_prints(saved):
    """Every file of a save but the manifest has its SHA-256 recorded, as coreutils' sha256sum
    computes it (an operator can check a copied checkpoint with ``sha256sum -c``)."""
    ckpt = saved / (saved / "latest").read_text().strip()
    manifest = json.loads((ckpt / "manifest.json").read_text())
    names = sorted(f.name for f in ckpt.iterdir() if f.name != "manifest.json")
    assert sorted(manifest["sha256"]) == names and len(names) >= 4
    out = subprocess.run(["sha256sum", *names], cwd=ckpt, capture_output=True, text=True,
                         check=True).stdout
    assert {n: h for h, n in (line.split() for line in out.splitlines())} == manifest["sha256"]


def _save_then_die(root: str) -> None:
    """Save at step 2, then get killed (SIGKILL) in the middle of writing the step-4 save."""
    import signal

    import torch.distributed as dist

    import mfsdp.checkpoint.io as io

    real = io.dcp.save

    def dying_save(state, checkpoint_id):
        if "iter_0000004" in str(checkpoint_id):
            if dist.get_rank() == 0:
                Path(checkpoint_id, "__0_0.distcp").write_bytes(b"partial")
                os.kill(os.getpid(), signal.SIGKILL)
            dist.barrier()
        return real(state, checkpoint_id=checkpoint_id)

    io.dcp.save = dying_save
    train_sharded(dict(BASE, steps=4, save_at=2, save_dir=root))
    train_sharded(dict(BASE, steps=4, save_at=4, save_dir=root))


@pytest.mark.slow
def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path):
    with pytest.raises(RankError, match="rank 0 raised ProcessExit: was killed by signal SIGKILL"):
        launch(_save_then_die, 2, args=(str(tmp_path),), timeout=120)
    assert (tmp_path / "latest").read_text().strip() == "iter_0000002"
    torn = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-iter_0000004")]
    assert torn and (torn[0] / "__0_0.distcp").exists()
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        from mfsdp.checkpoint.manifest import resolve_checkpoint

        resolve_checkpoint(torn[0])
    resumed = launch(train_sharded, 2, args=(dict(BASE, steps=4, load_dir=str(tmp_path)),))[0]
    assert len(resumed["losses"]) == 2  # steps 3 and 4, after the step-2 checkpoint


def _rng_round_trip(root: str) -> bool:
    import mfsdp
    from mfsdp.checkpoint import load_checkpoint, save_checkpoint
    from mfsdp.models import Block, ToyModel

    torch.manual_seed(0)
    model = ToyModel(dim=8, hidden=16, num_blocks=2)
    model.register_buffer("step_count", torch.zeros(()))  # a persistent module buffer
    model, opt = mfsdp.fully_shard(model, torch.optim.AdamW(model.parameters()),
                                   fsdp_unit_modules=[Block])
    rank = dist.get_rank()
    torch.manual_seed(5 + rank)  # each rank's generator in its own state, as dropout needs
    model.module.step_count.fill_(7)
    save_checkpoint(root, model, opt, iteration=1, extra={"consumed_samples": 128})
    expected = torch.rand(3)
    torch.manual_seed(99)
    model.module.step_count.fill_(0)
    extra = load_checkpoint(root, model, opt)
    return (torch.equal(torch.rand(3), expected) and extra["consumed_samples"] == 128
            and model.module.step_count.item() == 7)


def test_rng_state_and_extra_are_restored(tmp_path):
    assert launch(_rng_round_trip, 2, args=(str(tmp_path),)) == [True, True]


def test_conversion_progress_in_a_log_is_a_line_every_30_seconds(capsys):
    """Not on a terminal (a Slurm log), a conversion's progress is tqdm's line, without carriage
    returns, at most every 30 s and once at the end: a 20-minute conversion (a clock we move)
    writes 40 lines with a rising percentage, a short one a single line."""
    from mfsdp.checkpoint.dcp import Progress

    now = [0.0]
    bar = Progress("export model", 1200 * 1024, clock=lambda: now[0])
    for _ in range(1200):  # one KiB a second for 20 minutes
        now[0] += 1.0
        bar(1024)
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "\r" not in err and len(lines) == 40, lines
    assert all(line.startswith("export model:") for line in lines)
    percents = [int(re.search(r"(\d+)%", line).group(1)) for line in lines]
    assert percents == sorted(percents) and percents[0] == 2 and percents[-1] == 100
    assert "[20:00<00:00" in lines[-1]
    bar = Progress("quick", 1000, clock=lambda: 0.0)
    for _ in range(100):
        bar(10)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("quick: 100%"), lines
    Progress("quiet", 10, enabled=False)(10)
    assert capsys.readouterr().err == ""


def test_convert_with_stderr_in_a_file_writes_one_line(tmp_path):
    """``mfsdp convert`` as a batch job runs it, stderr redirected to a file: a conversion that
    takes seconds leaves one progress line and no carriage return."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    with open(tmp_path / "err.log", "w") as err:
        proc = subprocess.run([sys.executable, "-m", "mfsdp.cli", "convert", "--from", "hf",
                               "--to", "fsdp_dtensor", str(tmp_path / "hf"),
                               str(tmp_path / "out")], stderr=err, stdout=subprocess.DEVNULL)
    text = (tmp_path / "err.log").read_text()
    assert proc.returncode == 0, text
    assert "\r" not in text and len(text.splitlines()) == 1, text
    assert text.startswith("import hf: 100%|"), text


def test_convert_refuses_a_from_that_is_not_what_is_on_disk(saved, tmp_path):
    """Read as another format, a checkpoint loses what the two do not share without a word
    (mfsdp's read as upstream Megatron-FSDP's kept 29 of 116 tensors): the input is recognised
    by what is on disk and a --from that disagrees is refused, writing nothing."""
    from mfsdp.checkpoint.convert import main
    from mfsdp.checkpoint.formats import checkpoint_format

    megatron_lm = Path(__file__).parent / "fixtures" / "megatron_lm" / "ckpt"
    upstream = Path(__file__).parent / "fixtures" / "megatron_fsdp" / "ckpt"
    assert [checkpoint_format(p) for p in (saved, megatron_lm, upstream)] == [
        "fsdp_dtensor", "megatron_lm", "megatron_fsdp"]
    for src, wrong, found in [(saved, "megatron_fsdp", "fsdp_dtensor"),
                              (saved, "mfsdp_full", "fsdp_dtensor"),
                              (megatron_lm, "megatron_fsdp", "megatron_lm"),
                              (upstream, "fsdp_dtensor", "megatron_fsdp")]:
        out = tmp_path / f"{wrong}-{found}"
        to = "hf" if wrong == "fsdp_dtensor" else "fsdp_dtensor"
        with pytest.raises(SystemExit, match=f"is a {found} checkpoint .* pass --from {found}"):
            main(["--from", wrong, "--to", to, str(src), str(out), "--no-progress"])
        assert not out.exists()


def test_a_truncated_safetensors_file_is_named(tmp_path):
    """The safetensors package reads the files; a damaged one is reported with its path."""
    from mfsdp.checkpoint.safetensors import SafetensorsReader, load_file, save_file

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.arange(12.0).view(3, 4), "b": torch.ones(3)}, path)
    assert SafetensorsReader(tmp_path).get("w").tolist() == torch.arange(12.0).view(3, 4).tolist()
    path.write_bytes(path.read_bytes()[:-8])
    for read in (lambda: SafetensorsReader(tmp_path), lambda: load_file(path)):
        with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors"):
            read()
