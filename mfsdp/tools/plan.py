"""Memory and communication planner: will this model fit, and what does a step move?

``mfsdp plan`` (or :func:`plan`) estimates, per rank, the bytes of each kind of state (compute
weights, main weights, gradients, optimizer state; the gathered weights and full gradient buffers
of a step at their peak; activations and the loss's bytes at its peak) and the bytes each group
moves per step, for a model and a layout. The state terms follow the engine exactly and the peak
buffers are the bounds the engine keeps to (both checked against measured runs in the tests);
activations count what the trainer's own layer keeps for backward, op by op
(``tests/test_layer_bytes.py``), and the loss's bytes (``logits``) a coefficient measured on a
real step (``tests/test_loss_peak.py``). For a Megatron-LM job with Transformer Engine layers
(``Layout(transformer_impl="transformer_engine")``) both follow Megatron-LM's own estimate
instead (``mfsdp.tools.plan_terms``). The total is the larger of the step's two candidate
peaks (:attr:`Plan.moments`).

>>> p = plan(PRESETS["llama3-8b"], Layout(world_size=8, strategy="optim_grads_params"))
>>> round(p.params / 1e9, 2), p.dominant, round(p.total / GiB, 1)
(8.03, 'activations', 52.8)
>>> engine = Layout(world_size=8, transformer_impl="transformer_engine")
>>> round(plan(PRESETS["llama3-8b"], engine).total / GiB, 1)
43.0
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from mfsdp.tools.plan_terms import (TRANSFORMER_IMPLS, activations, fsdp_traffic, logits,
                                    logits_grad, padded_units, padding)
from mfsdp.tools.plan_time import step_time

__all__ = ["ModelConfig", "Layout", "Plan", "PRESETS", "plan", "padding", "state_bytes",
           "fsdp_traffic",
           "smallest_world", "smallest_layout", "with_global_batch", "tp_dense", "estimate",
           "peak_buffers"]

GiB = 2**30


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer, dense or mixture-of-experts (SwiGLU MLPs)."""

    num_layers: int
    hidden: int
    ffn_hidden: int
    num_heads: int
    vocab: int
    num_kv_heads: int | None = None  # grouped-query attention; None = num_heads
    tied_embeddings: bool = False
    num_experts: int = 0  # routed experts per MoE layer (0: dense model)
    moe_ffn_hidden: int = 0
    shared_expert_ffn_hidden: int = 0
    topk: int = 1
    first_dense_layers: int = 0  # leading layers with a dense MLP in an MoE model
    mla: tuple[int, int, int, int, int] | None = None
    """Multi-head latent attention ranks (q_lora, kv_lora, qk_nope, qk_rope, v_head)."""
    head_dim: int | None = None  # None: hidden / num_heads
    qkv_bias: bool = False
    qk_norm: bool = False
    shared_expert_gate: bool = False

    @classmethod
    def from_gpt(cls, cfg) -> "ModelConfig":
        """The planner's view of a :class:`~mfsdp.models.gpt.GPTConfig` (SwiGLU, no linear
        biases, RMSNorm, RoPE: the Llama and DeepSeek families), so that both count the same
        parameters; any other architecture is a ``ValueError`` naming the flags that make it
        one the planner models."""
        problems = [what for bad, what in (
            (not cfg.swiglu, "GELU MLPs (--swiglu)"),
            (cfg.add_bias_linear, "linear biases (--disable-bias-linear)"),
            (cfg.normalization != "RMSNorm", f"{cfg.normalization} (--normalization RMSNorm)"),
            (cfg.position_embedding_type == "learned_absolute",
             "learned positions (--position-embedding-type rope)")) if bad]
        if problems:
            raise ValueError("the planner models the Llama and DeepSeek families (SwiGLU MLPs "
                             "without linear biases, RMSNorm, RoPE); this model has "
                             + ", ".join(problems) + ": add those flags, or start from a "
                             "Llama or DeepSeek preset")
        mla = None
        if cfg.multi_latent_attention:
            mla = (cfg.q_lora_rank or 0, cfg.kv_lora_rank, cfg.qk_head_dim,
                   cfg.qk_pos_emb_head_dim, cfg.v_head_dim)
        return cls(cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_attention_heads,
                   cfg.vocab_size, num_kv_heads=cfg.num_query_groups,
                   tied_embeddings=cfg.share_embeddings_and_output_weights,
                   num_experts=cfg.num_experts,
                   moe_ffn_hidden=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
                   shared_expert_ffn_hidden=cfg.moe_shared_expert_intermediate_size,
                   topk=cfg.moe_router_topk, first_dense_layers=cfg.moe_first_dense_layers,
                   mla=mla, head_dim=cfg.kv_channels, qkv_bias=cfg.add_qkv_bias,
                   qk_norm=cfg.qk_layernorm, shared_expert_gate=cfg.moe_shared_expert_gate)

    def attention_params(self) -> int:
        h = self.hidden
        if self.mla:
            q_lora, kv_lora, nope, rope, v = self.mla
            heads = self.num_heads
            q = (h * q_lora + q_lora + q_lora * heads * (nope + rope) if q_lora
                 else h * heads * (nope + rope))  # down, norm, up (or one projection)
            return (q + h * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v)
                    + heads * v * h)
        head = self.head_dim or h // self.num_heads
        kv = self.num_kv_heads or self.num_heads
        q = self.num_heads * head
        out = h * q + 2 * h * kv * head + q * h
        if self.qkv_bias:
            out += q + 2 * kv * head
        if self.qk_norm:
            out += 2 * head
        return out

    def layer_params(self, moe: bool) -> tuple[int, int]:
        """(dense, expert) parameters of one layer."""
        dense = self.attention_params() + 2 * self.hidden  # + two norms
        if not moe:
            return dense + 3 * self.hidden * self.ffn_hidden, 0
        dense += self.hidden * self.num_experts + 3 * self.hidden * self.shared_expert_ffn_hidden
        dense += self.hidden if self.shared_expert_gate else 0
        return dense, self.num_experts * 3 * self.hidden * self.moe_ffn_hidden

    def bucket_shapes(self, ep: int = 1) -> dict[str, tuple[list[tuple[int, ...]], int]]:
        """The engine's buckets for this model: name -> (parameter shapes, how many such buckets).

        One bucket per dense layer, per MoE layer's dense part and per MoE layer's local experts
        (``num_experts / ep`` of them), and the root (embeddings, final norm, head).
        """
        h, heads = self.hidden, self.num_heads
        if self.mla:
            q_lora, kv_lora, nope, rope, v = self.mla
            attn = [(q_lora, h), (heads * (nope + rope), q_lora), (kv_lora + rope, h),
                    (heads * (nope + v), kv_lora), (h, heads * v)]
        else:
            head, kv = h // heads, self.num_kv_heads or heads
            attn = [(h, h), (kv * head, h), (kv * head, h), (h, h)]
        norms = [(h,), (h,)]
        moe_layers = self.num_layers - self.first_dense_layers if self.num_experts else 0
        out = {"dense layer": (attn + [(self.ffn_hidden, h)] * 2 + [(h, self.ffn_hidden)] + norms,
                               self.num_layers - moe_layers)}
        if moe_layers:
            shared = self.shared_expert_ffn_hidden
            out["moe layer"] = (attn + [(self.num_experts, h)] + norms
                                + ([(shared, h)] * 2 + [(h, shared)] if shared else []), moe_layers)
            local = self.num_experts // ep
            out["experts"] = ([(self.moe_ffn_hidden, h)] * 2 * local
                              + [(h, self.moe_ffn_hidden)] * local, moe_layers)
        out["root"] = ([(self.vocab, h)] * (1 if self.tied_embeddings else 2) + [(h,)], 1)
        return out

    def root_params(self, tp: int = 1) -> float:
        """Parameters of the root unit on one TP rank: the embedding and the output layer (one
        matrix when tied), split over TP by vocabulary, and the final norm, whole."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) / tp + self.hidden

    def tp_replicated_params(self) -> int:
        """Dense parameters that Megatron-LM's tensor parallelism keeps whole on every TP rank:
        norms, routers, shared-expert gates and query/key norms. Everything else dense (attention
        and MLP projections, shared experts, vocabulary-parallel embedding and output layer) is
        split ``tp`` ways; routed experts are split over EP instead (expert TP size 1)."""
        h = self.hidden
        moe_layers = self.num_layers - self.first_dense_layers if self.num_experts else 0
        per_layer = 2 * h + (2 * (self.head_dim or h // self.num_heads) if self.qk_norm else 0)
        if self.mla:
            per_layer += self.mla[0] + self.mla[1]  # the q and kv latent norms
        router = h * self.num_experts + (h if self.shared_expert_gate else 0)
        return self.num_layers * per_layer + moe_layers * router + h

    def param_counts(self) -> tuple[int, int]:
        """(dense, expert) parameters of the whole model."""
        moe_layers = self.num_layers - self.first_dense_layers if self.num_experts else 0
        d1, _ = self.layer_params(False)
        d2, e2 = self.layer_params(True) if moe_layers else (0, 0)
        embed = self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden
        dense = embed + (self.num_layers - moe_layers) * d1 + moe_layers * d2
        return dense, moe_layers * e2


def _presets() -> dict[str, ModelConfig]:
    from mfsdp.models.gpt import GPT_PRESETS

    out = {}
    for name, cfg in GPT_PRESETS.items():
        try:
            out[name] = ModelConfig.from_gpt(cfg)
        except ValueError:  # GPT-2-like presets: not a planner model
            pass
    return out


PRESETS: dict[str, ModelConfig] = _presets()
"""The trainer's presets (:data:`mfsdp.models.gpt.GPT_PRESETS`) the planner models: the same
definitions, so both count the same parameters."""


@dataclass(frozen=True)
class Layout:
    """How the model is trained: ranks, sharding, dtypes, batch."""

    world_size: int
    strategy: str = "optim_grads_params"
    dp_outer: int = 1
    outer_strategy: str = "no_shard"
    ep: int = 1
    compute_bytes: int = 2  # bf16
    main_bytes: int = 4  # fp32 main weights (equal to compute_bytes: one copy)
    grad_bytes: int = 4  # fp32 gradient accumulation
    optimizer_bytes: int = 8  # Adam: two fp32 moments
    # Gradient reductions (reduce-scatter, all-reduce) carry the main gradients' dtype unless
    # told otherwise: fp32 under Megatron-LM's and mfsdp train's --bf16 (2: --grad-reduce-in-bf16).
    grad_comm_bytes: int | None = None
    micro_batch: int = 1
    # Micro-batches per optimizer step on each data-parallel rank (gradient accumulation):
    # global batch = micro_batch x micro_batches x data-parallel ranks.
    micro_batches: int = 1
    seq_length: int = 4096
    prefetch_depth: int = 1
    # Gradient reductions in flight before the oldest is waited for (the engine's and
    # fully_shard's max_inflight_reduce): full gradient buffers alive at once in backward.
    max_inflight_reduce: int = 2
    recompute: bool = False  # shorthand for recompute_granularity="full", uniform, 1 layer
    recompute_granularity: str | None = None  # "full" or "selective" (Megatron-LM's names)
    recompute_method: str = "uniform"  # with full: "uniform" chunks or the first layers ("block")
    recompute_num_layers: int = 1
    flash_attention: bool = True  # no s x s attention scores kept for backward
    tp: int = 1  # tensor-parallel size (Megatron-LM's split, see ModelConfig.tp_replicated_params)
    cp: int = 1  # context-parallel size: each rank holds seq_length / cp tokens of a sequence
    sequence_parallel: bool = False  # norms and dropout on sequence shards (needs tp > 1)
    # The layer and loss the activation terms model (Megatron-LM's --transformer-impl): "local",
    # mfsdp train's (measured), or "transformer_engine", Megatron-LM's Transformer Engine layer.
    transformer_impl: str = "local"

    def __post_init__(self) -> None:
        from mfsdp.config import ShardingStrategy
        from mfsdp.layout import ParallelLayout

        ShardingStrategy.parse(self.strategy)
        ShardingStrategy.parse(self.outer_strategy, "outer_strategy")
        ParallelLayout(self.world_size, self.dp_outer, self.ep, tp=self.tp, cp=self.cp)
        for name in ("micro_batches", "micro_batch", "seq_length", "recompute_num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.prefetch_depth < 0:
            raise ValueError(f"prefetch_depth={self.prefetch_depth} must be at least 0")
        if self.max_inflight_reduce < 1:
            raise ValueError(f"max_inflight_reduce={self.max_inflight_reduce} must be at least 1")
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            raise ValueError(f"transformer_impl={self.transformer_impl!r} is not one of "
                             f"{TRANSFORMER_IMPLS} (mfsdp plan --transformer-impl); pick one")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel=True needs tp > 1 (it splits the TP region's "
                             "norms and dropout over the TP ranks)")

    @property
    def shard(self) -> int:
        """Ranks the dense parameters are sharded over (``dp x cp``)."""
        return self.world_size // (self.dp_outer * self.tp)


def state_bytes(dense: int, expert: int, layout: Layout) -> dict[str, float]:
    """Per-rank bytes of weights, main weights, gradients and optimizer state (no padding).

    ``dense`` counts what one TP rank holds (see :func:`tp_dense`). The same terms the engine
    allocates (see ``docs/sharding.md``): dense parameters are sharded
    over the shard group, expert parameters (``expert / ep`` per rank) over the expert shard
    group; under HFSDP main weights, gradients and optimizer state are also split over the outer
    dimension. Main weights take no memory of their own when their dtype is the compute dtype.
    """
    from mfsdp.config import ShardingStrategy

    stage = ShardingStrategy.parse(layout.strategy).zero_stage
    shard = layout.shard
    outer = layout.dp_outer if ShardingStrategy.parse(layout.outer_strategy).zero_stage else 1
    separate_main = layout.main_bytes != layout.compute_bytes
    out = {"weights": 0.0, "main_weights": 0.0, "grads": 0.0, "optimizer": 0.0}
    for params, n in ((dense, shard), (expert / layout.ep, shard // layout.ep)):
        owned = params if stage == 0 else params / (n * outer)  # main weights' share
        out["weights"] += params * layout.compute_bytes / (n if stage == 3 else 1)
        out["main_weights"] += owned * layout.main_bytes if separate_main else 0.0
        full_grads = params * layout.grad_bytes if stage in (0, 1) else 0.0
        out["grads"] += full_grads + (owned * layout.grad_bytes if stage else 0.0)
        out["optimizer"] += owned * layout.optimizer_bytes
    return out


@dataclass
class Plan:
    """The estimate for one model and layout (bytes per rank unless said otherwise)."""

    params: int
    dense_params: int
    expert_params: int
    memory: dict[str, float]
    comm: dict[str, float] = field(default_factory=dict)
    padding: float = 0.0
    """Shard padding of the buckets, as a fraction of the parameters (counted in ``memory``)."""
    logits_grad: float = 0.0
    """The bf16 gradient of the logits (``plan_terms.logits_grad``), live
    beside the first gradient buffers of the backward; counted in :attr:`moments`."""

    @property
    def moments(self) -> dict[str, float]:
        """Bytes per rank at the step's two candidate peaks: ``"loss"``, the start of backward
        (every term but ``grad_buffers``: no full gradient exists yet, the loss holds its
        ``logits`` bytes), and ``"backward"`` (every term but ``logits``, which the loss has
        freed, plus the logits' bf16 gradient ``logits_grad``)."""
        common = sum(v for k, v in self.memory.items() if k not in ("grad_buffers", "logits"))
        return {"loss": common + self.memory.get("logits", 0.0),
                "backward": common + self.memory.get("grad_buffers", 0.0) + self.logits_grad}

    @property
    def peak_moment(self) -> str:
        """``"loss"`` or ``"backward"``: the moment of :attr:`moments` that is the peak."""
        m = self.moments
        return "loss" if m["loss"] >= m["backward"] else "backward"

    @property
    def total(self) -> float:
        """The step's peak bytes per rank: the larger of the two :attr:`moments`."""
        return max(self.moments.values())

    @property
    def dominant(self) -> str:
        return max(self.memory, key=self.memory.get)

    def fits(self, device_gib: float = 80.0, reserve_gib: float = 4.0) -> bool:
        """Whether it fits on one device of ``device_gib``, keeping ``reserve_gib`` spare."""
        return self.total <= (device_gib - reserve_gib) * GiB

    def table(self) -> str:
        """Memory terms in GiB per rank, the total (the larger of the two :attr:`moments`, with
        a line saying which and what the other is), then the GiB each rank sends per optimizer
        step and group (a step: every micro-batch of the global batch, see :class:`Layout`)."""
        rows = [f"{'term':<14} {'GiB per rank':>12}"]
        for k, v in self.memory.items():
            rows.append(f"{k:<14} {v / GiB:12.2f}")
        rows.append(f"{'total':<14} {self.total / GiB:12.2f}")
        m, grad = self.moments, self.logits_grad / GiB
        if self.peak_moment == "loss":
            rows.append(f"  at the loss's peak (no grad_buffers yet); in backward "
                        f"{m['backward'] / GiB:.2f} ({grad:.2f} logits' grad)")
        else:
            rows.append(f"  in backward (+ {grad:.2f} logits' grad, no logits); at the loss's "
                        f"peak {m['loss'] / GiB:.2f}")
        for k, v in self.comm.items():
            rows.append(f"{'sent ' + k:<14} {v / GiB:12.2f}  (GiB per optimizer step per rank)")
        return "\n".join(rows)


def tp_dense(model: ModelConfig, dense: float, tp: int) -> float:
    """Dense parameters one TP rank holds: the split ones ``/ tp``, the replicated ones whole."""
    whole = model.tp_replicated_params()
    return (dense - whole) / tp + whole


def peak_buffers(unit: float, root: float, stage: int, layout: Layout) -> dict[str, float]:
    """The two buffers a step allocates and frees, at their peak, in bytes per rank: ``gathered``
    and ``grad_buffers``. ``unit``: the parameters of the largest layer on one rank; ``root``: the
    root unit's (embedding, final norm, output layer).

    ``gathered`` (ZeRO-3): the root unit's weights, which stay gathered from its forward through
    its backward, plus ``prefetch_depth + 1`` layers (the one computing and the ones prefetched).
    ``grad_buffers`` (ZeRO-2/3): full gradients before their reduce-scatter. The root's fill from
    the output layer's gradient, the first of the backward, to its embedding's, the last; besides
    it at most ``max_inflight_reduce`` layers wait for their reductions while one more
    accumulates. Under ZeRO-0/1 the full gradients are already in ``grads``. When the reductions
    carry another dtype (``grad_comm_bytes``), each reduction in flight holds a cast copy too.
    Both are upper bounds the engine keeps to (``tests/test_plan_peaks.py`` measures them).
    """
    cb, gb = layout.compute_bytes, layout.grad_bytes
    gathered = (root + (layout.prefetch_depth + 1) * unit) * cb if stage == 3 else 0.0
    inflight = layout.max_inflight_reduce
    grads = (root + (inflight + 1) * unit) * gb if stage >= 2 else 0.0
    comm = layout.grad_comm_bytes
    if comm is not None and comm != gb:
        grads += (root + inflight * unit) * comm
    return {"gathered": gathered, "grad_buffers": grads}


def plan(model: ModelConfig, layout: Layout) -> Plan:
    """Estimate per-rank memory and per-step communication for ``model`` under ``layout``.

    State terms count the shard padding of the engine's buckets (``padding``).
    """
    from mfsdp.config import ShardingStrategy

    dense, expert = model.param_counts()
    pad_dense, pad_expert = padding(model, layout)
    local_dense = tp_dense(model, dense, layout.tp)  # what one TP rank holds
    memory = state_bytes(local_dense * (1 + pad_dense), expert * (1 + pad_expert), layout)
    s = ShardingStrategy.parse(layout.strategy).zero_stage
    unit, root = padded_units(model, layout)  # the largest layer and the root on one rank
    memory.update(peak_buffers(unit, root, s, layout))
    memory["activations"] = activations(model, layout)
    memory["logits"] = logits(model, layout)
    comm = fsdp_traffic(model, layout, local_dense * (1 + pad_dense),
                        expert / layout.ep * (1 + pad_expert), pad_dense)
    m = layout.micro_batches
    granularity = layout.recompute_granularity or ("full" if layout.recompute else None)
    tokens_here = layout.micro_batch * layout.seq_length // layout.cp  # one rank's tokens
    act = tokens_here * model.hidden * layout.compute_bytes  # one [s, b, h] activation
    if layout.tp > 1:
        # Per layer: an all-reduce after attention and after the MLP in forward, two for the
        # input gradients in backward (with SP: all-gather + reduce-scatter, the same bytes);
        # full recomputation repeats the forward's two.
        n = 4 + (2 if granularity == "full" else 0)
        comm["tp"] = m * model.num_layers * n * 2 * (layout.tp - 1) / layout.tp * act
    if layout.cp > 1:
        # Per layer: keys and values of the other CP ranks' chunks in forward (all-gathered, as
        # Llama 3 does), their gradients reduce-scattered back in backward, again in recompute.
        head = model.head_dim or model.hidden // model.num_heads
        kv = 2 * (model.num_kv_heads or model.num_heads) * head if not model.mla else \
            2 * model.num_heads * model.mla[2]
        n = 2 + (1 if granularity == "full" else 0)
        comm["cp"] = (m * model.num_layers * n * (layout.cp - 1) * tokens_here * kv
                      * layout.compute_bytes / layout.tp)
    if layout.ep > 1 and model.num_experts:
        tokens = tokens_here
        moe_layers = model.num_layers - model.first_dense_layers
        # dispatch + combine, forward + backward, topk copies of each token
        comm["ep"] = 4 * m * moe_layers * tokens * model.topk * model.hidden * layout.compute_bytes \
            * (layout.ep - 1) / layout.ep
    return Plan(dense + expert, dense, expert, memory, comm,
                padding=(pad_dense * dense + pad_expert * expert) / (dense + expert),
                logits_grad=logits_grad(model, layout))


def estimate(model: ModelConfig, layout: Layout, gpu="h100", **overrides):
    """The time estimate of one optimizer step (:func:`mfsdp.tools.plan_time.step_time`) from this
    plan's traffic: ``estimate(PRESETS["llama3-8b"], Layout(8), "h100").tokens_per_gpu_s``."""
    return step_time(model, layout, plan(model, layout).comm, gpu, **overrides)


def _nodes(what: str, max_nodes: int, progress) -> object:
    """The node counts a search tries, ``1..max_nodes``, behind a ``tqdm`` bar on ``progress``
    (a stream: stderr for the CLI) or silently (``None``)."""
    from tqdm.auto import tqdm

    return tqdm(range(1, max_nodes + 1), desc=what, unit=" node counts", file=progress,
                disable=progress is None, leave=False, mininterval=0.5, dynamic_ncols=True)


def with_global_batch(layout: Layout, global_batch: int | None) -> Layout | None:
    """``layout`` with the micro-batches per rank that make ``global_batch`` sequences a step, or
    None when its data-parallel ranks x ``micro_batch`` do not divide it; ``layout`` itself when
    ``global_batch`` is None (no batch to keep).

    >>> with_global_batch(Layout(24, tp=2, sequence_parallel=True), 512) is None  # DP 12
    True
    >>> with_global_batch(Layout(32, tp=2, sequence_parallel=True), 512).micro_batches
    32
    """
    if global_batch is None:
        return layout
    per_step = layout.micro_batch * layout.world_size // (layout.tp * layout.cp)
    if global_batch % per_step:
        return None
    return replace(layout, micro_batches=global_batch // per_step)


def smallest_world(model: ModelConfig, layout: Layout, device_gib: float = 80.0,
                   gpus_per_node: int = 8, max_nodes: int = 4096,
                   progress=None, global_batch: int | None = None) -> int | None:
    """The smallest world size (whole nodes) on which every rank fits, or None; ``progress``: a
    stream for a ``tqdm`` bar of the node counts tried (the CLI passes stderr). With
    ``global_batch`` (sequences per step) only worlds whose data-parallel ranks x micro-batch
    divide it count (``with_global_batch``)."""
    for nodes in _nodes("smallest world", max_nodes, progress):
        world = nodes * gpus_per_node
        try:
            candidate = with_global_batch(replace(layout, world_size=world), global_batch)
        except ValueError:
            continue
        if candidate is None:
            continue
        p = plan(model, candidate)
        if p.fits(device_gib):
            return world
        if not _fits_without_state(p, device_gib):
            return None  # more ranks shrink only the state: no world size fits
    return None


def _fits_without_state(p: Plan, device_gib: float) -> bool:
    """Whether what no added data-parallel rank shrinks (gathered weights, gradient buffers and
    activations) fits."""
    kept = ("gathered", "grad_buffers", "activations")
    return replace(p, memory={k: p.memory[k] for k in kept}).fits(device_gib)


def smallest_layout(model: ModelConfig, layout: Layout, device_gib: float = 80.0,
                    gpus_per_node: int = 8, tps=(1, 2, 4, 8), cps=(1, 2, 4, 8),
                    max_nodes: int = 4096, progress=None,
                    global_batch: int | None = None) -> Layout | None:
    """The layout on the fewest whole nodes where every rank fits, searching the TP and CP sizes
    too (TP at most a node: its traffic needs NVLink); among equal worlds the least TP x CP.
    ``progress``: a stream for a ``tqdm`` bar of the node counts tried (the CLI passes stderr).
    With ``global_batch`` (sequences per step) only layouts whose data-parallel ranks x
    micro-batch divide it count (``with_global_batch``).

    >>> best = smallest_layout(PRESETS["llama3-70b"], Layout(8, seq_length=8192))
    >>> # FSDP alone fits nowhere (activations: 254 GiB)
    >>> best.world_size, best.tp, best.cp
    (32, 4, 2)
    """
    options = sorted(((tp, cp) for tp in tps for cp in cps if tp <= gpus_per_node),
                     key=lambda tc: (tc[0] * tc[1], tc[0]))
    for nodes in _nodes("smallest layout with TP/CP", max_nodes, progress):
        world = nodes * gpus_per_node
        for tp, cp in list(options):
            try:
                candidate = with_global_batch(replace(layout, world_size=world, tp=tp, cp=cp,
                                                      sequence_parallel=tp > 1), global_batch)
            except ValueError:
                continue
            if candidate is None:
                continue
            p = plan(model, candidate)
            if p.fits(device_gib):
                return candidate
            if not _fits_without_state(p, device_gib):
                options.remove((tp, cp))  # more ranks shrink only the state: never fits
        if not options:
            return None
    return None
