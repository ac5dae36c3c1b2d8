"""ParallelLayout: pure rank arithmetic, checked against DESIGN.md's table and by properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mfsdp import ParallelLayout
from mfsdp.layout import GROUP_KINDS

# The reference table (world 8, EP 2, outer 2) of the design document.
DESIGN_TABLE = {
    "dp_shard": [[0, 1, 2, 3], [4, 5, 6, 7]],
    "dp_outer": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "expt_dp_shard": [[0, 2], [4, 6], [1, 3], [5, 7]],
    "expt_dp": [[0, 2, 4, 6], [1, 3, 5, 7]],
}


def test_rank_table_matches_the_design_document():
    layout = ParallelLayout(world_size=8, dp_outer=2, ep=2)
    for kind, groups in DESIGN_TABLE.items():
        assert layout.groups(kind) == groups, kind
    text = str(layout)
    assert "expt_dp_shard  | [0,2] [4,6] [1,3] [5,7]" in text


@st.composite
def layouts(draw):
    outer = draw(st.sampled_from([1, 2, 3, 4]))
    ep = draw(st.sampled_from([1, 2, 4]))
    expt_shard = draw(st.sampled_from([1, 2, 3]))
    return ParallelLayout(world_size=outer * ep * expt_shard, dp_outer=outer, ep=ep)


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_every_rank_in_exactly_one_group_of_each_kind(layout):
    for kind in GROUP_KINDS:
        ranks = sorted(r for g in layout.groups(kind) for r in g)
        assert ranks == list(range(layout.world_size)), kind


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_groups_are_orthogonal_and_sizes_multiply_to_the_world(layout):
    size = {k: len(layout.groups(k)[0]) for k in GROUP_KINDS}
    assert size["dp_shard"] * size["dp_outer"] == layout.world_size
    assert size["expt_dp_shard"] * size["ep"] * size["dp_outer"] == layout.world_size
    assert size["expt_dp"] == size["expt_dp_shard"] * size["dp_outer"]
    # orthogonal: two groups of different kinds among (shard, outer) / (expt shard, ep, outer)
    # share at most one rank
    for a, b in [("dp_shard", "dp_outer"), ("expt_dp_shard", "ep"), ("ep", "dp_outer"),
                 ("expt_dp_shard", "dp_outer")]:
        for ga in layout.groups(a):
            for gb in layout.groups(b):
                assert len(set(ga) & set(gb)) <= 1, (a, b, ga, gb)
    # EP groups are contiguous ranks, and lie inside one dense shard group
    for g in layout.groups("ep"):
        assert g == list(range(g[0], g[0] + len(g)))
        assert any(set(g) <= set(s) for s in layout.groups("dp_shard"))


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=8, dp_outer=3), "world_size=8 is not divisible by dp_outer=3"),
    (dict(world_size=8, dp_outer=2, ep=3), "ep=3 does not divide the shard group size 4"),
    (dict(world_size=8, ep=4, num_experts=2), "ep=4 is larger than num_experts=2"),
    (dict(world_size=8, ep=4, num_experts=6), "num_experts=6 is not divisible by ep=4"),
    (dict(world_size=0), "world_size=0 must be a positive integer"),
    (dict(world_size=8, tp=3), "is not divisible by tp x cp = 3 x 1"),
])
def test_bad_layouts_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ParallelLayout(**kwargs)


def test_unknown_group_kind():
    with pytest.raises(ValueError, match="kind='pp' is not a group kind"):
        ParallelLayout(4).groups("pp")


def test_tp_and_cp_follow_megatron_lm_rank_order():
    """Megatron-LM's order (tp fastest, then cp, then dp): rank = ((o*dp + d)*cp + c)*tp + t."""
    outer, dp, cp, tp = 2, 2, 2, 2
    layout = ParallelLayout(world_size=16, dp_outer=outer, tp=tp, cp=cp)
    rank = {(o, d, c, t): ((o * dp + d) * cp + c) * tp + t for o in range(outer)
            for d in range(dp) for c in range(cp) for t in range(tp)}
    for (o, d, c, t), r in rank.items():
        assert layout.group_of("tp", r) == [rank[o, d, c, x] for x in range(tp)]
        assert layout.group_of("cp", r) == [rank[o, d, x, t] for x in range(cp)]
        # parameters are sharded over dp x cp at one TP index (upstream's dp_shard_cp)
        assert layout.group_of("dp_shard", r) == [rank[o, y, x, t] for y in range(dp)
                                                  for x in range(cp)]
        assert layout.group_of("dp_outer", r) == [rank[x, d, c, t] for x in range(outer)]
        assert layout.group_of("dp", r) == [rank[x, y, c, t] for x in range(outer)
                                            for y in range(dp)]
    assert "tp             | [0,1] [2,3]" in str(layout)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([1, 2]), st.sampled_from([1, 2, 3]), st.sampled_from([1, 2]),
       st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]))
def test_tp_cp_layouts_cover_every_rank_once(outer, dp, cp, tp, ep):
    if (dp * cp) % ep:
        return
    layout = ParallelLayout(world_size=outer * dp * cp * tp, dp_outer=outer, ep=ep, tp=tp, cp=cp)
    for kind in GROUP_KINDS:
        ranks = sorted(r for g in layout.groups(kind) for r in g)
        assert ranks == list(range(layout.world_size)), kind
    size = {k: len(layout.groups(k)[0]) for k in GROUP_KINDS}
    assert size["dp_shard"] * size["dp_outer"] * size["tp"] == layout.world_size
    assert size["expt_dp_shard"] * size["ep"] == size["dp_shard"]
    # an EP group never crosses TP indices or replicas: it lies inside one shard group
    for g in layout.groups("ep"):
        assert any(set(g) <= set(s) for s in layout.groups("dp_shard"))
