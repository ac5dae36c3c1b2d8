"""The layout's flag groups: ``parallelism and sharding`` (the engine, ZeRO level, HSDP, EP, TP,
SP, CP, overlap) and ``precision`` (bf16 compute and the dtypes of main weights, main gradients
and their reduction)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from mfsdp.argtypes import positive_int
from mfsdp.config import DTYPES  # the dtypes the --megatron-fsdp-*-dtype flags name
from mfsdp.trainer.config.flags import flag

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
"""The ZeRO levels of ``--data-parallel-sharding-strategy`` (mfsdp's ``zero_dp_strategy``)."""


@dataclass(kw_only=True, frozen=True)
class ParallelConfig:
    """The engine and the parallel layout: ZeRO level, HSDP, EP, TP, SP, CP, overlap."""

    use_megatron_fsdp: bool = flag(default=False)
    """shard with mfsdp (without it: PyTorch DDP, dense models only)"""
    data_parallel_sharding_strategy: str = flag(default="optim_grads_params", choices=STRATEGIES)
    """ZeRO level"""
    outer_dp_sharding_strategy: str = flag(default="no_shard", choices=("no_shard", "optim"))
    """across the outer groups"""
    num_distributed_optimizer_instances: int = flag(default=1, type=positive_int)
    """outer (HSDP) size: model replicas, each sharded over world/N ranks"""
    expert_model_parallel_size: int = flag(default=1, type=positive_int)
    """EP size: ranks that split the experts of each MoE layer"""
    tensor_model_parallel_size: int = flag(default=1, type=positive_int)
    """TP size: consecutive ranks that split every layer (Megatron-LM's split: column/row-parallel
    projections, vocabulary-parallel embedding)"""
    sequence_parallel: bool = flag(default=False)
    """with TP: norms on sequence shards, all-gather/reduce-scatter around the TP regions"""
    context_parallel_size: int = flag(default=1, type=positive_int)
    """CP size: ranks that split every sequence (Megatron-LM's load-balanced 2 x CP chunks;
    attention over the whole sequence)"""
    expert_tensor_parallel_size: int | None = flag(type=positive_int)
    """TP size inside the experts (Megatron-LM's default: the TP size); mfsdp keeps experts whole,
    split over EP: 1"""
    create_all_gather_group: bool = flag(default=False)
    """all-gathers on their own communicator (overlap with reduce-scatters)"""
    fsdp_double_buffer: bool = flag(default=False)
    """gathered weights in a fixed two-unit pool"""
    init_model_with_meta_device: bool = flag(default=False)
    """build on meta and materialise shard by shard"""
    overlap_grad_reduce: bool = flag(default=True, action=argparse.BooleanOptionalAction)
    """reduce each bucket's gradients during backward (default: on)"""
    overlap_param_gather: bool = flag(default=True, action=argparse.BooleanOptionalAction)
    """prefetch the next unit's weights (default: on)"""
    calculate_per_token_loss: bool = flag(default=False)
    """sum gradients over ranks; the loss is normalised by the global token count"""
    use_nccl_ub: bool = flag(default=False)
    """Megatron-LM's NCCL user buffers: refused, mfsdp does not register them (fully_shard refuses
    nccl_ub=True alike)"""
    fsdp_manual_registration: bool = flag(default=False)
    """registers buffers for --use-nccl-ub: refused with it"""

    def __post_init__(self) -> None:
        if self.outer_dp_sharding_strategy == "optim" and \
                self.num_distributed_optimizer_instances < 2:
            raise ValueError("--outer-dp-sharding-strategy optim needs "
                             "--num-distributed-optimizer-instances of at least 2")


@dataclass(kw_only=True, frozen=True)
class PrecisionConfig:
    """bf16 compute and the dtypes of main weights, main gradients and their reduction."""

    bf16: bool = flag(default=False)
    """bf16 weights and compute, fp32 main weights"""
    grad_reduce_in_bf16: bool = flag(default=False)
    """reduce gradients in bf16 (shorthand for --megatron-fsdp-grad-comm-dtype bf16; another
    --megatron-fsdp-grad-comm-dtype is refused)"""
    megatron_fsdp_main_params_dtype: str | None = flag(choices=tuple(sorted(DTYPES)))
    """dtype of the main params"""
    megatron_fsdp_main_grads_dtype: str | None = flag(choices=tuple(sorted(DTYPES)))
    """dtype of the main grads"""
    megatron_fsdp_grad_comm_dtype: str | None = flag(choices=tuple(sorted(DTYPES)))
    """dtype of the grad comm"""
