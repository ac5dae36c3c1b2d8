"""How long a preemption save may take, how long saves really take, and what a clean preemption
save leaves for the job script.

A SIGTERM is followed by a SIGKILL after a grace the launcher or scheduler fixes:

- ``torchrun`` that receives the signal forwards it to the ranks and kills them after its
  ``--shutdown-timeout`` (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``; 30 s by default);
- a Slurm script with ``#SBATCH --signal=B:TERM@N`` gives the ranks ``N`` seconds before the time
  limit; the mfsdp templates export that lead as ``MFSDP_PREEMPTION_GRACE_S``.

:func:`grace` reads it. With ``--exit-signal-handler`` rank 0 times every save
(:class:`SaveBudget`), keeps the last time in ``--save``'s ``save_time.json``, and says in one
line, at start-up (from the time a previous job recorded there) or after the first save that
does not fit, what to set.

After a save on SIGTERM, rank 0 writes ``$MFSDP_PREEMPTION_MARKER`` (when set): torchrun that got
the signal itself exits 1 (its ``SignalException``) although every rank saved and exited 0, and
the job script reads the marker to report success (see the guide's page Inside a Slurm script,
docs/slurm-scripts.md).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Callable

__all__ = ["GRACE_ENV", "MARKER_ENV", "SAVE_TIME_FILE", "SaveBudget", "grace",
           "torchrun_shutdown_timeout", "write_marker"]

GRACE_ENV = "MFSDP_PREEMPTION_GRACE_S"
MARKER_ENV = "MFSDP_PREEMPTION_MARKER"
SAVE_TIME_FILE = "save_time.json"
TORCHRUN_DEFAULT_S = 30  # torch.distributed.launcher.api: LaunchConfig.shutdown_timeout


def torchrun_shutdown_timeout(cmdline: list[str] | None = None,
                              env: dict | None = None) -> int:
    """The seconds torchrun waits after forwarding SIGTERM before it SIGKILLs its workers: its
    ``--shutdown-timeout``/``--shutdown_timeout`` flag (read from the launcher's command line,
    ``/proc/PPID/cmdline``, or ``cmdline``), else ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else 30.

    >>> torchrun_shutdown_timeout(["torchrun", "--shutdown-timeout", "90", "-m", "x"], {})
    90
    >>> torchrun_shutdown_timeout(["torchrun", "-m", "x"], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "45"})
    45
    """
    env = os.environ if env is None else env
    if cmdline is None:
        try:
            raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
            cmdline = raw.decode(errors="replace").split("\0")
        except OSError:
            cmdline = []
    # the launcher's own arguments: after `torchrun`, or after `python -m torch.distributed.run`
    args = cmdline[1:]
    if len(args) >= 2 and args[0] == "-m":
        args = args[2:]
    seconds = None
    if args:
        import contextlib
        import io

        from torch.distributed.run import get_args_parser

        try:
            with contextlib.redirect_stderr(io.StringIO()):
                seconds = get_args_parser().parse_args(args).shutdown_timeout
        except SystemExit:  # not torchrun's command line
            seconds = None
    if seconds is not None:
        return int(seconds)
    try:
        return int(env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", TORCHRUN_DEFAULT_S))
    except ValueError:
        return TORCHRUN_DEFAULT_S


def grace(env: dict | None = None) -> tuple[float, str, str] | None:
    """``(seconds, what gives them, how to raise them)`` between a preemption SIGTERM and the
    SIGKILL, or None when no launcher or scheduler fixes one (a plain process).

    ``MFSDP_PREEMPTION_GRACE_S`` (the mfsdp templates: Slurm's ``--signal`` lead) wins; under
    torchrun (``TORCHELASTIC_RUN_ID``) it is torchrun's shutdown timeout.

    >>> grace({"MFSDP_PREEMPTION_GRACE_S": "120"})[:2]
    (120.0, "the 120 s between Slurm's --signal and the time limit (MFSDP_PREEMPTION_GRACE_S)")
    >>> grace({}) is None
    True
    """
    env = os.environ if env is None else env
    value = env.get(GRACE_ENV, "")
    if value:
        try:
            seconds = float(value)
        except ValueError:
            raise SystemExit(f"mfsdp train: {GRACE_ENV}={value!r} is not a number of seconds; "
                             "set it to Slurm's --signal lead time, or unset it") from None
        return (seconds, f"the {seconds:g} s between Slurm's --signal and the time limit "
                         f"({GRACE_ENV})",
                "render the script with --set signal_seconds={need} (#SBATCH "
                "--signal=B:TERM@{need})")
    if env.get("TORCHELASTIC_RUN_ID"):
        seconds = torchrun_shutdown_timeout(env=env)
        return (float(seconds), f"the {seconds} s torchrun waits after SIGTERM before it kills "
                                "the ranks (its --shutdown-timeout)",
                "start torchrun with --shutdown-timeout {need} (or "
                "TORCH_ELASTIC_SHUTDOWN_TIMEOUT={need})")
    return None


def needed(save_s: float) -> int:
    """A grace that a save of ``save_s`` seconds fits with room: 1.5 x the save plus a minute
    for the iteration under way, rounded up to 10 s.

    >>> needed(41.0)
    130
    """
    return int(math.ceil((1.5 * save_s + 60) / 10) * 10)


class SaveBudget:
    """Rank 0's clock on saves: measures each, keeps the last in ``ROOT/save_time.json`` and says
    once per job, in one line, when a save does not fit the grace (:func:`grace`)."""

    def __init__(self, root: str | None, log: Callable[..., None], saves_on_signal: bool = True,
                 env: dict | None = None) -> None:
        # --save (None: nothing is saved, nothing to measure)
        self.root = Path(root) if root else None
        # rank 0's log (a no-op elsewhere)
        self.log = log
        # whether the run saves on SIGTERM (--exit-signal-handler): only such a run records
        # its saves' times and checks them
        self.saves_on_signal = saves_on_signal
        # (seconds, what gives them, the fix), or None: no launcher fixes one, or the run does
        # not save on SIGTERM
        self.grace = grace(env) if saves_on_signal else None
        # said once per job: a second slow save repeats nothing
        self.warned = False

    def recorded(self) -> dict | None:
        """What a previous save into ``--save`` recorded (``iteration``, ``seconds``), if any."""
        if self.root is None:
            return None
        try:
            data = json.loads((self.root / SAVE_TIME_FILE).read_text())
            return data if isinstance(data, dict) and float(data["seconds"]) >= 0 else None
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def at_start(self) -> None:
        """At start-up: the line, when the last recorded save would not fit the grace."""
        before = self.recorded()
        if before is not None:
            self.check(float(before["seconds"]),
                       f"the last save into {self.root} (iteration {before.get('iteration')}) "
                       "took")

    def after_save(self, iteration: int, seconds: float) -> None:
        """Record a save of ``seconds`` (rank 0) and check it against the grace."""
        if self.root is None or not self.saves_on_signal:
            return
        tmp = self.root / f".latest-save-time-{os.getpid()}"
        try:
            tmp.write_text(json.dumps({"iteration": iteration, "seconds": round(seconds, 3),
                                       "time": time.time()}))
            os.replace(tmp, self.root / SAVE_TIME_FILE)
        except OSError:
            tmp.unlink(missing_ok=True)  # a record only: the checkpoint itself is complete
        self.check(seconds, f"saving iteration {iteration} took")

    def check(self, seconds: float, what: str) -> None:
        """Say once when ``seconds`` of saving do not fit the grace."""
        if self.grace is None or self.warned:
            return
        limit, source, fix = self.grace
        if seconds <= 0.8 * limit:
            return
        self.warned = True
        need = needed(seconds)
        self.log(f"mfsdp train: warning: {what} {seconds:.1f} s, more than 80% of {source}: "
                 f"a save on SIGTERM would be killed before it completes (the previous "
                 f"checkpoint would stay the latest); {fix.format(need=need)}", flush=True)


def write_marker(iteration: int, save: str, env: dict | None = None) -> None:
    """After a complete save on SIGTERM: write ``$MFSDP_PREEMPTION_MARKER`` (rank 0), which
    tells the job script that torchrun's exit status 1 followed a clean save."""
    env = os.environ if env is None else env
    path = env.get(MARKER_ENV, "")
    if not path:
        return
    try:
        Path(path).write_text(json.dumps({"iteration": iteration, "save": str(save),
                                          "time": time.time()}) + "\n")
    except OSError as exc:  # the save is complete: say so, and leave the status to torchrun
        import sys

        sys.stderr.write(f"mfsdp train: note: saved iteration {iteration} on SIGTERM, but "
                         f"{MARKER_ENV}={path} cannot be written ({exc.strerror or exc}): the job "
                         "script sees only the launcher's exit status\n")
        sys.stderr.flush()
