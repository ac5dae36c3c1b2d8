"""MoE: router, permutation, dispatchers against a dense reference on real ranks, fused experts
under ZeRO-3, and THD packed sequences.

Tolerance: outputs and gradients to 1e-5 absolute (fp32; the only difference from the dense
reference is the order of floating-point sums, measured below 1e-6).
"""

from __future__ import annotations

import functools

import pytest
import torch

from mfsdp.launch import launch
from mfsdp.models.gpt import GPT, GPT_PRESETS, GPTConfig, pack_sequences
from mfsdp.moe import (MoELayer, TopKRouter, aux_loss, capacity_mask, make_dispatcher, permute,
                       topk_routing, unpermute, z_loss)

TOL = 1e-5
RUNS = [dict(kind="allgather"), dict(kind="alltoall"), dict(kind="flex", backend="torch"),
        dict(kind="alltoall", fused=True),
        dict(kind="alltoall", topk=3, score_func="sigmoid", num_groups=4, group_topk=2),
        dict(kind="flex", backend="torch", shared_ffn=8)]
COUNTS = {1: [7], 2: [5, 11], 4: [3, 9, 0, 14]}  # uneven, one rank with no token at all


@functools.lru_cache(maxsize=None)
def _dispatch(ep: int) -> list[list[dict]]:
    return launch("mfsdp.testing.moe_checks:dispatcher_check_all", ep, args=(COUNTS[ep], RUNS), timeout=300)


@pytest.mark.parametrize("ep", [1, 2, 4])
@pytest.mark.parametrize("run", range(len(RUNS)), ids=lambda i: "-".join(
    f"{v}" for v in RUNS[i].values()))
def test_dispatcher_matches_dense_reference(ep, run):
    results = _dispatch(ep)
    for rank, result in enumerate(results):
        r = result[run]
        for key in ("out", "grad_x", "grad_router", "grad_experts"):
            assert r[key] < TOL, f"rank {rank} {RUNS[run]}: {key} differs by {r[key]:.2e}"
    # Every token reaches exactly topk experts somewhere (no capacity limit in these runs), and
    # padding rows (flex) reach none: the experts' row counts add up to tokens x topk.
    routed = sum(sum(result[run]["tokens_per_expert"]) for result in results)
    assert routed == sum(COUNTS[ep]) * RUNS[run].get("topk", 2)


@pytest.mark.parametrize("ep", [2, 4])
def test_dispatchers_agree_and_move_different_bytes(ep):
    results = _dispatch(ep)
    for rank, result in enumerate(results):
        base = result[0]["output"]
        for r in result[1:3]:  # allgather, alltoall, flex on the same layer
            torch.testing.assert_close(r["output"], base, atol=TOL, rtol=0)
    # All-to-all sends only routed rows; all-gather every token to every rank.
    sent = [sum(r[i]["bytes_sent"].values()) for r in results for i in range(2)]
    assert sum(sent[1::2]) < sum(sent[0::2])


def test_flex_torch_backend_pads_to_a_common_multiple_of_64():
    results = launch("mfsdp.testing.moe_checks:dispatcher_check", 2, args=("flex", [17, 70]),
                     kwargs=dict(backend="torch"), timeout=120)
    for r in results:
        assert r["padded_tokens"] == 128  # max(17, 70) rounded up to 64
        assert r["padding_routes_nowhere"]
        assert r["out"] < TOL and r["grad_x"] < TOL and r["grad_experts"] < TOL
    assert [r["output"].shape[0] for r in results] == [17, 70]  # trimmed back


@functools.lru_cache(maxsize=None)
def _fused(mode: str) -> dict:
    return launch("mfsdp.testing.moe_checks:fused_experts_check", 1 if mode == "reference" else 2,
                  args=(mode,), timeout=120)[0]


def test_fused_experts_without_hook_replay_lose_their_weights():
    r = _fused("none")
    # The children's weights are never put in place: the fused kernel meets their sharded
    # DTensors (before parameters were DTensors outside forward, it read released storage).
    assert r["error"] is not None and "DTensor" in r["error"], r
    assert r["losses"] == []  # the first forward already fails: the weights were never gathered


@pytest.mark.parametrize("mode", ["sequential", "replay", "recursive"])
def test_fused_experts_with_replay_or_recursive_gather_match_reference(mode):
    ref, got = _fused("reference"), _fused(mode)
    assert got["error"] is None, got["error"]
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=0)
    torch.testing.assert_close(got["fc1"], ref["fc1"], atol=TOL, rtol=0)
    torch.testing.assert_close(got["fc2"], ref["fc2"], atol=TOL, rtol=0)


@pytest.mark.parametrize("hook_mode", ["replay", "none"])
def test_fused_experts_replay_hooks_of_both_signatures(hook_mode):
    """Pre-hooks and forward hooks registered with and without ``with_kwargs`` on the children all
    run (in registration order) around the fused computation, and a forward hook's return value
    replaces the output; with ``hook_mode="none"`` none of them runs."""
    from mfsdp.moe.experts import FusedExperts

    torch.manual_seed(0)
    experts = FusedExperts(3, 4, 6, hook_mode=hook_mode)
    calls = []
    fc1, fc2 = experts.linear_fc1, experts.linear_fc2
    fc1.register_forward_pre_hook(lambda m, a: calls.append(("pre", a[0].shape[0])))
    fc1.register_forward_pre_hook(lambda m, a, k: calls.append(("pre_kw", type(k).__name__)),
                                  with_kwargs=True)
    fc2.register_forward_hook(lambda m, a, out: calls.append(("post", out.shape)))
    fc2.register_forward_hook(lambda m, a, k, out: out * 2, with_kwargs=True)
    x = torch.randn(5, 4)
    out = experts(x, [2, 0, 3])
    plain = experts._fused(x, [2, 0, 3])
    if hook_mode == "none":
        assert calls == []
        torch.testing.assert_close(out, plain)
    else:
        assert calls == [("pre", 5), ("pre_kw", "dict"), ("post", torch.Size([5, 4]))]
        torch.testing.assert_close(out, 2 * plain)  # the with_kwargs forward hook's result


# ---- router (single process) ----

def test_aux_loss_hand_computed():
    # 4 tokens, 2 experts, top-1: expert 0 gets 3 tokens, expert 1 one.
    scores = torch.tensor([[0.75, 0.25], [0.75, 0.25], [0.75, 0.25], [0.25, 0.75]])
    routing = scores == scores.max(1, keepdim=True).values
    # f = [3/4, 1/4], P = [5/8, 3/8]; E * sum f*P = 2 * (15/32 + 3/32) = 9/8
    assert aux_loss(scores, routing, topk=1).item() == pytest.approx(9 / 8)


def test_z_loss_hand_computed():
    logits = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    lse = torch.log(torch.tensor(2.0))
    expected = ((lse ** 2 + (1 + lse) ** 2) / 2).item()
    assert z_loss(logits).item() == pytest.approx(expected)


def test_router_losses_are_weighted_by_their_coefficients():
    router = TopKRouter(4, 4, topk=2, aux_loss_coeff=0.5, z_loss_coeff=0.25)
    x = torch.randn(6, 4)
    router(x)
    logits = x @ router.weight.t()
    probs = torch.softmax(logits, -1)
    _, routing = topk_routing(logits, 2)
    assert router.losses["aux"].item() == pytest.approx(0.5 * aux_loss(probs, routing, 2).item())
    assert router.losses["z"].item() == pytest.approx(0.25 * z_loss(logits).item())


def test_capacity_dropping_keeps_exactly_the_documented_tokens():
    # Expert 0 is chosen by all five tokens; capacity 2.
    probs = torch.tensor([[0.1, 0], [0.5, 0], [0.3, 0], [0.9, 0], [0.2, 0]])
    routing = probs > 0
    by_prob = capacity_mask(probs, routing, 2, "probs")
    by_pos = capacity_mask(probs, routing, 2, "position")
    assert by_prob[:, 0].nonzero().flatten().tolist() == [1, 3]  # the two largest weights
    assert by_pos[:, 0].nonzero().flatten().tolist() == [0, 1]  # the first two tokens
    assert not by_prob[:, 1].any() and not by_pos[:, 1].any()
    padded = capacity_mask(probs, routing, 2, "probs", pad_to_capacity=True)
    assert padded.sum(0).tolist() == [2, 2]  # every expert exactly at capacity


def test_router_with_capacity_factor_zeroes_dropped_weights():
    router = TopKRouter(4, 2, topk=1, capacity_factor=0.5)
    probs, routing = router(torch.randn(8, 4))
    assert routing.sum(0).max() <= 2  # ceil(8 * 1 / 2 * 0.5)
    assert (probs[~routing] == 0).all()


def test_group_limited_routing_stays_inside_the_chosen_groups():
    torch.manual_seed(0)
    logits = torch.randn(200, 16)
    bias = torch.randn(16) * 0.1
    probs, routing = topk_routing(logits, topk=4, score_func="sigmoid", num_groups=4,
                                  group_topk=2, expert_bias=bias)
    scores = torch.sigmoid(logits) + bias
    group_score = scores.view(200, 4, 4).topk(2, dim=-1).values.sum(-1)
    chosen = torch.zeros(200, 4, dtype=torch.bool).scatter_(1, group_score.topk(2, -1).indices, True)
    used_groups = routing.view(200, 4, 4).any(-1)
    assert not (used_groups & ~chosen).any()
    assert (routing.sum(1) == 4).all()
    torch.testing.assert_close(probs.sum(1), torch.ones(200))  # sigmoid weights normalised


@pytest.mark.parametrize("kwargs, message", [
    (dict(topk=5), "moe_router_topk=5"),
    (dict(topk=2, num_groups=3, group_topk=1), "num_groups=3 does not divide"),
    (dict(topk=1, score_func="relu"), "score_func='relu'"),
])
def test_router_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MoELayer(dim=4, ffn=8, num_experts=4, **kwargs)


def test_dispatcher_errors():
    with pytest.raises(ValueError, match="moe_token_dispatcher_type='ring'"):
        make_dispatcher("ring", 4)
    with pytest.raises(ValueError, match="moe_flex_dispatcher_backend='hybridep'"):
        make_dispatcher("flex", 4, backend="hybridep")
    try:
        import deep_ep  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="needs the deep_ep package"):
            make_dispatcher("flex", 4, backend="deepep")


def test_permute_unpermute_round_trip():
    torch.manual_seed(0)
    x = torch.randn(9, 3)
    probs, routing = topk_routing(torch.randn(9, 4), topk=2)
    rows, index = permute(x, routing)
    assert rows.shape[0] == 18
    back = unpermute(rows, index, None, None, 9)
    torch.testing.assert_close(back, 2 * x)  # each token came back from its two experts


# ---- THD ----

@pytest.mark.parametrize("preset", ["gpt-tiny", "deepseek-proxy"])
def test_packed_sequences_match_one_by_one(preset):
    torch.manual_seed(0)
    model = GPT(GPT_PRESETS[preset])
    seqs = [torch.randint(0, 256, (n,)) for n in (5, 17, 1, 9)]
    tokens, cu = pack_sequences(seqs)
    packed = model(tokens, cu)
    one_by_one = torch.cat([model(s) for s in seqs])
    torch.testing.assert_close(packed, one_by_one, atol=1e-5, rtol=1e-5)


def test_gpt_config_errors():
    with pytest.raises(ValueError, match="not divisible by num_attention_heads"):
        GPTConfig(hidden_size=10, num_attention_heads=4)
    with pytest.raises(ValueError, match="unknown GPTConfig keys"):
        GPTConfig.from_dict({"hidden": 3})
