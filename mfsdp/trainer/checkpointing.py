"""The trainer's checkpoints: ``--save`` in each ``--ckpt-format``, ``--load`` of every format mfsdp
reads, and the learning-rate schedule saved and restored by Megatron-LM's rules.

:class:`Checkpointer` is the component the :class:`~mfsdp.trainer.trainer.Trainer` holds: it is
given the ``checkpoint`` and ``training`` groups (:class:`~mfsdp.trainer.config.CheckpointConfig`,
:class:`~mfsdp.trainer.config.TrainingConfig`) and the EP size."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from mfsdp.checkpoint.manifest import (RankZeroOSError, describe_os_error, os_error_in,
                                      os_error_remedy)
from mfsdp.trainer.signals import slow_save_for_tests


class Checkpointer:
    """Saves to ``--save`` and resumes from ``--load`` for a run whose model configuration is
    ``cfg`` (collective calls: every rank calls them)."""

    def __init__(self, checkpoint, training, expert_model_parallel_size: int, cfg) -> None:
        # the checkpoint group: --save, --load, the format, verification, the schedule's rule
        self.checkpoint = checkpoint
        # the training group: its learning-rate schedule is saved, and restored by --load
        # under --use-checkpoint-opt_param-scheduler
        self.training = training
        # the EP size a torch_dist export lays experts out for
        self.expert_model_parallel_size = expert_model_parallel_size
        # the model's configuration, saved beside the weights (model_config.json)
        self.cfg = cfg
        # what the --load checkpoint carried from the Megatron-LM job it came from
        # (megatron_lm_args), kept in every save: an export back writes that job's optimizer
        # layout (with or without the distributed optimizer)
        self.carried: dict = {}

    def save(self, model, opt, iteration: int, routers) -> None:
        """Save iteration ``iteration`` into ``--save`` in ``--ckpt-format``.

        A save the file system refuses (full, read-only, no permission: an ``OSError`` on any
        rank, also inside ``torch.distributed.checkpoint``'s per-rank report) stops the job with
        one line naming the path and the previous checkpoint, which the save never touched."""
        save = self.checkpoint.save
        try:
            self._save(model, opt, iteration, routers)
        except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
            cause = os_error_in(exc)
            if cause is None:
                raise
            raise SystemExit(f"mfsdp train: saving iteration {iteration} into --save {save} "
                             f"failed: {describe_os_error(cause)}; {previous_checkpoint(save)}; "
                             f"{os_error_remedy(cause)} or choose another --save, then "
                             "resume") from None

    def _save(self, model, opt, iteration: int, routers) -> None:
        """:meth:`save` without its error message."""
        _save_step(self.checkpoint, self.training, self.expert_model_parallel_size, model, opt,
                   iteration, routers, self.cfg, self.carried)

    def load(self, model, opt, routers) -> int:
        """Resume from ``--load`` (see :func:`~mfsdp.trainer.checkpointing.load_for_training`);
        0 without ``--load``."""
        if not self.checkpoint.load:
            return 0
        resumed = load_for_training(self.checkpoint, self.training, model, opt, routers,
                                    self.cfg, self.carried)
        check_save_not_newer(self.checkpoint, resumed)
        return resumed


def _pointers(root: Path):
    """``(name, text)`` of each readable pointer file of ``root``: mfsdp's ``latest``, then
    Megatron-LM's tracker."""
    from mfsdp.checkpoint.detect import TRACKER

    for name in ("latest", TRACKER):
        try:
            yield name, (root / name).read_text().strip()
        except (OSError, UnicodeDecodeError):
            continue


def latest_iteration(root) -> int | None:
    """The iteration ``root``'s ``latest`` (or Megatron-LM's tracker) names, or None."""
    for _, text in _pointers(Path(root)):
        digits = text.removeprefix("iter_")
        if digits.isdigit():
            return int(digits)
    return None


def check_save_not_newer(checkpoint, resumed: int) -> None:
    """Refuse to train on when ``--save`` (another directory than ``--load``) already holds a
    checkpoint newer than the iteration resumed from: the run would overwrite it with a
    history it never had (a requeued job given an old --load, or two runs' paths swapped)."""
    if not (checkpoint.save and checkpoint.load):
        return
    save, load = Path(checkpoint.save), Path(checkpoint.load)
    try:
        if save.resolve() == load.resolve():
            return
    except OSError:
        return
    newer = latest_iteration(save)
    if newer is not None and newer > resumed:
        raise SystemExit(f"mfsdp train: --save {save} already holds iteration {newer}, newer "
                         f"than iteration {resumed} resumed from --load {load}: training on "
                         "would replace its checkpoints with another history. Resume from it "
                         "(--load "
                         f"{save}), or choose a new --save")


def previous_checkpoint(root) -> str:
    """Which checkpoint of ``root`` still loads (what ``latest`` or Megatron-LM's tracker
    names), for the message of a failed save."""
    root = Path(root)
    for name, text in _pointers(root):
        if name != "latest" and text.isdigit():  # Megatron-LM's tracker holds the number
            text = f"iter_{int(text):07d}"
        if text and Path(text).name == text and (root / text).is_dir():
            return (f"the previous checkpoint, {root / text} (named by {name}), is untouched and "
                    "is what --load reads")
    return "no earlier checkpoint is in it"


def _save_step(checkpoint, training, ep: int, model, opt, iteration: int, routers,
               cfg, carried: dict | None = None) -> None:
    """Write iteration ``iteration`` into ``checkpoint.save`` in ``checkpoint.ckpt_format``: a
    sharded save, converted on rank 0 for the other formats; ``carried`` joins its ``extra``."""
    from mfsdp.checkpoint import save_checkpoint
    from mfsdp.checkpoint.dcp import MODEL_CONFIG_FILE
    from mfsdp.checkpoint.full import fsdp_to_full

    extra = {"expert_bias": {n: m.expert_bias.detach().cpu().clone() for n, m in routers},
             "data_position": iteration,
             "opt_param_scheduler": scheduler_state(training, iteration), **(carried or {})}
    files = {MODEL_CONFIG_FILE: json.dumps(cfg.to_dict(), indent=1)}
    root = Path(checkpoint.save)
    slow_save_for_tests()
    if checkpoint.ckpt_format == "fsdp_dtensor":
        save_checkpoint(root, model, opt, iteration=iteration, extra=extra, files=files)
        return
    staging = root / ".staging-fsdp_dtensor"
    written = save_checkpoint(staging, model, opt, iteration=iteration, extra=extra, files=files)
    error = [None]
    if dist.get_rank() == 0:  # rank 0 converts the sharded save into the asked format
        try:
            if checkpoint.ckpt_format == "torch_dist":
                export_megatron_lm(ep, written, root, iteration, cfg)
            else:
                final = root / written.name
                if final.exists():
                    shutil.rmtree(final)
                fsdp_to_full(written, final, verify=False)  # hashed by this very save
                (root / ".latest-tmp").write_text(written.name + "\n")
                os.replace(root / ".latest-tmp", root / "latest")
        except Exception as exc:  # noqa: BLE001 - every rank stops with the reason
            cause = os_error_in(exc)
            error[0] = cause if cause is not None else f"{type(exc).__name__}: {exc}"
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    dist.broadcast_object_list(error, src=0)
    if isinstance(error[0], OSError):
        raise RankZeroOSError(error[0])
    if error[0]:
        raise RuntimeError(f"--ckpt-format {checkpoint.ckpt_format}: writing iteration "
                           f"{iteration} to "
                           f"{root} failed: {error[0]}")


def export_megatron_lm(ep: int, written: Path, root: Path, iteration: int, cfg) -> None:
    """Megatron-LM's ``torch_dist`` into the save root, as Megatron-LM lays it out (experts for
    EP size ``ep``): the iteration directory moved in whole, then the tracker replaced (a crash
    in between leaves the previous iteration the one that loads)."""
    from mfsdp.checkpoint.detect import TRACKER
    from mfsdp.checkpoint.megatron_lm import fsdp_to_megatron_lm

    tmp_root = root / f".export-iter_{iteration:07d}"
    shutil.rmtree(tmp_root, ignore_errors=True)
    try:
        fsdp_to_megatron_lm(written, tmp_root, cfg.to_dict(), progress=False, verify=False,
                            expert_model_parallel_size=ep)
        name = f"iter_{iteration:07d}"
        final = root / name
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp_root / name, final)
        (root / f".{TRACKER}.tmp").write_text(str(iteration))
        os.replace(root / f".{TRACKER}.tmp", root / TRACKER)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)


# Megatron-LM's OptimizerParamScheduler state keys and the names its messages use; steps are
# iterations here (Megatron-LM counts samples when it trains by --train-samples).
SCHEDULER_FIELDS = (("max_lr", "lr", "learning rate"), ("min_lr", "min_lr", "minimum learning rate"),
              ("lr_warmup_steps", "lr_warmup_iters", "warmup iterations"),
              ("lr_decay_steps", "lr_decay_iters", "total number of iterations"),
              ("lr_decay_style", "lr_decay_style", "learning rate decay style"))


def scheduler_state(training, iteration: int) -> dict:
    """The learning-rate schedule a checkpoint records (Megatron-LM's opt_param_scheduler fields)
    of the ``training`` group (:class:`~mfsdp.trainer.config.TrainingConfig`)."""
    state = {key: getattr(training, attr) for key, attr, _ in SCHEDULER_FIELDS}
    state["lr_decay_steps"] = training.lr_decay_iters or training.train_iters
    state["num_steps"] = iteration
    return state


def restore_scheduler(training, checkpoint, saved: dict | None) -> None:
    """Megatron-LM's rule for the schedule of a resumed run: the ``training`` group's values must
    equal the checkpoint's, unless ``--override-opt_param-scheduler`` (the command's win) or
    ``--use-checkpoint-opt_param-scheduler`` (the checkpoint's win: written into ``training``),
    both in the ``checkpoint`` group."""
    if not saved or checkpoint.override_opt_param_scheduler:
        return
    mine = scheduler_state(training, 0)
    if checkpoint.use_checkpoint_opt_param_scheduler:
        for key, attr, _ in SCHEDULER_FIELDS:
            setattr(training, attr, saved[key])
        return
    for key, attr, name in SCHEDULER_FIELDS:
        if mine[key] != saved[key]:
            flag = "--" + attr.replace("_", "-")
            if key == "lr_decay_steps":
                flag = "--lr-decay-iters (default --train-iters)"
            raise SystemExit(
                f"--load: the {name} ({flag}) is {mine[key]} here and {saved[key]} in the "
                "checkpoint; pass the checkpoint's value, --use-checkpoint-opt_param-scheduler to "
                "continue its schedule, or --override-opt_param-scheduler to use this command's")


def convert_on_rank0(tmp: Path, convert) -> None:
    """``convert(tmp)`` on rank 0 (a stale ``tmp`` removed first); every rank stops with the
    reason if it fails, none waits at a barrier for a rank that raised."""
    from mfsdp.checkpoint.dcp import on_rank_zero

    def work():
        if tmp.exists():
            shutil.rmtree(tmp)
        convert(tmp)

    error = on_rank_zero(work, cleanup=lambda: shutil.rmtree(tmp, ignore_errors=True))
    if error:
        raise SystemExit(f"--load: {error}")


def check_load_exists(root) -> None:
    """``--exit-on-missing-checkpoint``: stop (every rank, one line) when ``--load`` is a new or
    empty directory."""
    from mfsdp.checkpoint.detect import is_empty_directory

    root = Path(root)
    if not root.exists() or is_empty_directory(root):
        raise SystemExit(f"mfsdp train: --load {root}: no checkpoint there, and "
                         "--exit-on-missing-checkpoint asks to stop")


def load_for_training(checkpoint, training, model, opt, routers, cfg,
                      carried: dict | None = None) -> int:
    """Resume from ``checkpoint.load`` in any format mfsdp reads; return the iteration to
    continue after (0 for a new or empty directory). Refuses what is not a checkpoint (see the
    trainer page); the schedule follows ``restore_scheduler``. ``carried`` receives what later
    saves keep of the checkpoint (``megatron_lm_args``)."""
    from mfsdp.checkpoint import load_checkpoint, read_manifest
    from mfsdp.checkpoint.full import full_to_fsdp
    from mfsdp.checkpoint.manifest import is_full_format
    from mfsdp.checkpoint.manifest import resolve_checkpoint
    from mfsdp.checkpoint.detect import resolve_megatron_lm
    from mfsdp.checkpoint.megatron_lm import megatron_lm_to_fsdp

    from mfsdp.checkpoint.detect import (describe_non_checkpoint, describe_unreadable,
                                         is_empty_directory)
    from mfsdp.checkpoint.formats import detect

    root = Path(checkpoint.load)
    found = detect(root)  # the format registry's answer (mfsdp/checkpoint/formats.py)
    if found == "megatron_fsdp":
        load_checkpoint(root, model, opt)
        if dist.get_rank() == 0:
            print(f"--load {root}: loaded an upstream Megatron-FSDP checkpoint (weights and "
                  "optimizer state); training starts at iteration 0", flush=True)
        return 0
    tmp = None
    if found == "megatron_lm":
        # Megatron-LM's torch_dist or fsdp_dtensor: rank 0 converts it with this job's model config
        directory, _ = resolve_megatron_lm(root)
        tmp = root / f".from-megatron_lm-{directory.name}"
        convert_on_rank0(tmp, lambda out: megatron_lm_to_fsdp(root, out, cfg.to_dict()))
        path = tmp
    else:
        unreadable = describe_unreadable(root)
        if unreadable:  # never a silent fresh start over a checkpoint we cannot read
            raise SystemExit(f"--load: {unreadable}")
        if not root.exists() or is_empty_directory(root):
            if checkpoint.exit_on_missing_checkpoint:
                check_load_exists(root)
            if dist.get_rank() == 0:
                print(f"--load {root}: no checkpoint there yet, starting from iteration 0",
                      flush=True)
            return 0
        if not ((root / "latest").exists() or (root / "manifest.json").exists()):
            # anything else is refused: a fresh start would later overwrite what is there
            raise SystemExit(f"mfsdp train: --load: {describe_non_checkpoint(root)}"
                             if dist.get_rank() == 0 else 1)
        path = resolve_checkpoint(root)
    if tmp is None and is_full_format(read_manifest(path)):
        tmp = root / f".from-mfsdp_full-{path.name}"
        convert_on_rank0(tmp, lambda out: full_to_fsdp(path, out, verify=checkpoint.ckpt_verify))
        path = tmp
    # --no-ckpt-verify skips the check; a conversion this job just wrote is not checked again
    extra = load_checkpoint(path, model, opt, verify=checkpoint.ckpt_verify and tmp is None)
    if extra.get("not_carried") and dist.get_rank() == 0:  # what a conversion left behind
        print(f"--load {root}: not carried: {', '.join(extra['not_carried'])}", flush=True)
    if int(extra["iteration"]) == 0 and dist.get_rank() == 0:
        print(f"--load {root}: loaded the weights of {path} (iteration 0, e.g. imported from "
              "Hugging Face); training starts from them", flush=True)
    dist.barrier()
    if tmp is not None and dist.get_rank() == 0:
        shutil.rmtree(tmp)
    with torch.no_grad():
        for name, m in routers:
            if name in extra.get("expert_bias", {}):
                m.expert_bias.copy_(extra["expert_bias"][name])
    restore_scheduler(training, checkpoint, extra.get("opt_param_scheduler"))
    if carried is not None and "megatron_lm_args" in extra:
        carried["megatron_lm_args"] = extra["megatron_lm_args"]
    return int(extra["iteration"])
