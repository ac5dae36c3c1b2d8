"""The ``training`` flag group, as two configs: :class:`TrainingConfig` (batch sizes,
iterations, the learning-rate schedule, the optimizer) and :class:`DataConfig` (mock data,
indexed datasets or a text file, split, cache, tokenizer, ``--train-samples``, evaluation),
which Megatron-LM lists with the training flags."""

from __future__ import annotations

from dataclasses import dataclass

from mfsdp.argtypes import (adam_beta, non_negative_float, non_negative_int, positive_float,
                            positive_int)
from mfsdp.trainer.config.flags import flag


@dataclass(kw_only=True)
class TrainingConfig:
    """Batch sizes, iterations, the learning-rate schedule and the optimizer."""

    micro_batch_size: int = flag("--micro-batch-size", default=2, type=positive_int,
                                 help="sequences per micro-batch per rank (default: %(default)s)")
    global_batch_size: int = flag("--global-batch-size", default=8, type=positive_int,
                                  help="sequences per iteration over all ranks (default: "
                                       "%(default)s)")
    seq_length: int = flag("--seq-length", default=64, type=positive_int,
                           help="tokens per sequence (the longest one with packing; default: "
                                "%(default)s)")
    train_iters: int = flag("--train-iters", default=20, type=positive_int,
                            help="iterations to reach")
    lr: float = flag("--lr", default=0.003, type=non_negative_float,
                     help="peak learning rate")
    min_lr: float = flag("--min-lr", default=0.0, type=non_negative_float,
                         help="the learning rate decay ends at")
    lr_warmup_iters: int = flag("--lr-warmup-iters", default=0, type=non_negative_int,
                                help="linear warm-up iterations")
    lr_decay_style: str = flag("--lr-decay-style", default="linear",
                               choices=("constant", "linear", "cosine", "inverse-square-root",
                                        "WSD"),
                               help="as Megatron-LM's scheduler (default: %(default)s)")
    lr_decay_iters: int | None = flag("--lr-decay-iters", type=positive_int,
                                      help="iterations of decay (default: --train-iters)")
    lr_warmup_init: float = flag("--lr-warmup-init", default=0.0, type=float,
                                 help="learning rate of the first warm-up step (default: "
                                      "%(default)s)")
    lr_wsd_decay_iters: int | None = flag("--lr-wsd-decay-iters", type=positive_int,
                                          help="WSD: the last N decay iterations anneal")
    lr_wsd_decay_style: str = flag("--lr-wsd-decay-style", default="exponential",
                                   choices=("linear", "cosine", "exponential", "minus_sqrt"),
                                   help="WSD: the shape of the anneal (default: %(default)s)")
    weight_decay: float = flag("--weight-decay", default=0.01, type=non_negative_float,
                               help="AdamW decay (not on biases and norms)")
    optimizer: str = flag("--optimizer", default="adam", choices=("adam", "sgd"),
                          help="adam: AdamW (decoupled weight decay, as Megatron-LM's adam); "
                               "sgd: SGD with --sgd-momentum (default: %(default)s)")
    sgd_momentum: float = flag("--sgd-momentum", default=0.9, type=non_negative_float,
                               help="(default: %(default)s)")
    adam_beta1: float = flag("--adam-beta1", default=0.9, type=adam_beta,
                             help="in [0, 1)")
    adam_beta2: float = flag("--adam-beta2", default=0.999, type=adam_beta,
                             help="in [0, 1)")
    adam_eps: float = flag("--adam-eps", default=1e-08, type=positive_float,
                           help="added to Adam's denominator, above 0 (default: %(default)s)")
    clip_grad: float = flag("--clip-grad", default=1.0, type=non_negative_float,
                            help="largest global gradient norm; 0 turns clipping off, as in "
                                 "Megatron-LM (default: %(default)s)")
    check_for_nan_in_loss_and_grad: bool = flag("--check-for-nan-in-loss-and-grad", default=True,
                                                action="store_true",
                                                help="stop when the loss or the gradient norm is "
                                                     "NaN or Inf, before the optimizer step and "
                                                     "before any save (Megatron-LM's default: "
                                                     "on)",
                                                also=(("--no-check-for-nan-in-loss-and-grad",),
                                                      {"action": "store_false",
                                                       "help": "train on through NaN/Inf (not "
                                                               "recommended)"}))
    seed: int = flag("--seed", default=1234, type=int,
                     help="model init and data order")

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


@dataclass(kw_only=True)
class DataConfig:
    """Mock data, indexed datasets or a text file, split, cache, tokenizer, ``--train-samples``,
    and the evaluation's interval and size."""

    mock_data: bool = flag("--mock-data", default=False, action="store_true",
                           help="synthetic sequences (the default when no --data-path is given; "
                                "refused with --data-path)")
    data_path: list[str] | None = flag("--data-path", nargs='+', metavar="PATH",
                                       help="Megatron indexed dataset prefixes "
                                            "(PREFIX.bin/.idx), optionally weighted: '0.3 a 0.7 "
                                            "b'; or one text file read as bytes (vocab 256); "
                                            "'bundled' uses the small text shipped with mfsdp")
    split: str = flag("--split", default="969,30,1",
                      help="train,valid,test weights over each dataset's documents (default: "
                           "%(default)s)")
    data_cache_path: str | None = flag("--data-cache-path", metavar="DIR",
                                       help="keep the sample index arrays here and reuse them")
    tokenizer_type: str | None = flag("--tokenizer-type",
                                      choices=("NullTokenizer", "HuggingFaceTokenizer"),
                                      help="sets the model's vocabulary (padded) and the EOD id")
    tokenizer_model: str | None = flag("--tokenizer-model", metavar="PATH",
                                       help="HuggingFaceTokenizer: a local tokenizer directory")
    make_vocab_size_divisible_by: int = flag("--make-vocab-size-divisible-by", default=128,
                                             type=positive_int,
                                             help="pad the tokenizer's vocabulary to a multiple "
                                                  "of this times the tensor-parallel size, as "
                                                  "Megatron-LM does (default: %(default)s)")
    train_samples: int | None = flag("--train-samples", type=positive_int,
                                     help="samples to train on (sets --train-iters = samples / "
                                          "global batch)")
    eval_interval: int = flag("--eval-interval", default=1000, type=positive_int,
                              help="validation every N iterations and at the end (default: "
                                   "%(default)s)")
    eval_iters: int = flag("--eval-iters", default=100, type=non_negative_int,
                           help="global batches per validation (0: none; default: %(default)s)")
    sequence_packing: bool = flag("--sequence-packing", default=False, action="store_true",
                                  help="variable-length sequences packed per micro-batch (THD); "
                                       "with indexed datasets, each sample is cut into its "
                                       "documents at EOD tokens")

    def __post_init__(self) -> None:
        from mfsdp.data.gpt_dataset import parse_split

        if self.tokenizer_model and not self.tokenizer_type:
            raise ValueError(f"--tokenizer-model {self.tokenizer_model} needs --tokenizer-type "
                             "HuggingFaceTokenizer (as in Megatron-LM, the type says how to read "
                             "it)")
        parse_split(self.split)  # (its ValueError names --split and the fix)
