"""The planner's time estimate: predicted step time, tokens/s per GPU and MFU for a layout.

A first-order model, stated in full so that a reader can check each term:

* **compute**: the FLOPs of a step on one GPU (``6 N`` per token for the weights, embedding
  lookup excluded, plus causal attention's ``3 s n_heads (d_qk + d_v)`` per token and layer;
  full recomputation adds the forward again) at ``efficiency`` x the GPU's dense peak. The
  efficiency is the one empirical constant, the fraction of the peak a whole step's kernels
  reach (0.4 by default: the published Llama runs ``docs/planner-accuracy.md`` compares with
  reach 0.30 to 0.37 of their precision's peak, and large dense models up to about 0.5).
* **communication**: the bytes :func:`mfsdp.tools.plan.plan` counts per group (passed in: this module
  does not import the planner, which imports it), over the links the
  group spans. Inside one NVLink domain (a node of 8 H100s, a rack of 72 GB200s) a collective
  runs at NVLink speed. A group spread over ``D`` domains with ``g`` of its ranks in each is
  priced as a two-level collective: the ``D`` ranks at the same place in their domains exchange
  ``(D - 1) / D`` of their ``1 / g`` of the data over their own NICs, then each domain completes
  it over NVLink (so only ``1 / g`` of the data crosses each GPU's NIC). Bandwidths are what
  NCCL reaches (bus bandwidth), not the links' peak.
* **overlap**: the FSDP collectives (``dp_shard``, ``dp_outer``) run beside the compute, as
  mfsdp's prefetch and bucketed reductions make them: the step takes the longer of the two. TP,
  CP and EP collectives sit on the critical path between layers and add to it.

Nothing here is measured; ``docs/planner-accuracy.md`` sets the predictions next to published
runs and says how far off they are and why.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["GPUS", "Gpu", "StepTime", "model_flops_per_token", "step_time"]


@dataclass(frozen=True)
class Gpu:
    """What the estimate needs to know about a GPU and its links."""

    name: str
    peak_tflops: float  # dense peak at the training precision (bf16 unless said otherwise)
    nvlink_gbps: float  # GB/s per GPU that NCCL's ring reaches inside an NVLink domain
    network_gbps: float  # GB/s per GPU across domains (one 400 Gb/s NIC per GPU: ~45)
    nvlink_domain: int  # GPUs that share NVLink: 8 in a DGX H100, 72 in a GB200 NVL72 rack
    efficiency: float = 0.4  # fraction of the peak the compute reaches (see the module notes)
    memory_gib: float = 80.0  # what a job may hold: mfsdp plan's --device-gib for this --gpu

    def __post_init__(self) -> None:
        for name in ("peak_tflops", "nvlink_gbps", "network_gbps", "memory_gib"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise ValueError(f"{name}={value} must be a finite number above 0")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency={self.efficiency} must be in (0, 1]: the fraction of "
                             "the peak a step's kernels reach (0.4 by default)")
        if self.nvlink_domain < 1:
            raise ValueError(f"nvlink_domain={self.nvlink_domain} must be at least 1")


GPUS = {
    # Memory: NVIDIA's figure per GPU, in GB as its spec pages give it, taken as GiB for
    # --device-gib (an 80 GB H100 reports 79.6 GiB; the 4 GiB mfsdp plan keeps spare covers
    # the difference), except the H200, whose 141 GB report as 140.4 GiB.
    # H100 SXM (NVIDIA H100 spec page): 80 GB HBM3; 989 dense bf16 TFLOP/s; NVLink 4 is 450 GB/s
    # per direction, NCCL's all-gather and reduce-scatter reach about 360 of it; a 400 Gb/s
    # ConnectX-7 per GPU, about 45 GB/s.
    "h100": Gpu("H100 SXM", 989.0, 360.0, 45.0, 8, memory_gib=80.0),
    # H200 SXM (NVIDIA H200 spec page): 141 GB HBM3e, an H100's compute (989 dense bf16
    # TFLOP/s), NVLink 4 and NICs; it reports about 140 GiB.
    "h200": Gpu("H200 SXM", 989.0, 360.0, 45.0, 8, memory_gib=140.0),
    # GB200 (NVIDIA GB200 NVL72 spec page): 186 GB HBM3e per GPU (13.4 TB over the rack's 72);
    # 2,500 dense bf16 TFLOP/s per GPU; NVLink 5 is 900 GB/s per direction over the 72-GPU rack
    # (about 720 reached); a 400 Gb/s NIC per GPU between racks.
    "gb200": Gpu("GB200", 2500.0, 720.0, 45.0, 72, memory_gib=186.0),
    # GB300 (NVIDIA GB300 NVL72 datasheet): 279 GB HBM3e per GPU (20.1 TB over the rack's 72;
    # the Blackwell Ultra chip carries 288 GB, the figure often quoted); the same dense bf16
    # and FP8 peak per GPU as GB200 (its gain is FP4), NVLink 5 over the 72-GPU rack; an
    # 800 Gb/s ConnectX-8 NIC per GPU.
    "gb300": Gpu("GB300", 2500.0, 720.0, 90.0, 72, memory_gib=279.0),
}
"""``mfsdp plan --gpu``'s choices: each GPU's peak, links and memory (``--device-gib``'s
default)."""


def model_flops_per_token(model, seq_length: int,
                          recompute_full: float = False) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of training on one token of a ``seq_length`` sequence:
    ``6 N`` over the parameters a token uses (each MoE layer's top-k routed experts, not all of
    them; the embedding lookup is no matmul) plus causal attention. Hardware FLOPs add a second
    forward under full recomputation (model FLOPs, which MFU counts, do not); a number between
    0 and 1 for ``recompute_full`` is the fraction of layers recomputed (block recomputation of
    the first layers), and adds that fraction of a forward."""
    dense, expert = model.param_counts()
    active = dense - model.vocab * model.hidden  # the input embedding is a lookup
    if model.num_experts:
        active += expert * model.topk / model.num_experts
    if model.mla:
        _, _, nope, rope, v = model.mla
        d_qk, d_v = nope + rope, v
    else:
        d_qk = d_v = model.head_dim or model.hidden // model.num_heads
    attention = 3 * seq_length * model.num_heads * (d_qk + d_v) * model.num_layers
    flops = 6 * active + attention
    return flops, flops + float(recompute_full) * (2 * active + attention / 3)


@dataclass
class StepTime:
    """A predicted optimizer step (seconds), with its parts and what follows from it."""

    compute_s: float
    comm_s: dict  # group -> seconds its traffic takes on its link
    links: dict  # group -> "NVLink" or "network"
    step_s: float
    tokens_per_gpu_s: float
    model_tflops_per_gpu: float
    mfu: float

    def summary(self) -> str:
        """Two lines: the parts, then the prediction."""
        comm = ", ".join(f"{g} {t:.2f} s ({self.links[g]})" for g, t in self.comm_s.items())
        return (f"time: compute {self.compute_s:.2f} s; communication {comm or 'none'}\n"
                f"predicted step {self.step_s:.2f} s: {self.tokens_per_gpu_s:,.0f} tokens/s per "
                f"GPU, {self.model_tflops_per_gpu:,.0f} model TFLOP/s per GPU, MFU "
                f"{100 * self.mfu:.1f}%")


def _seconds(sent: float, n: int, span: int, gpu: Gpu) -> tuple[float, str]:
    """(seconds, links) of ``sent`` ring bytes in a group of ``n`` ranks spread evenly over
    ``span`` consecutive GPUs (see the module notes)."""
    if n <= 1 or not sent:
        return 0.0, "none"
    domains = min(n, -(-span // gpu.nvlink_domain))
    g = n // domains  # the group's ranks in one domain
    size = sent * n / (n - 1)  # the data the collectives move, from the ring's bytes
    t = size * (g - 1) / g / (gpu.nvlink_gbps * 1e9)
    t += size * (domains - 1) / (domains * g) / (gpu.network_gbps * 1e9)
    links = "NVLink" if domains == 1 else ("network" if g == 1 else "NVLink + network")
    return t, links


def step_time(model, layout, sent: dict, gpu: Gpu | str = "h100", **overrides) -> StepTime:
    """Predict one optimizer step of ``model`` (a :class:`mfsdp.tools.plan.ModelConfig`) under
    ``layout`` (a :class:`mfsdp.tools.plan.Layout`) whose groups send ``sent`` (bytes per rank and
    step by group: ``plan(model, layout).comm``) on ``gpu`` (a key of ``GPUS`` or a
    :class:`mfsdp.tools.plan_time.Gpu`; ``overrides`` replace its fields, e.g. ``peak_tflops=1979``
    for FP8). :func:`mfsdp.tools.plan.estimate` does both steps.

    >>> from mfsdp.tools.plan import PRESETS, Layout, plan
    >>> model = PRESETS["llama3-8b"]
    >>> layout = Layout(world_size=8, seq_length=8192, micro_batch=2)
    >>> t = step_time(model, layout, plan(model, layout).comm)
    >>> round(t.compute_s, 2), t.links["dp_shard"], round(100 * t.mfu)
    (2.13, 'NVLink', 40)
    """
    gpu = replace(GPUS[gpu] if isinstance(gpu, str) else gpu, **overrides)
    granularity = layout.recompute_granularity or ("full" if layout.recompute else None)
    recomputed = 0.0
    if granularity == "full":  # uniform recomputes every layer; block only the first n
        recomputed = (min(layout.recompute_num_layers, model.num_layers) / model.num_layers
                      if layout.recompute_method == "block" else 1.0)
    model_flops, hw_flops = model_flops_per_token(model, layout.seq_length, recomputed)
    dp = layout.world_size // (layout.tp * layout.cp)
    tokens = layout.micro_batch * layout.micro_batches * dp * layout.seq_length  # per step
    compute = hw_flops * tokens / layout.world_size / (gpu.peak_tflops * 1e12 * gpu.efficiency)
    # Ranks are ordered TP fastest, then CP, then DP (Megatron-LM's order): a TP group is tp
    # consecutive GPUs, a CP group spans cp x tp, a shard group (dp x cp) spans world / dp_outer,
    # an EP group (inside the shard group, TP fastest) spans ep x tp.
    groups = {"tp": (layout.tp, layout.tp), "cp": (layout.cp, layout.cp * layout.tp),
              "ep": (layout.ep, layout.ep * layout.tp),
              "dp_shard": (layout.shard, layout.world_size // layout.dp_outer),
              "dp_outer": (layout.dp_outer, layout.world_size)}
    timed = {g: _seconds(b, *groups[g], gpu) for g, b in sent.items()}
    comm = {g: t for g, (t, _) in timed.items()}
    links = {g: link for g, (_, link) in timed.items()}
    overlapped = comm.get("dp_shard", 0.0) + comm.get("dp_outer", 0.0)
    exposed = sum(t for g, t in comm.items() if g not in ("dp_shard", "dp_outer"))
    step = max(compute, overlapped) + exposed
    per_gpu = model_flops * tokens / layout.world_size / step
    return StepTime(compute, comm, links, step, tokens / layout.world_size / step, per_gpu / 1e12,
                    per_gpu / (gpu.peak_tflops * 1e12))
