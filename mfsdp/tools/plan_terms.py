"""The planner's terms that follow the engine's layout: the shard padding of its buckets, the
FSDP traffic of a step on its schedule, and the activation estimate (:mod:`mfsdp.tools.plan`
adds them up; ``mfsdp plan --dry-run`` checks the first two against the engine itself)."""

from __future__ import annotations

import math

__all__ = ["padding", "padded_units", "fsdp_traffic", "layer_activations", "te_layer_activations",
           "te_outside_layers", "activations", "logits", "logits_grad", "TRANSFORMER_IMPLS"]

TRANSFORMER_IMPLS = ("local", "transformer_engine")
"""The layers the activation and loss terms model, by Megatron-LM's ``--transformer-impl``
names: ``local``, mfsdp train's own layer and loss (measured), and ``transformer_engine``,
Megatron-LM's Transformer Engine layer and fused loss (Megatron-LM's own estimate)."""


def layer_activations(model: mfsdp.tools.plan.ModelConfig,  # noqa: F821
                      layout: mfsdp.tools.plan.Layout) -> float:  # noqa: F821
    """Bytes one of the trainer's Llama layers (:class:`~mfsdp.models.gpt.TransformerLayer`:
    RMSNorm, RoPE, grouped-query attention through SDPA's flash kernel, SwiGLU, no biases, no
    dropout) keeps for backward in bf16, for one rank's ``s = seq_length / cp`` tokens of a
    micro-batch of ``b`` sequences, measured op by op (:mod:`mfsdp.testing.layer_bytes`).

    Per token, with ``q = heads x head_dim``, ``kv = kv_heads x head_dim``, ``d = head_dim``,
    ``a = heads`` and ``f = ffn_hidden``:

    * each RMSNorm keeps its fp32 input (``4 h``), its bf16 normalised output (``2 h``) and the
      fp32 reciprocal root (4): ``12 h + 8`` for the two;
    * ``linear_qkv`` and ``linear_fc1`` keep their inputs, the norms' outputs: ``4 h``;
    * attention keeps ``linear_qkv``'s output whole (RoPE and SDPA hold views of it,
      ``2 q + 4 kv``), then what RoPE and SDPA add, ``4 q + 2 kv`` (rotated queries and keys,
      a rotate-half copy, the attention output; the split among them is read off the code,
      the sum is measured) and SDPA's fp32 log-sum-exp (``4 a``): ``6 q + 6 kv + 4 a`` in
      all; RoPE's bf16 cos and sin, cast per call for ``q`` and for ``k``, add ``8 d``;
    * the SwiGLU MLP keeps ``linear_fc1``'s output (gate and up, ``4 f``), SiLU's output
      (``2 f``) and their product, ``linear_fc2``'s input (``2 f``): ``8 f``.

    That is ``s b (16 h + 6 q + 6 kv + 8 f + 4 a + 8 d + 8)``: 51.8 bytes per token and
    channel for Llama 3 8B, where Korthikanti et al. (2022) count 34 for a GPT layer. Under
    TP the widths ``q``, ``kv``, ``f`` and heads are split over the ``t`` ranks; the ``h``
    terms too with sequence parallelism, else every rank keeps them whole; the ``d`` term
    stays whole. No term grows with ``s^2`` (flash attention).
    """
    s, b, h, t = layout.seq_length // layout.cp, layout.micro_batch, model.hidden, layout.tp
    d = model.head_dim or h // model.num_heads
    q, kv = model.num_heads * d, (model.num_kv_heads or model.num_heads) * d
    whole = 16 * h + 8
    split = 6 * q + 6 * kv + 8 * model.ffn_hidden + 4 * model.num_heads
    return s * b * ((whole / t if layout.sequence_parallel else whole) + split / t + 8 * d)


def te_layer_activations(model: mfsdp.tools.plan.ModelConfig,  # noqa: F821
                         layout: mfsdp.tools.plan.Layout) -> float:  # noqa: F821
    """Bytes one Megatron-LM Transformer Engine layer keeps for backward, by Megatron-LM's own
    estimate (``compute_activation_memory`` in ``megatron/training/theoretical_memory_usage.py``,
    NVIDIA/Megatron-LM at d98e8a64): ``s b h (18 + 4 f / h)`` for one rank's
    ``s = seq_length / cp`` tokens, all of it split over the ``t`` TP ranks with sequence
    parallelism. It is Korthikanti et al.'s (2022, Table 2) ``34 s b h`` for a GPT layer with
    selective recomputation or flash attention, its MLP's ``16 s b h`` written ``4 s b f``.
    Without sequence parallelism their split applies: norm inputs, the layer inputs of
    attention and MLP and the dropout masks, ``10 h``, stay whole on every TP rank, the rest,
    ``8 h + 4 f``, is split.

    Read off Transformer Engine's modules, a Llama layer keeps less and differently: the
    ``LayerNormLinear`` before attention and the ``LayerNormMLP`` each keep their bf16 input and
    normalised output (``8 h`` for the two), flash attention its rotated queries and keys, the
    values and its output (``4 q + 2 kv``, ``2 kv`` more when RoPE is not fused), the MLP its
    ``fc1`` output and the SwiGLU product (``6 f``), plus fp32 norm and log-sum-exp statistics.
    For Llama 3 8B that is 33.5 bytes per token and channel against the estimate's 32.0 (and
    the local layer's 51.8); 33.2 against 32.0 for 70B, 31.6 against 31.0 for 405B. No
    dropout mask is kept, and the estimate's ``4 f`` stands for the ``6 f`` a SwiGLU MLP
    keeps. The planner uses the estimate, as Megatron-LM reports it.
    """
    s, b, h, t = layout.seq_length // layout.cp, layout.micro_batch, model.hidden, layout.tp
    if layout.sequence_parallel:
        return s * b * (18 * h + 4 * model.ffn_hidden) / t
    return s * b * (10 * h + (8 * h + 4 * model.ffn_hidden) / t)


def te_outside_layers(model: mfsdp.tools.plan.ModelConfig,  # noqa: F821
                      layout: mfsdp.tools.plan.Layout) -> float:  # noqa: F821
    """Activation bytes of a Transformer Engine model outside its layers, by the same upstream
    estimate: the embedding's input token ids (``8 s b``), its dropout mask (``s b h``) and the
    output layer's input (``4 s b h``), split over TP as upstream splits them (with sequence
    parallelism; whole on every TP rank without it)."""
    s, b, h = layout.seq_length // layout.cp, layout.micro_batch, model.hidden
    return s * b * (8 + 5 * h) / (layout.tp if layout.sequence_parallel else 1)


def activations(model: mfsdp.tools.plan.ModelConfig,  # noqa: F821
                layout: mfsdp.tools.plan.Layout) -> float:  # noqa: F821
    """Activation bytes of one micro-batch in bf16, for all of the model's layers.

    Grouped-query (Llama) layers: :func:`layer_activations`, measured on the trainer's layer,
    or with ``layout.transformer_impl == "transformer_engine"`` :func:`te_layer_activations`,
    Megatron-LM's estimate, plus what that estimate counts outside the layers
    (:func:`te_outside_layers`). Multi-head latent attention (DeepSeek) layers keep Korthikanti
    et al.'s (2022) GPT estimate under either, per layer ``s b h (34 + 5 a s / h)`` bytes (the
    second term vanishes with flash attention or selective recomputation): Megatron-LM's
    estimate models neither latent attention nor top-k routing. Routed experts add ``topk - 1``
    more copies of a SwiGLU MLP's ``3 f`` bf16 activations per token. Full recomputation keeps
    ``2 s b h`` per recomputed chunk's input plus one chunk's activations while it is
    recomputed (uniform), or ``2 s b h`` for each of the first ``recompute_num_layers`` layers
    (block).
    """
    s, b, h, a = layout.seq_length // layout.cp, layout.micro_batch, model.hidden, model.num_heads
    t = layout.tp
    granularity = layout.recompute_granularity or ("full" if layout.recompute else None)
    if model.mla:
        scores = 0 if layout.flash_attention or granularity == "selective" else 5 * a * s / (h * t)
        # Korthikanti et al.: 10 of the 34 bytes per token and channel (norm inputs, dropout
        # masks) stay whole on every TP rank unless sequence parallelism splits them too.
        per_layer = s * b * h * ((34 / t if layout.sequence_parallel else 10 + 24 / t) + scores)
    else:
        engine = layout.transformer_impl == "transformer_engine"
        per_layer = (te_layer_activations if engine else layer_activations)(model, layout)
        if not (layout.flash_attention or granularity == "selective"):
            per_layer += s * b * 5 * a * s / t  # scores, softmax and its dropout mask kept
    if model.num_experts:  # routed tokens: topk copies of the MLP activations
        per_layer += s * b * (model.topk - 1) * 3 * model.moe_ffn_hidden * 2
    if layout.sequence_parallel:  # the checkpointed layer inputs are sequence shards too
        s = s // t
    L = model.num_layers
    engine = layout.transformer_impl == "transformer_engine"
    outside = te_outside_layers(model, layout) if engine else 0.0
    if granularity != "full":
        return L * per_layer + outside
    n = min(layout.recompute_num_layers, L)
    if layout.recompute_method == "block":  # the first n layers keep only their input
        return n * 2 * s * b * h + (L - n) * per_layer + outside
    # uniform: every chunk keeps its input; one chunk is recomputed at a time
    return math.ceil(L / n) * 2 * s * b * h + n * per_layer + outside


LOSS_BYTES = {"whole": 12, "vocab_parallel": 16}
"""Bytes per logit (``s b v / t`` of them) the trainer's loss holds at its peak, measured
(:mod:`mfsdp.testing.loss_peak`, ``tests/test_loss_peak.py``): ``F.cross_entropy`` of whole
logits (TP 1), and of logits split over TP ranks (``loss_parallel``)."""


def logits(model: mfsdp.tools.plan.ModelConfig,  # noqa: F821
           layout: mfsdp.tools.plan.Layout) -> float:  # noqa: F821
    """Bytes the trainer's loss holds at its peak, ``12 s b v`` (TP 1) or ``16 s b v / t`` (TP
    ``t``), for one rank's ``s = seq_length / cp`` tokens and its ``v / t`` vocabulary columns.

    The loss (``F.cross_entropy`` of the float32 logits) keeps its float32 log-probabilities for
    backward, ``4 s b v / t`` (Korthikanti et al., 2022, section 4.3). Its peak comes in its
    backward, with every layer's activations still held: ``nll_loss``'s backward writes a dense
    float32 gradient of the log-probabilities and ``log_softmax``'s backward a float32 gradient
    of the logits beside them, ``8 s b v`` more. Under TP, PyTorch's ``loss_parallel`` keeps
    two float32 copies for backward and writes two, ``16 s b v / t``. Both coefficients
    (:data:`LOSS_BYTES`) are measured: one step of the trainer's model under a live-storage
    tracker (``tests/test_loss_peak.py``, at two vocabulary sizes and sequence lengths).
    Megatron-LM's vocabulary-parallel cross-entropy computes its gradient in place of the
    softmax it keeps, about ``4 s b v / t`` at its backward, so this overcounts its loss.

    With ``layout.transformer_impl == "transformer_engine"`` the loss is Megatron-LM's and its
    bytes Megatron-LM's own estimate (``theoretical_memory_usage.py``), ``4 s b v / t``: the
    float32 softmax its cross-entropy (``tensor_parallel/cross_entropy.py``, fused or not)
    keeps for backward, where it writes the gradient in place. Not counted, as upstream does
    not: the bf16 logits beside their float32 copy while the loss's forward runs (2 more
    bytes per logit, for that moment), and the bf16 cast of the gradient at the end of its
    backward (:func:`logits_grad`). Transformer Engine's own cross-entropy (the other
    ``--cross-entropy-fusion-impl``) keeps only the bf16 logits, 2 bytes per logit."""
    s = layout.seq_length // layout.cp
    if layout.transformer_impl == "transformer_engine":
        return 4 * s * layout.micro_batch * model.vocab / layout.tp
    per_logit = LOSS_BYTES["vocab_parallel" if layout.tp > 1 else "whole"]
    return per_logit * s * layout.micro_batch * model.vocab / layout.tp


def logits_grad(model: mfsdp.tools.plan.ModelConfig,  # noqa: F821
                layout: mfsdp.tools.plan.Layout) -> float:  # noqa: F821
    """The bf16 gradient of the logits, ``2 s b v / t`` bytes, that the output layer's backward
    reads once the loss has freed the rest of its bytes: live beside the first full gradient
    buffers of the backward (:attr:`mfsdp.tools.plan.Plan.moments`).

    The same under either ``transformer_impl``: Megatron-LM's fused cross-entropy (its default
    ``--cross-entropy-fusion-impl``, ``native``, ``fusions/fused_cross_entropy.py``) writes
    the gradient over its float32 softmax and returns a bf16 cast of it; its unfused one
    returns the float32 gradient, which autograd casts to the bf16 logits' dtype; Transformer
    Engine's (the other ``--cross-entropy-fusion-impl``) writes it over the bf16 logits
    themselves. In each the output layer's backward reads 2 bytes per logit, the float32
    buffer freed with the loss's graph."""
    s = layout.seq_length // layout.cp
    return 2 * s * layout.micro_batch * model.vocab / layout.tp


def padding(model: mfsdp.tools.plan.ModelConfig,  # noqa: F821
            layout: mfsdp.tools.plan.Layout) -> tuple[float, float]:  # noqa: F821
    """(dense, expert) shard padding as a fraction of the parameters, from the engine's own bucket
    planner (:func:`mfsdp.fsdp.bucket.plan_bucket`) on the model's buckets.

    >>> from mfsdp.tools.plan import PRESETS, Layout
    >>> d, _ = padding(PRESETS["llama3-70b"], Layout(world_size=1024))
    >>> d < 0.01
    True
    """
    from mfsdp.config import ShardingStrategy

    if ShardingStrategy.parse(layout.strategy).zero_stage == 0:
        return 0.0, 0.0
    pad = {"dense": [0, 0], "expert": [0, 0]}  # [padding, numel]
    for name, (numel, padded, count) in _buckets(model, layout).items():
        kind = "expert" if name == "experts" else "dense"
        pad[kind][0] += count * (padded - numel)
        pad[kind][1] += count * numel
    return tuple(p / n if n else 0.0 for p, n in pad.values())


def padded_units(model: mfsdp.tools.plan.ModelConfig,  # noqa: F821
                 layout: mfsdp.tools.plan.Layout) -> tuple[float, float]:  # noqa: F821
    """(largest layer, root unit): the parameters one rank gathers or holds full gradients of
    for each, with the shard padding of their buckets (the engine's bucket planner; the padding
    of the unsplit shapes, applied to what one TP rank holds)."""
    from mfsdp.config import ShardingStrategy

    buckets = _buckets(model, layout)
    if ShardingStrategy.parse(layout.strategy).zero_stage == 0:
        buckets = {k: (n, n, c) for k, (n, _, c) in buckets.items()}  # whole buffers: no padding

    def padded(name: str, numel: float) -> float:
        return numel * buckets[name][1] / buckets[name][0] if name in buckets else numel

    dense, _ = model.layer_params(False)
    layers = []
    if "dense layer" in buckets and buckets["dense layer"][2]:
        layers.append(padded("dense layer", dense / layout.tp))
    if "moe layer" in buckets:
        moe, expert = model.layer_params(True)
        layers.append(padded("moe layer", moe / layout.tp)
                      + padded("experts", expert / layout.ep))
    return max(layers), padded("root", model.root_params(layout.tp))


def _buckets(model, layout) -> dict[str, tuple[int, int, int]]:
    """The model's buckets (:meth:`~mfsdp.tools.plan.ModelConfig.bucket_shapes`) as
    name -> (parameters, padded parameters, how many), cut for ``layout``'s shard groups."""
    from mfsdp.config import ShardingStrategy

    shard = layout.shard
    factor = layout.dp_outer if ShardingStrategy.parse(layout.outer_strategy).zero_stage else 1
    out = {}
    for name, (shapes, count) in model.bucket_shapes(layout.ep).items():
        n = (shard // layout.ep if name == "experts" else shard) * factor
        b = _plan_bucket(tuple(shapes), n)
        out[name] = (b.numel, b.padded_numel, count)
    return out


_BUCKET_PLANS: dict = {}


def _plan_bucket(shapes: tuple, n: int):
    from mfsdp.fsdp.bucket import plan_bucket

    if (shapes, n) not in _BUCKET_PLANS:
        _BUCKET_PLANS[(shapes, n)] = plan_bucket(list(shapes), n)
    return _BUCKET_PLANS[(shapes, n)]


def fsdp_traffic(model: mfsdp.tools.plan.ModelConfig,  # noqa: F821
                 layout: mfsdp.tools.plan.Layout, dense: float, expert: float,  # noqa: F821
                 pad_dense: float = 0.0) -> dict[str, float]:
    """Bytes one rank sends per optimizer step over the shard groups (``dp_shard``: the dense and
    the expert one) and the outer group (``dp_outer``), for ``dense`` and ``expert`` parameters
    held per TP rank and per EP rank (padded), on the engine's schedule.

    Per optimizer step of ``m`` micro-batches: ZeRO-3 all-gathers each layer for its forward and
    again for its backward, the root unit (embeddings, final norm, output layer) once, since it
    stays gathered through the backward, and reduce-scatters every micro-batch's gradients;
    ZeRO-2 reduce-scatters every micro-batch and gathers the new weights once; ZeRO-1
    reduce-scatters the accumulated gradients once and gathers once; ``no_shard`` all-reduces
    once. Gathers carry the compute dtype, reductions ``grad_comm_bytes`` (fp32 by default). The
    outer group all-reduces the reduced shard (HSDP), or reduce-scatters it and gathers the new
    weights (HFSDP); under ``no_shard`` it all-reduces every gradient again. Each collective
    sends ``(n - 1) / n`` of its bytes (a ring); the expert shard group is ``ep`` times smaller
    than the dense one. ``mfsdp plan --dry-run`` reads the same figures off the engine's
    buckets.
    """
    from mfsdp.config import ShardingStrategy

    stage = ShardingStrategy.parse(layout.strategy).zero_stage
    cb, gb = layout.compute_bytes, layout.grad_comm_bytes or layout.grad_bytes
    m, tp = layout.micro_batches, layout.tp
    n_dense, n_expert = layout.shard, layout.shard // layout.ep

    def ring(n: int) -> float:
        return (n - 1) / n

    root = (model.vocab * model.hidden * (1 if model.tied_embeddings else 2) / tp
            + model.hidden) * (1 + pad_dense)  # the root unit on one TP rank
    if stage == 0:
        sent = 2 * gb * (ring(n_dense) * dense + ring(n_expert) * expert)
    else:
        reduces = m if stage >= 2 else 1
        gathered = (m * (2 * dense - root), 2 * m * expert) if stage == 3 else (dense, expert)
        sent = (cb * (ring(n_dense) * gathered[0] + ring(n_expert) * gathered[1])
                + gb * reduces * (ring(n_dense) * dense + ring(n_expert) * expert))
    comm = {"dp_shard": sent}
    o = layout.dp_outer
    if o > 1 and not stage:  # no_shard: every gradient again over the outer group
        comm["dp_outer"] = 2 * ring(o) * gb * (dense + expert)
    elif o > 1:
        shard = dense / n_dense + expert / n_expert  # one rank's reduced gradients
        outer_sharded = ShardingStrategy.parse(layout.outer_strategy).zero_stage > 0
        comm["dp_outer"] = ring(o) * shard * ((gb + cb) if outer_sharded else 2 * gb)
    return comm
