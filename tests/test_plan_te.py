"""``mfsdp plan --transformer-impl transformer_engine`` against Megatron-LM's own estimator, run
from its unmodified source (``tests/fixtures/upstream/theoretical_memory_usage.py``), and the
``--smallest`` margin against the layouts page's search."""

from __future__ import annotations

import argparse
import functools
import math
import sys
import types
from pathlib import Path

import pytest

from mfsdp.tools.plan import GiB, PRESETS, Layout, plan
from mfsdp.tools.plan_terms import te_layer_activations

UPSTREAM = Path(__file__).parent / "fixtures" / "upstream" / "theoretical_memory_usage.py"
DENSE = ("llama3-8b", "llama3-70b", "llama3.1-405b")


@functools.lru_cache(maxsize=None)
def upstream() -> dict:
    """The upstream file's functions, its source run as it is: its one import
    (``from .utils import is_hybrid_model, print_rank_0``) answered by a stand-in package."""
    package = types.ModuleType("_mlm_training")
    package.__path__ = []
    utils = types.ModuleType("_mlm_training.utils")
    utils.is_hybrid_model = lambda args: False
    utils.print_rank_0 = print
    saved = {k: sys.modules.get(k) for k in (package.__name__, utils.__name__)}
    sys.modules.update({package.__name__: package, utils.__name__: utils})
    try:
        namespace = {"__name__": "_mlm_training.theoretical_memory_usage",
                     "__package__": package.__name__}
        exec(compile(UPSTREAM.read_text(), str(UPSTREAM), "exec"), namespace)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k)
            else:
                sys.modules[k] = v
    return namespace


def megatron_args(name: str, layout: Layout, padded_vocab: bool = False) -> argparse.Namespace:
    """Megatron-LM's arguments for a planner preset and layout (no pipeline parallelism;
    ``seq_length`` is one CP rank's share, as the upstream estimator has no CP). Megatron-LM
    pads the vocabulary to a multiple of ``128 x TP`` (``padded_vocab``); the planner does not."""
    m = PRESETS[name]
    vocab = m.vocab
    if padded_vocab:
        vocab = math.ceil(m.vocab / (128 * layout.tp)) * 128 * layout.tp
    return argparse.Namespace(
        seq_length=layout.seq_length // layout.cp, micro_batch_size=layout.micro_batch,
        hidden_size=m.hidden, ffn_hidden_size=m.ffn_hidden, num_layers=m.num_layers,
        num_attention_heads=m.num_heads, num_query_groups=m.num_kv_heads,
        group_query_attention=True, kv_channels=m.hidden // m.num_heads,
        padded_vocab_size=vocab, tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
        sequence_parallel=layout.sequence_parallel, recompute_granularity="selective",
        num_experts=None, swiglu=True, normalization="RMSNorm", multi_latent_attention=False,
        moe_shared_expert_intermediate_size=None, moe_latent_size=None, mtp_num_layers=None,
        untie_embeddings_and_output_weights=not m.tied_embeddings, add_bias_linear=False,
        expert_tensor_parallel_size=1, expert_model_parallel_size=1,
        use_distributed_optimizer=True, world_size=layout.world_size,
        data_parallel_size=layout.world_size // (layout.tp * layout.cp))


def te_bytes(name: str, layout: Layout) -> float:
    """The planner's activation and loss bytes for ``layout`` under Transformer Engine."""
    p = plan(PRESETS[name], layout)
    return p.memory["activations"] + p.memory["logits"]


CASES = [(name, tp, seq, mb) for name in DENSE for tp in (1, 2, 4, 8)
         for seq, mb in ((4096, 1), (8192, 1), (8192, 2), (16384, 1))]


@pytest.mark.parametrize("name, tp, seq, mb", CASES)
def test_te_activations_and_loss_are_megatron_lms_estimate(name, tp, seq, mb):
    """With SP (none at TP 1), the planner's TE activations and loss are what upstream's
    ``compute_activation_memory`` says, to 1e-9 on the vocabulary the planner models, and within
    0.5% on the vocabulary Megatron-LM pads to a multiple of 128 x TP (the only term where the
    two differ: the planner counts the model's 128256 logits, not the padded 128512)."""
    layout = Layout(64, tp=tp, sequence_parallel=tp > 1, seq_length=seq, micro_batch=mb,
                    transformer_impl="transformer_engine")
    ours = te_bytes(name, layout)
    estimate = upstream()["compute_activation_memory"]
    assert ours == pytest.approx(estimate(megatron_args(name, layout), None), rel=1e-9)
    padded = estimate(megatron_args(name, layout, padded_vocab=True), None)
    assert abs(ours / padded - 1) < 0.005


@pytest.mark.parametrize("cp", [2, 4])
def test_te_context_parallelism_divides_the_sequence(cp):
    """CP ranks each hold ``seq_length / cp`` tokens: upstream's estimate of that shorter
    sequence, to 1e-9."""
    layout = Layout(64, tp=4, cp=cp, sequence_parallel=True, seq_length=16384,
                    transformer_impl="transformer_engine")
    upstream_bytes = upstream()["compute_activation_memory"](
        megatron_args("llama3-70b", layout), None)
    assert te_bytes("llama3-70b", layout) == pytest.approx(upstream_bytes, rel=1e-9)


def test_te_without_sp_splits_korthikantis_way():
    """Without SP each layer keeps Korthikanti et al.'s ``10 s b h`` whole on every TP rank and
    splits the rest: the TP 1 figure minus ``(1 - 1/t)`` of the split part, recomputed here from
    the TP 1 layer (1e-12)."""
    model = PRESETS["llama3-8b"]
    whole = te_layer_activations(model, Layout(8, transformer_impl="transformer_engine"))
    for t in (2, 4, 8):
        lay = Layout(8, tp=t, transformer_impl="transformer_engine")
        split = 4096 * (8 * model.hidden + 4 * model.ffn_hidden)
        assert te_layer_activations(model, lay) == pytest.approx(whole - split * (1 - 1 / t),
                                                                 rel=1e-12)


def test_state_terms_agree_with_megatron_lms_distributed_optimizer():
    """Not part of the TE model, but the same file's other estimate: Megatron-LM's distributed
    optimizer, ``6 + 12 / dp`` bytes per parameter of a TP rank, against the planner's ZeRO-1
    (``optim``), which also counts the engine's fp32 shard of the reduced gradients, ``4 / dp``
    more (Megatron-LM's optimizer reads its shard of the gradient buffer in place). With that
    added they agree within 0.5% (the planner's buckets' shard padding, under 0.4% here)."""
    weights = upstream()["compute_weight_and_optimizer_memory"]
    for name in DENSE:
        for tp in (1, 4, 8):
            layout = Layout(64, "optim", tp=tp, sequence_parallel=tp > 1)
            p = plan(PRESETS[name], layout)
            ours = sum(p.memory[k] for k in ("weights", "main_weights", "grads", "optimizer"))
            args = megatron_args(name, layout)
            theirs = weights(args)
            dp = args.data_parallel_size
            per_rank = theirs / (6 + 12 / dp)  # parameters on one TP rank, upstream's count
            assert abs(ours / (theirs + 4 * per_rank / dp) - 1) < 0.005, (name, tp)


def test_recomputation_and_moments_keep_their_rules_under_te():
    """Full recomputation keeps each recomputed layer's ``2 s b h`` input under TE as under the
    local layer; the output layer and embedding terms stay; the logits' gradient is the same
    ``2 s b v`` bf16 either way (exact)."""
    model, s = PRESETS["llama3-8b"], 8192
    te = dict(seq_length=s, transformer_impl="transformer_engine")
    none = plan(model, Layout(8, **te))
    full = plan(model, Layout(8, recompute_granularity="full", recompute_method="block",
                              recompute_num_layers=32, **te))
    layer = te_layer_activations(model, Layout(8, **te))
    assert none.memory["activations"] - full.memory["activations"] == pytest.approx(
        32 * (layer - 2 * s * model.hidden), rel=1e-12)
    local = plan(model, Layout(8, seq_length=s))
    assert none.logits_grad == local.logits_grad == 2 * s * model.vocab
    assert none.memory["logits"] == 4 * s * model.vocab


def test_mla_layers_keep_the_gpt_estimate_under_te():
    """DeepSeek's latent-attention MoE layers are not in upstream's estimate: TE changes only
    the terms outside the layers (embedding, output layer's input) and the loss (exact)."""
    model = PRESETS["deepseek-v3"]
    base = dict(world_size=256, ep=32, seq_length=4096)
    local = plan(model, Layout(**base))
    te = plan(model, Layout(**base, transformer_impl="transformer_engine"))
    outside = 4096 * (8 + 5 * model.hidden)
    assert te.memory["activations"] - local.memory["activations"] == pytest.approx(outside)
    assert te.memory["logits"] == 4 * 4096 * model.vocab


def test_cli_transformer_impl_lowers_the_llama3_8b_plan_and_refuses_a_bad_value(capsys):
    """``--transformer-impl transformer_engine`` lowers llama3-8b's total on 8 GPUs and says so
    in its assumptions; an unknown value is refused in one line naming the flag and choices, and
    the Python API's Layout refuses it too."""
    from mfsdp.tools.plan_cli import main

    totals = {}
    for impl in ("local", "transformer_engine"):
        main(["llama3-8b", "--world-size", "8", "--seq-length", "8192",
              "--transformer-impl", impl])
        out = capsys.readouterr().out
        totals[impl] = float(out.split("\ntotal")[1].split()[0])
        assert ("Transformer Engine layers" in out) == (impl == "transformer_engine")
    layout = dict(world_size=8, seq_length=8192)
    for impl, total in totals.items():
        expected = plan(PRESETS["llama3-8b"], Layout(**layout, transformer_impl=impl)).total
        assert total == pytest.approx(expected / GiB, abs=0.005)
    assert totals["transformer_engine"] < totals["local"]
    with pytest.raises(SystemExit) as stop:
        main(["llama3-8b", "--transformer-impl", "te"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    # argparse quotes the choices or not by Python version
    assert err[-1].startswith("mfsdp plan: error: argument --transformer-impl: invalid choice: "
                              "'te' (choose from "), err
    assert "local" in err[-1] and "transformer_engine" in err[-1], err
    with pytest.raises(ValueError, match="transformer_impl='te' is not one of"):
        Layout(8, transformer_impl="te")


def test_smallest_keeps_the_layouts_margin(capsys):
    """``--smallest`` searches with ``--margin`` (default ``TIGHT_GIB``, 5 GiB) to spare, as the
    layouts page (``plan_layouts.choose``) does: for llama3-70b at 4096 tokens on 40 GiB GPUs
    with full recomputation both answer the same world and TP x CP, with the margin and with
    ``--margin 0`` (where they differ: 40 GPUs leave under 5 GiB)."""
    from mfsdp.tools.plan_cli import TIGHT_GIB, main
    from mfsdp.tools.plan_layouts import choose

    answers = {}
    for margin in (None, 0.0):
        main(["llama3-70b", "--seq-length", "4096", "--device-gib", "40",
              "--recompute-granularity", "full", "--smallest"]
             + ([] if margin is None else ["--margin", "0"]))
        out = capsys.readouterr().out
        line = next(x for x in out.splitlines() if x.startswith("smallest with TP/CP"))
        spare = TIGHT_GIB if margin is None else margin
        c = choose("llama3-70b", 4096, 40.0, spare_gib=spare).layout
        assert line.startswith(f"smallest with TP/CP searched with {spare:g} GiB spare: "
                               f"{c.world_size} (TP {c.tp}"), (line, c)
        assert f"CP {c.cp};" in line, (line, c)
        answers[spare] = c.world_size
    assert answers[0.0] < answers[TIGHT_GIB], answers
    with pytest.raises(SystemExit, match="--margin belongs to the --smallest search"):
        main(["llama3-8b", "--margin", "2"])
    with pytest.raises(SystemExit, match="--margin 76 leaves nothing of --device-gib 80 - 4"):
        main(["llama3-8b", "--smallest", "--margin", "76"])
    assert capsys.readouterr().out == ""  # refused before any plan is printed
