"""Token dispatchers: move each token to the ranks holding its experts and bring the results back.

Every dispatcher runs the same seven stages; only :meth:`~TokenDispatcher.token_dispatch` and
:meth:`~TokenDispatcher.token_combine` communicate::

    dispatch_preprocess -> token_dispatch -> dispatch_postprocess -> experts
        -> combine_preprocess -> token_combine -> combine_postprocess

* ``allgather``: every rank gathers all tokens of the EP group with their routing, computes its
  local experts on the tokens routed to them, and a reduce-scatter returns the weighted sums.
* ``alltoall``: each (token, expert) pair travels to the expert's rank only (variable splits).
* ``flex``: a backend chosen by name. ``torch`` is a static-shape implementation on
  ``torch.distributed``: every rank pads its tokens to the same count (MAX over the EP group,
  rounded up to a multiple of 64, padded rows route nowhere), exchanges fixed-size per-rank slots
  and trims back after the combine. ``deepep`` uses the DeepEP library's fused kernels on GPUs.

>>> make_dispatcher("alltoall", num_experts=4).num_local_experts
4
>>> make_dispatcher("flex", num_experts=4, backend="nccl")
Traceback (most recent call last):
...
ValueError: moe_flex_dispatcher_backend='nccl': choose one of ('torch', 'deepep')
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from mfsdp.moe.comm import all_gather_v, all_to_all_v, gather_sizes, reduce_scatter_v
from mfsdp.moe.permute import permute, sort_chunks_by_index, unpermute

__all__ = ["AllGatherDispatcher", "AllToAllDispatcher", "DISPATCHERS", "DeepEPFlexDispatcher",
           "FLEX_BACKENDS", "TokenDispatcher", "TorchFlexDispatcher", "deepep_buffer_bytes",
           "make_dispatcher", "padded_token_count"]

DISPATCHERS = ("allgather", "alltoall", "flex")
FLEX_BACKENDS = ("torch", "deepep")
PAD_MULTIPLE = 64

Experts = Callable[[torch.Tensor, list[int]], torch.Tensor]


def local_experts(num_experts: int, ep_group: dist.ProcessGroup | None,
                  where: str = "") -> range:
    """The experts (global indices) this rank owns when ``ep_group`` splits ``num_experts``
    (all of them without a group); refuses a count the EP size does not divide."""
    ep = dist.get_world_size(ep_group) if ep_group is not None else 1
    rank = dist.get_rank(ep_group) if ep_group is not None else 0
    if num_experts % ep:
        raise ValueError(f"{where}num_experts={num_experts} is not divisible by the EP size {ep} "
                         "(expert_model_parallel_size)")
    per_rank = num_experts // ep
    return range(rank * per_rank, (rank + 1) * per_rank)


class TokenDispatcher:
    """The staged interface shared by every dispatcher.

    Args:
        num_experts: experts in the whole model (all EP ranks together).
        ep_group: the expert-parallel group; ``None`` means one rank holds every expert.

    After each call, ``bytes_sent`` holds what this rank sent per stage (``{"dispatch": n,
    "combine": n}``, payload bytes to other ranks) and ``tokens_per_expert`` the rows each local
    expert computed.
    """

    name = "base"

    def __init__(self, num_experts: int, ep_group: dist.ProcessGroup | None = None):
        self.num_experts = num_experts
        self.ep_group = ep_group
        self.ep = dist.get_world_size(ep_group) if ep_group is not None else 1
        self.ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
        mine = local_experts(num_experts, ep_group)
        self.num_local_experts = len(mine)
        self.local_slice = slice(mine.start, mine.stop)
        self.bytes_sent = {"dispatch": 0, "combine": 0}
        self.tokens_per_expert: list[int] = []

    # The seven stages. Subclasses keep what later stages need on ``self``.
    def dispatch_preprocess(self, hidden, probs, routing_map):
        """Local work before communication (permutation, counting). By default none: keep the
        local token count and pass the inputs on."""
        self.num_tokens = hidden.shape[0]
        return hidden, probs, routing_map

    def token_dispatch(self, state):
        """Send tokens to their experts' ranks."""
        raise NotImplementedError

    def dispatch_postprocess(self, state) -> tuple[torch.Tensor, list[int]]:
        """Arrange received rows by local expert; return them and the count per local expert."""
        raise NotImplementedError

    def combine_preprocess(self, expert_output):
        """Local work on the experts' output before it travels back."""
        raise NotImplementedError

    def token_combine(self, state):
        """Send results back to the tokens' home ranks."""
        raise NotImplementedError

    def combine_postprocess(self, state) -> torch.Tensor:
        """Turn what came back into one output row per local token."""
        raise NotImplementedError

    def __call__(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                 experts: Experts) -> torch.Tensor:
        """Run all stages: ``hidden`` is ``[tokens, dim]``, ``probs``/``routing_map`` ``[tokens, E]``."""
        if routing_map.shape != (hidden.shape[0], self.num_experts):
            raise ValueError(f"routing_map has shape {tuple(routing_map.shape)}; expected "
                             f"({hidden.shape[0]}, {self.num_experts})")
        self.bytes_sent = {"dispatch": 0, "combine": 0}
        state = self.dispatch_preprocess(hidden, probs, routing_map)
        state = self.token_dispatch(state)
        tokens, counts = self.dispatch_postprocess(state)
        self.tokens_per_expert = counts
        out = experts(tokens, counts)
        state = self.combine_preprocess(out)
        state = self.token_combine(state)
        return self.combine_postprocess(state)

    def _count(self, stage: str, rows_to_others: int, row_bytes: int) -> None:
        self.bytes_sent[stage] += rows_to_others * row_bytes


class AllGatherDispatcher(TokenDispatcher):
    """Gather every token of the EP group on every rank; reduce-scatter the results."""

    name = "allgather"

    def token_dispatch(self, state):
        hidden, probs, routing_map = state
        if self.ep == 1:
            self.sizes = [hidden.shape[0]]
            return state
        self.sizes = gather_sizes(hidden.shape[0], self.ep_group, hidden.device)
        hidden = all_gather_v(hidden, self.sizes, self.ep_group)
        probs = all_gather_v(probs, self.sizes, self.ep_group)
        routing_map = all_gather_v(routing_map.to(torch.uint8), self.sizes, self.ep_group).bool()
        row = hidden.shape[1] * hidden.element_size() + probs.shape[1] * (probs.element_size() + 1)
        self._count("dispatch", (self.ep - 1) * max(self.sizes), row)
        return hidden, probs, routing_map

    def dispatch_postprocess(self, state):
        hidden, probs, routing_map = state
        self.local_probs = probs[:, self.local_slice]
        self.local_map = routing_map[:, self.local_slice]
        self.gathered_tokens = hidden.shape[0]
        tokens, self.index = permute(hidden, self.local_map)
        return tokens, self.local_map.sum(0).tolist()

    def combine_preprocess(self, expert_output):
        return unpermute(expert_output, self.index, self.local_probs, self.local_map,
                         self.gathered_tokens)

    def token_combine(self, state):
        if self.ep == 1:
            return state
        self._count("combine", (self.ep - 1) * max(self.sizes), state.shape[1] * state.element_size())
        return reduce_scatter_v(state, self.sizes, self.ep_group)

    def combine_postprocess(self, state):
        return state


class AllToAllDispatcher(TokenDispatcher):
    """Send each (token, expert) pair only to the rank that holds the expert (variable splits)."""

    name = "alltoall"

    def dispatch_preprocess(self, hidden, probs, routing_map):
        self.probs, self.routing_map, self.num_tokens = probs, routing_map, hidden.shape[0]
        tokens, self.index = permute(hidden, routing_map)  # grouped by expert, so by rank too
        self.local_counts = routing_map.sum(0).to(torch.int64)  # [E] rows this rank sends
        return tokens

    def token_dispatch(self, tokens):
        L, ep = self.num_local_experts, self.ep
        if ep == 1:
            self.recv_counts = self.local_counts.view(1, L)
            return tokens
        recv = torch.empty_like(self.local_counts)
        dist.all_to_all_single(recv, self.local_counts, group=self.ep_group)
        self.recv_counts = recv.view(ep, L)  # [source rank, local expert]
        self.in_splits = self.local_counts.view(ep, L).sum(1).tolist()
        self.out_splits = self.recv_counts.sum(1).tolist()
        row = tokens.shape[1] * tokens.element_size()
        self._count("dispatch", sum(self.in_splits) - self.in_splits[self.ep_rank], row)
        return all_to_all_v(tokens, self.out_splits, self.in_splits, self.ep_group)

    def dispatch_postprocess(self, received):
        ep, L = self.ep, self.num_local_experts
        self.chunk_sizes = self.recv_counts.flatten().tolist()  # by source, then expert
        by_expert = [s * L + e for e in range(L) for s in range(ep)]
        self.sorted_sizes = [self.chunk_sizes[i] for i in by_expert]
        self.unsort = sorted(range(len(by_expert)), key=by_expert.__getitem__)
        tokens = sort_chunks_by_index(received, self.chunk_sizes, by_expert)
        return tokens, self.recv_counts.sum(0).tolist()

    def combine_preprocess(self, expert_output):
        return sort_chunks_by_index(expert_output, self.sorted_sizes, self.unsort)

    def token_combine(self, rows):
        if self.ep == 1:
            return rows
        self._count("combine", sum(self.out_splits) - self.out_splits[self.ep_rank],
                    rows.shape[1] * rows.element_size())
        return all_to_all_v(rows, self.in_splits, self.out_splits, self.ep_group)

    def combine_postprocess(self, rows):
        return unpermute(rows, self.index, self.probs, self.routing_map, self.num_tokens)


def padded_token_count(local_tokens: int, group: dist.ProcessGroup | None,
                       multiple: int = PAD_MULTIPLE, device="cpu") -> int:
    """The static-shape contract: MAX of the local token counts over ``group``, rounded up to
    a multiple of ``multiple`` (one all-reduce; no communication when ``group`` is ``None``)."""
    t = torch.tensor([local_tokens], dtype=torch.int64, device=device)
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return max(multiple, math.ceil(t.item() / multiple) * multiple)


class TorchFlexDispatcher(TokenDispatcher):
    """Flex backend ``torch``: static shapes on ``torch.distributed``.

    Every rank pads to the same ``padded_tokens`` (see :func:`padded_token_count`); the padding rows
    are zero with an all-false routing row, so no expert sees them. Each rank then sends one
    fixed-size slot of ``padded_tokens`` rows to every EP rank (a row is zero unless the token
    routes to that rank), the receiver applies the routing weights of its local experts, and the
    sums travel back in the same fixed slots, are added up and trimmed to the local count. The shapes
    of both exchanges depend only on ``padded_tokens`` and the EP size, never on the routing.
    """

    name = "flex/torch"

    def token_dispatch(self, state):
        hidden, probs, routing_map = state
        ep, L, T = self.ep, self.num_local_experts, self.num_tokens
        self.padded_tokens = P = padded_token_count(T, self.ep_group, device=hidden.device)
        hidden = torch.cat([hidden, hidden.new_zeros(P - T, hidden.shape[1])])
        probs = torch.cat([probs, probs.new_zeros(P - T, probs.shape[1])])
        routing_map = torch.cat([routing_map, routing_map.new_zeros(P - T, routing_map.shape[1])])
        self.padded_routing_map = routing_map
        per_rank = routing_map.view(P, ep, L)
        goes = per_rank.any(-1)  # [P, ep]: token needs rank r
        slots = (hidden.unsqueeze(0) * goes.t().unsqueeze(-1).to(hidden.dtype))  # [ep, P, dim]
        send_probs = probs.view(P, ep, L).permute(1, 0, 2)  # [ep, P, L]
        send_map = per_rank.permute(1, 0, 2).to(torch.uint8)
        equal = [P] * ep
        if ep > 1:
            slots = all_to_all_v(slots.reshape(ep * P, -1), equal, equal, self.ep_group)
            send_probs = all_to_all_v(send_probs.reshape(ep * P, L), equal, equal, self.ep_group)
            send_map = all_to_all_v(send_map.reshape(ep * P, L).contiguous(), equal, equal,
                                    self.ep_group)
            row = hidden.shape[1] * hidden.element_size() + L * (probs.element_size() + 1)
            self._count("dispatch", (ep - 1) * P, row)
        return (slots.reshape(ep * P, -1), send_probs.reshape(ep * P, L),
                send_map.reshape(ep * P, L).bool())

    def dispatch_postprocess(self, state):
        hidden, self.recv_probs, self.recv_map = state
        tokens, self.index = permute(hidden, self.recv_map)
        return tokens, self.recv_map.sum(0).tolist()

    def combine_preprocess(self, expert_output):
        return unpermute(expert_output, self.index, self.recv_probs, self.recv_map,
                         self.recv_map.shape[0])

    def token_combine(self, rows):
        ep, P = self.ep, self.padded_tokens
        if ep > 1:
            self._count("combine", (ep - 1) * P, rows.shape[1] * rows.element_size())
            rows = all_to_all_v(rows, [P] * ep, [P] * ep, self.ep_group)
        return rows.view(ep, P, -1).sum(0)

    def combine_postprocess(self, rows):
        return rows[:self.num_tokens]


def deepep_buffer_bytes(ep_size: int, ranks_per_node: int, hidden_bytes: int) -> dict[str, int]:
    """Buffer sizes for the DeepEP backend: NVLink bytes always, RDMA bytes only when the EP group
    spans nodes (more ranks than one node's NVLink domain of at most 8 GPUs).

    >>> bf16_hidden = 7168 * 2
    >>> deepep_buffer_bytes(8, ranks_per_node=8, hidden_bytes=bf16_hidden)["rdma"]
    0
    >>> deepep_buffer_bytes(16, ranks_per_node=8, hidden_bytes=bf16_hidden)["rdma"] > 0
    True
    """
    intranode = ep_size <= min(ranks_per_node, 8)
    # Room for a few thousand tokens per peer, as DeepEP's own size hints allow for.
    nvl = hidden_bytes * 4096 * min(ep_size, 8)
    rdma = 0 if intranode else hidden_bytes * 4096 * ep_size
    return {"nvl": nvl, "rdma": rdma}


class DeepEPFlexDispatcher(TokenDispatcher):
    """Flex backend ``deepep``: DeepEP's fused dispatch and combine kernels (GPU only).

    Needs the ``deep_ep`` package and CUDA tensors. The communication buffer is sized by
    :func:`deepep_buffer_bytes` from the EP group.
    """

    name = "flex/deepep"

    def __init__(self, num_experts: int, ep_group: dist.ProcessGroup | None = None):
        super().__init__(num_experts, ep_group)
        try:
            import deep_ep  # noqa: F401
        except ImportError as exc:
            raise RuntimeError(
                "moe_flex_dispatcher_backend='deepep' needs the deep_ep package (GPU only), which "
                "is not importable here; use --moe-flex-dispatcher-backend torch") from exc
        if not torch.cuda.is_available():
            raise RuntimeError("moe_flex_dispatcher_backend='deepep' needs CUDA GPUs; use "
                               "--moe-flex-dispatcher-backend torch on CPU")
        self._deep_ep = deep_ep
        self._buffer = None

    def _get_buffer(self, hidden: torch.Tensor):
        if self._buffer is None:
            per_node = int(torch.cuda.device_count())
            sizes = deepep_buffer_bytes(self.ep, per_node, hidden.shape[1] * hidden.element_size())
            group = self.ep_group or dist.group.WORLD
            self._buffer = self._deep_ep.Buffer(group, sizes["nvl"], sizes["rdma"])
        return self._buffer

    def dispatch_preprocess(self, hidden, probs, routing_map):
        self.num_tokens = hidden.shape[0]
        topk = int(routing_map.sum(1).max().item()) if routing_map.numel() else 1
        weights, idx = probs.masked_fill(~routing_map, -1).topk(topk, dim=1)
        idx = idx.masked_fill(weights < 0, -1)  # DeepEP's "no expert" marker
        return hidden, idx, weights.clamp_min(0).float()

    def token_dispatch(self, state):
        hidden, idx, weights = state
        buf = self._get_buffer(hidden)
        recv, recv_w, recv_idx, counts = _DeepEPDispatch.apply(hidden, weights, idx, buf, self)
        return recv, recv_idx, recv_w, counts

    def dispatch_postprocess(self, state):
        recv, recv_idx, recv_w, counts = state
        L = self.num_local_experts
        # A received token may go to several local experts: expand to (token, expert) rows.
        rmap = torch.zeros(recv.shape[0], L, dtype=torch.bool, device=recv.device)
        rprobs = torch.zeros(recv.shape[0], L, dtype=recv_w.dtype, device=recv.device)
        valid = recv_idx >= 0
        rows = valid.nonzero(as_tuple=True)[0]
        rmap[rows, recv_idx[valid]] = True
        rprobs[rows, recv_idx[valid]] = recv_w[valid]
        self.recv_map, self.recv_probs, self.recv_rows = rmap, rprobs, recv.shape[0]
        tokens, self.index = permute(recv, rmap)
        return tokens, list(counts)

    def combine_preprocess(self, expert_output):
        return unpermute(expert_output, self.index, self.recv_probs, self.recv_map, self.recv_rows)

    def token_combine(self, rows):
        return _DeepEPCombine.apply(rows, self._get_buffer(rows), self.handle)

    def combine_postprocess(self, rows):
        return rows


class _DeepEPDispatch(torch.autograd.Function):
    """DeepEP dispatch; its backward is a combine with the same handle (weights included)."""

    @staticmethod
    def forward(ctx, hidden, weights, idx, buf, owner):
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, owner.num_experts)
        recv, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            hidden, topk_idx=idx, topk_weights=weights, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert)
        owner.handle = handle
        ctx.buf, ctx.handle = buf, handle
        ctx.mark_non_differentiable(recv_idx)
        return recv, recv_w, recv_idx, list(counts)

    @staticmethod
    def backward(ctx, grad_recv, grad_w, _grad_idx, _grad_counts):
        grad_hidden, grad_weights, _ = ctx.buf.combine(grad_recv.contiguous(), ctx.handle,
                                                       topk_weights=grad_w.contiguous())
        return grad_hidden, grad_weights, None, None, None


class _DeepEPCombine(torch.autograd.Function):
    """DeepEP combine; its backward is a dispatch with the same handle."""

    @staticmethod
    def forward(ctx, rows, buf, handle):
        ctx.buf, ctx.handle = buf, handle
        out, _, _ = buf.combine(rows, handle)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = ctx.buf.dispatch(grad.contiguous(), handle=ctx.handle)[0]
        return back, None, None


def make_dispatcher(kind: str, num_experts: int, ep_group: dist.ProcessGroup | None = None,
                    backend: str = "torch") -> TokenDispatcher:
    """Build a dispatcher by the trainer's names (``--moe-token-dispatcher-type``, and for
    ``flex`` ``--moe-flex-dispatcher-backend``)."""
    if kind not in DISPATCHERS:
        raise ValueError(f"moe_token_dispatcher_type={kind!r}: choose one of {DISPATCHERS}")
    if kind == "allgather":
        return AllGatherDispatcher(num_experts, ep_group)
    if kind == "alltoall":
        return AllToAllDispatcher(num_experts, ep_group)
    if backend not in FLEX_BACKENDS:
        raise ValueError(f"moe_flex_dispatcher_backend={backend!r}: choose one of {FLEX_BACKENDS}")
    cls = TorchFlexDispatcher if backend == "torch" else DeepEPFlexDispatcher
    return cls(num_experts, ep_group)
