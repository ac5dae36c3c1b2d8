"""The HSDP page's picture of process groups on 2 nodes x 8 GPUs, drawn from the engine's own
rank arithmetic (:meth:`mfsdp.ParallelLayout.groups`, the lists ``create_groups`` hands to
``torch.distributed``).

``python docs/_ext/rank_groups.py`` writes ``docs/_static/rank-groups.svg``;
``tests/test_docs_rank_groups.py`` fails when the committed file differs from a fresh render, so
the picture cannot drift from the layout code. Three panels: ZeRO-3 (one shard group), HSDP and
HFSDP (shard inside a node, outer groups across: the same groups), and EP 8 inside a
16-rank shard group.
"""

from __future__ import annotations

import html
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "_static" / "rank-groups.svg"

WIDTH = 760
NODES, GPUS = 2, 8
CELL, GAP = 64, 10  # a GPU's square and the space between squares
LEFT = 92  # room for the node labels
FONT = 15  # the smallest text, in SVG units (the page draws the picture at ~0.9 scale)
COLOURS = ["#cfe2f3", "#fde2c4", "#d9ead3", "#ead1dc"]  # light fills: dark text stays legible
LINE = "#444444"


def panels() -> list[dict]:
    """Each panel: its title, the layout, which group kind colours the squares, which kind is
    drawn as lines between members, which kind (if any) is drawn as a box around its members,
    whether squares show the rank's place in its EP group, and caption lines."""
    from mfsdp import ParallelLayout

    def sizes(layout, kind):
        groups = layout.groups(kind)
        return f"{len(groups)} group{'s' if len(groups) > 1 else ''} of {len(groups[0])}"

    zero3 = ParallelLayout(world_size=16)
    hsdp = ParallelLayout(world_size=16, dp_outer=2)
    ep = ParallelLayout(world_size=16, ep=8, num_experts=256)
    return [
        dict(title="ZeRO-3: one shard group over both nodes", layout=zero3, fill="dp_shard",
             caption=[f"dp_shard: {sizes(zero3, 'dp_shard')} (colour). Every all-gather and "
                      "reduce-scatter", "crosses the network between the nodes."]),
        dict(title="HSDP and HFSDP: shard inside a node, outer groups across", layout=hsdp,
             fill="dp_shard", link="dp_outer",
             caption=[f"dp_shard: {sizes(hsdp, 'dp_shard')} (colour); dp_outer: "
                      f"{sizes(hsdp, 'dp_outer')} (lines). Across the nodes,",
                      "HSDP all-reduces the gradient shard once a step; HFSDP also splits the",
                      f"main weights and Adam state 1/{hsdp.dp_shard * hsdp.dp_outer} a rank "
                      "(a reduce-scatter, then an all-gather)."]),
        dict(title="EP 8 inside a 16-rank shard group", layout=ep, fill="ep",
             link="expt_dp_shard", box="dp_shard", expert_index=True,
             caption=[f"ep: {sizes(ep, 'ep')} (colour; e0-e{ep.ep - 1}: "
                      f"{ep.num_experts // ep.ep} experts each); "
                      f"expt_dp_shard: {sizes(ep, 'expt_dp_shard')}",
                      f"(lines); dense dp_shard: {sizes(ep, 'dp_shard')} (dashed box)."]),
    ]


def _text(x, y, s, size=FONT, weight="normal", anchor="start") -> str:
    return (f'<text x="{x}" y="{y}" font-size="{size}" font-weight="{weight}" '
            f'text-anchor="{anchor}">{html.escape(s)}</text>')


def _cell(rank: int) -> tuple[int, int]:
    """Column and row (node) of ``rank``: 8 consecutive ranks a node."""
    return rank % GPUS, rank // GPUS


def _panel(p: dict, top: int) -> tuple[list[str], int]:
    """One panel's SVG elements from ``top`` down, and the height it takes."""
    layout = p["layout"]
    out = [_text(8, top + 20, p["title"], size=FONT + 2, weight="bold")]
    grid_top = top + 34
    row_h = CELL + 26  # the space between the rows carries the cross-node lines

    def xy(rank):
        col, row = _cell(rank)
        return LEFT + col * (CELL + GAP), grid_top + row * row_h

    if "box" in p:
        for group in layout.groups(p["box"]):
            xs, ys = zip(*(xy(r) for r in group))
            out.append(f'<rect x="{min(xs) - 6}" y="{min(ys) - 6}" '
                       f'width="{max(xs) - min(xs) + CELL + 12}" '
                       f'height="{max(ys) - min(ys) + CELL + 12}" fill="none" '
                       f'stroke="{LINE}" stroke-width="1.5" stroke-dasharray="6 4"/>')
    for node in range(NODES):
        out.append(_text(8, grid_top + node * row_h + CELL / 2 + 5, f"node {node}"))
    fill_of = {r: i for i, g in enumerate(layout.groups(p["fill"])) for r in g}
    place = {r: i for g in layout.groups("ep") for i, r in enumerate(g)}
    for rank in range(layout.world_size):
        x, y = xy(rank)
        colour = COLOURS[fill_of[rank] % len(COLOURS)]
        out.append(f'<rect x="{x}" y="{y}" width="{CELL}" height="{CELL}" rx="6" '
                   f'fill="{colour}" stroke="{LINE}" stroke-width="1"/>')
        if p.get("expert_index"):
            out.append(_text(x + CELL / 2, y + 26, f"r{rank}", anchor="middle"))
            out.append(_text(x + CELL / 2, y + 48, f"e{place[rank]}", anchor="middle"))
        else:
            out.append(_text(x + CELL / 2, y + CELL / 2 + 5, f"r{rank}", anchor="middle"))
    for group in layout.groups(p["link"]) if "link" in p else ():
        for a, b in zip(group, group[1:]):
            (xa, ya), (xb, yb) = xy(a), xy(b)
            out.append(f'<line x1="{xa + CELL / 2}" y1="{ya + CELL}" x2="{xb + CELL / 2}" '
                       f'y2="{yb}" stroke="{LINE}" stroke-width="2.5"/>')
    y = grid_top + NODES * row_h + 8
    for line in p["caption"]:
        out.append(_text(8, y, line))
        y += FONT + 6
    return out, y - top + 10


def render() -> str:
    """The whole picture, as SVG text."""
    body, top = [], 0
    for p in panels():
        elements, height = _panel(p, top)
        body += elements
        top += height
    title = ("Process groups of 16 ranks on 2 nodes of 8 GPUs: ZeRO-3, HSDP, HFSDP and EP 8, "
             "from mfsdp.ParallelLayout.groups")
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {top}" '
            f'width="{WIDTH}" height="{top}" role="img" font-family="sans-serif" '
            f'fill="#222222">\n<title>{html.escape(title)}</title>\n'
            f'<rect width="{WIDTH}" height="{top}" fill="#ffffff"/>\n'
            + "\n".join(body) + "\n</svg>\n")


def main() -> None:
    """Write the picture to ``docs/_static/rank-groups.svg``."""
    OUT.write_text(render())


if __name__ == "__main__":
    main()
