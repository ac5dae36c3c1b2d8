"""``mfsdp bandwidth``: the groups it measures, the collectives it times (real gloo ranks), nccl-tests'
bus-bandwidth arithmetic, its agreement with the planner's time model, and its refusals."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch

from mfsdp.cli import main
from mfsdp.launch import launch
from mfsdp.tools import plan_time
from mfsdp.tools.bandwidth import OPS, measure, rank_groups, report

SIZES_MIB = [1 / 64, 1 / 16]  # 4,096 and 16,384 float32 elements: seconds on two cores


@pytest.fixture(scope="module")
def four_ranks():
    """4 real gloo ranks, 2 per node: every rank's result of :func:`measure`."""
    return launch(measure, 4, args=(SIZES_MIB, 2, 2, 1), timeout=120)


def test_rank_groups_place_nodes_in_rank_order():
    groups = rank_groups(16, 8)
    assert groups["node"] == [list(range(8)), list(range(8, 16))]
    assert groups["network"] == [[i, i + 8] for i in range(8)]
    assert groups["world"] == [list(range(16))]


def test_four_ranks_on_two_nodes_measure_their_groups_with_correct_collectives(four_ranks):
    expected = {"node": [[0, 1], [2, 3]], "network": [[0, 2], [1, 3]], "world": [[0, 1, 2, 3]]}
    for rank, result in enumerate(four_ranks):
        assert result["skipped"] == {}
        for kind, groups in expected.items():
            mine = next(g for g in groups if rank in g)
            assert result["mine"][kind] == mine
            # the gathered chunk i (first and last element) came from the group's i-th rank
            assert result["observed"][kind]["all_gather_into_tensor"] == \
                [[float(r), float(r)] for r in mine]
            # each rank sent its rank number: the reduced shard holds their sum
            assert result["observed"][kind]["reduce_scatter_tensor"] == \
                [[float(sum(mine)), float(sum(mine))]]
        # the time is the slowest rank's: every rank reports the same rows
        assert result["rows"] == four_ranks[0]["rows"]
    rows = four_ranks[0]["rows"]
    assert [(r["group"], r["ranks"], r["op"], r["size_bytes"]) for r in rows] == \
        [(kind, len(expected[kind][0]), op, int(mib * 2**20 + 0.5))
         for kind in expected for mib in SIZES_MIB for op in OPS]


def test_bus_bandwidth_follows_nccl_tests_definitions(four_ranks):
    # nccl-tests doc/PERFORMANCE.md: algbw = S / t; for all-gather and reduce-scatter
    # busbw = algbw * (n - 1) / n, with S the gathered size; GB/s are 10^9 bytes a second
    for row in four_ranks[0]["rows"]:
        size, t, n = row["size_bytes"], row["time_s"], row["ranks"]
        assert t > 0
        assert row["algbw_gbps"] == pytest.approx(size / t / 1e9, rel=1e-12)
        assert row["busbw_gbps"] == pytest.approx(size / t / 1e9 * (n - 1) / n, rel=1e-12)


def test_the_planner_predicts_the_measured_time_at_the_measured_busbw(four_ranks):
    """plan_time._seconds prices a collective's ring bytes (S (n-1)/n per rank) over the link at its
    GB/s; at the measured busbw it must give back the measured time (same definition, same units)."""
    world, per_node = 4, 2
    for row in four_ranks[0]["rows"]:
        if row["group"] == "world":
            continue
        n, size = row["ranks"], row["size_bytes"]
        link = "nvlink_gbps" if row["group"] == "node" else "network_gbps"
        gpu = replace(plan_time.GPUS["h100"], nvlink_domain=per_node, **{link: row["busbw_gbps"]})
        span = n if row["group"] == "node" else world  # a network group spans every node
        seconds, links = plan_time._seconds(size * (n - 1) / n, n, span, gpu)
        assert links == ("NVLink" if row["group"] == "node" else "network")
        assert seconds == pytest.approx(row["time_s"], rel=1e-9)


def test_the_printed_plan_line_sets_the_planners_links(capsys, tmp_path):
    path = tmp_path / "bw.json"
    assert main(["bandwidth", "--nproc", "4", "--ranks-per-node", "2", "--device", "cpu",
                 "--size-mib", "0.0625", "--iters", "1", "--warmup", "0",
                 "--json", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["group", "ranks", "op", "size", "MiB", "time", "ms", "algbw",
                              "GB/s", "busbw", "GB/s"]
    assert len([line for line in out if re.match(r"(node|network|world) +\d+ +\w+_tensor ", line)]) == 6
    saved = json.loads(path.read_text())
    assert saved["environment"]["backend"] == "gloo" and saved["environment"]["world_size"] == 4
    for kind in ("node", "network"):  # the lower of the two ops' busbw at the largest size
        assert saved["links_gbps"][kind] == min(r["busbw_gbps"] for r in saved["rows"]
                                                if r["group"] == kind)
    line = out[-1]
    m = re.fullmatch(r"mfsdp plan \.\.\. --nvlink-gbps (\S+) --network-gbps (\S+)", line)
    assert m, line
    nvlink, network = float(m[1]), float(m[2])
    assert nvlink == pytest.approx(saved["links_gbps"]["node"], rel=5e-3)
    assert network == pytest.approx(saved["links_gbps"]["network"], rel=5e-3)

    model_args = ["llama3-8b", "--world-size", "16"]
    assert main(["plan", *model_args]) == 0
    default = capsys.readouterr().out
    assert main(["plan", *model_args, *line.split()[3:]]) == 0
    measured = capsys.readouterr().out

    from mfsdp.tools.plan import PRESETS, Layout, plan
    model, layout = PRESETS["llama3-8b"], Layout(world_size=16, seq_length=4096)
    sent = plan(model, layout).comm
    for text, overrides in ((default, {}),
                            (measured, {"nvlink_gbps": nvlink, "network_gbps": network})):
        t = plan_time.step_time(model, layout, sent, "h100", **overrides)
        assert f"communication dp_shard {t.comm_s['dp_shard']:.2f} s" in text
    assert default != measured


def test_a_group_of_one_rank_is_skipped_with_a_line(capsys):
    assert main(["bandwidth", "--nproc", "2", "--ranks-per-node", "1", "--device", "cpu",
                 "--size-mib", "0.0625", "--iters", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("mfsdp bandwidth: node: groups of one rank") for line in out)
    assert "mfsdp bandwidth: world: the same ranks as network: measured once" in out
    assert re.fullmatch(r"mfsdp plan \.\.\. --network-gbps \S+", out[-1]), out[-1]


@pytest.mark.parametrize("argv, says", [
    (["--nproc", "4", "--ranks-per-node", "3"],
     "--ranks-per-node 3 does not divide the world size 4; pass a divisor of 4"),
    (["--size-mib", "0"], "--size-mib 0 is not above 0; pass sizes in MiB"),
    (["--size-mib", "-1"], "--size-mib -1 is not above 0; pass sizes in MiB"),
    (["--nproc", "3", "--size-mib", "1"],
     "do not split evenly over 3 ranks; pass a multiple of 3 elements, such as --size-mib"),
])
def test_refusals_name_the_input_and_the_fix(argv, says, capsys):
    assert main(["bandwidth", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mfsdp bandwidth: error: ") and says in err[0], err


@pytest.mark.parametrize("argv, says", [
    (["--iters", "0"], "--iters: 0 is not a positive integer"),
    (["--warmup", "-1"], "--warmup: -1 is not an integer of at least 0"),
    (["--nproc", "0"], "--nproc: 0 is not a positive integer"),
])
def test_argparse_refuses_counts_below_their_minimum(argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bandwidth", *argv])
    assert exc.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_a_gpu_is_refused(capsys):
    assert main(["bandwidth", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--device cuda" in err and "--device cpu" in err


def test_nproc_under_torchrun_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["bandwidth", "--device", "cpu", "--nproc", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "drop --nproc" in err


def _rows(node_gbps: float, network_gbps: float) -> dict:
    """A result as :func:`measure` returns it, with the given bus bandwidths at 1 GiB."""
    rows = [{"group": group, "ranks": n, "op": op, "size_bytes": 2**30,
             "time_s": 2**30 * (n - 1) / n / (gbps * 1e9),
             "algbw_gbps": gbps * n / (n - 1), "busbw_gbps": gbps}
            for group, n, gbps in (("node", 8, node_gbps), ("network", 2, network_gbps))
            for op in OPS]
    return {"rows": rows, "skipped": {}}


@pytest.mark.parametrize("node, network, warned", [
    (350.0, 44.0, []),  # a healthy H100 node: no warning
    (120.0, 44.0, ["NVLink"]),  # 33% of 360: PCIe or a shared node
    (350.0, 12.0, ["network"]),  # 27% of 45: TCP sockets, say
])
def test_links_under_70_percent_of_the_planners_figure_are_warned_about_on_gpus(
        node, network, warned):
    text = report(_rows(node, network), gpu="h100")
    assert [line.split()[1] for line in text.splitlines()
            if line.startswith("warning:")] == warned
    flags = f"--nvlink-gbps {node:g} --network-gbps {network:g}"
    assert text.splitlines()[-1] == f"mfsdp plan ... {flags}"
    assert "NET/IB" in text if "network" in warned else "NET/IB" not in text
    # on CPU (gloo) the same figures are no GPU link's: compared, never warned about
    quiet = report(_rows(node, network), gpu="h100", cpu=True)
    assert "warning:" not in quiet and "says nothing about a GPU's links" in quiet
