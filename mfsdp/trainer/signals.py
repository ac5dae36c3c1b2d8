"""Stopping on request: SIGTERM (Slurm's preemption warning) makes every rank save and stop at
the same iteration."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from mfsdp.trainer.config import CheckpointConfig


class StopRequest:
    """SIGTERM (with ``--exit-signal-handler``) and ``--exit-duration-in-mins``, agreed by all ranks.

    The handler only records the signal; the loop checks it after each iteration, so the
    checkpoint is written between steps, by every rank, and the process exits with status 0.

    The :class:`~mfsdp.trainer.trainer.Trainer` owns its StopRequest: the entry point makes one
    as soon as the arguments are parsed (a preemption warning that comes while the process
    group forms, the model is built or a checkpoint loads is kept, and the run saves after its
    first iteration instead of dying with the signal) and hands it to the Trainer; a Trainer
    given none makes its own when the loop starts.
    """

    def __init__(self, handle_signal: bool) -> None:
        import signal

        # the signal number once SIGTERM arrived (None until then): read by reason()
        self.received: int | None = None
        # the SIGTERM handler before ours, put back by restore()
        self._previous = None
        if handle_signal:
            self._previous = signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum: int, frame: object) -> None:
        self.received = signum

    def reason(self, checkpoint: CheckpointConfig, t_start: float,
               device: torch.device) -> str | None:
        """Why to stop now ('' to go on), the same on every rank (``checkpoint``: the
        :class:`~mfsdp.trainer.config.job.CheckpointConfig`, which holds the exit flags)."""
        if not (checkpoint.exit_signal_handler or checkpoint.exit_duration_in_mins):
            return ""
        minutes = (time.perf_counter() - t_start) / 60
        flags = torch.tensor([float(self.received is not None),
                              float(bool(checkpoint.exit_duration_in_mins)
                                    and minutes >= checkpoint.exit_duration_in_mins)],
                             device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0] > 0:
            return "SIGTERM received (--exit-signal-handler)"
        if flags[1] > 0:
            return f"--exit-duration-in-mins {checkpoint.exit_duration_in_mins} reached"
        return ""

    def restore(self) -> None:
        """Put the previous SIGTERM handler back."""
        if self._previous is not None:
            import signal

            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


class Terminated(BaseException):
    """SIGTERM reached a rank that does not save on it (no ``--exit-signal-handler``): raised
    from the signal handler :func:`install_terminate` sets, so the rank says in one line why
    it stopped (``guard.report_error``) instead of dying silently."""


# the job's store key under which a rank that leaves on SIGTERM says so (see guard.lost_ranks)
TERMINATED_KEY = "mfsdp/terminated"


def note_terminated() -> None:
    """Tell the job's store that this rank leaves on a SIGTERM of its own (called from the
    signal handler, before a failed collective can be what this rank reports): the report of
    a lost rank (``guard.lost_ranks``) does not name it."""
    if not dist.is_initialized():
        return
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        _get_default_store().set(f"{TERMINATED_KEY}/{dist.get_rank()}", "1")
    except Exception:  # noqa: BLE001 - no store, or it is gone
        pass


def install_terminate() -> None:
    """Without ``--exit-signal-handler``: SIGTERM raises :class:`Terminated` once (the rank
    leaves at once, without saving, through the one-line report; status 143 as for SIGTERM;
    later SIGTERMs are ignored while it leaves). Under torchrun this is how a rank learns that
    a peer died: torchrun SIGTERMs the others. :func:`leaving` ends it."""
    import signal

    def handler(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the rank is on its way out
        note_terminated()  # (before a failed collective can be what this rank reports)
        raise Terminated()

    signal.signal(signal.SIGTERM, handler)


def leaving() -> None:
    """The rank is ending (its report said why, or the run finished): a SIGTERM from now on
    (torchrun's, to the ranks still running after one failed) cannot interrupt the report or the
    shutdown with a traceback; the launcher's SIGKILL after its shutdown timeout still ends a
    rank that hangs."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
