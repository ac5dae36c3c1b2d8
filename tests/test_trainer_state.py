"""The trainer's components that own their state (``mfsdp.trainer.state``) and the
Checkpointer that saves them.

What these tests prove:

* the :class:`~mfsdp.trainer.state.LRScheduler`, stepped as the Trainer steps it, sets on a
  real ``torch.optim`` optimizer the learning rates megatron-core 0.19.2's
  ``OptimizerParamScheduler`` gives (``tests/fixtures/megatron_lr``, written by megatron-core:
  warm-up, constant, linear, cosine, inverse square root, WSD), to 1e-12 relative;
* its ``state_dict`` round trip continues the schedule where it stopped, and its
  ``load_state_dict`` follows Megatron-LM's rule (refuse a different schedule, or take the
  checkpoint's, or keep this one), without changing the run's configuration;
* a checkpoint written with the keys the trainer wrote before these components existed (no
  ``trainer`` entry) still resumes: the Trainer takes its iteration, its schedule and its
  routers' bias, and the resumed losses equal an uninterrupted run's (one gloo rank, SGD); and
  ``Trainer.from_config`` refuses a config the command line refuses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mfsdp.launch import launch
from mfsdp.trainer.config import CheckpointConfig, TrainConfig, TrainingConfig
from mfsdp.trainer.state import LRScheduler, TrainState

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "megatron_lr" / "expected.json")
                     .read_text())


def _training(c: dict) -> TrainingConfig:
    return TrainingConfig(lr=c["lr"], min_lr=c["min_lr"], lr_warmup_iters=c["warmup"],
                          lr_decay_style=c["style"], train_iters=FIXTURE["train_iters"],
                          lr_decay_iters=c["decay"], lr_warmup_init=c.get("init", 0.0),
                          lr_wsd_decay_iters=c.get("wsd"),
                          lr_wsd_decay_style=c.get("wsd_style", "exponential"))


@pytest.mark.parametrize("case", sorted(FIXTURE["cases"]))
def test_the_scheduler_sets_megatron_cores_rates_on_the_optimizer(case):
    c = FIXTURE["cases"][case]
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [param]}, {"params": [], "weight_decay": 0.0}], lr=9.0)
    sched = LRScheduler.from_config(_training(c), optimizer=opt)
    got = []
    for _ in range(FIXTURE["train_iters"]):
        sched.apply()
        got.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    assert [g[0] for g in got] == pytest.approx(c["lrs"], rel=1e-12, abs=1e-15)
    assert all(a == b for a, b in got)  # every parameter group
    assert sched.state_dict()["num_steps"] == FIXTURE["train_iters"]


@pytest.mark.parametrize("case", ["cosine", "wsd_minus_sqrt", "warmup_init"])
def test_a_saved_schedule_continues_where_it_stopped(case):
    c = FIXTURE["cases"][case]
    training = _training(c)
    first = LRScheduler.from_config(training)
    for _ in range(5):
        first.step()
    second = LRScheduler.from_config(training)
    second.load_state_dict(first.state_dict())
    rates = []
    for _ in range(FIXTURE["train_iters"] - 5):
        rates.append(second.apply())
        second.step()
    assert rates == pytest.approx(c["lrs"][5:], rel=1e-12, abs=1e-15)


def test_a_loaded_schedule_follows_megatron_lms_rule_and_leaves_the_config_alone():
    saved = LRScheduler.from_config(TrainingConfig(lr=0.003, train_iters=4)).state_dict()
    saved["num_steps"] = 2
    mine = TrainingConfig(lr=0.01, train_iters=4)
    with pytest.raises(SystemExit, match=r"learning rate \(--lr\) is 0.01 here and 0.003 in"):
        LRScheduler.from_config(mine, CheckpointConfig()).load_state_dict(saved)
    theirs = LRScheduler.from_config(mine, CheckpointConfig(
        use_checkpoint_opt_param_scheduler=True))
    theirs.load_state_dict(saved)
    assert (theirs.max_lr, theirs.num_steps, mine.lr) == (0.003, 2, 0.01)  # config unchanged
    ours = LRScheduler.from_config(mine, CheckpointConfig(override_opt_param_scheduler=True))
    ours.load_state_dict(saved)
    assert (ours.max_lr, ours.get_lr()) == (0.01, pytest.approx(0.01 * 2 / 4))
    state = TrainState()
    state.advance(8)
    copy = TrainState()
    copy.load_state_dict(state.state_dict())
    assert (copy.iteration, copy.consumed_samples) == (1, 8)


def _resume_from_an_old_checkpoint(root: str) -> tuple[list[float], list[float], int, str]:
    """One rank: an uninterrupted run of 4 iterations; a run of 2 saved with the keys the
    trainer wrote before its components owned their state; a resumed run from it. And what
    ``Trainer.from_config`` says of a global batch that does not split."""
    from mfsdp.checkpoint import save_checkpoint
    from mfsdp.checkpoint.dcp import MODEL_CONFIG_FILE
    from mfsdp.trainer.checkpointing import scheduler_state
    from mfsdp.trainer.trainer import Trainer

    def config(**kw) -> TrainConfig:
        values = dict(use_megatron_fsdp=True, optimizer="sgd", train_iters=4,
                      global_batch_size=4, micro_batch_size=2, num_experts=4,
                      moe_router_enable_expert_bias=True, moe_aux_loss_coeff=0.0)
        return TrainConfig.from_fields(**{**values, **kw})

    quiet = dict(log=lambda *a, **k: None)
    straight = Trainer.from_config(config(), **quiet).run()
    first = Trainer.from_config(config(exit_interval=2), **quiet)
    first.run()
    assert first.routers, "the model has routers with a balancing bias"
    extra = {"expert_bias": {n: m.expert_bias.detach().cpu().clone() for n, m in first.routers},
             "data_position": 2, "opt_param_scheduler": scheduler_state(config().training, 2)}
    save_checkpoint(root, first.model, first.opt, iteration=2, extra=extra,
                    files={MODEL_CONFIG_FILE: json.dumps(first.cfg.to_dict())})
    resumed = Trainer.from_config(config(load=root), **quiet)
    records = resumed.run()
    assert resumed.state.consumed_samples == 4 * 4  # iteration 2's 8 samples taken as given
    try:
        Trainer.from_config(config(global_batch_size=5), **quiet)
        refused = "accepted"
    except ValueError as exc:
        refused = str(exc)
    return ([r["loss"] for r in straight[2:]], [r["loss"] for r in records],
            resumed.scheduler.num_steps, refused)


def test_a_checkpoint_without_the_trainer_state_still_resumes(tmp_path):
    straight, resumed, steps, refused = launch(_resume_from_an_old_checkpoint, 1,
                                               args=(str(tmp_path / "ckpt"),))[0]
    assert resumed == straight  # bit-identical: weights, optimizer, schedule, bias, RNG
    assert steps == 4
    # Trainer.from_config meets the command line's rules (TrainConfig.validate)
    assert refused == ("--global-batch-size 5 is not divisible by --micro-batch-size x "
                       "data-parallel size = 2 x 1; pick a multiple of 2")
