"""The layout's flag groups: ``parallelism and sharding`` (the engine, ZeRO level, HSDP, EP, TP,
SP, CP, overlap) and ``precision`` (bf16 compute and the dtypes of main weights, main gradients
and their reduction)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from mfsdp.argtypes import positive_int
from mfsdp.trainer.config.flags import flag

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
"""The ZeRO levels of ``--data-parallel-sharding-strategy`` (mfsdp's ``zero_dp_strategy``)."""

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The dtypes the ``--megatron-fsdp-*-dtype`` flags name."""


@dataclass(kw_only=True)
class ParallelConfig:
    """The engine and the parallel layout: ZeRO level, HSDP, EP, TP, SP, CP, overlap."""

    use_megatron_fsdp: bool = flag("--use-megatron-fsdp", default=False, action="store_true",
                                   help="shard with mfsdp (without it: PyTorch DDP, dense models "
                                        "only)")
    data_parallel_sharding_strategy: str = flag("--data-parallel-sharding-strategy",
                                                default="optim_grads_params",
                                                choices=STRATEGIES,
                                                help="ZeRO level (default: %(default)s)")
    outer_dp_sharding_strategy: str = flag("--outer-dp-sharding-strategy", default="no_shard",
                                           choices=("no_shard", "optim"),
                                           help="across the outer groups (default: %(default)s)")
    num_distributed_optimizer_instances: int = flag("--num-distributed-optimizer-instances",
                                                    default=1, type=positive_int,
                                                    help="outer (HSDP) size: model replicas, "
                                                         "each sharded over world/N ranks")
    expert_model_parallel_size: int = flag("--expert-model-parallel-size", default=1,
                                           type=positive_int,
                                           help="EP size: ranks that split the experts of each "
                                                "MoE layer")
    tensor_model_parallel_size: int = flag("--tensor-model-parallel-size", default=1,
                                           type=positive_int,
                                           help="TP size: consecutive ranks that split every "
                                                "layer (Megatron-LM's split: column/row-parallel "
                                                "projections, vocabulary-parallel embedding)")
    sequence_parallel: bool = flag("--sequence-parallel", default=False, action="store_true",
                                   help="with TP: norms on sequence shards, "
                                        "all-gather/reduce-scatter around the TP regions")
    context_parallel_size: int = flag("--context-parallel-size", default=1, type=positive_int,
                                      help="CP size: ranks that split every sequence "
                                           "(Megatron-LM's load-balanced 2 x CP chunks; "
                                           "attention over the whole sequence)")
    expert_tensor_parallel_size: int | None = flag("--expert-tensor-parallel-size",
                                                   type=positive_int,
                                                   help="TP size inside the experts "
                                                        "(Megatron-LM's default: the TP size); "
                                                        "mfsdp keeps experts whole, split over "
                                                        "EP: 1")
    create_all_gather_group: bool = flag("--create-all-gather-group", default=False,
                                         action="store_true",
                                         help="all-gathers on their own communicator (overlap "
                                              "with reduce-scatters)")
    fsdp_double_buffer: bool = flag("--fsdp-double-buffer", default=False, action="store_true",
                                    help="gathered weights in a fixed two-unit pool")
    init_model_with_meta_device: bool = flag("--init-model-with-meta-device", default=False,
                                             action="store_true",
                                             help="build on meta and materialise shard by shard")
    overlap_grad_reduce: bool = flag("--overlap-grad-reduce",
                                     default=True, action=argparse.BooleanOptionalAction,
                                     help="reduce each bucket's gradients during backward "
                                          "(default: on)")
    overlap_param_gather: bool = flag("--overlap-param-gather",
                                      default=True, action=argparse.BooleanOptionalAction,
                                      help="prefetch the next unit's weights (default: on)")
    calculate_per_token_loss: bool = flag("--calculate-per-token-loss", default=False,
                                          action="store_true",
                                          help="sum gradients over ranks; the loss is normalised "
                                               "by the global token count")
    use_nccl_ub: bool = flag("--use-nccl-ub", default=False, action="store_true",
                             help="Megatron-LM's NCCL user buffers: refused, mfsdp does not "
                                  "register them (fully_shard refuses nccl_ub=True alike)")
    fsdp_manual_registration: bool = flag("--fsdp-manual-registration", default=False,
                                          action="store_true",
                                          help="registers buffers for --use-nccl-ub: refused "
                                               "with it")

    def __post_init__(self) -> None:
        if self.outer_dp_sharding_strategy == "optim" and \
                self.num_distributed_optimizer_instances < 2:
            raise ValueError("--outer-dp-sharding-strategy optim needs "
                             "--num-distributed-optimizer-instances of at least 2")


@dataclass(kw_only=True)
class PrecisionConfig:
    """bf16 compute and the dtypes of main weights, main gradients and their reduction."""

    bf16: bool = flag("--bf16", default=False, action="store_true",
                      help="bf16 weights and compute, fp32 main weights")
    grad_reduce_in_bf16: bool = flag("--grad-reduce-in-bf16", default=False, action="store_true",
                                     help="reduce gradients in bf16 (shorthand for "
                                          "--megatron-fsdp-grad-comm-dtype bf16; another "
                                          "--megatron-fsdp-grad-comm-dtype is refused)")
    megatron_fsdp_main_params_dtype: str | None = flag("--megatron-fsdp-main-params-dtype",
                                                       choices=tuple(sorted(DTYPES)),
                                                       help="dtype of the main params")
    megatron_fsdp_main_grads_dtype: str | None = flag("--megatron-fsdp-main-grads-dtype",
                                                      choices=tuple(sorted(DTYPES)),
                                                      help="dtype of the main grads")
    megatron_fsdp_grad_comm_dtype: str | None = flag("--megatron-fsdp-grad-comm-dtype",
                                                     choices=tuple(sorted(DTYPES)),
                                                     help="dtype of the grad comm")
