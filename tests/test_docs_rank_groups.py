"""The HSDP page's process-group picture (docs/_ext/rank_groups.py, committed as
docs/_static/rank-groups.svg): up to date with the layout code, drawing the groups a 2 x 8 job
has, and readable."""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

import rank_groups  # noqa: E402

NS = {"s": "http://www.w3.org/2000/svg"}


def test_the_committed_picture_is_a_fresh_render():
    """Regenerate with ``python docs/_ext/rank_groups.py`` when the layout code changes."""
    assert rank_groups.OUT.read_text() == rank_groups.render(), \
        "docs/_static/rank-groups.svg is stale: run python docs/_ext/rank_groups.py"


def _squares(svg: ET.Element) -> list[tuple[float, float, str, str]]:
    """(x, y, fill, rank label) of every GPU square, in drawing order."""
    rects = [r for r in svg.findall("s:rect", NS) if r.get("rx")]
    labels = [t.text for t in svg.findall("s:text", NS) if re.fullmatch(r"r\d+", t.text or "")]
    return [(float(r.get("x")), float(r.get("y")), r.get("fill"), lab)
            for r, lab in zip(rects, labels)]


def test_the_panels_colour_and_link_the_groups_of_a_two_node_job():
    """Written out by hand for 2 nodes x 8 GPUs (ranks 8n..8n+7 on node n): ZeRO-3 one colour;
    HSDP one colour per node and a line from each rank to the same GPU of the other node; EP 8
    one colour per node too (an EP group is a node), and its expert shard groups the same
    cross-node pairs."""
    svg = ET.fromstring(rank_groups.render())
    squares = _squares(svg)
    assert len(squares) == 3 * 16
    panels = [squares[i:i + 16] for i in range(0, 48, 16)]
    for panel in panels:
        assert [s[3] for s in panel] == [f"r{r}" for r in range(16)]
    assert len({s[2] for s in panels[0]}) == 1
    for panel in panels[1:]:
        assert len({s[2] for s in panel[:8]}) == len({s[2] for s in panel[8:]}) == 1
        assert panel[0][2] != panel[8][2]
    lines = svg.findall("s:line", NS)
    assert len(lines) == 2 * 8  # HSDP's dp_outer pairs and EP's expt_dp_shard pairs
    for panel, drawn in zip(panels[1:], (lines[:8], lines[8:])):
        for gpu, line in enumerate(drawn):
            top, bottom = panel[gpu], panel[gpu + 8]
            assert float(line.get("x1")) == float(line.get("x2")) == top[0] + rank_groups.CELL / 2
            assert float(line.get("y1")) == top[1] + rank_groups.CELL
            assert float(line.get("y2")) == bottom[1]


def test_text_stays_readable_on_the_page():
    """Every label at least 12 px when the picture is drawn 640 px wide (narrower than the
    article column at a 1280 px window), and the picture has a title for screen readers."""
    svg = ET.fromstring(rank_groups.render())
    width = float(svg.get("viewBox").split()[2])
    sizes = [float(t.get("font-size")) for t in svg.findall("s:text", NS)]
    assert min(sizes) * 640 / width >= 12, (min(sizes), width)
    assert svg.find("s:title", NS).text.startswith("Process groups")
