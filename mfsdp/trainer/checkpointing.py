"""The trainer's checkpoints: ``--save`` in the ``--ckpt-format`` the format registry
(``mfsdp.checkpoint.formats``) writes, ``--load`` of every format mfsdp reads, and the
components' states saved beside the model and optimizer.

:class:`Checkpointer` is the component the :class:`~mfsdp.trainer.trainer.Trainer` holds, in
torchtitan's ``CheckpointManager`` shape: it is given the ``checkpoint`` group
(:class:`~mfsdp.trainer.config.CheckpointConfig`), the model's configuration and the EP size,
and saves and loads the model, the optimizer and a dict of components with ``state_dict`` /
``load_state_dict`` (:mod:`mfsdp.trainer.state`: the learning-rate schedule, the Trainer's own
progress, the routers' bias), each under its name in the checkpoint's ``extra``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from mfsdp.checkpoint.manifest import (RankZeroOSError, describe_os_error, os_error_in,
                                      os_error_remedy)
from mfsdp.models.config import GPTConfig
from mfsdp.trainer.config import CheckpointConfig
from mfsdp.trainer.state import SCHEDULER_FIELDS, LRScheduler  # noqa: F401 (older imports)


class Stateful(Protocol):
    """A component whose state a checkpoint keeps (torchtitan's ``Stateful``)."""

    def state_dict(self) -> dict[str, Any]:
        """The state to save."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take over a saved state (empty: the checkpoint has none)."""


class Checkpointer:
    """Saves to ``--save`` and resumes from ``--load`` for a run whose model configuration is
    ``cfg`` (collective calls: every rank calls them)."""

    def __init__(self, checkpoint: CheckpointConfig, cfg: GPTConfig,
                 expert_model_parallel_size: int = 1) -> None:
        # the checkpoint group: --save, --load, the format, verification
        self.checkpoint = checkpoint
        # the model's configuration, saved beside the weights (model_config.json)
        self.cfg = cfg
        # the EP size a torch_dist export lays experts out for
        self.expert_model_parallel_size = expert_model_parallel_size
        # what the --load checkpoint carried from the Megatron-LM job it came from
        # (megatron_lm_args), kept in every save: an export back writes that job's optimizer
        # layout (with or without the distributed optimizer)
        self.carried: dict = {}

    def save(self, model: torch.nn.Module, opt: torch.optim.Optimizer, iteration: int,
             states: dict[str, Stateful]) -> None:
        """Save iteration ``iteration`` (the model, the optimizer and each of ``states`` under
        its name) into ``--save`` in ``--ckpt-format``.

        A save the file system refuses (full, read-only, no permission: an ``OSError`` on any
        rank, also inside ``torch.distributed.checkpoint``'s per-rank report) stops the job with
        one line naming the path and the previous checkpoint, which the save never touched."""
        save = self.checkpoint.save
        try:
            self._save(model, opt, iteration, states)
        except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
            cause = os_error_in(exc)
            if cause is None:
                raise
            raise SystemExit(f"mfsdp train: saving iteration {iteration} into --save {save} "
                             f"failed: {describe_os_error(cause)}; {previous_checkpoint(save)}; "
                             f"{os_error_remedy(cause)} or choose another --save, then "
                             "resume") from None

    def _save(self, model: torch.nn.Module, opt: torch.optim.Optimizer, iteration: int,
              states: dict[str, Stateful]) -> None:
        """:meth:`save` without its error message: a sharded save, written by the registry's
        format on rank 0 when ``--ckpt-format`` is another than the common form."""
        from mfsdp.checkpoint import formats, save_checkpoint
        from mfsdp.checkpoint.dcp import MODEL_CONFIG_FILE

        # (data_position: the key Megatron-LM's checkpoints and older mfsdp ones have)
        extra = {"data_position": iteration, **self.carried,
                 **{name: state.state_dict() for name, state in states.items()}}
        files = {MODEL_CONFIG_FILE: json.dumps(self.cfg.to_dict(), indent=1)}
        root = Path(self.checkpoint.save)
        fmt = formats.get(self.checkpoint.ckpt_format)
        if fmt.train_write is None:  # the common form itself
            save_checkpoint(root, model, opt, iteration=iteration, extra=extra, files=files)
            return
        staging = root / f".staging-{formats.COMMON}"
        written = save_checkpoint(staging, model, opt, iteration=iteration, extra=extra,
                                  files=files)
        options = SimpleNamespace(model_cfg=self.cfg.to_dict(),
                                  expert_model_parallel_size=self.expert_model_parallel_size)
        _on_rank0(lambda: fmt.train_write(written, root, iteration, options), staging,
                  f"--ckpt-format {self.checkpoint.ckpt_format}: writing iteration {iteration} "
                  f"to {root} failed")

    def load(self, model: torch.nn.Module, opt: torch.optim.Optimizer,
             states: dict[str, Stateful]) -> int:
        """Resume from ``--load`` (see :func:`~mfsdp.trainer.checkpointing.load_for_training`):
        the model, the optimizer, and each of ``states`` from its name in the checkpoint (an
        empty state where the checkpoint has none); return the iteration resumed from (0
        without ``--load``)."""
        if not self.checkpoint.load:
            return 0
        extra = load_for_training(self.checkpoint, model, opt, self.cfg)
        if "megatron_lm_args" in extra:
            self.carried["megatron_lm_args"] = extra["megatron_lm_args"]
        for name, state in states.items():
            state.load_state_dict(extra.get(name) or {})
        resumed = int(extra.get("iteration", 0))
        check_save_not_newer(self.checkpoint, resumed)
        return resumed


def _on_rank0(work: Callable[[], None], staging: Path, failed: str) -> None:
    """``work()`` on rank 0, ``staging`` removed after it; every rank stops with the reason
    when it fails (an ``OSError`` as itself, for the save's one-line message)."""
    from mfsdp.checkpoint.dcp import on_rank_zero

    def run():
        try:
            work()
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def describe(exc: BaseException) -> object:
        cause = os_error_in(exc)
        return cause if cause is not None else f"{type(exc).__name__}: {exc}"

    error = on_rank_zero(run, describe=describe)
    if isinstance(error, OSError):
        raise RankZeroOSError(error)
    if error:
        raise RuntimeError(f"{failed}: {error}")


def _pointers(root: Path):
    """``(name, text)`` of each readable pointer file of ``root``: mfsdp's ``latest``, then
    Megatron-LM's tracker."""
    from mfsdp.checkpoint.detect import TRACKER

    for name in ("latest", TRACKER):
        try:
            yield name, (root / name).read_text().strip()
        except (OSError, UnicodeDecodeError):
            continue


def latest_iteration(root: str | Path) -> int | None:
    """The iteration ``root``'s ``latest`` (or Megatron-LM's tracker) names, or None."""
    for _, text in _pointers(Path(root)):
        digits = text.removeprefix("iter_")
        if digits.isdigit():
            return int(digits)
    return None


def check_save_not_newer(checkpoint: CheckpointConfig, resumed: int) -> None:
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


def previous_checkpoint(root: str | Path) -> str:
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


def scheduler_state(training: Any, iteration: int) -> dict[str, Any]:
    """The learning-rate schedule a checkpoint records after ``iteration`` iterations
    (Megatron-LM's ``opt_param_scheduler`` fields) for the ``training`` group: the
    :class:`~mfsdp.trainer.state.LRScheduler`'s ``state_dict``."""
    scheduler = LRScheduler.from_config(training)
    scheduler.num_steps = iteration
    return scheduler.state_dict()


def restore_scheduler(training: Any, checkpoint: Any, saved: dict | None) -> LRScheduler:
    """The schedule of a resumed run by Megatron-LM's rule (see
    :meth:`~mfsdp.trainer.state.LRScheduler.load_state_dict`): the ``training`` group's
    schedule with the checkpoint's state ``saved`` loaded. The configuration is not changed."""
    scheduler = LRScheduler.from_config(training, checkpoint)
    scheduler.load_state_dict(saved or {})
    return scheduler


def convert_on_rank0(tmp: Path, convert: Callable[[Path], Any]) -> None:
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


def check_load_exists(root: str | Path) -> None:
    """``--exit-on-missing-checkpoint``: stop (every rank, one line) when ``--load`` is a new or
    empty directory."""
    from mfsdp.checkpoint.detect import is_empty_directory

    root = Path(root)
    if not root.exists() or is_empty_directory(root):
        raise SystemExit(f"mfsdp train: --load {root}: no checkpoint there, and "
                         "--exit-on-missing-checkpoint asks to stop")


def load_for_training(checkpoint: CheckpointConfig, model: torch.nn.Module,
                      opt: torch.optim.Optimizer, cfg: GPTConfig) -> dict[str, Any]:
    """Load ``checkpoint.load``, in any format mfsdp reads, into ``model`` and ``opt``; return
    the checkpoint's ``extra`` (``iteration``: the one to continue after, 0 for a new or empty
    directory; the components' states by name). The format registry
    (``mfsdp.checkpoint.formats``) recognises the format and says how it is read: loaded as
    it is, or converted into the common form inside the ``--load`` root first
    (``train_converts``). Refuses what is not a checkpoint (see the guide's
    Trainer reference, docs/trainer-reference.md)."""
    from mfsdp.checkpoint import formats, load_checkpoint
    from mfsdp.checkpoint.detect import (describe_non_checkpoint, describe_unreadable,
                                         is_empty_directory)
    from mfsdp.checkpoint.manifest import resolve_checkpoint

    root = Path(checkpoint.load)
    found = formats.detect(root)
    fmt = formats.get(found) if found is not None else None
    if fmt is None or (fmt.load is None and not fmt.train_converts):
        unreadable = describe_unreadable(root)
        if unreadable:  # never a silent fresh start over a checkpoint we cannot read
            raise SystemExit(f"--load: {unreadable}")
        if not root.exists() or is_empty_directory(root):
            if checkpoint.exit_on_missing_checkpoint:
                check_load_exists(root)
            if dist.get_rank() == 0:
                print(f"--load {root}: no checkpoint there yet, starting from iteration 0",
                      flush=True)
            return {"iteration": 0}
        # anything else is refused: a fresh start would later overwrite what is there
        raise SystemExit(f"mfsdp train: --load: {describe_non_checkpoint(root)}"
                         if dist.get_rank() == 0 else 1)
    path = resolve_checkpoint(root) if fmt.resolves_latest else root
    tmp = None
    if fmt.train_converts:  # rank 0 converts it with this job's model configuration
        tmp = root / f".from-{fmt.name}-{path.name}"
        options = SimpleNamespace(model_cfg=cfg.to_dict(), verify=checkpoint.ckpt_verify)
        source = path
        convert_on_rank0(tmp, lambda out: fmt.to_common(source, out, options))
        path = tmp
    # --no-ckpt-verify skips the check; a conversion this job just wrote is not checked again
    extra = load_checkpoint(path, model, opt, verify=checkpoint.ckpt_verify and tmp is None)
    if extra.get("not_carried") and dist.get_rank() == 0:  # what a conversion left behind
        print(f"--load {root}: not carried: {', '.join(extra['not_carried'])}", flush=True)
    if int(extra.get("iteration", 0)) == 0 and dist.get_rank() == 0:
        print(f"--load {root}: loaded {fmt.train_note}; training starts at iteration 0"
              if fmt.train_note else
              f"--load {root}: loaded the weights of {path} (iteration 0, e.g. imported from "
              "Hugging Face); training starts from them", flush=True)
    dist.barrier()
    if tmp is not None and dist.get_rank() == 0:
        shutil.rmtree(tmp)
    return extra
