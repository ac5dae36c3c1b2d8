"""Top-k routers: softmax or sigmoid scores, group-limited selection, expert bias, auxiliary losses
and capacity dropping.

A router turns a token's hidden state into *routing weights* ``probs`` (``[tokens, experts]``, zero
where the token does not go) and a boolean ``routing_map`` of the same shape. Every dispatcher in
:mod:`mfsdp.moe.dispatcher` consumes exactly this pair.

>>> logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
>>> probs, routing_map = topk_routing(logits, topk=2)
>>> routing_map.int().tolist()
[[1, 1, 0, 0]]
>>> round(probs.sum().item(), 4)  # softmax scores of the two chosen experts, not renormalised
0.8808
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["TopKRouter", "aux_loss", "capacity_mask", "expert_capacity", "topk_routing",
           "z_loss"]

SCORE_FUNCS = ("softmax", "sigmoid")
DROP_POLICIES = ("probs", "position")


def _check_topk(topk: int, num_experts: int, num_groups: int | None,
                group_topk: int | None) -> None:
    if not 1 <= topk <= num_experts:
        raise ValueError(f"moe_router_topk={topk}: must be between 1 and num_experts={num_experts}")
    if num_groups is None:
        if group_topk is not None:
            raise ValueError("group_topk needs num_groups (group-limited routing)")
        return
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"num_groups={num_groups} does not divide num_experts={num_experts}; "
                         "pick a divisor so that every group holds the same number of experts")
    if group_topk is None or not 1 <= group_topk <= num_groups:
        raise ValueError(f"group_topk={group_topk}: must be between 1 and num_groups={num_groups}")
    if topk > group_topk * (num_experts // num_groups):
        raise ValueError(f"moe_router_topk={topk} exceeds the {group_topk} chosen groups' "
                         f"{group_topk * (num_experts // num_groups)} experts")


def topk_routing(
    logits: torch.Tensor,
    topk: int,
    score_func: str = "softmax",
    num_groups: int | None = None,
    group_topk: int | None = None,
    expert_bias: torch.Tensor | None = None,
    scaling_factor: float = 1.0,
    normalize: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose ``topk`` experts per token; return ``(probs, routing_map)``, both ``[tokens, experts]``.

    Scores: ``softmax`` over all experts or ``sigmoid`` per expert. ``normalize`` rescales the
    chosen scores to sum to one (default: for sigmoid, as DeepSeek-V3 does, not for softmax;
    ``normalize=True`` with softmax is Mixtral's and Megatron-LM's default routing), then every
    weight is multiplied by ``scaling_factor`` (DeepSeek-V3's routed scaling factor). The selection
    ranks ``score + expert_bias``; the bias steers the choice but never enters the weights.
    Group-limited routing splits the experts into ``num_groups`` equal groups, scores each group
    by the sum of its two best (biased) scores (its best one when a group has one expert), keeps
    the ``group_topk`` best groups and selects the top-k only among their experts.
    """
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func={score_func!r}: choose one of {SCORE_FUNCS}")
    tokens, experts = logits.shape
    _check_topk(topk, experts, num_groups, group_topk)
    logits = logits.float()
    scores = torch.softmax(logits, dim=-1) if score_func == "softmax" else torch.sigmoid(logits)
    choice = scores.detach() if expert_bias is None else scores.detach() + expert_bias.float()
    if num_groups is not None:
        per = experts // num_groups
        grouped = choice.view(tokens, num_groups, per)
        group_score = grouped.topk(min(2, per), dim=-1).values.sum(-1)
        keep = torch.zeros(tokens, num_groups, dtype=torch.bool, device=logits.device)
        keep.scatter_(1, group_score.topk(group_topk, dim=-1).indices, True)
        allowed = keep.unsqueeze(-1).expand(tokens, num_groups, per).reshape(tokens, experts)
        choice = choice.masked_fill(~allowed, float("-inf"))
    index = choice.topk(topk, dim=-1).indices
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, index, True)
    chosen = scores.gather(1, index)
    if normalize is None:
        normalize = score_func == "sigmoid"
    if normalize and topk > 1:
        chosen = chosen / (chosen.sum(-1, keepdim=True) + 1e-20)
    probs = torch.zeros_like(scores).scatter(1, index, chosen * scaling_factor)
    return probs, routing_map


def aux_loss(scores: torch.Tensor, routing_map: torch.Tensor, topk: int) -> torch.Tensor:
    """Switch-style load-balancing loss ``E * sum_e f_e * P_e`` (coefficient not applied).

    ``f_e`` is the fraction of the ``tokens * topk`` assignments that went to expert ``e`` and
    ``P_e`` the mean score of expert ``e`` over the tokens. It is 1 for perfectly uniform routing.

    >>> scores = torch.full((4, 2), 0.5)
    >>> routing = torch.tensor([[1, 0], [0, 1], [1, 0], [0, 1]]).bool()
    >>> aux_loss(scores, routing, topk=1).item()
    1.0
    """
    tokens, experts = scores.shape
    f = routing_map.float().sum(0) / (tokens * topk)
    p = scores.float().mean(0)
    return experts * (f * p).sum()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Router z-loss: the mean squared log-sum-exp of the logits (coefficient not applied).

    >>> round(z_loss(torch.zeros(3, 4)).item(), 4)  # log(4) ** 2
    1.9218
    """
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def expert_capacity(tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Tokens each expert may take: ``ceil(tokens * topk / num_experts * capacity_factor)``.

    >>> expert_capacity(tokens=10, num_experts=4, topk=2, capacity_factor=1.0)
    5
    """
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor={capacity_factor}: must be positive (or None for no cap)")
    return math.ceil(tokens * topk / num_experts * capacity_factor)


def capacity_mask(probs: torch.Tensor, routing_map: torch.Tensor, capacity: int,
                  policy: str = "probs", pad_to_capacity: bool = False) -> torch.Tensor:
    """The routing map after each expert keeps at most ``capacity`` tokens.

    ``policy="probs"`` keeps each expert's ``capacity`` highest-weight tokens, ``"position"`` its
    first ``capacity`` tokens in order. With ``pad_to_capacity`` every expert receives exactly
    ``capacity`` rows: the dropped-or-unrouted slots are filled with other tokens whose weight is
    zero, so the expert's batch has a fixed shape.

    >>> probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3]])
    >>> routing = torch.tensor([[1, 0], [1, 0], [1, 0]]).bool()
    >>> capacity_mask(probs, routing, capacity=2, policy="position").int().tolist()
    [[1, 0], [1, 0], [0, 0]]
    >>> kept = capacity_mask(probs, routing, capacity=2, policy="probs",
    ...                      pad_to_capacity=True)
    >>> kept.int().tolist()
    [[1, 1], [1, 1], [0, 0]]
    """
    if policy not in DROP_POLICIES:
        raise ValueError(f"moe_token_drop_policy={policy!r}: choose one of {DROP_POLICIES}")
    tokens = probs.shape[0]
    capacity = min(capacity, tokens)
    if policy == "probs":
        # routed tokens by weight; when padding, unrouted ones after them, earliest first
        first = -1.0 - torch.arange(tokens, device=probs.device, dtype=torch.float32) / tokens
        rank_key = torch.where(routing_map, probs.detach().float(), first.unsqueeze(1))
    else:  # earlier tokens first; routed before unrouted when padding
        order = torch.arange(tokens, 0, -1, device=probs.device, dtype=torch.float32).unsqueeze(1)
        rank_key = torch.where(routing_map, order + tokens, order if pad_to_capacity else -order)
    keep = torch.zeros_like(routing_map)
    keep.scatter_(0, rank_key.topk(capacity, dim=0).indices, True)
    return keep if pad_to_capacity else keep & routing_map


class TopKRouter(nn.Module):
    """A linear gate followed by :func:`~mfsdp.moe.topk_routing`, with optional losses and capacity.

    After each forward ``self.losses`` holds the weighted auxiliary and z-losses of that call
    (``{"aux": tensor, "z": tensor}``, only those with a non-zero coefficient); add
    :func:`mfsdp.moe.collect_aux_losses` of the model to the training loss.

    With ``expert_bias=True`` a non-trained buffer ``expert_bias`` shifts the selection;
    :meth:`update_expert_bias` moves it towards balance from the tokens each expert received.
    """

    def __init__(self, hidden: int, num_experts: int, topk: int = 1, score_func: str = "softmax",
                 num_groups: int | None = None, group_topk: int | None = None,
                 expert_bias: bool = False, aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0,
                 capacity_factor: float | None = None, drop_policy: str = "probs",
                 pad_to_capacity: bool = False, scaling_factor: float = 1.0,
                 normalize: bool | None = None):
        super().__init__()
        _check_topk(topk, num_experts, num_groups, group_topk)
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func={score_func!r}: choose one of {SCORE_FUNCS}")
        if drop_policy not in DROP_POLICIES:
            raise ValueError(f"drop_policy={drop_policy!r}: choose one of {DROP_POLICIES}")
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.reset_parameters()
        self.num_experts, self.topk, self.score_func = num_experts, topk, score_func
        self.num_groups, self.group_topk = num_groups, group_topk
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.pad_to_capacity, self.scaling_factor = pad_to_capacity, scaling_factor
        self.normalize = normalize
        self.register_buffer("expert_bias", torch.zeros(num_experts) if expert_bias else None)
        self.losses: dict[str, torch.Tensor] = {}
        # Tokens routed to each expert since the last update_expert_bias() (with expert_bias).
        self.load = torch.zeros(num_experts)
        # Which of the next forward's tokens count toward `load` (None: all). A trainer that
        # pads micro-batches (sequence or context parallelism) leaves the padding out, so that
        # the bias updates do not depend on the layout.
        self.count_mask: torch.Tensor | None = None

    def reset_parameters(self) -> None:
        """Initialise the gate weight (normal, std ``hidden ** -0.5``)."""
        nn.init.normal_(self.weight, std=self.weight.shape[1] ** -0.5)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Route ``hidden`` (``[tokens, hidden]``); return ``(probs, routing_map)``."""
        logits = hidden.float() @ self.weight.float().t()
        probs, routing_map = topk_routing(logits, self.topk, self.score_func, self.num_groups,
                                          self.group_topk, self.expert_bias, self.scaling_factor,
                                          self.normalize)
        self.losses = {}
        # count the load once: not again when activation checkpointing recomputes this forward
        # inside backward
        recomputing = torch._C._current_graph_task_id() != -1
        if self.expert_bias is not None and torch.is_grad_enabled() and not recomputing:
            counted = routing_map if self.count_mask is None else routing_map[self.count_mask]
            self.load = self.load.to(routing_map.device) + counted.sum(0).float()
        if self.aux_loss_coeff:
            scores = (torch.softmax(logits, -1) if self.score_func == "softmax"
                      else torch.sigmoid(logits))
            self.losses["aux"] = self.aux_loss_coeff * aux_loss(scores, routing_map, self.topk)
        if self.z_loss_coeff:
            self.losses["z"] = self.z_loss_coeff * z_loss(logits)
        if self.capacity_factor is not None:
            cap = expert_capacity(hidden.shape[0], self.num_experts, self.topk,
                                  self.capacity_factor)
            routing_map = capacity_mask(probs, routing_map, cap, self.drop_policy,
                                        self.pad_to_capacity)
            probs = probs * routing_map
        return probs, routing_map

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor, rate: float = 1e-3) -> None:
        """Auxiliary-loss-free balancing: raise the bias of under-loaded experts, lower the others."""
        if self.expert_bias is None:
            raise RuntimeError("this router was built with expert_bias=False")
        load = tokens_per_expert.float().to(self.expert_bias.device)
        self.expert_bias += rate * torch.sign(load.mean() - load)
        self.load = torch.zeros_like(self.load)
