"""A resumed mfsdp job continues Megatron-LM's trajectory: from a checkpoint that Megatron-LM's
own ``save_checkpoint`` wrote, ``mfsdp train --load`` takes the step megatron-core takes.

The fixtures (``tests/fixtures/megatron_lm/trajectory``, written by ``make_training_fixture.py``
with megatron-core 0.19.2 and Megatron-LM's ``megatron/training`` of the same release) are a
``pretrain_gpt.py`` job's iteration-2 checkpoint, for each optimizer layout (DDP + Adam, DDP +
SGD, the distributed optimizer's ``fully_reshardable`` and ``dp_reshardable``; Megatron-FSDP's
``fsdp_dtensor`` with a GELU MLP, data parallel 2) at TP 1 and TP 2,
trained on ``trajectory/data/corpus`` through megatron-core's ``GPTDataset``; and, per layout,
megatron-core's iteration 3 from it (loss, gradient norm, schedule; the weights and optimizer
state after it are recorded once per optimizer, by the TP 1 DDP run: the other layouts' runs
equal it bit for bit, and TP 2 within 6e-8, as each fixture records; ``fsdp_dtensor``'s own
TP 1 run records them for its model, its TP 2 run within 1.2e-7). The TP 2 fsdp_dtensor
resume lands within 2.8e-5 of the update (megatron-core's TP 2 and TP 1 runs differ by that).

mfsdp resumes with the job's flags (``--data-path``, ``--split``, ``--seed``: the same samples
in the same order, the consumed samples carried from the checkpoint). Tolerance: float32, not
bit for bit: mfsdp computes the same model with its own modules (another order of the sums in
attention, the norms and the loss), so the weights after the step differ from megatron-core's
by rounding. Each weight is within 1e-4 of the step's size (``|w - w_mcore| <= 1e-4 |w_mcore -
w_2|``, measured up to 7e-7), each Adam moment and momentum buffer within 1e-5 of its size
(measured up to 4e-7); the loss and gradient norm as printed (4 significant digits). A wrong
learning rate, batch, clipping or step count moves the update by 10% or more.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

FIXTURE = Path(__file__).parent / "fixtures" / "megatron_lm"
TRAJECTORY = FIXTURE / "trajectory"
WEIGHT_TOL, MOMENT_TOL = 1e-4, 1e-5
MOMENTS = ("exp_avg", "exp_avg_sq", "momentum_buffer")


def train_flags(layout: str) -> list[str]:
    """``mfsdp train``'s flags for the fixture's ``pretrain_gpt.py`` job (the same names)."""
    sgd = layout == "ddp-sgd"
    lr = 1e-2 if sgd else 1e-3
    return [
        "--use-megatron-fsdp", "--train-iters", "3", "--data-path",
        str(TRAJECTORY / "data" / "corpus"), "--split", "100,0,0", "--seed", "1234",
        "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
        "--log-interval", "1", "--lr", str(lr), "--min-lr", str(lr / 10),
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--lr-decay-iters", "8",
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--disable-bias-linear",
        *([] if layout == "fsdp-dtensor" else ["--swiglu"]),
        "--group-query-attention",
        "--num-query-groups", "2", "--num-layers", "2", "--hidden-size", "64",
        "--ffn-hidden-size", "176", "--num-attention-heads", "4", "--vocab-size", "256",
        "--norm-epsilon", "1e-5", "--rotary-base", "10000",
        "--untie-embeddings-and-output-weights", "--save-interval", "1",
        *(["--optimizer", "sgd", "--sgd-momentum", "0.9"] if sgd else
          ["--adam-beta1", "0.9", "--adam-beta2", "0.95"])]


def resume(name: str, source: str, ranks: int, tmp_path: Path) -> tuple[dict, dict, str]:
    """``mfsdp convert`` of the fixture ``name`` then ``mfsdp train --load`` of the result
    (``source="converted"``), or ``--load`` of the Megatron-LM directory itself
    (``"megatron_lm"``), for iteration 3 on ``ranks`` ranks: the tensors and blobs of the
    checkpoint it saves, and its output."""
    from mfsdp.checkpoint.dcp import read_full
    from mfsdp.checkpoint.manifest import resolve_checkpoint

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    load = tmp_path / "megatron"
    shutil.copytree(TRAJECTORY / name, load)
    if source == "converted":
        out = subprocess.run([sys.executable, "-m", "mfsdp.cli", "convert", "--from",
                              "megatron_lm", "--to", "fsdp_dtensor", "--no-progress", str(load),
                              str(tmp_path / "converted")],
                             capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        load = tmp_path / "converted"
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(ranks), "-m", "mfsdp.train", *train_flags(name.removesuffix("-tp2")),
           "--load", str(load), "--save", str(tmp_path / "saved")]
    out = subprocess.run(run, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    tensors, blobs, _ = read_full(resolve_checkpoint(tmp_path / "saved"))
    return tensors, blobs, out.stdout


def weights_at_iteration_2(name: str, tmp_path: Path) -> dict:
    """The fixture's weights (what the step started from: the tolerance's scale)."""
    from mfsdp.checkpoint.dcp import read_full
    from mfsdp.checkpoint.megatron_lm import megatron_lm_to_fsdp

    megatron_lm_to_fsdp(TRAJECTORY / name, tmp_path / "weights", weights_only=True,
                        progress=False)
    tensors, _, _ = read_full(tmp_path / "weights")
    return {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}


def assert_megatron_cores_step(name: str, tensors: dict, blobs: dict, stdout: str,
                               tmp_path: Path) -> None:
    """The checkpoint mfsdp saved after iteration 3 holds megatron-core's iteration 3 (see the
    module docstring for the tolerances), its counters continue (Adam's step 3, iteration 3,
    6 consumed samples), and exported back (``fsdp_to_megatron_lm``) its schedule and counters
    are megatron-core's (the schedule in samples)."""
    from mfsdp.checkpoint.megatron_common import mfsdp_name

    mine = torch.load(TRAJECTORY / f"expected_{name}.pt", weights_only=False)
    e = mine
    if "reference" in mine:  # megatron-core's run of the same optimizer at TP 1 (DDP)
        assert max(mine["largest_difference"].values()) < 1e-6
        e = torch.load(TRAJECTORY / f"expected_{mine['reference']}.pt", weights_only=False)
    m = re.search(r"iteration +3/3 \| loss ([\d.]+) \| grad norm ([\d.]+)", stdout)
    assert m, stdout
    assert float(m.group(1)) == pytest.approx(mine["losses"][2], abs=1e-4)
    assert float(m.group(2)) == pytest.approx(mine["grad_norms"][2], abs=1e-3)
    before = weights_at_iteration_2(name, tmp_path)
    worst = {}
    for key, fields in e["after"].items():
        p = mfsdp_name(key)
        got, want = tensors[f"model.{p}"], fields["param"]
        step = (want - before[p]).norm()
        worst[p] = float((got - want).norm() / step)
        for field in MOMENTS:
            if field in fields:
                theirs = fields[field]
                ours = tensors[f"optimizer.state.{p}.{field}"]
                assert (ours - theirs).norm() <= MOMENT_TOL * theirs.norm(), (p, field)
        if "exp_avg" in fields:
            assert tensors[f"optimizer.state.{p}.step"].item() == 3.0, p
    assert max(worst.values()) <= WEIGHT_TOL, sorted(worst.items(), key=lambda x: -x[1])[:3]
    extra = blobs["extra"]
    assert extra["iteration"] == 3
    assert extra["trainer"] == {"iteration": 3, "consumed_samples": 6}
    assert extra["opt_param_scheduler"]["num_steps"] == 3
    # back to Megatron-LM: its counters are megatron-core's after iteration 3 (in samples)
    from mfsdp.checkpoint.megatron_common import read_common_state
    from mfsdp.checkpoint.megatron_lm import fsdp_to_megatron_lm

    back = fsdp_to_megatron_lm(tmp_path / "saved", tmp_path / "back", progress=False,
                               transformer_impl="local",
                               tensor_model_parallel_size=2 if name.endswith("-tp2") else 1)
    common = read_common_state(back / "iter_0000003")
    saved = common["opt_param_scheduler"]
    assert saved == pytest.approx({k: mine["scheduler"][k] for k in saved})
    assert common["iteration"] == 3 and common["args"].consumed_train_samples == 6
    if name.startswith("ddp-adam"):
        assert common["optimizer"]["state"]["common_step"].item() == 3.0


LAYOUTS = ["ddp-adam", "ddp-sgd", "fully-reshardable", "dp-reshardable"]


@pytest.mark.slow
@pytest.mark.parametrize("layout,source", [
    ("ddp-adam", "converted"),
    pytest.param("ddp-adam", "megatron_lm", marks=pytest.mark.extended),
    ("ddp-sgd", "converted"),  # make test's budget: the two layouts below run in extended
    pytest.param("fully-reshardable", "converted", marks=pytest.mark.extended),
    pytest.param("dp-reshardable", "converted", marks=pytest.mark.extended)])
def test_resume_takes_megatron_cores_step(layout, source, tmp_path):
    """Convert (or not: ``--load`` of the Megatron-LM directory), ``train --load`` for one
    iteration on 1 rank, save: megatron-core's step."""
    tensors, blobs, stdout = resume(layout, source, 1, tmp_path)
    assert "resumed from iteration 2" in stdout, stdout
    assert_megatron_cores_step(layout, tensors, blobs, stdout, tmp_path)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("layout,source", [
    ("ddp-adam", "megatron_lm"), ("ddp-adam", "converted"), ("ddp-sgd", "converted"),
    ("fully-reshardable", "megatron_lm"),
    ("dp-reshardable", "converted")])
def test_resume_of_a_tp2_job_takes_megatron_cores_step(layout, source, tmp_path):
    """The TP 2 job's checkpoint (converted, or the Megatron-LM directory itself), resumed on
    2 ranks: megatron-core's step (its TP 2 run is its TP 1 run within 6e-8, recorded in the
    fixture; the reference weights and moments are TP 1's)."""
    name = f"{layout}-tp2"
    tensors, blobs, stdout = resume(name, source, 2, tmp_path)
    assert_megatron_cores_step(name, tensors, blobs, stdout, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name,source", [
    pytest.param("fsdp-dtensor", "converted", marks=pytest.mark.extended),  # about 20 s
    pytest.param("fsdp-dtensor", "megatron_lm", marks=pytest.mark.extended),
    pytest.param("fsdp-dtensor-tp2", "converted", marks=pytest.mark.extended),
    pytest.param("fsdp-dtensor-tp2", "megatron_lm", marks=pytest.mark.extended)])
def test_resume_of_a_megatron_fsdp_job_takes_megatron_cores_step(name, source, tmp_path):
    """The ``--use-megatron-fsdp --ckpt-format fsdp_dtensor`` job's checkpoint (a GELU MLP; 2
    ranks of data parallelism, or TP 2 x data parallel 2 on 4), converted or loaded as it is,
    resumed on 2 ranks: megatron-core's step (the weights and moments its TP 1 job recorded;
    its TP 2 job is within 1.2e-7 of it, as that fixture records)."""
    tensors, blobs, stdout = resume(name, source, 2, tmp_path)
    assert "resumed from iteration 2" in stdout, stdout
    assert_megatron_cores_step(name, tensors, blobs, stdout, tmp_path)


def test_megatron_lms_own_checkpoint_converts_with_its_schedule_in_iterations(tmp_path):
    """What Megatron-LM's ``save_checkpoint`` writes converts: its ``args`` (with megatron-core's
    enums and ``signal.Signals`` in it) are read, its schedule (counted in samples: 2 per
    iteration here) lands in iterations, as ``mfsdp train``'s flags give it, and converting
    back restores Megatron-LM's counts, the consumed samples and the job's
    ``add_position_embedding`` exactly."""
    from mfsdp.checkpoint.dcp import read_full
    from mfsdp.checkpoint.megatron_common import MegatronEnum, read_common_state
    from mfsdp.checkpoint.megatron_lm import fsdp_to_megatron_lm, megatron_lm_to_fsdp

    common = read_common_state(TRAJECTORY / "ddp-adam" / "iter_0000002")
    args = common["args"]
    assert isinstance(args.attention_backend, MegatronEnum)
    assert (args.global_batch_size, args.consumed_train_samples) == (2, 4)
    saved = common["opt_param_scheduler"]
    assert (saved["num_steps"], saved["lr_warmup_steps"], saved["lr_decay_steps"]) == (4, 2, 16)
    megatron_lm_to_fsdp(TRAJECTORY / "ddp-adam", tmp_path / "m", progress=False)
    _, blobs, _ = read_full(tmp_path / "m")
    sched = blobs["extra"]["opt_param_scheduler"]
    # --lr-warmup-iters 1 --lr-decay-iters 8, two iterations done
    assert (sched["num_steps"], sched["lr_warmup_steps"], sched["lr_decay_steps"]) == (2, 1, 8)
    back = fsdp_to_megatron_lm(tmp_path / "m", tmp_path / "back", progress=False,
                               transformer_impl="local")
    again = read_common_state(back / "iter_0000002")
    assert again["opt_param_scheduler"] == {k: saved[k] for k in again["opt_param_scheduler"]}
    assert again["args"].consumed_train_samples == 4
    # Megatron-LM's loader compares it with the loading job's (its default, True, with RoPE)
    assert again["args"].add_position_embedding is args.add_position_embedding is True
