"""The ``training`` flag group, as two configs: :class:`TrainingConfig` (batch sizes,
iterations, the learning-rate schedule, the optimizer) and :class:`DataConfig` (mock data,
indexed datasets or a text file, split, cache, tokenizer, ``--train-samples``, evaluation),
which Megatron-LM lists with the training flags."""

from __future__ import annotations

from dataclasses import dataclass

from mfsdp.argtypes import (adam_beta, non_negative_float, non_negative_int, positive_float,
                            positive_int)
from mfsdp.trainer.config.flags import flag


@dataclass(kw_only=True, frozen=True)
class TrainingConfig:
    """Batch sizes, iterations, the learning-rate schedule and the optimizer."""

    micro_batch_size: int = flag(default=2, type=positive_int)
    """sequences per micro-batch per rank"""
    global_batch_size: int = flag(default=8, type=positive_int)
    """sequences per iteration over all ranks"""
    seq_length: int = flag(default=64, type=positive_int)
    """tokens per sequence (the longest one with packing)"""
    train_iters: int = flag(default=20, type=positive_int)
    """iterations to reach"""
    lr: float = flag(default=0.003, type=non_negative_float)
    """peak learning rate"""
    min_lr: float = flag(default=0.0, type=non_negative_float)
    """the learning rate decay ends at"""
    lr_warmup_iters: int = flag(default=0, type=non_negative_int)
    """linear warm-up iterations"""
    lr_decay_style: str = flag(default="linear", choices=("constant", "linear", "cosine",
                                                          "inverse-square-root", "WSD"))
    """as Megatron-LM's scheduler"""
    lr_decay_iters: int | None = flag(type=positive_int)
    """iterations of decay (default: --train-iters)"""
    lr_warmup_init: float = flag(default=0.0, type=float)
    """learning rate of the first warm-up step"""
    lr_wsd_decay_iters: int | None = flag(type=positive_int)
    """WSD: the last N decay iterations anneal"""
    lr_wsd_decay_style: str = flag(default="exponential",
                                   choices=("linear", "cosine", "exponential", "minus_sqrt"))
    """WSD: the shape of the anneal"""
    weight_decay: float = flag(default=0.01, type=non_negative_float)
    """AdamW decay (not on biases and norms)"""
    optimizer: str = flag(default="adam", choices=("adam", "sgd"))
    """adam: AdamW (decoupled weight decay, as Megatron-LM's adam); sgd: SGD with --sgd-momentum"""
    sgd_momentum: float = flag(default=0.9, type=non_negative_float)
    """momentum of --optimizer sgd"""
    fused_adam: bool = flag(default=False)
    """PyTorch's fused AdamW: one kernel steps every parameter (CUDA and CPU; needs --optimizer
    adam); faster on GPUs, the same losses to rounding"""
    adam_beta1: float = flag(default=0.9, type=adam_beta)
    """in [0, 1)"""
    adam_beta2: float = flag(default=0.999, type=adam_beta)
    """in [0, 1)"""
    adam_eps: float = flag(default=1e-08, type=positive_float)
    """added to Adam's denominator, above 0"""
    clip_grad: float = flag(default=1.0, type=non_negative_float)
    """largest global gradient norm; 0 turns clipping off, as in Megatron-LM"""
    check_for_nan_in_loss_and_grad: bool = flag(
        default=True, action="store_true",
        also=(("--no-check-for-nan-in-loss-and-grad",),
              {"action": "store_false", "help": "train on through NaN/Inf (not recommended)"}))
    """stop when the loss or the gradient norm is NaN or Inf, before the optimizer step and before
    any save (Megatron-LM's default: on)"""
    seed: int = flag(default=1234, type=int)
    """model init and data order"""
    compile: bool = flag(default=False)
    """torch.compile each transformer layer's forward (torchtitan's per-block compile; the
    sharding hooks stay outside): fused kernels on GPUs, after a compile of tens of seconds at
    the first iteration"""

    def __post_init__(self) -> None:
        if self.lr_decay_style == "WSD" and not self.lr_wsd_decay_iters:
            raise ValueError("--lr-decay-style WSD needs --lr-wsd-decay-iters (the annealing "
                             "tail)")
        decay = self.lr_decay_iters or self.train_iters
        if self.lr_decay_style not in ("constant", "inverse-square-root") and \
                decay <= self.lr_warmup_iters:
            raise ValueError(f"--lr-decay-iters {decay} must exceed --lr-warmup-iters "
                             f"{self.lr_warmup_iters}")
        if self.clip_grad < 0:
            raise ValueError(f"--clip-grad {self.clip_grad}: the largest gradient norm must be "
                             "positive, or 0 to turn clipping off")


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """Mock data, indexed datasets or a text file, split, cache, tokenizer, ``--train-samples``,
    and the evaluation's interval and size."""

    mock_data: bool = flag(default=False)
    """synthetic sequences (the default when no --data-path is given; refused with --data-path)"""
    data_path: list[str] | None = flag(nargs='+', metavar="PATH")
    """Megatron indexed dataset prefixes (PREFIX.bin/.idx), optionally weighted: '0.3 a 0.7 b'; or
    one text file read as bytes (vocab 256); 'bundled' uses the small text shipped with mfsdp"""
    split: str = flag(default="969,30,1")
    """train,valid,test weights over each dataset's documents"""
    data_cache_path: str | None = flag(metavar="DIR")
    """keep the sample index arrays here and reuse them"""
    tokenizer_type: str | None = flag(choices=("NullTokenizer", "HuggingFaceTokenizer"))
    """sets the model's vocabulary (padded) and the EOD id"""
    tokenizer_model: str | None = flag(metavar="PATH")
    """HuggingFaceTokenizer: a local tokenizer directory"""
    make_vocab_size_divisible_by: int = flag(default=128, type=positive_int)
    """pad the tokenizer's vocabulary to a multiple of this times the tensor-parallel size, as
    Megatron-LM does"""
    train_samples: int | None = flag(type=positive_int)
    """samples to train on (sets --train-iters = samples / global batch)"""
    eval_interval: int = flag(default=1000, type=positive_int)
    """validation every N iterations and at the end"""
    eval_iters: int = flag(default=100, type=non_negative_int)
    """global batches per validation (0: none)"""
    sequence_packing: bool = flag(default=False)
    """variable-length sequences packed per micro-batch (THD); with indexed datasets, each sample is
    cut into its documents at EOD tokens"""

    def __post_init__(self) -> None:
        from mfsdp.data.gpt_dataset import parse_split

        if self.tokenizer_model and not self.tokenizer_type:
            raise ValueError(f"--tokenizer-model {self.tokenizer_model} needs --tokenizer-type "
                             "HuggingFaceTokenizer (as in Megatron-LM, the type says how to read "
                             "it)")
        parse_split(self.split)  # (its ValueError names --split and the fix)
