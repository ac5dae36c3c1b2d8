"""The trainer (``mfsdp.train``): real runs under torchrun and the in-process launcher.

Layout invariance tolerance: per-iteration losses agree to 1e-5 relative. Every layout trains on
the same global batch with the loss normalised by the global token count, in fp32; what differs is
the order of floating-point sums (gradient reductions over 1, 2 or 4 ranks, micro-batch
accumulation), measured at ~2e-7 relative over these runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mfsdp.launch import RankError, launch

pytestmark = pytest.mark.slow
SHORT = ["--use-megatron-fsdp", "--train-iters", "4", "--global-batch-size", "8",
         "--micro-batch-size", "1", "--sequence-packing"]
MOE = SHORT + ["--model-preset", "deepseek-proxy", "--moe-aux-loss-coeff", "0"]


def _torchrun(args: list[str], nproc: int = 2, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
         "--standalone", "-m", "mfsdp.train", *args],
        capture_output=True, text=True, timeout=300, cwd=cwd,
        env=dict(os.environ, OMP_NUM_THREADS="1"))


def _jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("args", [
    ["--data-parallel-sharding-strategy", s] for s in
    ("no_shard", "optim", "optim_grads", "optim_grads_params")] + [
    ["--model-preset", "deepseek-proxy", "--expert-model-parallel-size", "2"]],
    ids=["no_shard", "optim", "optim_grads", "optim_grads_params", "moe-ep2"])
def test_torchrun_two_ranks_lowers_the_loss(args, tmp_path):
    log = tmp_path / "log.jsonl"
    proc = _torchrun(["--use-megatron-fsdp", "--train-iters", "12", "--lr", "0.01",
                      "--log-jsonl", str(log), *args])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    recs = _jsonl(log)
    assert [r["iteration"] for r in recs] == list(range(1, 13))
    for key in ("iteration", "loss", "grad_norm", "lr", "tokens_per_s", "elapsed_s"):
        assert key in recs[0]
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.1, [r["loss"] for r in recs]
    assert "iteration    12/12 | loss" in proc.stdout
    # the model is named by the preset passed, or by the default's name (not its family, gpt)
    from mfsdp.models.gpt import GPT_PRESETS

    name = args[args.index("--model-preset") + 1] if "--model-preset" in args else "gpt-tiny"
    c = GPT_PRESETS[name]
    assert f", model {name} ({c.num_layers} layers, hidden {c.hidden_size}, " in proc.stdout
    if args == ["--data-parallel-sharding-strategy", "optim_grads_params"]:  # the page's run
        announce, iteration = _trainer_page_sample()
        assert announce in proc.stdout.splitlines()
        # the same fields in the same order; the numbers are this run's
        fields = re.compile(" ".join(r"[\d.,e+-]+" if re.fullmatch(r"[\d.,e+-]*\d[\d.,e+-]*", w)
                                     else re.escape(w) for w in iteration.split(" ")))
        assert any(fields.fullmatch(line) for line in proc.stdout.splitlines()), iteration


def _trainer_page_sample() -> tuple[str, str]:
    """The trainer page's sample output of its first command: the start line and the last
    iteration's line, each printed on one line (shown on the page in two)."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "trainer.md").read_text()
    block = page.split("```text\n", 1)[1].split("```", 1)[0]
    lines = block.replace("\n  ", " ").splitlines()
    assert len(lines) >= 2 and lines[0].startswith("mfsdp train: 2 ranks"), lines
    assert all(line.startswith("iteration ") for line in lines[1:]), lines
    return lines[0], lines[-1].replace("20/20", "12/12")


@functools.lru_cache(maxsize=None)
def _losses(nproc: int, args: tuple[str, ...]) -> list[float]:
    recs = launch("mfsdp.train:run_in_rank", nproc, args=(list(args),), timeout=300)[0]
    return [r["loss"] for r in recs]


LAYOUTS = {
    "fsdp-2": (2, SHORT),
    "hsdp-4": (4, SHORT + ["--num-distributed-optimizer-instances", "2"]),
    "hfsdp-4": (4, SHORT + ["--num-distributed-optimizer-instances", "2",
                            "--outer-dp-sharding-strategy", "optim"]),
    "optim-2-ag-group": (2, SHORT + ["--data-parallel-sharding-strategy", "optim",
                                     "--create-all-gather-group"]),
}
MOE_LAYOUTS = {
    f"ep2-{d}": (2, MOE + ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", d])
    for d in ("allgather", "alltoall", "flex")
}
MOE_LAYOUTS["ep2-hsdp-4-fused"] = (4, MOE + ["--expert-model-parallel-size", "2",
                                             "--num-distributed-optimizer-instances", "2",
                                             "--moe-grouped-gemm"])


LLAMA = SHORT + ["--model-preset", "llama-tiny"]
TP = ["--tensor-model-parallel-size", "2"]
# Megatron-LM's tensor (and sequence) parallelism through the CLI, on 4 ranks, against 1 rank.
# SGD curves agree to float rounding; Adam's normalisation amplifies the reduction-order
# differences of the TP all-reduces a little more (1e-4, as the tolerance).
TP_LAYOUTS = {
    "llama-tp2-sp": (LLAMA + TP + ["--sequence-parallel"], 1e-5),
    "llama-tp2-sp-sgd": (LLAMA + TP + ["--sequence-parallel", "--optimizer", "sgd", "--lr", "0.5"],
                         1e-5),
    "gpt-tp2-hsdp": (SHORT + TP + ["--num-distributed-optimizer-instances", "2"], 1e-5),
    "moe-mla-tp2-sp-ep2": (MOE + TP + ["--sequence-parallel", "--expert-model-parallel-size",
                                       "2", "--expert-tensor-parallel-size", "1"], 1e-4),
    "moe-mla-tp2-sgd": (MOE + TP + ["--expert-tensor-parallel-size", "1", "--optimizer", "sgd",
                                    "--lr", "0.5"], 1e-5),
    "gpt-tp2-hsdp-sgd": (SHORT + TP + ["--num-distributed-optimizer-instances", "2",
                                       "--optimizer", "sgd", "--lr", "0.5"], 1e-5),
    "llama-cp2": (LLAMA + ["--context-parallel-size", "2"], 1e-5),
    "llama-cp2-sgd": (LLAMA + ["--context-parallel-size", "2", "--optimizer", "sgd", "--lr",
                               "0.5"], 1e-5),
    "llama-tp2-cp2-sp-sgd": (LLAMA + TP + ["--context-parallel-size", "2", "--sequence-parallel",
                                           "--optimizer", "sgd", "--lr", "0.5"], 1e-5),
    "llama-tp2-cp2-sp": (LLAMA + TP + ["--context-parallel-size", "2", "--sequence-parallel"],
                         1e-5),
    "moe-mla-cp2-ep2-sgd": (MOE + ["--context-parallel-size", "2", "--expert-model-parallel-size",
                                   "2", "--optimizer", "sgd", "--lr", "0.5"], 1e-5),
}
_SIZE_FLAGS = ("--tensor-model-parallel-size", "--num-distributed-optimizer-instances",
               "--expert-model-parallel-size", "--expert-tensor-parallel-size",
               "--context-parallel-size")


# in `make test` (the rest, llama-tp2-cp2-sp included, in the extended set: the budget)
TP_DEFAULT = ("llama-tp2-sp", "moe-mla-cp2-ep2-sgd")


@pytest.mark.parametrize("name", [n if n in TP_DEFAULT else
                                  pytest.param(n, marks=pytest.mark.extended)
                                  for n in TP_LAYOUTS])
def test_tensor_parallel_layouts_give_the_single_process_loss_curve(name):
    args, rel = TP_LAYOUTS[name]
    one = [a for i, a in enumerate(args) if a != "--sequence-parallel" and not (
        a in _SIZE_FLAGS or (i and args[i - 1] in _SIZE_FLAGS))]
    assert _losses(4, tuple(args)) == pytest.approx(_losses(1, tuple(one)), rel=rel)


def test_tensor_parallel_flags_follow_megatron_lm_rules():
    errors = []
    for extra in (TP + ["--num-attention-heads", "1"],  # heads not divisible by TP
                  ["--model-preset", "deepseek-proxy"] + TP):  # ETP defaults to the TP size
        try:
            launch("mfsdp.train:run_in_rank", 2, args=(SHORT + extra,), timeout=120)
        except RankError as e:
            errors.append(str(e))
    assert "num_attention_heads=1 is not divisible by the tensor-parallel size 2" in errors[0]
    assert "pass --expert-tensor-parallel-size 1" in errors[1]


def test_vocabulary_is_padded_for_tensor_parallelism_as_megatron_lm_pads(tmp_path):
    """A vocabulary that TP does not divide gains dummy tokens, with Megatron-LM's start-up line
    (255 -> 256 at TP 2); training at TP 2 then gives the 1-rank curve of the 256-token model."""
    log = tmp_path / "log.jsonl"
    proc = _torchrun(SHORT + TP + ["--vocab-size", "255", "--log-jsonl", str(log)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert " > padded vocab (size: 255) with 1 dummy tokens (new size: 256)" in proc.stdout
    assert [r["loss"] for r in _jsonl(log)] == pytest.approx(
        _losses(1, tuple(SHORT + ["--vocab-size", "256"])), rel=1e-5)


@pytest.mark.extended  # `make test`'s budget (22 s); CI runs it
def test_resume_at_another_tensor_parallel_size(tmp_path):
    """Saved at TP 2 x DP 2, resumed at TP 1 x DP 4: the straight run's losses."""
    ckpt = str(tmp_path / "ckpt")
    launch("mfsdp.train:run_in_rank", 4,
           args=(LLAMA + TP + ["--sequence-parallel", "--exit-interval", "2", "--save", ckpt],))
    resumed = launch("mfsdp.train:run_in_rank", 4, args=(LLAMA + ["--load", ckpt],))[0]
    assert [r["loss"] for r in resumed] == pytest.approx(_losses(1, tuple(LLAMA))[2:], rel=1e-5)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dense_layouts_give_the_single_process_loss_curve(name):
    ref = _losses(1, tuple(SHORT))
    got = _losses(LAYOUTS[name][0], tuple(LAYOUTS[name][1]))
    assert got == pytest.approx(ref, rel=1e-5)


@pytest.mark.parametrize("name", list(MOE_LAYOUTS))
def test_moe_layouts_give_the_single_process_loss_curve(name):
    ref = _losses(1, tuple(MOE))
    got = _losses(MOE_LAYOUTS[name][0], tuple(MOE_LAYOUTS[name][1]))
    assert got == pytest.approx(ref, rel=1e-5)


RECOMPUTE = {
    "selective": ["--recompute-granularity", "selective"],
    "full-uniform-2": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                       "--recompute-num-layers", "2"],
    "full-block-1": ["--recompute-granularity", "full", "--recompute-method", "block",
                     "--recompute-num-layers", "1"],
}


def _saved_activations(words: list[str], tokens: int = 64) -> dict:
    """One forward of the trainer's model (``model_config`` of these flags) on 2 sequences of
    ``tokens``: each distinct storage autograd saves for backward (parameters left out: they
    are held anyway), with its bytes and every place it is saved from (``outside``, ``layer<i>``,
    or ``layer<i>:attention``: inside the core attention), read with
    ``torch.autograd.graph.saved_tensors_hooks``; and the gradients of a backward."""
    import torch

    import mfsdp.models.gpt as gpt
    from mfsdp.trainer.arguments import build_parser
    from mfsdp.trainer.build import model_config

    cfg = model_config(build_parser().parse_args(words))
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    held = {p.untyped_storage().data_ptr() for p in model.parameters()}
    where, saved = ["outside"], {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in held:
            saved.setdefault(storage.data_ptr(), (storage.nbytes(), set()))[1].add(where[-1])
        return t

    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(lambda m, args, i=i: where.append(f"layer{i}"))
        layer.register_forward_hook(lambda m, args, out: where.pop() and None)
    sdpa = gpt._sdpa

    def attention(*args):
        where.append(where[-1] + ":attention")
        try:
            return sdpa(*args)
        finally:
            where.pop()

    batch = torch.randint(0, cfg.vocab_size, (2, tokens),
                          generator=torch.Generator().manual_seed(1))
    gpt._sdpa = attention  # (the name _core_attention calls, recomputed or not)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(batch)
    finally:
        gpt._sdpa = sdpa
    logits.float().pow(2).mean().backward()
    return {"total": sum(nbytes for nbytes, _ in saved.values()), "saved": list(saved.values()),
            "config": cfg,
            "tokens": 2 * tokens, "grads": {n: p.grad.clone() for n, p in model.named_parameters()
                                             if p.grad is not None}}


@pytest.mark.parametrize("name", list(RECOMPUTE))
@pytest.mark.parametrize("preset", ["llama-tiny", "deepseek-proxy"])
def test_activation_recompute_saves_fewer_activations_and_the_same_gradients(name, preset):
    """Measured with saved-tensor hooks on the trainer's model, against the same model without
    recomputation (one process; the gradients agree to 1e-6 relative):

    * full recompute: the recomputed layers save nothing; what only they saved without
      recomputation is gone, and only each checkpointed chunk's input (tokens x hidden, fp32) is
      kept in its place (Megatron-LM's ``--recompute-granularity full``);
    * selective: what the core attention saved is recomputed; every attention backend keeps at
      least one fp32 value per head and token (flash: the log-sum-exp; math: the probabilities),
      so at least ``layers x heads x tokens x 4`` bytes are gone."""
    base = ["--model-preset", preset]
    plain, got = _saved_activations(base), _saved_activations(base + RECOMPUTE[name])
    cfg, tokens = got["config"], got["tokens"]
    layers = [f"layer{i}" for i in range(cfg.num_layers)]
    if cfg.recompute_granularity == "full":
        n = cfg.recompute_num_layers
        uniform = cfg.recompute_method == "uniform"
        recomputed = layers if uniform else layers[:n]
        chunks = -(-cfg.num_layers // n) if uniform else n
        gone = sum(b for b, places in plain["saved"]
                   if all(place.split(":")[0] in recomputed for place in places))
        kept = chunks * tokens * cfg.hidden_size * 4
        assert 0 < kept < gone
        assert got["total"] <= plain["total"] - gone + kept, (got["total"], plain["total"], gone)
        assert not any(p.split(":")[0] in recomputed for _, places in got["saved"] for p in places)
    else:
        assert cfg.recompute_granularity == "selective"
        margin = cfg.num_layers * cfg.num_attention_heads * tokens * 4
        assert got["total"] <= plain["total"] - margin, (got["total"], plain["total"], margin)
        assert not any(p.endswith(":attention") for _, places in got["saved"] for p in places)
    assert got["grads"].keys() == plain["grads"].keys()
    for n, g in plain["grads"].items():
        assert (got["grads"][n] - g).norm() <= 1e-6 * g.norm() + 1e-12, n


@pytest.mark.parametrize("fmt, base", [
    ("fsdp_dtensor", SHORT),
    # mfsdp_full with EP 2: each rank saves other experts (the parameter-group map lists them all)
    pytest.param("mfsdp_full", MOE + ["--expert-model-parallel-size", "2"],
                 marks=pytest.mark.extended),  # `make test`'s budget; CI runs it
    # Megatron-LM's torch_dist, as Megatron-LM lays it out (tracker, iter_XXXXXXX/metadata.json)
    ("torch_dist", MOE + ["--expert-model-parallel-size", "2"]),
], ids=["fsdp_dtensor", "mfsdp_full-ep2", "torch_dist-ep2"])
def test_save_then_load_continues_the_run(fmt, base, tmp_path):
    args = base + ["--save", str(tmp_path / "ckpt"), "--ckpt-format", fmt]
    straight = launch("mfsdp.train:run_in_rank", 2,
                      args=(base + ["--train-iters", "4"],))[0]
    launch("mfsdp.train:run_in_rank", 2, args=(args + ["--exit-interval", "2"],))
    resumed = launch("mfsdp.train:run_in_rank", 2,
                     args=(args + ["--train-iters", "4", "--load", str(tmp_path / "ckpt")],))[0]
    assert [r["iteration"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[2:]]  # bit-identical
    if fmt == "torch_dist":
        from mfsdp.checkpoint.detect import TRACKER

        assert (tmp_path / "ckpt" / TRACKER).read_text().strip() == "4"  # the resumed run's save
        for it in (2, 4):
            meta = json.loads((tmp_path / "ckpt" / f"iter_{it:07d}" / "metadata.json").read_text())
            assert meta["sharded_backend"] == "torch_dist"
        return
    latest = (tmp_path / "ckpt" / "latest").read_text().strip()
    manifest = json.loads((tmp_path / "ckpt" / latest / "manifest.json").read_text())
    assert manifest["format"] == fmt


@pytest.mark.extended  # 13 s: make test's 25-minute budget
def test_a_resumed_schedule_follows_megatron_lm_rules(tmp_path):
    """As Megatron-LM's OptimizerParamScheduler: a resumed run whose schedule differs from the
    checkpoint's stops with the value named, unless told which one wins; SGD so that the learning
    rate shows in the losses one to one."""
    from mfsdp.train import check_args, restore_scheduler, scheduler_state, build_parser
    from mfsdp.trainer.config import TrainConfig

    ckpt = str(tmp_path / "ckpt")
    base = SHORT + ["--optimizer", "sgd", "--train-iters", "4"]
    saved = scheduler_state(build_parser().parse_args(base), 2)
    for extra, message in [(["--lr", "0.01"], r"learning rate \(--lr\) is 0.01 here and 0.003 in "
                            r"the checkpoint; pass the checkpoint's value, --use-checkpoint-opt_"),
                           (["--train-iters", "6"], r"total number of iterations \(--lr-decay-it"),
                           (["--lr-decay-style", "cosine"], "decay style")]:
        config = TrainConfig.from_args(build_parser().parse_args(base + extra))
        with pytest.raises(SystemExit, match=message):
            restore_scheduler(config.training, config.checkpoint, saved)
    both = build_parser().parse_args(base + ["--override-opt_param-scheduler",
                                             "--use-checkpoint-opt-param-scheduler"])
    with pytest.raises(SystemExit, match="contradict"):
        check_args(both, 1, None)
    # end to end: stop at 2 of 4, resume with another --lr under each rule
    straight = straight_records(base)
    launch("mfsdp.train:run_in_rank", 1, args=(base + ["--exit-interval", "2", "--save", ckpt],))
    # the log names the resumed default model as the fresh run does (gpt-tiny), though the
    # checkpoint's model config holds no name and the run's sequence length for its positions
    from dataclasses import replace

    from mfsdp.trainer.build import model_config, model_family

    cfg = model_config(TrainConfig.from_args(build_parser().parse_args(base + ["--load", ckpt])))
    assert model_family(None, cfg, ckpt) == "gpt-tiny"
    assert model_family(None, replace(cfg, num_layers=3), ckpt) == "gpt"  # no preset's shape
    kept = launch("mfsdp.train:run_in_rank", 1, args=(
        base + ["--lr", "0.01", "--load", ckpt, "--use-checkpoint-opt_param-scheduler"],))[0]
    assert [r["lr"] for r in kept] == [r["lr"] for r in straight[2:]]
    assert [r["loss"] for r in kept] == pytest.approx([r["loss"] for r in straight[2:]], rel=1e-6)
    new = launch("mfsdp.train:run_in_rank", 1, args=(
        base + ["--lr", "0.01", "--load", ckpt, "--override-opt-param-scheduler"],))[0]
    assert [r["lr"] for r in new] == pytest.approx([0.01 * 2 / 4, 0.01 * 1 / 4])


def straight_records(argv) -> list[dict]:
    return launch("mfsdp.train:run_in_rank", 1, args=(list(argv),))[0]


def test_resume_on_another_layout(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    launch("mfsdp.train:run_in_rank", 2, args=(SHORT + ["--exit-interval", "2", "--save", ckpt],))
    resumed = launch("mfsdp.train:run_in_rank", 4, args=(
        SHORT + ["--num-distributed-optimizer-instances", "2", "--load", ckpt],))[0]
    assert [r["loss"] for r in resumed] == pytest.approx(_losses(1, tuple(SHORT))[2:], rel=1e-5)


def test_dump_param_to_param_group_map(tmp_path):
    """As upstream's flag: a DCP directory of {name: group} with the JSON inside; a .json path
    gives the JSON alone; the reader takes either."""
    from mfsdp.checkpoint.state import read_param_to_param_group_map

    path = tmp_path / "map"
    launch("mfsdp.train:run_in_rank", 2, args=(
        SHORT + ["--train-iters", "1", "--dump-param-to-param-group-map", str(path)],))
    assert (path / ".metadata").is_file()
    mapping = json.loads((path / "param_to_param_group_map.json").read_text())
    assert mapping["layers.0.self_attention.linear_qkv.weight"] == 0  # decayed group
    assert mapping["layers.0.self_attention.linear_qkv.bias"] == 1  # no decay
    assert set(mapping.values()) == {0, 1}
    (path / "param_to_param_group_map.json").unlink()
    assert read_param_to_param_group_map(path) == mapping  # from the DCP alone
    launch("mfsdp.train:run_in_rank", 2, args=(
        SHORT + ["--train-iters", "1", "--dump-param-to-param-group-map",
                 str(tmp_path / "map.json")],))
    assert json.loads((tmp_path / "map.json").read_text()) == mapping


def test_nccl_user_buffer_flags_are_refused_under_torchrun(tmp_path):
    """mfsdp registers no NCCL user buffers, so ``--use-nccl-ub`` is refused (as
    ``fully_shard(nccl_ub=True)`` is) before anything is built: one line, exit status 2."""
    proc = _torchrun(SHORT + ["--train-iters", "1", "--use-nccl-ub"], nproc=1)
    assert proc.returncode != 0
    line = ("mfsdp train: error: --use-nccl-ub: NCCL user-buffer registration is not implemented "
            "by mfsdp")
    assert (proc.stdout + proc.stderr).count(line) == 1, proc.stderr[-3000:]
    assert "exitcode: 2" in proc.stderr and "iteration" not in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--global-batch-size", "6", "--micro-batch-size", "2"],
     "--global-batch-size 6 is not divisible by --micro-batch-size x data-parallel size = 2 x 2"),
    (["--expert-model-parallel-size", "2", "--use-megatron-fsdp"],
     "--expert-model-parallel-size 2 needs an MoE model"),
    (["--save-interval", "2"], "--save-interval needs --save DIR"),
])
def test_bad_flag_combinations_fail_with_a_message(args, message):
    with pytest.raises(RankError, match=message.replace("+", r"\+")):
        launch("mfsdp.train:run_in_rank", 2, args=(args,))


def test_flags_the_guide_names_exist():
    """Every ``--flag`` in the guide belongs to one of our parsers or to a named external tool."""
    import re
    from pathlib import Path

    from mfsdp.cli import build_parser

    ours: set[str] = set()

    def collect(parser):
        for action in parser._actions:
            ours.update(o for o in action.option_strings if o.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    collect(sub)
    collect(build_parser())
    from mfsdp.tools import sbatch
    collect(sbatch.build_parser())
    external = {  # flags of other programs the guide shows, by program
        "torchrun": {"--nproc-per-node", "--nnodes", "--rdzv-backend", "--rdzv-endpoint",
                     "--rdzv-id", "--standalone", "--max-restarts", "--log-dir", "--tee",
                     "--shutdown-timeout"},
        "sbatch": {"--wait", "--test-only", "--nodes", "--export", "--chdir", "--gpus-per-node",
                   "--ntasks-per-node", "--cpus-per-task", "--time", "--output", "--partition",
                   "--account", "--exclusive", "--job-name", "--signal", "--open-mode",
                   "--dependency", "--requeue"},
        "scancel": {"--batch"},
        "srun/pyxis": {"--container-image", "--container-mounts", "--container-workdir",
                       "--kill-on-bad-exit", "--overlap"},
        "sphinx/pytest/pip": {"--keep-going", "--upgrade", "--index-url"},
        "nsys": {"--trace", "--output", "--capture-range"},
        "py-spy/sha256sum": {"--pid", "--quiet"},
        # Megatron-LM flags of features mfsdp does not implement or does not need; the page
        # that names them (gpu-clusters.md) says so on the same row; conversion.md and
        # conversion-reference.md name the flags a Megatron-LM job saves or loads mfsdp's
        # export with
        "megatron-lm": {"--no-gradient-accumulation-fusion", "--use-distributed-optimizer",
                        "--megatron-fsdp-version",  # per-module-api.md: upstream main's v2 switch
                        "--moe-layer-freq",
                        "--fp8-format", "--fp8-recipe", "--fp8-param-gather",
                        "--use-precision-aware-optimizer", "--tensor-model-parallel-size",
                        "--context-parallel-size", "--dist-ckpt-strictness",
                        "--dist-ckpt-optim-fully-reshardable", "--use-checkpoint-args"},
    }
    allowed = ours | set().union(*external.values())
    root = Path(__file__).resolve().parents[1]
    unknown = {}
    for page in sorted((root / "docs").glob("*.md")) + [root / "README.md"]:
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]+)", page.read_text()):
            if flag not in allowed:
                unknown.setdefault(flag, page.name)
    assert not unknown, f"flags in the guide that no parser defines: {unknown}"


@pytest.mark.parametrize("case", sorted(json.loads(
    (Path(__file__).parent / "fixtures" / "megatron_lr" / "expected.json").read_text())["cases"]))
def test_learning_rates_equal_megatron_cores_scheduler(case):
    """Every iteration's learning rate against megatron-core 0.19.2's ``OptimizerParamScheduler``
    (``tests/fixtures/megatron_lr``: warm-up, constant, linear, cosine, inverse square root, WSD)."""
    from mfsdp.train import build_parser, learning_rate

    data = json.loads((Path(__file__).parent / "fixtures" / "megatron_lr" / "expected.json")
                      .read_text())
    c = data["cases"][case]
    argv = ["--lr", str(c["lr"]), "--min-lr", str(c["min_lr"]), "--lr-warmup-iters",
            str(c["warmup"]), "--lr-decay-style", c["style"], "--train-iters",
            str(data["train_iters"]), "--lr-warmup-init", str(c.get("init", 0.0))]
    if c["decay"] is not None:
        argv += ["--lr-decay-iters", str(c["decay"])]
    if "wsd" in c:
        argv += ["--lr-wsd-decay-iters", str(c["wsd"]), "--lr-wsd-decay-style", c["wsd_style"]]
    args = build_parser().parse_args(argv)
    got = [learning_rate(args, i) for i in range(1, data["train_iters"] + 1)]
    assert got == pytest.approx(c["lrs"], rel=1e-12, abs=1e-15)


def test_nan_stops_every_rank_before_the_step_and_nothing_non_finite_is_saved(tmp_path):
    """Megatron-LM's --check-for-nan-in-loss-and-grad, on by default: --lr 1e6 makes iteration
    2's loss NaN; the run stops there with one line (rank 0), before the optimizer step, so the
    only checkpoint is iteration 1's and it is finite. Without the check it trains on."""
    from mfsdp.checkpoint.dcp import read_full

    save = tmp_path / "ckpt"
    proc = _torchrun(["--use-megatron-fsdp", "--train-iters", "6", "--lr", "1e6", "--save",
                      str(save), "--save-interval", "1", "--log-interval", "1"])
    assert proc.returncode != 0
    said = [line for line in (proc.stdout + proc.stderr).splitlines()
            if line.startswith("mfsdp train: iteration")]
    assert len(said) == 1 and "iteration 2: the loss is nan" in said[0], proc.stderr[-2000:]
    assert (save / "latest").read_text().strip() == "iter_0000001"
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000001", "latest"]
    tensors, _, _ = read_full(save / "iter_0000001")
    assert all(bool(t.isfinite().all()) for k, t in tensors.items() if t.is_floating_point())
    log = tmp_path / "log.jsonl"
    proc = _torchrun(["--use-megatron-fsdp", "--train-iters", "3", "--lr", "1e6",
                      "--no-check-for-nan-in-loss-and-grad", "--log-jsonl", str(log)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["iteration"] for r in _jsonl(log)] == [1, 2, 3]


@pytest.mark.extended  # 20 s: make test's 25-minute budget
def test_load_of_what_is_not_a_checkpoint_is_refused_and_nothing_is_overwritten(tmp_path):
    """--load starts from iteration 0 only where the directory is new or empty; a file, a Hugging
    Face directory, iteration directories without latest, or anything else is refused with one
    line naming what was found, and the run neither trains nor saves over it."""
    base = ["--use-megatron-fsdp", "--train-iters", "2", "--save-interval", "1"]
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"\0" * 16)
    iters = tmp_path / "iters"
    (iters / "iter_0000002").mkdir(parents=True)
    (iters / "iter_0000002" / "weights").write_text("keep me")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    cases = {afile: "is a file", hf: "is a Hugging Face model directory",
             iters: "holds iteration directories (iter_0000002) but no latest",
             other: "holds no checkpoint mfsdp reads (found notes.txt)"}
    for where, message in cases.items():
        before = sorted((p.relative_to(tmp_path), p.read_bytes() if p.is_file() else b"")
                        for p in [where, *where.rglob("*")])
        with pytest.raises(RankError, match="SystemExit.*" + re.escape(message)):
            launch("mfsdp.train:run_in_rank", 1,
                   args=(base + ["--load", str(where), "--save", str(where)],))
        after = sorted((p.relative_to(tmp_path), p.read_bytes() if p.is_file() else b"")
                       for p in [where, *where.rglob("*")])
        assert after == before, where
    # a new or empty directory starts from iteration 0 (the first job of a chain) ...
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / ".tmp-iter_0000001-ab12").mkdir()  # a save that never finished does not count
    for where in (empty, tmp_path / "new"):
        recs = launch("mfsdp.train:run_in_rank", 1,
                      args=(base + ["--load", str(where), "--save", str(where)],))[0]
        assert [r["iteration"] for r in recs] == [1, 2]
        assert (where / "latest").read_text().strip() == "iter_0000002"
    # ... unless --exit-on-missing-checkpoint asks for one
    with pytest.raises(RankError, match="--exit-on-missing-checkpoint"):
        launch("mfsdp.train:run_in_rank", 1, args=(base + [
            "--load", str(tmp_path / "absent"), "--save", str(tmp_path / "absent"),
            "--exit-on-missing-checkpoint"],))
    assert not (tmp_path / "absent").exists()


def _trainer_run(argv: list[str]) -> tuple[list[str], list[dict], dict]:
    """A Trainer's run() on this rank: rank 0's log lines, its records, and the model's full
    weights after the run (keyed as a saved checkpoint keys them)."""
    import torch.distributed as dist

    from mfsdp.trainer.arguments import build_parser, checked_config
    from mfsdp.trainer.trainer import Trainer

    lines: list[str] = []
    config, _ = checked_config(build_parser().parse_args(argv), dist.get_world_size(), "cpu")
    trainer = Trainer.from_config(config, log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    records = trainer.run()
    weights = {f"model.{k}": v.clone() for k, v in trainer.model.full_parameters().items()}
    return lines, records, weights


def test_a_resume_with_nothing_to_train_says_so_and_trains_nothing(tmp_path):
    """The two-node smoke run of the Slurm page, in small: a second run with the first one's
    --save and --load and the same --train-iters resumes at the last iteration. It exits 0, as
    Megatron-LM does, but says so in one line (rank 0) instead of ending without a word, and
    trains, logs and saves nothing: the checkpoint's files are untouched and the model keeps
    the checkpoint's weights."""
    from mfsdp.checkpoint.dcp import read_full

    ckpt = tmp_path / "ckpt"
    where = ["--save", str(ckpt), "--load", str(ckpt)]
    base = SHORT + ["--train-iters", "3", *where]
    first = _torchrun(base)
    assert first.returncode == 0, first.stderr[-2000:]
    files = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    second = _torchrun(base + ["--log-jsonl", str(tmp_path / "log.jsonl")])
    assert second.returncode == 0, second.stderr[-2000:]
    said = [line for line in second.stdout.splitlines() if "nothing to train" in line]
    assert said == [f"mfsdp train: nothing to train: the checkpoint in {ckpt} is at iteration 3 "
                    "and --train-iters is 3; raise --train-iters to train on, or point --save "
                    "and --load at a new directory to start over"], second.stdout
    assert not re.search(r"^(iteration |saved iteration)", second.stdout, re.M), second.stdout
    assert not (tmp_path / "log.jsonl").exists()
    assert {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == files
    # --train-samples (24 samples of batch 8: 3 iterations) is named as given
    samples = [a for a in SHORT if a not in ("--train-iters", "4")] + [
        "--train-samples", "24", *where]
    lines, records, weights = launch(_trainer_run, 2, args=(samples,))[0]
    assert records == []
    assert lines[-1] == (f"mfsdp train: nothing to train: the checkpoint in {ckpt} is at "
                         "iteration 3 and --train-samples 24 is 3 iterations of "
                         "--global-batch-size 8; raise --train-samples to train on, or point "
                         "--save and --load at a new directory to start over")
    saved, _, _ = read_full(ckpt / "iter_0000003")
    assert weights.keys() <= saved.keys() and weights
    for name, tensor in weights.items():
        assert tensor.equal(saved[name]), name


@pytest.mark.parametrize("flags, message", [
    (["--clip-grad", "-1"], "argument --clip-grad: -1 is not a finite number of at least 0"),
    (["--clip-grad", "nan"], "argument --clip-grad: nan is not a finite number of at least 0"),
    (["--vocab-size", "1"], "--vocab-size 1: a language model needs at least 2 tokens"),
    (["--use-megatron-fsdp", "--save", "{file}/sub"], "is not a directory this process may write"),
    (["--use-megatron-fsdp", "--save", "{file}"], "is a file; name a directory"),
    (["--adam-beta1", "1.5"], "argument --adam-beta1: 1.5 is not in [0, 1)"),
    (["--adam-beta2", "1"], "argument --adam-beta2: 1 is not in [0, 1)"),
    (["--adam-eps", "0"], "argument --adam-eps: 0 is not a finite number above 0"),
    (["--weight-decay", "-0.1"], "argument --weight-decay: -0.1 is not a finite number of at least 0"),
    (["--distributed-timeout-minutes", "0.001"],
     "argument --distributed-timeout-minutes: 0.001 minutes is too short a wait: at least 0.1"),
    (["--split", "90,x,10"], "--split '90,x,10': give up to three non-negative weights separated "
                             "by commas, train,valid,test, e.g. 969,30,1 ('x' is not a "
                             "non-negative number)"),
    (["--tokenizer-model", "{dir}"], "needs --tokenizer-type HuggingFaceTokenizer"),
    (["--log-jsonl", "{dir}/missing/log.jsonl"], "the directory {dir}/missing does not exist"),
    (["--tensorboard-dir", "{file}/tb"], "--tensorboard-dir {file}/tb: {file} is a file"),
    (["--data-cache-path", "{file}"], "--data-cache-path {file} is a file; name a directory"),
], ids=["clip-grad", "clip-grad-nan", "vocab-size", "save-below-a-file", "save-is-a-file",
        "adam-beta1", "adam-beta2", "adam-eps", "weight-decay", "timeout", "split",
        "tokenizer-model-alone", "log-jsonl-missing-dir", "tensorboard-below-a-file",
        "data-cache-is-a-file"])
def test_bad_values_are_refused_at_start(flags, message, tmp_path, capsys):
    """Each refused before the model is built (check_args is the first thing a run does), in
    one line naming the flag; Megatron-LM's semantics where it has them (--clip-grad 0 turns
    clipping off)."""
    from mfsdp.train import build_parser, check_args, model_config

    (tmp_path / "afile").write_text("x")
    fill = {"file": tmp_path / "afile", "dir": tmp_path}
    with pytest.raises(SystemExit) as stop:
        args = build_parser().parse_args([f.format(**fill) for f in flags])
        check_args(args, 1, model_config(args))
    said = stop.value.code if isinstance(stop.value.code, str) else capsys.readouterr().err
    assert message.format(**fill) in said, said
    args = build_parser().parse_args(["--clip-grad", "0", "--split", "90/10"])
    check_args(args, 1, model_config(args))  # Megatron-LM's: 0 is no clipping


def test_damaged_checkpoint_files_are_named(tmp_path):
    """Garbage in manifest.json, model_config.json or Megatron-LM's tracker: an error naming the
    file, not a bare JSONDecodeError or UnicodeDecodeError."""
    from mfsdp.checkpoint import CheckpointError, read_manifest
    from mfsdp.checkpoint.detect import resolve_megatron_lm
    from mfsdp.trainer.build import saved_config

    ckpt = tmp_path / "iter_0000001"
    ckpt.mkdir()
    (tmp_path / "latest").write_text("iter_0000001\n")
    for garbage in (b"{not json", b"\xff\xfe\x00garbage", b"[1, 2]"):
        (ckpt / "manifest.json").write_bytes(garbage)
        with pytest.raises(CheckpointError, match=re.escape(str(ckpt / "manifest.json"))):
            read_manifest(tmp_path)
    (ckpt / "manifest.json").write_text('{"files": {}, "format_version": 1}')
    (ckpt / "model_config.json").write_bytes(b"{oops")
    with pytest.raises(SystemExit, match="model_config.json is not valid JSON"):
        saved_config(str(tmp_path))
    mlm = tmp_path / "mlm"
    mlm.mkdir()
    (mlm / "latest_checkpointed_iteration.txt").write_bytes(b"\x80\x81")
    with pytest.raises(CheckpointError, match="latest_checkpointed_iteration.txt is not text"):
        resolve_megatron_lm(mlm)


def test_profile_writes_a_trace_with_mfsdps_labels(tmp_path):
    """Megatron-LM's --profile --use-pytorch-profiler: a torch.profiler trace of iterations 2 and
    3 (--profile-step-end is exclusive) on rank 0 only, in --tensorboard-dir/profile, where the
    engine's collectives carry their labels."""
    tb = tmp_path / "tb"
    launch("mfsdp.train:run_in_rank", 2, args=(SHORT + [
        "--profile", "--use-pytorch-profiler", "--profile-step-start", "2",
        "--profile-step-end", "4", "--tensorboard-dir", str(tb)],))
    traces = sorted((tb / "profile").glob("*.pt.trace.json"))
    assert len(traces) == 1 and traces[0].name.startswith("rank0.")
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = [e.get("name", "") for e in events]
    for label in ("mfsdp::all_gather", "mfsdp::reduce_scatter"):
        assert names.count(label) > 0, label


@pytest.mark.parametrize("flags, message", [
    (["--record-memory-history"], "records the CUDA caching allocator, which a CPU run does not use"),
    (["--profile"], "needs CUDA; on CPU add --use-pytorch-profiler"),
    (["--profile", "--use-pytorch-profiler"], "pass --tensorboard-dir DIR"),
    (["--profile", "--use-pytorch-profiler", "--tensorboard-dir", "x", "--profile-step-end", "3"],
     "--profile-step-end 3 must exceed --profile-step-start 10"),
], ids=["memory-history-on-cpu", "nsys-on-cpu", "no-trace-dir", "empty-window"])
def test_profiling_flags_that_cannot_work_are_refused_at_start(flags, message):
    from mfsdp.train import build_parser
    from mfsdp.trainer.arguments import checked_config

    with pytest.raises(SystemExit, match=re.escape(message)):
        checked_config(build_parser().parse_args(flags), 1, "cpu")


@pytest.mark.extended  # four trainer launches (about a minute on an idle 2-core machine)
@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_per_token_loss_gives_one_process_gradients_on_ddp_and_fsdp(engine):
    """``--calculate-per-token-loss`` normalises by the global token count: on two ranks, with
    SGD, the loss curve is the one process's curve, whether mfsdp sums the gradients (FSDP path)
    or PyTorch's DDP averages them (the DDP path scales the loss up by the ranks)."""
    args = ["--train-iters", "4", "--global-batch-size", "8", "--micro-batch-size", "1",
            "--sequence-packing", "--calculate-per-token-loss", "--optimizer", "sgd",
            "--lr", "0.5"] + (["--use-megatron-fsdp"] if engine == "fsdp" else [])
    one = _losses(1, tuple(args))
    two = _losses(2, tuple(args))
    assert two == pytest.approx(one, rel=1e-5), (engine, one, two)
    assert one[-1] != one[0]
