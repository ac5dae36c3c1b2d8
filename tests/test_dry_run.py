"""The dry run (``mfsdp plan --dry-run``): the real engine on a fake process group at full world
size, checked against a real step on gloo ranks, and the planner checked against the dry run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mfsdp.launch import launch
from mfsdp.testing.dry_run import real_step
from mfsdp.tools.dry_run import TOLERANCE, DryRunError, dry_run
from mfsdp.tools.plan import PRESETS, Layout

# -- the dry run's accounting against a real step on real ranks -------------------------------

REAL = [
    ("llama-tiny", dict(strategy="no_shard", dp_outer=2)),
    ("llama-tiny", dict(strategy="optim", dp_outer=2)),
    ("llama-tiny", dict(strategy="optim_grads", micro_batches=2)),
    ("llama-tiny", dict(strategy="optim_grads_params", micro_batches=2)),
    ("llama-tiny", dict(strategy="optim_grads_params", dp_outer=2, outer_strategy="optim",
                        micro_batches=2)),
    ("llama-tiny", dict(strategy="optim_grads_params", tp=2, sequence_parallel=True)),
    ("deepseek-proxy", dict(strategy="optim_grads_params", ep=2, micro_batches=2)),
    ("deepseek-proxy", dict(strategy="optim_grads", ep=2, dp_outer=2)),
]


def _real_cases():
    for i, (preset, kw) in enumerate(REAL):
        marks = () if i == 4 else (pytest.mark.extended,)  # HFSDP (ZeRO-3 + outer) in make test
        name = f"{preset}-{'-'.join(map(str, kw.values()))}"
        yield pytest.param(preset, kw, marks=marks, id=name)


@pytest.mark.parametrize("preset, kw", list(_real_cases()))
def test_dry_run_bytes_equal_a_real_step_on_four_gloo_ranks(preset, kw):
    """What a dry run reads off the buckets equals what a real training step on 4 gloo ranks
    logs and allocates: every collective's bytes (the engine's CommLog of the step, the
    used-gradient flags aside) exactly, and the storage its buffers hold (the engine's own
    storage accounting, ``memory_by_kind``, and the optimizer's state after a real AdamW step)
    exactly; then the meta-device dry run of the same layout gives the same bytes."""
    kw = dict(kw, seq_length=32)
    ranks = launch(real_step, 4, args=(preset, kw), timeout=300)
    for rank, r in enumerate(ranks):
        assert r["logged"] == pytest.approx(r["implied"], rel=1e-12), rank
        held = r["held"]
        assert held["weights"] + held["main_weights"] + held["grads"] == r["storage"], rank
        assert held["optimizer"] == r["optimizer_after_step"], rank
    meta = dry_run(preset, Layout(world_size=4, **kw), ranks=[0, 3], progress=False)
    for rank in (0, 3):
        for kind in ("weights", "main_weights", "grads", "optimizer"):
            assert meta.ranks[rank][kind] == ranks[rank]["held"][kind], (rank, kind)
        assert meta.traffic[rank] == pytest.approx(ranks[rank]["implied"], rel=1e-12)


# -- the planner against the dry run at scale ---------------------------------------------------

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
OUTER = ((1, "no_shard"), (2, "no_shard"), (2, "optim"))


def _grid():
    """preset x strategy x outer x TP x EP at worlds 64 to 4,096; the large models on a smaller
    grid (one case takes 5-40 s there on a quiet 2-core machine)."""
    cases = []
    for preset, worlds, tps, eps in (("llama3-8b", (64, 4096), (1, 8), (1,)),
                                     ("deepseek-proxy", (64, 1024, 4096), (1,), (1, 8)),
                                     ("llama3-70b", (1024,), (1, 8), (1,))):
        for world in worlds:
            for strategy in STRATEGIES if preset != "llama3-70b" else STRATEGIES[-1:]:
                for outer, outer_strategy in OUTER:
                    if outer_strategy == "optim" and strategy != "optim_grads_params":
                        continue
                    for tp in tps:
                        for ep in eps:
                            cases.append((preset, dict(world_size=world, strategy=strategy,
                                                       dp_outer=outer,
                                                       outer_strategy=outer_strategy, tp=tp,
                                                       sequence_parallel=tp > 1, ep=ep)))
    # (DeepSeek-V3 at 4,096 ranks with EP 64 is test_a_671b_model_at_4096_ranks_stays_small...)
    cases += [("llama3.1-405b", dict(world_size=4096, tp=8, sequence_parallel=True)),
              ("deepseek-v3", dict(world_size=256, ep=8, dp_outer=2, outer_strategy="optim"))]
    return cases


GRID = _grid()
# `make test` runs these; `make test-extended` every case.
FAST = {("llama3-8b", 4096, "optim_grads_params", 2, "optim", 8, 1),
        ("deepseek-proxy", 1024, "optim_grads", 2, "no_shard", 1, 8)}


def _case(preset: str, kw: dict):
    key = (preset, kw["world_size"], kw.get("strategy", "optim_grads_params"),
           kw.get("dp_outer", 1), kw.get("outer_strategy", "no_shard"), kw.get("tp", 1),
           kw.get("ep", 1))
    return pytest.param(preset, kw, marks=() if key in FAST else (pytest.mark.extended,),
                        id="-".join(map(str, key)))


@pytest.mark.parametrize("preset, kw", [_case(p, k) for p, k in GRID])
def test_the_plan_agrees_with_the_engine_within_2_percent(preset, kw):
    """The planner's weights, main weights, gradients, optimizer state and FSDP traffic (shard
    and outer groups) per rank are within 2% of what the real engine holds and sends at that
    world size (rank 0 built: every rank of a layout holds the same shapes, which
    test_the_command_line_reports_writes_json_and_exits_by_the_verdict checks on the first and
    last rank)."""
    layout = Layout(**kw)
    result = dry_run(preset, layout, ranks=[0], progress=False)
    measured, planned = result.measured, result.planned
    for kind in ("weights", "main_weights", "grads", "optimizer", "params"):
        assert measured[kind] == pytest.approx(planned[kind], rel=TOLERANCE, abs=1), kind
    wire = result.wire()
    for group in ("dp_shard", "dp_outer"):
        assert wire.get(group, 0.0) == pytest.approx(result.planned_comm.get(group, 0.0),
                                                     rel=TOLERANCE, abs=1), group
    assert result.ok()


# -- refusals and the command line --------------------------------------------------------------

@pytest.mark.parametrize("preset, kw, words", [
    ("llama3-8b", dict(world_size=64, tp=16, sequence_parallel=True),
     "--tensor-model-parallel-size 16"),
    ("llama3-8b", dict(world_size=64, ep=2), "--expert-model-parallel-size 2 needs an MoE model"),
    ("deepseek-v3", dict(world_size=1024, ep=512), "--expert-model-parallel-size 512"),
    ("deepseek-proxy", dict(world_size=48, ep=3), "--expert-model-parallel-size 3 does not divide"),
])
def test_a_layout_the_trainer_refuses_is_refused_with_its_line(preset, kw, words):
    with pytest.raises(DryRunError, match=words.replace("+", r"\+")) as err:
        dry_run(preset, Layout(**kw), progress=False)
    assert "\n" not in str(err.value)


def test_the_command_line_reports_writes_json_and_exits_by_the_verdict(tmp_path):
    out = tmp_path / "dry.json"
    run = subprocess.run([sys.executable, "-m", "mfsdp.cli", "plan", "llama3-8b",
                          "--world-size", "1024", "--dry-run", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "\r" not in run.stderr  # no progress bar's frames when stderr is not a terminal
    assert "the plan agrees with the engine within 2%" in run.stdout
    data = json.loads(out.read_text())
    for kind in ("params", "grads", "optimizer"):
        assert data["measured"][kind] == pytest.approx(data["planned"][kind], rel=TOLERANCE)
    assert data["ranks_built"][0] == 0 and data["ranks_built"][-1] == 1023

    bad = subprocess.run([sys.executable, "-m", "mfsdp.cli", "plan", "llama3-8b",
                          "--world-size", "64", "--tensor-model-parallel-size", "16",
                          "--dry-run"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "--tensor-model-parallel-size 16" in bad.stderr


@pytest.mark.extended
def test_the_double_buffer_and_chosen_ranks(tmp_path):
    """--fsdp-double-buffer reports the two slots in place of the gathered layers;
    --dry-run-ranks builds the ranks named."""
    out = tmp_path / "dry.json"
    pooled = subprocess.run([sys.executable, "-m", "mfsdp.cli", "plan", "llama3-8b",
                             "--world-size", "64", "--dry-run", "--dry-run-ranks", "5",
                             "--fsdp-double-buffer", "--json", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert pooled.returncode == 0, pooled.stderr
    data = json.loads(out.read_text())
    assert data["ranks_built"] == [5]
    # two slots, each one layer's bf16 weights (the planner's layers, gathered with prefetch
    # 1); the root unit keeps its own buffer beside them
    measured = data["measured"]
    assert measured["double_buffer"] + measured["gathered"] == pytest.approx(
        data["planned"]["gathered"], rel=0.01)
    assert measured["gathered"] > 0  # the root's own
    assert "state and peak buffers: the plan agrees" in pooled.stdout


def test_a_plan_that_disagrees_exits_1(tmp_path, monkeypatch):
    """A planner that forgets the gradient buffers ZeRO-1 keeps is caught (exit status 1)."""
    import mfsdp.tools.plan as planner
    from mfsdp.tools.plan_cli import main

    real = planner.state_bytes

    def forgetful(dense, expert, layout):
        out = real(dense, expert, layout)
        out["grads"] /= 2
        return out

    monkeypatch.setattr(planner, "state_bytes", forgetful)
    code = main(["llama3-8b", "--world-size", "64", "--data-parallel-sharding-strategy",
                         "optim", "--dry-run"])
    assert code == 1


@pytest.mark.extended
def test_a_671b_model_at_4096_ranks_stays_small_in_memory():
    """The meta device and the fake process group keep a 671B MoE's dry run under 2 GiB of
    resident memory (measured in a fresh process)."""
    code = ("from mfsdp.tools.dry_run import dry_run; from mfsdp.tools.plan import Layout; "
            "r = dry_run('deepseek-v3', Layout(world_size=4096, ep=64), ranks=[0], "
            "progress=False); print(r.peak_rss, r.ok())")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    rss, ok = run.stdout.split()
    assert int(rss) < 2 * 2**30 and ok == "True"
    assert PRESETS["deepseek-v3"].num_experts == 256
