"""A Megatron-LM job's whole state, moved to mfsdp: what a conversion does not carry is named,
and ``mfsdp train --load`` continues the step count of megatron-core's DDP + Adam layout.

The fixture ``tests/fixtures/megatron_lm/optim/adam-ddp`` is what megatron-core 0.19.2 writes for
Megatron-LM without ``--use-distributed-optimizer``: torch's Adam under megatron-core's plain
optimizer, its moments in model space and its step saved once, as
``optimizer.state.common_step`` in the common state (``make_tp_fixture.py mcore --ddp-adam``).
The first resumed step's parity with megatron-core is checked in
``test_megatron_lm_checkpoints.py`` (``adam-ddp`` cases).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

FIXTURE = Path(__file__).parent / "fixtures" / "megatron_lm"
DDP_ADAM = FIXTURE / "optim" / "adam-ddp"


def _with_more_state(dst: Path, **common_more) -> Path:
    """A copy of the DDP + Adam fixture rewritten with ``common_more`` added to its common state
    and an ``rng_state`` object beside it (as Megatron-LM saves one without ``--no-save-rng``)."""
    from mfsdp.checkpoint.dcp import DCPSource
    from mfsdp.checkpoint.megatron_common import (COMMON, SAFE_TYPES, read_common_state,
                                                  write_iteration)

    directory = DDP_ADAM / "iter_0000002"
    source = DCPSource(directory)
    state: dict[str, object] = {k: torch.empty(shape, dtype=dtype, device="meta")
                                for k, (shape, dtype) in source.tensors.items()}
    state.update({k: source.object(k, SAFE_TYPES) for k in source.blob_keys if k != COMMON})
    state[COMMON] = [read_common_state(directory) | common_more]
    state["rng_state/shard_0_1"] = [{"random_rng_state": (3, (1, 2), None)}]
    write_iteration(dst, 2, state, lambda key, i=None: source.get(key),
                    metadata_json={"sharded_backend": "torch_dist",
                                   "sharded_backend_version": 1})
    return dst


def test_what_a_conversion_does_not_carry_is_named(tmp_path, capsys):
    """``mfsdp convert`` ends with one ``not carried: KEY (why)`` line: an entry of the common
    state it cannot map (here ``my_job_state``), Megatron-LM's ``rng_state`` and Transformer
    Engine's extra state, each with its reason; what it reads (step, moments, groups, schedule,
    iteration, ``args`` with the consumed samples) is not in it, and lands in the checkpoint."""
    from mfsdp.checkpoint.convert import main
    from mfsdp.checkpoint.dcp import read_full

    src = _with_more_state(tmp_path / "megatron", my_job_state={"seen": 3})
    assert main(["--from", "megatron_lm", "--to", "fsdp_dtensor", "--no-progress", str(src),
                 str(tmp_path / "m")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("not carried: "), lines
    left = lines[-1][len("not carried: "):]
    assert "my_job_state (no counterpart in mfsdp)" in left
    assert "rng_state (Megatron-LM's per-rank Python, NumPy, torch and CUDA" in left
    assert "*._extra_state (8 entries: Transformer Engine" in left
    for carried in ("optimizer", "opt_param_scheduler", "args", "iteration", "common_step"):
        assert carried not in left.replace("optimizer (", ""), carried
    tensors, blobs, _ = read_full(tmp_path / "m")
    extra = blobs["extra"]
    assert extra["iteration"] == 2 and extra["consumed_train_samples"] == 4
    assert extra["megatron_lm_args"]["num_attention_heads"] == 4
    assert extra["opt_param_scheduler"]["num_steps"] == 2
    steps = {v.item() for k, v in tensors.items() if k.endswith(".step")}
    assert steps == {2.0}


def test_adam_moments_without_a_step_are_refused(tmp_path):
    """A checkpoint whose Adam moments come without any step counter is refused in one line
    (torch's Adam would fail at the first step); the weights alone still convert."""
    from mfsdp.checkpoint.manifest import CheckpointError
    from mfsdp.checkpoint.megatron_common import read_common_state
    from mfsdp.checkpoint.megatron_lm import megatron_lm_to_fsdp

    optimizer = read_common_state(DDP_ADAM / "iter_0000002")["optimizer"]
    src = _with_more_state(tmp_path / "megatron",
                           optimizer={"state": {}, "param_groups": optimizer["param_groups"]})
    with pytest.raises(CheckpointError, match="has Adam's moments but no step counter"):
        megatron_lm_to_fsdp(src, tmp_path / "m", progress=False)
    assert not (tmp_path / "m").exists()
    megatron_lm_to_fsdp(src, tmp_path / "w", weights_only=True, progress=False)


TRAIN = ["-m", "mfsdp.train", "--use-megatron-fsdp", "--train-iters", "3", "--mock-data",
         "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
         "--log-interval", "1", "--use-checkpoint-opt_param-scheduler", "--normalization",
         "RMSNorm", "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
         "--group-query-attention", "--num-query-groups", "2", "--num-layers", "2",
         "--hidden-size", "64", "--ffn-hidden-size", "176", "--num-attention-heads", "4",
         "--vocab-size", "256", "--norm-epsilon", "1e-5", "--rotary-base", "10000",
         "--untie-embeddings-and-output-weights", "--save-interval", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("layout,source,ranks", [
    ("adam-ddp", "converted", 1),
    pytest.param("adam-ddp", "megatron_lm", 2, marks=pytest.mark.extended),
    pytest.param("adam", "converted", 1, marks=pytest.mark.extended),
    pytest.param("adam-dp-reshardable", "megatron_lm", 2, marks=pytest.mark.extended),
    pytest.param("adam-dp-reshardable-tp2", "megatron_lm", 2, marks=pytest.mark.extended)])
def test_trainer_continues_the_step_count(layout, source, ranks, tmp_path):
    """``mfsdp convert`` then ``mfsdp train --load`` of the result (1 rank), or ``--load`` of
    the Megatron-LM directory itself (2 ranks), for DDP + Adam and for the distributed
    optimizer's ``fully_reshardable`` layout (``adam``, whose saved arguments lack the model:
    the model flags name it) and its default ``dp_reshardable`` one (also of a TP 2 job, loaded
    with ``--tensor-model-parallel-size 2``): iteration 3 runs (no ``KeyError: 'step'``), the
    not-carried line is printed, and the checkpoint it saves holds Adam's step 3 for every parameter, at
    iteration 3; exported, it is the job's layout again (the step 3 where that layout keeps
    it)."""
    from mfsdp.checkpoint.dcp import read_full
    from mfsdp.checkpoint.manifest import resolve_checkpoint

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    load = tmp_path / "megatron"
    shutil.copytree(FIXTURE / "optim" / layout, load)
    if source == "converted":
        model = [] if layout == "adam-ddp" else MODEL + ["--num-attention-heads", "4"]
        out = subprocess.run([sys.executable, "-m", "mfsdp.cli", "convert", "--from", "torch_dist",
                              "--to", "fsdp_dtensor", "--no-progress", str(load),
                              str(tmp_path / "converted"), *model],
                             capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "not carried: *._extra_state" in out.stdout, out.stdout
        load = tmp_path / "converted"
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(ranks), *TRAIN, "--load", str(load), "--save", str(tmp_path / "saved")]
    if layout.endswith("-tp2"):
        run += ["--tensor-model-parallel-size", "2"]
    out = subprocess.run(run, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from iteration 2" in out.stdout, out.stdout
    assert "iteration     3/3" in out.stdout, out.stdout
    if source == "megatron_lm":
        assert "not carried: *._extra_state" in out.stdout, out.stdout
    tensors, blobs, _ = read_full(resolve_checkpoint(tmp_path / "saved"))
    steps = {k: v.item() for k, v in tensors.items() if k.endswith(".step")}
    assert len(steps) == len([k for k in tensors if k.startswith("model.")])
    assert set(steps.values()) == {3.0}
    assert blobs["extra"]["iteration"] == 3
    # back to Megatron-LM in the job's own layout: its plain optimizer, the step once
    from mfsdp.checkpoint.megatron_common import read_common_state
    from mfsdp.checkpoint.megatron_lm import fsdp_to_megatron_lm

    back = fsdp_to_megatron_lm(tmp_path / "saved", tmp_path / "back", progress=False)
    common = read_common_state(back / "iter_0000003")
    if layout == "adam-ddp":
        assert common["optimizer"]["state"]["common_step"].item() == 3.0
    else:
        groups = common["optimizer"]["optimizer"]["param_groups"]
        assert {g["step"] for g in groups} == {3.0}
    assert common["args"].use_distributed_optimizer is (layout != "adam-ddp")


# --- the model of a checkpoint: Megatron-LM's saved arguments, or mfsdp train's model flags

MODEL = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
         "--disable-bias-linear", "--group-query-attention", "--num-query-groups", "2",
         "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176",
         "--vocab-size", "256", "--norm-epsilon", "1e-5", "--rotary-base", "10000",
         "--untie-embeddings-and-output-weights"]


def _convert(capsys, *argv) -> tuple[int, str]:
    """``mfsdp convert ARGV`` in this process: its exit status and its last line (stdout on
    success, the error on stderr)."""
    from mfsdp.cli import main

    code = main(["convert", "--no-progress", *map(str, argv)])
    out = capsys.readouterr()
    text = out.out if code == 0 else out.err
    return code, text.strip().splitlines()[-1] if text.strip() else ""


def test_model_flags_name_a_checkpoint_that_saved_no_arguments(tmp_path, capsys):
    """``ckpt/`` (megatron-core's model saved without ``args``) converts with mfsdp train's model
    flags, its weights as megatron-core saved them; without ``--num-attention-heads`` (which
    the shapes cannot tell) it is refused naming the flag; with 8 heads in place of 4 the
    refusal names the tensor whose shape disagrees and the flags given."""
    from mfsdp.checkpoint.dcp import read_full

    src = FIXTURE / "ckpt"
    code, line = _convert(capsys, "--from", "megatron_lm", "--to", "fsdp_dtensor", src,
                          tmp_path / "no-heads", *MODEL)
    assert code == 2 and "lack num_attention_heads (--num-attention-heads)" in line, line
    code, line = _convert(capsys, "--from", "megatron_lm", "--to", "fsdp_dtensor", src,
                          tmp_path / "eight", *MODEL, "--num-attention-heads", "8")
    assert code == 2 and "linear_qkv.weight the shape (128, 64)" in line, line
    assert "(96, 64)" in line and "--num-attention-heads 8" in line, line
    code, line = _convert(capsys, "--from", "megatron_lm", "--to", "fsdp_dtensor", src,
                          tmp_path / "four", *MODEL, "--num-attention-heads", "4")
    assert code == 0, line
    tensors, _, _ = read_full(tmp_path / "four")
    want = torch.load(FIXTURE / "expected.pt")["state_dict"]
    assert torch.equal(tensors["model.layers.1.self_attention.linear_qkv.weight"],
                       want["decoder.layers.1.self_attention.linear_qkv.weight"])
    assert not any(p.name.startswith(("eight", "no-heads")) for p in tmp_path.iterdir())


def test_a_flag_that_contradicts_the_saved_arguments_is_refused(tmp_path, capsys):
    """A model flag against Megatron-LM's saved ``args`` is refused in one line naming both; one
    that agrees is accepted."""
    code, line = _convert(capsys, "--from", "megatron_lm", "--to", "fsdp_dtensor", DDP_ADAM,
                          tmp_path / "m", "--num-attention-heads", "8")
    assert code == 2, line
    assert "--num-attention-heads 8 contradicts" in line and "num_attention_heads=4" in line
    code, line = _convert(capsys, "--from", "megatron_lm", "--to", "fsdp_dtensor", DDP_ADAM,
                          tmp_path / "m", "--num-attention-heads", "4")
    assert code == 0, line


def test_missing_arguments_are_named_all_at_once():
    """Saved arguments that lack several fields are refused with every one of them, each with the
    flag that supplies it."""
    import argparse

    from mfsdp.checkpoint.manifest import CheckpointError
    from mfsdp.checkpoint.megatron_common import config_from_megatron_args

    with pytest.raises(CheckpointError) as info:
        config_from_megatron_args(argparse.Namespace(num_layers=2))
    assert ("lack hidden_size (--hidden-size), num_attention_heads (--num-attention-heads), "
            "padded_vocab_size (--vocab-size)") in str(info.value)


def test_model_flags_and_configs_are_refused_where_they_cannot_act(tmp_path, capsys):
    """Model flags name a Megatron-LM checkpoint's model, and are refused for other inputs; a
    ``--model-config`` that names no head count is refused (GPTConfig's default would be taken
    silently)."""
    import json

    code, line = _convert(capsys, "--from", "fsdp_dtensor", "--to", "hf", tmp_path / "a",
                          tmp_path / "b", "--num-layers", "2")
    assert code == 2 and "the model flags (--num-layers)" in line, line
    (tmp_path / "cfg.json").write_text(json.dumps({"num_layers": 2, "hidden_size": 64}))
    code, line = _convert(capsys, "--from", "megatron_lm", "--to", "fsdp_dtensor", DDP_ADAM,
                          tmp_path / "m", "--model-config", tmp_path / "cfg.json")
    assert code == 2 and "names no num_attention_heads" in line, line


def test_a_model_config_with_another_head_count_is_refused(tmp_path):
    """A model configuration (the trainer's, for ``--load`` of Megatron-LM's directory, or
    ``--model-config``) whose head count differs from the checkpoint's saved arguments gives the
    same shapes: it is refused, naming both, instead of loading another model."""
    from mfsdp.checkpoint.manifest import CheckpointError
    from mfsdp.checkpoint.megatron_lm import megatron_lm_to_fsdp
    from mfsdp.models.gpt import GPTConfig

    cfg = GPTConfig(num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=8,
                    num_query_groups=4, kv_channels=8, vocab_size=256, swiglu=True,
                    normalization="RMSNorm", position_embedding_type="rope",
                    add_bias_linear=False, share_embeddings_and_output_weights=False)
    with pytest.raises(CheckpointError, match="num_attention_heads=8 contradicts .* hold "
                                              "num_attention_heads=4"):
        megatron_lm_to_fsdp(DDP_ADAM, tmp_path / "m", cfg.to_dict(), progress=False)
    assert not (tmp_path / "m").exists()


# --- mfsdp train --load of Megatron-LM's directory: the model from its saved arguments

RESUME = ["--use-megatron-fsdp", "--train-iters", "3", "--mock-data", "--seq-length", "16",
          "--micro-batch-size", "1", "--global-batch-size", "2", "--log-interval", "1",
          "--use-checkpoint-opt_param-scheduler"]


def _train_log(load: Path, log: Path, *more: str) -> tuple[dict, str]:
    """``mfsdp train --load LOAD`` on one rank with no model flags (``more``: the optimizer's):
    the ``--log-jsonl`` record of its one iteration, and its output."""
    import json

    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "1", "-m", "mfsdp.train", *RESUME, "--load", str(load), "--log-jsonl", str(log),
           *more]
    out = subprocess.run(run, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["iteration"] for r in records] == [3], records
    return records[0], out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("fixture,optimizer", [
    ("optim/adam-ddp", []),
    ("trajectory/ddp-sgd", ["--optimizer", "sgd", "--sgd-momentum", "0.9"])])
def test_direct_load_reads_the_model_from_the_saved_arguments(fixture, optimizer, tmp_path):
    """``mfsdp train --load`` of a directory megatron-core wrote, with no model flags, builds the
    model its saved arguments name (the log calls it ``llama``, not the default ``gpt-tiny``)
    and runs iteration 3 with the loss and learning rate of the documented path, ``mfsdp
    convert`` then ``--load`` of the result (Adam: the ``lr 8.68e-04`` of the guide's page)."""
    from mfsdp.cli import main

    load = tmp_path / "megatron"
    shutil.copytree(FIXTURE / fixture, load)
    assert main(["convert", "--from", "torch_dist", "--to", "fsdp_dtensor", "--no-progress",
                 str(load), str(tmp_path / "converted")]) == 0
    direct, out = _train_log(load, tmp_path / "direct.jsonl", *optimizer)
    converted, _ = _train_log(tmp_path / "converted", tmp_path / "converted.jsonl", *optimizer)
    assert "resumed from iteration 2" in out and "model llama (2 layers, hidden 64" in out, out
    assert "gpt-tiny" not in out and "win over" not in out, out
    assert (direct["loss"], direct["lr"]) == (converted["loss"], converted["lr"])
    if not optimizer:
        assert f"{direct['lr']:.2e}" == "8.68e-04"


def _model(capsys, *argv) -> tuple[object, str]:
    """``mfsdp train``'s model for ``argv`` (the GPTConfig, or the SystemExit's line) and what
    it printed."""
    from mfsdp.trainer.arguments import build_parser
    from mfsdp.trainer.build import model_config

    try:
        cfg = model_config(build_parser().parse_args(["--use-megatron-fsdp", *map(str, argv)]))
    except SystemExit as exc:
        cfg = str(exc)
    return cfg, capsys.readouterr().out


@pytest.mark.parametrize("fixture", ["optim/adam-ddp", "trajectory/fsdp-dtensor"])
def test_the_model_is_the_one_convert_reads(fixture, capsys):
    """Without model flags, ``--load`` of a ``torch_dist`` or ``fsdp_dtensor`` directory gives
    the model ``mfsdp convert`` reads from the same saved arguments, and prints nothing."""
    from mfsdp.checkpoint.detect import megatron_lm_backend, resolve_megatron_lm
    from mfsdp.checkpoint.megatron_common import config_from_megatron_args
    from mfsdp.checkpoint.megatron_lm import saved_arguments
    from mfsdp.trainer.build import model_family

    directory = resolve_megatron_lm(FIXTURE / fixture)[0]
    want = config_from_megatron_args(saved_arguments(directory,
                                                     megatron_lm_backend(directory)))
    cfg, out = _model(capsys, "--load", FIXTURE / fixture, "--seq-length", "16")
    assert cfg.to_dict() == want and out == ""
    assert model_family(None, cfg, str(FIXTURE / fixture)) != "gpt-tiny"


def test_a_flag_against_the_saved_arguments_is_named_in_one_line(capsys):
    """A model flag given on the command line wins over the saved argument; where they differ,
    one line names the flag and the saved value. Flags that agree print nothing."""
    cfg, out = _model(capsys, "--load", DDP_ADAM, "--norm-epsilon", "1e-6", "--num-layers", "2")
    assert cfg.norm_epsilon == 1e-6
    assert out.splitlines() == [
        f"--load {DDP_ADAM}: the model flags given win over its saved Megatron-LM arguments: "
        "--norm-epsilon 1e-06 (saved norm_epsilon=1e-05)"], out
    cfg, out = _model(capsys, "--load", DDP_ADAM, *TRAIN[TRAIN.index("--normalization"):-2])
    assert out == "" and cfg.num_layers == 2


def test_a_checkpoint_without_arguments_names_the_flags(capsys):
    """``ckpt/`` saved no arguments: ``--load`` alone stops in one line naming the flags; the
    sizes still missing after some are given; with them all it is the model they name (the log
    calls it by its family)."""
    from mfsdp.trainer.build import model_family

    src = FIXTURE / "ckpt"
    line, _ = _model(capsys, "--load", src)
    assert line == (f"mfsdp train: --load {src}: {src / 'iter_0000007'} saved no Megatron-LM "
                    "arguments; name its model with --num-layers, --hidden-size, "
                    "--num-attention-heads, --vocab-size and the flags of its architecture "
                    "(--swiglu, --normalization, --position-embedding-type, ...), or "
                    "--model-preset")
    line, _ = _model(capsys, "--load", src, *MODEL)
    assert "name its model with --num-attention-heads and the flags" in line, line
    cfg, out = _model(capsys, "--load", src, *MODEL, "--num-attention-heads", "4")
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.swiglu) == (4, 2, True)
    assert out == "" and model_family(None, cfg, str(src)) == "llama"
    line, _ = _model(capsys, "--load", FIXTURE / "optim" / "adam")  # arguments without a size
    assert line.endswith("lack padded_vocab_size (--vocab-size); pass those flags, or "
                         "--model-preset"), line
