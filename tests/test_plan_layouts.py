"""The layout page's search (mfsdp/tools/plan_layouts.py) against a brute force over the planner,
and its commands against ``mfsdp plan``."""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import replace

import pytest

from mfsdp.tools.plan import GiB, PRESETS, Layout, estimate, plan, with_global_batch
from mfsdp.tools.plan_cli import TIGHT_GIB
from mfsdp.tools.plan_layouts import GLOBAL_BATCH, GPUS, ROWS, choose, row, table, why
from mfsdp.tools.plan_time import GPUS as PLAN_GPUS


def _fits(model, layout, device_gib, spare):
    return plan(model, layout).total <= (device_gib - 4 - spare) * GiB


@pytest.mark.parametrize("device_gib, spare, batch", [
    (80.0, TIGHT_GIB, None), (80.0, 0.0, None), (140.0, 0.0, None), (80.0, TIGHT_GIB, 512)])
def test_no_layout_on_fewer_gpus_fits_and_none_on_as_many_is_faster(device_gib, spare, batch):
    """Every TP, CP and recompute choice on every whole-node world up to the chosen one, planned
    directly: none on fewer GPUs fits, and none on as many fits and runs faster; with a global
    batch, of those whose data-parallel ranks divide it (checked here by the modulo)."""
    model = PRESETS["llama3-70b"]
    got = choose("llama3-70b", 8192, device_gib, spare_gib=spare, global_batch=batch)
    assert got is not None and _fits(model, got.layout, device_gib, spare)
    assert got.total == plan(model, got.layout).total
    for world in range(8, got.layout.world_size + 1, 8):
        for tp in (1, 2, 4, 8):
            for cp in (1, 2, 4, 8):
                for recompute in (None, "full"):
                    try:
                        layout = Layout(world, tp=tp, cp=cp, sequence_parallel=tp > 1,
                                        seq_length=8192, recompute_granularity=recompute)
                    except ValueError:
                        continue
                    if batch is not None:
                        dp = world // (tp * cp)
                        if batch % dp:
                            continue
                        layout = replace(layout, micro_batches=batch // dp)
                    if not _fits(model, layout, device_gib, spare):
                        continue
                    assert world == got.layout.world_size, layout
                    assert (estimate(model, layout).tokens_per_gpu_s
                            <= got.tokens_per_gpu_s * (1 + 1e-12)), layout


def test_an_moe_preset_gets_an_expert_parallel_layout_that_fits():
    got = choose("deepseek-v3", 4096, 80.0, spare_gib=TIGHT_GIB)
    assert got.layout.ep > 1 and PRESETS["deepseek-v3"].num_experts % got.layout.ep == 0
    assert got.fits and not got.tight and got.spare_gib >= TIGHT_GIB
    fewer = got.layout.world_size - 8
    for ep in (8, 16, 32, 64):  # the same recompute and CP, one node fewer: does not fit
        try:
            layout = Layout(fewer, ep=ep, cp=got.layout.cp, seq_length=4096,
                            recompute_granularity="full")
        except ValueError:
            continue
        assert not _fits(PRESETS["deepseek-v3"], layout, 80.0, TIGHT_GIB), layout


def _run_plan(argv):
    from mfsdp.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv[1:]) in (0, None)
    return out.getvalue()


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_every_rows_command_prints_the_rows_figures(impl):
    """Each row's command on the page (``mfsdp train``'s table; the Transformer Engine table's
    on H100), run through ``mfsdp plan``: it is accepted with the row's ``--global-batch-size``,
    prints the row's total and the micro-batches that make the batch, and fits on the row's GPU,
    whose memory ``--gpu`` alone sets."""
    for preset, seq in ROWS:
        for gpu_name in GPUS if impl == "local" else ("H100",):
            device_gib, gpu = GPUS[gpu_name]
            c = row(preset, seq, gpu_name, transformer_impl=impl)
            argv = c.command().replace("\\\n", " ").split()
            assert argv[:2] == ["mfsdp", "plan"]
            assert "--device-gib" not in argv and ("--gpu" in argv) == (gpu != "h100"), argv
            assert argv[argv.index("--global-batch-size") + 1] == str(GLOBAL_BATCH[preset])
            assert ("--transformer-impl" in argv) == (impl != "local"), argv
            out = _run_plan(argv)
            total = re.search(r"^total +(\d+\.\d\d)$", out, re.M)[1]
            assert total == f"{c.total / GiB:.2f}", argv
            dp = c.layout.world_size // (c.layout.tp * c.layout.cp)
            assert GLOBAL_BATCH[preset] % dp == 0 and c.layout.micro_batches * dp == \
                GLOBAL_BATCH[preset]
            assert f"fits on {device_gib:g} GiB: yes" in out


def test_smallest_keeps_to_the_global_batch():
    """``mfsdp plan --smallest --global-batch-size``: the search skips the 70B's TP 2 world of
    24 (DP 12 does not divide 512) that it finds without the batch, and says it kept to it."""
    argv = ("mfsdp plan llama3-70b --world-size 32 --tensor-model-parallel-size 2 "
            "--sequence-parallel --seq-length 8192 --recompute-granularity full "
            "--smallest").split()
    free = _run_plan(argv)
    kept = _run_plan(argv + ["--global-batch-size", "512"])
    assert re.search(r"^smallest world that fits with 5 GiB spare: 24$", free, re.M)
    world = re.search(r"^smallest world that fits with 5 GiB spare and DP x micro-batch "
                      r"dividing --global-batch-size 512: (\d+)$", kept, re.M)
    assert world and 512 % (int(world[1]) // 2) == 0 and int(world[1]) > 24
    assert with_global_batch(Layout(24, tp=2, sequence_parallel=True), 512) is None


def test_the_table_fits_the_page_and_a_bad_input_is_refused():
    text = table(rows=(("llama3-8b", 8192),))
    assert max(len(line) for line in text.splitlines()) <= 88
    assert len(text.splitlines()) == 1 + len(GPUS)
    with pytest.raises(ValueError, match="is not a planner preset"):
        choose("llama4", 8192)
    with pytest.raises(ValueError, match="spare_gib"):
        choose("llama3-8b", 8192, 80.0, spare_gib=80.0)


def _drop_tp_cp(layout):
    return replace(layout, tp=1, cp=1, sequence_parallel=False)


def test_why_names_what_the_search_tried_planned_directly():
    """``why`` for rows whose reasons differ, against the planner called here: the layout without
    TP and CP (tight, or over the GPU in activations alone), without recomputation (how many GPUs
    the search without it needs), experts per GPU, and the fewest GPUs when tight."""
    for preset, seq, gpu_name in [("llama3-8b", 8192, "H100"), ("llama3-70b", 8192, "H100"),
                                  ("llama3-70b", 8192, "H200"), ("llama3-8b", 8192, "H200")]:
        device_gib, gpu = GPUS[gpu_name]
        model, c = PRESETS[preset], row(preset, seq, gpu_name)
        batch = GLOBAL_BATCH[preset]
        got = why(preset, seq, gpu_name)
        lay = c.layout
        if lay.tp * lay.cp == 1 and not lay.recompute_granularity:
            assert got == ""  # nothing to explain: ZeRO-3 alone, no recomputation
            continue
        flat = plan(model, _drop_tp_cp(lay))
        spare = device_gib - 4 - flat.total / GiB
        if 0 <= spare < TIGHT_GIB:
            assert f"leaves {spare:.1f} GiB: tight" in got
        elif flat.memory["activations"] > (device_gib - 4) * GiB:
            assert "activations alone exceed the GPU" in got
        if lay.recompute_granularity:  # no recomputation: the same search, brute force
            worlds = [w for w in range(8, 2 * lay.world_size + 1, 8)
                      if any(_fits(model, Layout(w, tp=tp, cp=cp, sequence_parallel=tp > 1,
                                                 seq_length=seq), device_gib, TIGHT_GIB)
                             for tp in (1, 2, 4, 8) for cp in (1, 2, 4, 8)
                             if w % (tp * cp) == 0 and batch % (w // (tp * cp)) == 0)]
            assert worlds and worlds[0] >= lay.world_size
            if worlds[0] > lay.world_size:
                assert f"no recompute needs {worlds[0]} GPUs" in got
            else:  # as many GPUs without it: the search kept the faster, recomputing one
                assert re.search(r"no recompute needs TP \d CP \d: slower", got), got
    assert why("llama3-8b", 8192, "H100").startswith("CP 1 ")  # the 8B H100 row's CP 2
    assert "TP 1 CP 1: the activations alone exceed the GPU" == why("llama3-70b", 8192, "H200")
    with pytest.raises(ValueError, match="gpu_name='A100'"):
        why("llama3-8b", 8192, "A100")


def test_the_rules_of_thumb_hold_on_the_rows():
    """The page's rules of thumb (docs/layouts.md) on the rows they name, from ``choose``."""
    got = {(n, s, g): row(n, s, g).layout for n, s in ROWS for g in GPUS}
    for (name, seq, gpu), lay in got.items():
        experts = PRESETS[name].num_experts
        assert GLOBAL_BATCH[name] % (lay.world_size // (lay.tp * lay.cp)) == 0
        if name == "llama3-8b":  # ZeRO-3 alone on one node; CP 2 on H100 only
            assert (lay.world_size, lay.tp, lay.ep) == (8, 1, 1)
            assert lay.cp == (2 if gpu == "H100" else 1)
        elif not experts:  # 70B, 405B: TP (with SP) x CP 2 to 8, CP 2; GB200: CP 4
            assert lay.tp <= 8 and (lay.tp == 1 or lay.sequence_parallel)
            if gpu == "GB200":
                assert (lay.tp, lay.cp) == ((1, 4) if name == "llama3-70b" else (4, 4))
            else:
                assert 2 <= lay.tp * lay.cp <= 8 and lay.cp <= 2
        else:  # MoE: 8 to 32 experts per GPU, TP 1
            assert lay.tp == 1 and 8 <= experts // lay.ep <= 32
        full = lay.recompute_granularity == "full"
        none = name == "llama3-8b" or (name, gpu) == ("llama3-70b", "H200") or \
            (gpu == "GB200" and name != "llama3-70b")
        assert full != none, (name, seq, gpu, lay)
    for name, seq in ROWS:  # more memory per GPU: never more GPUs; half with H200 from 70B on
        worlds = [got[name, seq, g].world_size for g in ("H100", "H200", "GB200")]
        assert worlds == sorted(worlds, reverse=True)
        assert (worlds[1] * 2 == worlds[0]) == (name != "llama3-8b")
        assert (worlds[2] == worlds[1]) == (name != "llama3-70b")  # 8B: one node on each


def test_the_pages_short_commands_are_one_rows_own():
    """The layouts page's bash blocks (its "In short": check a row, then render it) are one
    row's ``mfsdp plan`` and ``mfsdp sbatch render`` commands as the search prints them now,
    so a planner change that moves that row fails here, as it fails the page's doctests."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "layouts.md").read_text()
    shown = tuple(b.strip() for b in re.findall(r"^```bash\n(.*?)^```$", page, re.S | re.M))
    pairs = [(c.command(), c.sbatch_command())
             for c in (row(n, s, g) for n, s in ROWS for g in GPUS)]
    assert shown in pairs, shown


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_every_rows_sbatch_command_renders_the_rows_layout_and_memory(impl, capsys):
    """Each row's ``mfsdp sbatch render`` command (the page's "From a row to a job"), run
    through the CLI: it renders (exit 0, no over-memory refusal), the script's flags are the
    row's layout as mfsdp train's parser reads them, and the render's planned peak is the
    row's, to the byte, and as printed."""
    import shlex

    from mfsdp import train
    from mfsdp.cli import main
    from mfsdp.tools.sbatch import build_parser, parse_overrides, resolve
    from mfsdp.tools.sbatch.schedule import schedule

    for preset, seq in ROWS:
        for gpu_name in GPUS:
            c = row(preset, seq, gpu_name, transformer_impl=impl)
            argv = shlex.split(c.sbatch_command().replace("\\\n", " "))
            assert argv[:3] == ["mfsdp", "sbatch", "render"], argv
            assert main(argv[1:-2]) == 0, argv  # (to stdout: the script's flags below)
            out = capsys.readouterr()
            body = re.search(r"^TRAIN_ARGS=\(\n(.*?)^\)", out.out, re.S | re.M).group(1)
            words = shlex.split(body)
            if impl != "local":  # Megatron-LM's script: its model flags are not mfsdp's
                assert "--use-distributed-optimizer" in words
            lay = c.layout
            args = train.build_parser().parse_args(
                [("/x" if w.startswith("$") else w) for w in words] if impl == "local" else
                ["--model-preset", preset, *_layout_words(words)])
            assert ((args.tensor_model_parallel_size or 1), bool(args.sequence_parallel),
                    args.context_parallel_size or 1, args.expert_model_parallel_size or 1,
                    args.recompute_granularity, args.seq_length,
                    args.global_batch_size) == (
                lay.tp, lay.tp > 1, lay.cp, lay.ep, lay.recompute_granularity,
                lay.seq_length, GLOBAL_BATCH[preset]), argv
            assert argv[-2] == "-o" and argv[-1].endswith(".sbatch")
            args = build_parser().parse_args(argv[2:])
            v = resolve(args.preset, parse_overrides(args.overrides))[1]
            assert v["nodes"] * v["ranks_per_node"] == lay.world_size
            assert schedule(v).peak_bytes == c.total, argv
            assert f"peak is {c.total / GiB:.1f} GiB per GPU" in out.err


def _layout_words(words: list[str]) -> list[str]:
    """The layout and batch flags of a Megatron-LM script's TRAIN_ARGS (with their values)."""
    keep = ("--tensor-model-parallel-size", "--sequence-parallel", "--context-parallel-size",
            "--expert-model-parallel-size", "--recompute-granularity", "--recompute-method",
            "--recompute-num-layers", "--seq-length", "--global-batch-size",
            "--micro-batch-size")
    out = []
    for i, w in enumerate(words):
        if w in keep:
            out.append(w)
            if i + 1 < len(words) and not words[i + 1].startswith("--"):
                out.append(words[i + 1])
    return out
