"""The entry of ``mfsdp train`` (see :mod:`mfsdp.train` for the commands): parse, check, start the
process group, lock ``--save``, watch for hangs, and hand the run to a
:class:`~mfsdp.trainer.trainer.Trainer` (build, load, train, evaluate, save, stop)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

import torch
import torch.distributed as dist

from mfsdp.checkpoint.dcp import on_rank_zero
from mfsdp.layout import rank_device
from mfsdp.models.config import GPTConfig
from mfsdp.trainer.arguments import build_parser, checked_config
from mfsdp.trainer.checkpointing import check_load_exists
from mfsdp.trainer.config import TrainConfig
from mfsdp.trainer.guard import SaveLock, Watch, report_error
from mfsdp.trainer.signals import StopRequest, install_terminate, leaving
from mfsdp.trainer.trainer import Trainer


def run(args: argparse.Namespace, stop: StopRequest | None = None) -> list[dict]:
    """Train with parsed ``args`` in an initialised process group; return rank 0's log records.

    The arguments become a :class:`~mfsdp.trainer.config.TrainConfig` validated for this world
    and device (``mfsdp.trainer.arguments.checked_config``), which is all the run reads from
    then on.
    ``--save``'s directory is locked for the run (:class:`~mfsdp.trainer.guard.SaveLock`) and a
    :class:`~mfsdp.trainer.guard.Watch` reports hangs (and, under torchrun, a dead launcher).
    ``stop``: the stop request the entry point made before the process group (else the
    Trainer makes its own)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    config, cfg = checked_config(args, world, device.type)  # (the Namespace stops here)
    num_micro = config.micro_batches(world)
    log = print if rank == 0 else (lambda *a, **k: None)
    ckpt = config.checkpoint
    if ckpt.load and ckpt.exit_on_missing_checkpoint:  # before the lock creates --save
        check_load_exists(ckpt.load)
    lock = SaveLock(ckpt.save) if (ckpt.save and config.parallel.use_megatron_fsdp) else None
    take_save_lock(lock, log)
    watch = Watch(config.job.distributed_timeout_minutes * 60, lock if rank == 0 else None)
    try:
        return train(config, cfg, num_micro, device, log, watch, stop)
    finally:  # (nothing here may raise: it would hide what ended the run)
        watch.stop()
        note = lock.release() if lock is not None else ""
        if note and sys.exc_info()[0] is None:
            log(f"note: {note}", flush=True)


def take_save_lock(lock: SaveLock | None, log: Callable[..., None]) -> None:
    """Rank 0 takes ``--save``'s lock; every rank stops with its message when it cannot."""
    error = (on_rank_zero(lock.acquire, catch=SystemExit, describe=lambda exc: str(exc.code))
             if lock is not None else None)
    if error:
        raise SystemExit(error)
    for note in lock.notes if lock is not None else ():
        log(f"note: {note}", flush=True)


def train(config: TrainConfig, cfg: GPTConfig, num_micro: int, device: torch.device,
          log: Callable[..., None], watch: Watch, stop: StopRequest | None = None) -> list[dict]:
    """Build, load and train (the body of :func:`run`, once the save directory is ours) with a
    :class:`~mfsdp.trainer.trainer.Trainer`; ``watch`` hears where this rank is."""
    return Trainer(config, cfg, num_micro, device, log, watch, stop).run()


def run_in_rank(argv: list[str]) -> list[dict]:
    """Parse ``argv`` and :func:`run` it in a rank of :func:`mfsdp.launch.launch` (tests, recipes)."""
    return run(build_parser().parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    """Entry point under ``torchrun``: initialise the process group, train, clean up."""
    args = build_parser().parse_args(argv)
    return main_parsed(args)


def main_parsed(args: argparse.Namespace) -> int:
    """Run parsed ``mfsdp train`` arguments as a job: start the process group when none is, train,
    and end the process cleanly (see :func:`mfsdp.runtime.shutdown`)."""
    started = False
    # with --exit-signal-handler a SIGTERM from here on is kept, not fatal: the Trainer is
    # handed this request and stops on it after its next iteration
    stop = StopRequest(True) if args.exit_signal_handler else None
    if not args.exit_signal_handler:
        install_terminate()  # a SIGTERM ends the rank with one line, not silently
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python -m mfsdp.train`: a world of one
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get(
                                  "MASTER_PORT", "29511"))
        from mfsdp.runtime import init_from_env

        # NCCL on GPUs, gloo otherwise; survives torchrun restarts
        init_from_env(timeout_s=args.distributed_timeout_minutes * 60)
        started = True
    from mfsdp.runtime import shutdown

    try:
        run(args, stop)
    except BaseException as exc:  # noqa: BLE001 - said once, in one line when it is the user's
        if not started:
            raise
        if not args.exit_signal_handler:
            leaving()  # torchrun's SIGTERM to the other ranks must not cut the report short
        # no barrier (a peer may never come); leave without the interpreter's teardown
        shutdown(barrier=False, exit_code=report_error(exc, args.debug))
    if started:
        if not args.exit_signal_handler:
            leaving()
        # This process owns the group: barrier, destroy, and leave without the interpreter's
        # teardown, in which gloo's threads can abort a finished run (see shutdown()).
        shutdown(exit_code=0)
    return 0
