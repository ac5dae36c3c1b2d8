"""The trainer's command line: Megatron-LM's flags (``build_parser``) and Megatron-LM's checks
of their values (``check_args``), each error naming the flag and the fix."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from mfsdp.argtypes import MIN_TIMEOUT_MINUTES  # noqa: F401
from mfsdp.data.batches import half_pair, is_indexed_prefix
from mfsdp.trainer.config import DTYPES, GROUPS, STRATEGIES, TrainConfig, add_flags  # noqa: F401


class OneRankParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are printed by rank 0 only (``RANK`` of torchrun):
    a typo on 512 ranks is one message, not 512. Every rank still exits with status 2."""

    def error(self, message: str):
        """Print the usage and ``message`` on rank 0 (or without a rank), then exit 2."""
        if os.environ.get("RANK", "0") == "0":
            self.print_usage(sys.stderr)
            sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The trainer's argument parser, generated from the config classes of
    :mod:`mfsdp.trainer.config` (one argument group per flag group; the guide's flag reference
    is generated from it)."""
    if parser is None:
        parser = OneRankParser(prog="mfsdp train", description=__doc__.splitlines()[0])
    for title, kinds in GROUPS:
        group = parser.add_argument_group(title)
        for kind in kinds:
            add_flags(group, kind)
    return parser


def check_args(args, world: int, cfg) -> int:
    """Validate the combination of flags; return the micro-batches per iteration per rank.

    Flags that the others would leave without effect are refused too
    (:func:`mfsdp.trainer.refusals.check_combinations`), after the checks of values."""
    from mfsdp.trainer.refusals import check_combinations, check_with_model

    TrainConfig.from_args(args)  # the W&B flags, then each group's own checks (__post_init__)
    per = _check_layout(args, world, cfg)
    if args.train_samples:  # (as TrainConfig.from_args does)
        args.train_iters = max(1, args.train_samples // args.global_batch_size)
    _check_data(args, cfg)
    _check_experts_and_replicas(args, world, cfg)
    _check_checkpoints(args)
    parser = build_parser()  # (the defaults and spellings of the flags)
    check_combinations(args, parser)
    check_with_model(args, cfg, parser)
    _check_paths(args)
    return args.global_batch_size // per


def _check_layout(args, world: int, cfg) -> int:
    """TP x CP x replicas divide the ranks, TP and CP have the engine, experts stay whole, the
    global batch splits into micro-batches; return the sequences per micro-batch step."""
    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
    if world % (tp * cp * args.num_distributed_optimizer_instances):
        raise SystemExit(f"--tensor-model-parallel-size {tp} x --context-parallel-size {cp} x "
                         f"--num-distributed-optimizer-instances "
                         f"{args.num_distributed_optimizer_instances} does not divide the "
                         f"{world} ranks")
    if cp > 1 and not args.use_megatron_fsdp:
        raise SystemExit("--context-parallel-size needs --use-megatron-fsdp (the DDP path "
                         "replicates the model)")
    if tp > 1:
        from mfsdp.models.tensor_parallel import check_tensor_parallel

        if not args.use_megatron_fsdp:
            raise SystemExit("--tensor-model-parallel-size needs --use-megatron-fsdp (the DDP "
                             "path replicates the model)")
        try:
            check_tensor_parallel(cfg, tp)
        except ValueError as e:
            raise SystemExit(f"--tensor-model-parallel-size {tp}: {e}") from None
    etp = args.expert_tensor_parallel_size or tp  # Megatron-LM's default: the TP size
    if etp != 1 and cfg.num_experts:
        raise SystemExit(f"expert tensor parallelism {etp}"
                         + ("" if args.expert_tensor_parallel_size else
                            " (Megatron-LM's default for --expert-tensor-parallel-size is the TP "
                            "size)") + ": mfsdp keeps experts whole, split over EP; pass "
                         "--expert-tensor-parallel-size 1")
    dp = world // (tp * cp)
    per = args.micro_batch_size * dp
    if args.global_batch_size % per:
        raise SystemExit(f"--global-batch-size {args.global_batch_size} is not divisible by "
                         f"--micro-batch-size x data-parallel size = {args.micro_batch_size} x "
                         f"{dp}; pick a multiple of {per}")
    return per


def _check_data(args, cfg) -> None:
    """``--data-path`` lists, byte files and the vocabulary (the tokenizer and ``--split``:
    :class:`~mfsdp.trainer.config.DataConfig`)."""
    if args.data_path and len(args.data_path) > 1:
        from mfsdp.data.gpt_dataset import parse_data_path

        try:
            parse_data_path(args.data_path)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    if args.data_path and len(args.data_path) == 1 and half_pair(args.data_path[0]):
        raise SystemExit(f"--data-path {args.data_path[0]}: {half_pair(args.data_path[0])}")
    if args.data_path and len(args.data_path) == 1 and not is_indexed_prefix(args.data_path[0]) \
            and cfg.vocab_size < 256:
        raise SystemExit(f"--data-path reads bytes: --vocab-size must be at least 256, "
                         f"not {cfg.vocab_size}")
    if cfg.vocab_size < 2:
        raise SystemExit(f"--vocab-size {cfg.vocab_size}: a language model needs at least 2 "
                         "tokens")


def _check_experts_and_replicas(args, world: int, cfg) -> None:
    """Expert parallelism and HSDP replicas fit the ranks, the experts and the engine."""
    if world % args.num_distributed_optimizer_instances:
        raise SystemExit(f"--num-distributed-optimizer-instances "
                         f"{args.num_distributed_optimizer_instances} does not divide the "
                         f"{world} ranks")
    ep = args.expert_model_parallel_size
    if ep > 1 and cfg.num_experts == 0:
        raise SystemExit(f"--expert-model-parallel-size {ep} needs an MoE model (--num-experts > 0 "
                         "or --model-preset deepseek-proxy)")
    if not args.use_megatron_fsdp and (ep > 1 or args.num_distributed_optimizer_instances > 1):
        raise SystemExit("expert parallelism and --num-distributed-optimizer-instances need "
                         "--use-megatron-fsdp (the DDP path replicates everything)")
    if cfg.num_experts and cfg.num_experts % ep:
        raise SystemExit(f"--expert-model-parallel-size {ep} does not divide the "
                         f"{cfg.num_experts} experts (--num-experts); pick a divisor")
    if cfg.num_experts and cfg.moe_router_topk > cfg.num_experts:
        raise SystemExit(f"--moe-router-topk {cfg.moe_router_topk} exceeds the "
                         f"{cfg.num_experts} experts (--num-experts)")


def _check_checkpoints(args) -> None:
    """``--save``/``--load`` need the engine."""
    if (args.save or args.load) and not args.use_megatron_fsdp:
        raise SystemExit("--save and --load need --use-megatron-fsdp (checkpoints are sharded "
                         "DTensors)")


def _check_paths(args) -> None:
    """Every path the run writes can be written, checked before the model is built."""
    if args.save:
        _check_save_dir(Path(args.save))
    dump = args.dump_param_to_param_group_map
    for flag, path, file in (("--log-jsonl", args.log_jsonl, True),
                             ("--tensorboard-dir", args.tensorboard_dir, False),
                             ("--wandb-save-dir", args.wandb_save_dir, False),
                             ("--data-cache-path", args.data_cache_path, False),
                             ("--dump-param-to-param-group-map", dump,
                              bool(dump) and dump.endswith(".json"))):
        if path:
            _check_writable(flag, Path(path), file)


def _check_writable(flag: str, path: Path, file: bool) -> None:
    """Fail at start, not after the model is built, when ``path`` cannot be written: a file
    (``file``) goes into an existing directory this process may write in; a directory may be
    created below the nearest one that exists."""
    if file:
        if path.is_dir():
            raise SystemExit(f"{flag} {path} is a directory; name a file in it")
        if path.exists() and not os.access(path, os.W_OK):
            raise SystemExit(f"{flag} {path}: the file is not writable by this process")
        parent = path.parent
        if not parent.is_dir():
            raise SystemExit(f"{flag} {path}: the directory {parent} does not exist; create it "
                             "or name a file in an existing directory")
    else:
        if path.exists() and not path.is_dir():
            raise SystemExit(f"{flag} {path} is a file; name a directory")
        parent = path
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            raise SystemExit(f"{flag} {path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise SystemExit(f"{flag} {path}: {parent} is not a directory this process may write "
                         "in; choose another path")


def _check_save_dir(save: Path) -> None:
    """Fail at start, not at the first save, when --save cannot be written: it must be a
    directory or not exist yet below a directory this process may write in."""
    if save.exists() and not save.is_dir():
        raise SystemExit(f"--save {save} is a file; name a directory (new or one --save wrote)")
    parent = save
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise SystemExit(f"--save {save}: {parent} is not a directory this process may write in; "
                         "choose another --save")
