"""Mixture-of-experts building blocks: router, permutation, token dispatchers, experts, layer."""

from mfsdp.moe.dispatcher import (AllGatherDispatcher, AllToAllDispatcher, TokenDispatcher,
                                  TorchFlexDispatcher, make_dispatcher, padded_token_count)
from mfsdp.moe.experts import FusedExperts, GroupedLinear, SequentialExperts
from mfsdp.moe.layer import MoELayer, collect_aux_losses, shard_experts
from mfsdp.moe.permute import permute, sort_chunks_by_index, unpermute
from mfsdp.moe.router import TopKRouter, aux_loss, capacity_mask, topk_routing, z_loss

__all__ = ["AllGatherDispatcher", "AllToAllDispatcher", "FusedExperts", "GroupedLinear", "MoELayer",
           "SequentialExperts", "TokenDispatcher", "TopKRouter", "TorchFlexDispatcher", "aux_loss",
           "capacity_mask", "collect_aux_losses", "make_dispatcher", "padded_token_count", "permute",
           "shard_experts", "sort_chunks_by_index", "topk_routing", "unpermute", "z_loss"]
