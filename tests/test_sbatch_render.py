"""What a rendered script says of itself: its header states the schedule it was rendered with
(the script is copied as the job's provenance record), and its argument lists pass each flag
once."""

from __future__ import annotations

import re
import shlex

import pytest

from mfsdp.tools import sbatch


def _overrides(args: list[str]) -> dict[str, str]:
    """The overrides ``mfsdp sbatch ARGS`` renders with, read by the CLI's own parser."""
    return sbatch.parse_overrides(sbatch.build_parser().parse_args(args).overrides)


def _header(text: str) -> str:
    """The first comment (after the shebang and the shellcheck directive), unwrapped; its
    lines fit 100 columns."""
    lines = text.splitlines()[2:]
    comment = lines[:lines.index("#")]
    assert all(len(line) <= 100 for line in comment), comment
    return " ".join(line.removeprefix("# ") for line in comment)


def test_header_states_the_rendered_schedule_not_the_presets():
    text = sbatch.render("llama3-8b", {"train_iters": "200", "lr_warmup_iters": "20"})
    header = _header(text)
    # the values the script trains with, as its TRAIN_ARGS pass them
    assert "  --train-iters 200\n" in text and "  --lr-warmup-iters 20\n" in text
    assert "schedule: 512 x 200 iterations, cosine from 3e-4 to 3e-5 after 20 warm-up " \
           "iterations (rendered with --set" in header
    # the preset's own schedule only as the preset's, after the rendered one
    rendered, presets = header.split("the preset's:", 1)
    assert "1,168,251" not in rendered and "2,000" not in rendered
    assert "512 x 1,168,251 iterations" in presets and "2,000 warm-up" in presets


def test_header_of_an_unchanged_preset_names_its_recipe_and_list_shows_the_presets(capsys):
    header = _header(sbatch.render("llama3-8b"))
    assert ("Megatron-Bridge's llama3_8b_pretrain_config (512 x 1,168,251 iterations, cosine "
            "from 3e-4 to 3e-5 after 2,000 warm-up iterations), in 4-hour jobs that save and "
            "requeue until done.") in header
    assert "--set" not in header
    # a change the schedule does not read leaves the recipe's sentence as it is
    recipe = header[header.index("Batch and learning-rate schedule:"):]
    wider = _header(sbatch.render("llama3-8b", {"nodes": "4"}))
    assert wider.endswith(recipe)
    # the preset's layout: CP 2, no recomputation, and the plan's reason
    from mfsdp.tools.sbatch.schedule import schedule

    peak = schedule(sbatch.resolve("llama3-8b")[1]).peak_bytes / 2**30
    assert ("on 2 nodes x 8 GPUs: context parallelism 2 (each rank holds 4,096 tokens of a "
            "sequence), ZeRO-3 (optim_grads_params) over 16 ranks (data-parallel size 8 x CP "
            "2), no activation recomputation (without it the plan of mfsdp train's layers "
            f"peaks at {peak:.1f} GiB of 80), bf16 compute") in header
    # the recomputation is stated from the rendered plan: without CP, on 32 GPUs (each holds
    # half the sharded state) 3 layers are no longer the fewest that fit, on 16 they are
    block3 = {"cp": "1", "recompute": "block:3"}
    narrow = _header(sbatch.render("llama3-8b", block3))
    assert "--recompute-num-layers 3\n" in sbatch.render("llama3-8b", block3)
    # no CP, no CP phrase
    assert "(optim_grads_params) over the 16 data-parallel ranks, full recomputation" in narrow
    assert "first 3 of 32 layers (with fewer the plan of mfsdp train's layers leaves under " \
           "5 GiB of 80 spare; it costs about 3% of the step)" in narrow
    assert "first 3 of 32 layers (it costs about 3% of the step)" in _header(
        sbatch.render("llama3-8b", dict(block3, nodes="4")))
    # the job length follows time, and a script that does not save says it does not requeue
    other = _header(sbatch.render("llama3-8b", {"time": "00:30:00", "save": ""}))
    assert "in 30-minute jobs (this script neither saves" in other
    # `mfsdp sbatch list` keeps the preset's own values
    sbatch.main(["list"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("llama3-8b "))
    assert line.endswith(header[2:])


def test_header_states_the_rendered_recomputation():
    """The recomputation the header names is the recompute key's, in the plan of the
    rendered trainer's layer."""
    from mfsdp.tools.plan import PRESETS, Layout, estimate

    layout = dict(world_size=16, seq_length=8192, micro_batch=1, micro_batches=32,
                  grad_comm_bytes=2)
    five = _header(sbatch.render("llama3-8b", {"cp": "1", "recompute": "block:5"}))
    cost = (estimate(PRESETS["llama3-8b"], Layout(recompute_granularity="full",
                                                  recompute_method="block",
                                                  recompute_num_layers=5, **layout)).step_s
            / estimate(PRESETS["llama3-8b"], Layout(**layout)).step_s - 1)
    assert f"first 5 of 32 layers (it costs about {cost:.0%} of the step)" in five
    none = _header(sbatch.render("llama3-8b", {"cp": "1"}))
    assert ", no activation recomputation, bf16 compute" in none  # over 71 GiB: no claim
    from mfsdp.tools.sbatch.schedule import schedule

    mlm = _header(sbatch.render("llama3-8b", {"trainer": "megatron-lm"}))
    peak = schedule(sbatch.resolve("llama3-8b", {"trainer": "megatron-lm"})[1]).peak_bytes
    assert ("no activation recomputation (without it the plan of Megatron-LM's Transformer "
            f"Engine layers peaks at {peak / 2**30:.1f} GiB of 80)") in mlm


def test_gpu_smoke_header_follows_its_values():
    header = _header(sbatch.render("gpu-smoke", {"train_iters": "80", "save_interval": "40"}))
    assert "for 80 iterations" in header and "saving every 40 iterations" in header
    assert "50" not in header and "25" not in header


def test_gpu_smoke_scales_an_unset_global_batch_with_the_nodes(capsys):
    """gpu-smoke renders at any node count: a global batch not given with --set is one
    sequence per data-parallel rank (nodes x 8 over tp x cp), and the script's ranks, batch and
    header agree; a global batch given with --set is used as given, or refused."""
    from mfsdp.cli import main

    for nodes, tp in ((1, 1), (2, 1), (3, 1), (2, 2)):
        text = sbatch.render("gpu-smoke", {"nodes": str(nodes), "tp": str(tp)})
        ranks = nodes * 8
        assert f"#SBATCH --nodes={nodes}\n" in text
        assert "--nnodes \"$SLURM_JOB_NUM_NODES\" --nproc-per-node 8" in text
        assert f"  --global-batch-size {ranks // tp}\n" in text
        header = _header(text)
        assert f"on {nodes} node{'s' if nodes > 1 else ''} x 8 GPUs" in header
        assert f"a step ({ranks // tp:,})" in header
        assert ("tensor parallelism 2" in header) == (tp == 2)
    two = sbatch.render("gpu-smoke", {"nodes": "2", "global_batch_size": "32"})
    assert "  --global-batch-size 32\n" in two
    with pytest.raises(sbatch.RenderError, match=re.escape("1 x 16")):
        sbatch.render("gpu-smoke", {"nodes": "2", "global_batch_size": "8"})
    assert main(["sbatch", "render", "gpu-smoke", "--set", "nodes=2"]) == 0
    assert "16 sequences" in capsys.readouterr().err


def test_a_save_interval_under_a_minute_reads_naturally(capsys):
    """The render's save-cadence line: 'about N min' from a minute on, 'less than a minute
    apart' below it (gpu-smoke saves every 25 iterations of a step well under 2.4 s)."""
    from mfsdp.cli import main
    from mfsdp.tools.sbatch.schedule import schedule

    step = schedule(sbatch.resolve("gpu-smoke")[1]).step_s
    assert 25 * step < 60
    assert main(["sbatch", "render", "gpu-smoke"]) == 0
    err = capsys.readouterr().err
    assert ("mfsdp sbatch: saves every 25 iterations, less than a minute apart at that step, "
            "in 30 min jobs") in err.splitlines()
    assert "about under" not in err
    interval = int(120 / step) + 1  # two minutes and a little more
    assert main(["sbatch", "render", "gpu-smoke", "--set", f"save_interval={interval}"]) == 0
    assert (f"saves every {interval:,} iterations, about {round(interval * step / 60)} min at "
            "that step") in capsys.readouterr().err


def _argument_lists(text: str) -> dict[str, list[list[str]]]:
    """Each ``NAME=(...)`` array of a script: its lines, split like the shell splits them."""
    arrays = re.findall(r"^([A-Z_]+)=\(\n(.*?)^\)", text, flags=re.M | re.S)
    assert arrays, "no argument list found"
    return {name: [shlex.split(line) for line in body.splitlines() if line.strip()]
            for name, body in arrays}


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
@pytest.mark.parametrize("name, overrides, rel", sbatch.scripts(),
                         ids=[rel for _, _, rel in sbatch.scripts()])
def test_no_flag_appears_twice_in_an_argument_list(name, overrides, rel, launcher):
    """Every preset, for each trainer that runs it (the committed scripts) and each launcher:
    a flag passed twice leaves the trainer's parser to pick one (the last), which a reader of
    the script cannot tell."""
    values = dict(overrides, launcher=launcher) if sbatch.PRESETS[name].template == "train" \
        else overrides
    for array, lines in _argument_lists(sbatch.render(name, values)).items():
        flags = [w.split("=", 1)[0] for line in lines for w in line if w.startswith("--")]
        twice = sorted({f for f in flags if flags.count(f) > 1})
        assert not twice, f"{rel} ({launcher}): {array} passes {twice} more than once"


def test_model_flags_after_the_preset_replace_its_value_for_megatron_lm():
    text = sbatch.render("gpu-smoke", {"trainer": "megatron-lm"})
    train = dict((line[0], line[1:]) for line in _argument_lists(text)["TRAIN_ARGS"])
    assert train["--num-layers"] == ["4"]  # the preset's 32, replaced where it stood
    assert train["--hidden-size"] == ["4096"]  # the rest of llama3-8b's shape is kept


def _guide_renders() -> list[tuple[str, str]]:
    """``(page, command)`` of every ``mfsdp sbatch render`` command line in the guide's fenced
    code blocks, continuation lines joined."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = []
    for page in sorted((root / "docs").glob("*.md")):
        fence, pending = None, []
        for line in page.read_text().splitlines():
            match = re.match(r"^\s*(`{3,}|~{3,})(.*)$", line)
            if fence is None:
                fence = match.group(1) if match else None
                continue
            if match and match.group(1) == fence and not match.group(2).strip():
                fence, pending = None, []
                continue
            pending.append(line.strip().removesuffix("\\").strip())
            if line.rstrip().endswith("\\"):
                continue
            command, pending = " ".join(pending), []
            if command.startswith("mfsdp sbatch render "):
                out.append((page.name, command))
    return out


@pytest.mark.parametrize("page, command", _guide_renders())
def test_every_render_command_of_the_guide_renders(page, command, tmp_path, monkeypatch,
                                                   capsys):
    """Each ``mfsdp sbatch render`` command the guide shows renders as printed (``$PWD`` is the
    submission directory), and writes the script it names with ``-o``."""
    argv = [w.replace("$PWD", str(tmp_path)) for w in shlex.split(command)]
    monkeypatch.chdir(tmp_path)
    assert sbatch.main(argv[2:]) == 0, capsys.readouterr().err
    script = (tmp_path / argv[argv.index("-o") + 1]).read_text()
    assert script.startswith("#!/bin/bash")


def test_the_slurm_pages_first_trial_and_two_node_smoke_are_short():
    """The Slurm page's first trial saves twice and takes minutes in the planner's estimate,
    in its own checkpoint directory; its two-node smoke test asks for 2 nodes and a checkpoint
    directory of its own."""
    from mfsdp.tools.sbatch.schedule import schedule

    commands = [c for page, c in _guide_renders() if page == "slurm.md"]
    trials = [c for c in commands if "render llama3-8b" in c]
    assert len(trials) == 2  # mfsdp train and Megatron-LM
    for command in trials:
        v = sbatch.resolve("llama3-8b", _overrides(shlex.split(command)[2:]))[1]
        assert v["train_iters"] == 2 * v["save_interval"] and v["save"] != "checkpoints/llama3-8b"
        assert schedule(v).seconds < 20 * 60
    smoke = [c for c in commands if "render gpu-smoke" in c]
    assert len(smoke) == 1 and "--set nodes=2" in smoke[0] and "global_batch_size" not in smoke[0]
    # not the one-node run's checkpoints, which it would resume at the last iteration
    overrides = _overrides(shlex.split(smoke[0])[2:])
    assert sbatch.resolve("gpu-smoke", overrides)[1]["save"] != sbatch.resolve(
        "gpu-smoke", {})[1]["save"]


def test_the_slurm_pages_hfsdp_figure_for_deepseek_is_the_planners():
    """The presets' deepseek-v3 note: the HFSDP render it names plans the GiB it says more than
    the preset, and the total it says (both to the page's 0.1 GiB)."""
    from pathlib import Path

    from mfsdp.tools.sbatch.schedule import schedule

    text = " ".join((Path(__file__).resolve().parents[1] / "docs" / "slurm.md").read_text().split())
    found = re.search(r"HFSDP over 2 outer groups \(`(--set [^`]+)`\) plans ([\d.]+) GiB more, "
                      r"([\d.]+) GiB", text)
    assert found, "the deepseek-v3 note's HFSDP sentence changed: update this test"
    overrides = _overrides(["render", "deepseek-v3", *shlex.split(found.group(1))])
    base = schedule(sbatch.resolve("deepseek-v3")[1]).peak_bytes / 2**30
    hfsdp = schedule(sbatch.resolve("deepseek-v3", overrides)[1]).peak_bytes / 2**30
    assert f"{hfsdp - base:.1f}" == found.group(2) and f"{hfsdp:.1f}" == found.group(3)


# ---- the bandwidth preset: mfsdp bandwidth under torchrun --------------------------------

def _sbatch_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("#SBATCH")]


def _bandwidth_args(text: str):
    """The script's BANDWIDTH_ARGS as ``mfsdp bandwidth``'s own parser reads them."""
    from mfsdp.tools import bandwidth

    lines = _argument_lists(text)["BANDWIDTH_ARGS"]
    return bandwidth.build_parser().parse_args([w for line in lines for w in line])


def _torchrun_args(text: str):
    """The script's TORCHRUN_ARGS and the command it runs, as torchrun's own parser reads
    them (its variables unexpanded)."""
    from torch.distributed.run import get_args_parser

    lines = _argument_lists(text)["TORCHRUN_ARGS"]
    return get_args_parser().parse_args([w for line in lines for w in line]
                                        + ["-m", "mfsdp.cli", "bandwidth"])


def test_bandwidth_runs_the_tool_under_torchrun_on_every_node():
    text = sbatch.render("bandwidth")
    assert _sbatch_lines(text) == [
        "#SBATCH --job-name=mfsdp-bandwidth", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8", "#SBATCH --cpus-per-task=64", "#SBATCH --time=00:15:00",
        "#SBATCH --output=%x-%j.log", "#SBATCH --exclusive"]
    run = _torchrun_args(text)
    assert (run.nnodes, run.nproc_per_node) == ("$SLURM_JOB_NUM_NODES", "8")
    assert (run.rdzv_backend, run.rdzv_endpoint, run.rdzv_id) == (
        "c10d", "$HEAD_NODE:$RDZV_PORT", "$SLURM_JOB_ID")
    # the training scripts' torchrun flags and rendezvous port, from the same includes
    train = sbatch.render("llama3-8b")
    assert _argument_lists(text)["TORCHRUN_ARGS"] == _argument_lists(train)["TORCHRUN_ARGS"]
    port = "RDZV_PORT=$((15000 + SLURM_JOB_ID % 15000))\n"
    assert port in text and port in train
    assert "RDZV_PORT=29400\n" in sbatch.render("bandwidth", {"rdzv_port": "29400"})
    # one srun task per node runs torchrun, which runs mfsdp bandwidth in every rank
    assert ('srun --kill-on-bad-exit=1 \\\n  bash -c "$NODE_TASK" node-task "$JOB_DIR" "$PYTHON" '
            '"${TORCHRUN_ARGS[@]}" \\\n  -m mfsdp.cli bandwidth "${BANDWIDTH_ARGS[@]}"\n') in text
    assert "exec \"$2\" -m torch.distributed.run --log-dir" in text
    args = _bandwidth_args(text)
    assert (args.device, args.gpu, args.size_mib) == ("cuda", "h100", [256.0, 1024.0])
    assert args.json == "$BANDWIDTH_JSON" and args.nproc is None  # torchrun's ranks
    assert 'BANDWIDTH_JSON="$PWD"/"$SLURM_JOB_NAME"-"$SLURM_JOB_ID".json\n' in text
    assert "export NCCL_DEBUG=${NCCL_DEBUG:-INFO}\n" in text  # INFO unless the user sets it


def test_bandwidth_gpu_and_sizes_reach_the_command_line():
    text = sbatch.render("bandwidth", {"gpu": "gb200", "size_mib": "64 512", "nodes": "4"})
    args = _bandwidth_args(text)
    assert (args.gpu, args.size_mib) == ("gb200", [64.0, 512.0])
    assert "#SBATCH --nodes=4" in _sbatch_lines(text)
    header = " ".join(line for line in text.splitlines()[2:6])
    assert "4 x 8 ranks" in header and "--gpu gb200" in header


def test_bandwidth_on_a_cpu_job_runs_gloo_ranks():
    text = sbatch.render("bandwidth", {"nodes": "1", "gpus_per_node": "0",
                                       "ranks_per_node": "4", "cpus_per_task": "2",
                                       "size_mib": "1 4"})
    assert not any("--gpus-per-node" in line for line in _sbatch_lines(text))
    assert _torchrun_args(text).nproc_per_node == "4"
    args = _bandwidth_args(text)
    assert (args.device, args.size_mib) == ("cpu", [1.0, 4.0])
    assert "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}" in text and "NCCL_DEBUG" not in text


def _without_provenance_line(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith("# Rendered by"))


# a changed value for each key the preset takes (gpus_per_node with ranks_per_node: one rank
# per GPU), from a CPU render so that ranks_per_node can change alone
_BANDWIDTH_CHANGES = {
    "job_name": {"job_name": "bw"}, "nodes": {"nodes": "2"},
    "gpus_per_node": {"gpus_per_node": "4", "ranks_per_node": "4"},
    "ranks_per_node": {"ranks_per_node": "2"}, "cpus_per_task": {"cpus_per_task": "3"},
    "time": {"time": "00:20:00"}, "output": {"output": "bw-%j.log"},
    "log_dir": {"log_dir": "/scratch/logs"}, "partition": {"partition": "batch"},
    "account": {"account": "proj"}, "exclusive": {"exclusive": "true"},
    "env_setup": {"env_setup": "source /venv/bin/activate"},
    "container_image": {"container_image": "img"},
    "container_mounts": {"container_image": "img", "container_mounts": "/a:/b"},
    "rdzv_port": {"rdzv_port": "29400"}, "gpu": {"gpu": "h200"}, "size_mib": {"size_mib": "8"},
}


@pytest.mark.parametrize("key", sorted(_BANDWIDTH_CHANGES))
def test_every_key_of_the_bandwidth_preset_acts(key):
    assert set(_BANDWIDTH_CHANGES) == set(sbatch.PRESETS["bandwidth"].values)
    base = {"nodes": "1", "gpus_per_node": "0", "ranks_per_node": "4", "cpus_per_task": "2",
            "exclusive": "false", "size_mib": "4"}
    before = dict(base, container_image="img") if key == "container_mounts" else base
    assert (_without_provenance_line(sbatch.render("bandwidth", before))
            != _without_provenance_line(sbatch.render("bandwidth",
                                                      dict(base, **_BANDWIDTH_CHANGES[key]))))


@pytest.mark.parametrize("overrides, message", [
    ({"train_iters": "5"}, "preset 'bandwidth' does not use 'train_iters'"),
    ({"trainer": "megatron-lm"}, "does not use 'trainer'"),
    ({"launcher": "srun"}, "does not use 'launcher'"),
    ({"save": "ckpt"}, "does not use 'save'"),
    ({"gpu": "a100"}, "choose one of gb200, gb300, h100, h200"),
    ({"size_mib": "0"}, "size_mib='0' for 16 ranks: --size-mib 0 is not above 0"),
    ({"size_mib": ""}, "is not above 0"),
    ({"size_mib": "fast"}, "size_mib='fast' for 16 ranks: MiB as numbers"),
    ({"size_mib": "inf"}, "MiB as numbers"),
    ({"nodes": "3", "size_mib": "1"}, "do not split evenly over 24 ranks"),
    ({"ranks_per_node": "4"}, "ranks_per_node=4 but gpus_per_node=8"),
    ({"output": "%N-%j.log"}, "knows only %x (job name) and %j (job id)"),
    ({"rdzv_port": "80"}, "rdzv_port=80: a TCP port from 1024 to 65535"),
    ({"nodes": "0"}, "nodes=0 must be at least 1"),
])
def test_bandwidth_refuses_in_one_line(overrides, message):
    with pytest.raises(sbatch.RenderError, match=re.escape(message)) as err:
        sbatch.render("bandwidth", overrides)
    assert "\n" not in str(err.value)


def _train_args(text: str) -> list[str]:
    """The TRAIN_ARGS array of a rendered script, as the shell passes it."""
    return shlex.split(re.search(r"^TRAIN_ARGS=\(\n(.*?)^\)", text, re.S | re.M).group(1))


@pytest.mark.parametrize("value, expected", [
    ("none", (None, None, None)), ("full", ("full", "uniform", 1)),
    ("block:26", ("full", "block", 26)), ("selective", ("selective", None, None))])
@pytest.mark.parametrize("trainer", ["mfsdp", "megatron-lm"])
def test_the_recompute_key_sets_the_flags_the_plan_and_the_header(value, expected, trainer):
    """recompute=VALUE renders the recomputation flags once, as mfsdp train's parser reads
    them (the same flags for Megatron-LM); the render's memory is the planner's for that
    recomputation, and the header names it."""
    from mfsdp import train
    from mfsdp.tools.plan import PRESETS, Layout, plan
    from mfsdp.tools.sbatch.schedule import schedule

    over = {"recompute": value, "trainer": trainer, "allow_over_memory": "true"}
    text = sbatch.render("llama3-70b", over)
    words = _train_args(text)
    flags = [w for w in words if w.startswith("--recompute")]
    assert len(flags) == len(set(flags)), flags
    mine = [t for i, w in enumerate(words) if w.startswith("--recompute")
            for t in (w, words[i + 1]) if not t.startswith("--") or t == w]
    args = train.build_parser().parse_args(mine)
    assert (args.recompute_granularity, args.recompute_method,
            args.recompute_num_layers) == expected
    v = sbatch.resolve("llama3-70b", over)[1]
    impl = "local" if trainer == "mfsdp" else "transformer_engine"
    layout = Layout(64, tp=4, sequence_parallel=True, seq_length=8192, micro_batches=32,
                    grad_comm_bytes=2, recompute_granularity=expected[0],
                    recompute_method=expected[1] or "uniform",
                    recompute_num_layers=expected[2] or 1, transformer_impl=impl)
    assert schedule(v).peak_bytes == plan(PRESETS["llama3-70b"], layout).total
    header = _header(text)
    phrase = {"none": "no activation recomputation", "full": ", full recompute,",
              "block:26": "full recomputation of the first 26 of 80 layers",
              "selective": "selective activation recomputation"}[value]
    assert phrase in header, header


@pytest.mark.parametrize("overrides, message", [
    ({"recompute": "block:81"}, "recompute='block:81': block:N recomputes the first N layers; "
                                "N must be from 1 to the model's 80 layers"),
    ({"recompute": "block:0"}, "N must be from 1 to the model's 80 layers"),
    ({"recompute": "partial"}, "recompute='partial': use none, full (every layer), block:N"),
    ({"model_args": "--model-preset llama3-70b --recompute-granularity full"},
     "model_args passes --recompute-granularity: set recomputation with --set recompute="),
])
def test_a_recompute_the_key_cannot_express_is_refused_in_one_line(overrides, message):
    with pytest.raises(sbatch.RenderError) as err:
        sbatch.render("llama3-70b", overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("trainer, extra, key", [
    ("mfsdp", "--recompute-num-layers 80", "recompute"),
    ("mfsdp", "--recompute-granularity=selective", "recompute"),
    ("mfsdp", "--tensor-model-parallel-size 2", "tp"),
    ("mfsdp", "--tensor-model 2", "tp"),  # mfsdp train's parser takes the prefix
    ("mfsdp", "--global-batch-size 1024", "global_batch_size"),
    ("mfsdp", "--context-parallel-size 2", "cp"),  # a key's flag, even where not written
    ("mfsdp", "--num-layers 40", "model_args"),
    ("mfsdp", "--mock-data", "mock_data"),
    ("megatron-lm", "--num-layers 40", "model_args"),
    ("megatron-lm", "--sequence-parallel", "sequence_parallel"),
    ("megatron-lm", "--recompute-method block", "recompute"),
])
def test_extra_args_that_repeat_a_flag_of_the_script_are_refused_naming_the_key(
        trainer, extra, key):
    with pytest.raises(sbatch.RenderError) as err:
        sbatch.render("llama3-70b", {"trainer": trainer, "extra_args": extra})
    text = str(err.value)
    assert text.startswith(f"extra_args={extra!r} passes --") and "\n" not in text
    assert text.endswith(f"use --set {key}=... instead"), text


def test_extra_args_with_flags_of_their_own_pass_and_fixed_flags_are_refused():
    text = sbatch.render("llama3-70b", {"extra_args": "--exit-interval 7"})
    assert _train_args(text)[-2:] == ["--exit-interval", "7"]
    # Megatron-LM's parser takes no prefixes: a flag of its own that begins a written one
    text = sbatch.render("llama3-70b", {"trainer": "megatron-lm",
                                        "extra_args": "--transformer-impl transformer_engine"})
    assert "--transformer-impl" in text
    with pytest.raises(sbatch.RenderError, match="the script always passes it; drop it"):
        sbatch.render("llama3-70b", {"extra_args": "--use-megatron-fsdp"})


def test_the_header_states_the_rendered_layout():
    """The report's case: llama3-70b on 4 nodes, TP 1, CP 2, full recomputation; the header
    names those values, not the preset's 8 nodes and TP 4."""
    over = {"nodes": "4", "tp": "1", "cp": "2", "recompute": "full",
            "grad_reduce_in_bf16": "false"}
    text = sbatch.render("llama3-70b", over)
    header = _header(text)
    assert "#SBATCH --nodes=4\n" in text
    assert header.startswith("Llama-3-70B-style dense model on 4 nodes x 8 GPUs: context "
                             "parallelism 2 (each rank holds 4,096 tokens of a sequence), "
                             "ZeRO-3 (optim_grads_params) over 32 ranks (data-parallel size "
                             "16 x CP 2), full recompute, bf16 compute"), header
    assert "tensor parallelism" not in header and "8 nodes" not in header
    # every part follows its key
    other = _header(sbatch.render("llama3-70b", {"tp": "8", "sequence_parallel": "false",
                                                 "bf16": "false", "meta_init": "false",
                                                 "strategy": "optim_grads",
                                                 "allow_over_memory": "true"}))
    assert ("on 8 nodes x 8 GPUs: tensor parallelism 8 inside a node, ZeRO-2 (optim_grads) "
            "over the 8 data-parallel ranks, ") in other
    assert "fp32 compute" in other and "meta-device" not in other and "bf16" not in other
    moe = _header(sbatch.render("deepseek-v3", {"ep": "8", "dispatcher": "alltoall",
                                                "allow_over_memory": "true"}))
    assert ("expert parallelism 8 inside a node (32 experts per GPU), ZeRO-3 "
            "(optim_grads_params) over the 256 data-parallel ranks, the alltoall token "
            "dispatcher, full recompute") in moe


def test_a_plan_over_the_gpu_is_refused_unless_allowed(capsys):
    """The report's render (llama3-70b on 4 nodes, TP 1, CP 2, the preset's 26 block-recomputed
    layers) plans 157 GiB per GPU: the render exits 2 with one line naming the fixes and
    allow_over_memory; allowed, it writes the script and warns; on a GB200 (186 GiB) it fits."""
    from mfsdp.cli import main
    from mfsdp.tools.plan import PRESETS, Layout, plan

    argv = ["sbatch", "render", "llama3-70b", "--set", "nodes=4", "--set", "tp=1", "--set",
            "sequence_parallel=false", "--set", "cp=2"]
    peak = plan(PRESETS["llama3-70b"], Layout(
        32, cp=2, seq_length=8192, micro_batches=32, grad_comm_bytes=2,
        recompute_granularity="full", recompute_method="block",
        recompute_num_layers=26)).total / 2**30
    assert peak > 76
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert captured.out == "" and len(err) == 1, err
    assert f"the planner's peak is {peak:.1f} GiB per GPU" in err[0]
    assert "over the 76 GiB that gpu=h100 (80 GiB) leaves" in err[0]
    assert "--set allow_over_memory=true" in err[0]
    assert main(argv + ["--set", "allow_over_memory=true"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("#!/bin/bash")
    assert f"peak is {peak:.1f} GiB per GPU" in captured.err and "WARNING: over" in captured.err
    assert main(argv + ["--set", "gpu=gb200"]) == 0
    assert "fits 186 GiB GPUs (at most 182 GiB)" in capsys.readouterr().err
