"""What keeps a training job from failing silently or harming another: the save directory's lock,
the progress board and its hang report, the launcher watch, and the one-line form of user errors.

- :class:`SaveLock`: ``--save DIR`` belongs to one job at a time (``DIR/.lock`` names the holder's
  host, pid and job); a second job refuses to start, a lock whose holder died is taken over, and
  the leftovers of unfinished saves are removed and named.
- :class:`Watch`: every rank posts where it is (``iteration 3: backward``) to the job's store; a
  background thread notices when its rank made no progress for nearly
  ``--distributed-timeout-minutes`` and prints, once per job, which rank is behind and where
  every rank waits. Under ``torchrun`` it also stops a rank whose launcher died (PyTorch leaves
  such ranks running, training and saving).
- :func:`report_error`: a user error (a bad flag, a checkpoint that cannot be read, a NaN) is
  one line, printed once per job, without a traceback unless ``--debug``.

See the reliability page of the guide for what each guard guarantees and how it is tested.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Iterable

import torch.distributed as dist

from mfsdp.trainer.signals import TERMINATED_KEY

__all__ = ["SaveLock", "Watch", "report_error", "is_user_error", "LOCK_FILE", "UNFINISHED"]

LOCK_FILE = ".lock"
# what an interrupted save, export or conversion leaves in a save root (never read)
UNFINISHED = (".tmp-", ".staging-", ".export-", ".from-", ".latest-")
HEARTBEAT_S = 30.0  # the holder touches its lock this often
# Every rank's watch thread posts its position, with the time as a heartbeat, every ALIVE_S
# seconds (more rarely in large jobs, so that the store sees at most about 250 such writes a
# second); a rank silent for three periods is stopped, or its host is gone.
ALIVE_S = 2.0
STALE_AFTER_S = 300.0  # a lock on another host untouched this long is a dead job's


def _store():
    """The job's key-value store (the one the process group was made from), or None."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001 - no group, or a backend without a store
        return None


def _first(store: dist.Store | None, key: str) -> bool:
    """Whether this rank is the first of the job to claim ``key`` (``store.add`` is atomic)."""
    if store is None:
        return True
    try:
        return store.add(f"mfsdp/once/{key}", 1) == 1
    except Exception:  # noqa: BLE001 - the store is gone (the job is ending): say it anyway
        return True


def _reported(store: dist.Store | None) -> bool:
    """Whether a rank of this job has already said what ended it (see :func:`report_error`)."""
    if store is None:
        return False
    try:
        return bool(store.check(["mfsdp/once/error"]))
    except Exception:  # noqa: BLE001 - the store is gone: nobody can tell
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    if not _alive(pid):
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _job_id() -> str:
    return os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or ""


class SaveLock:
    """``DIR/.lock``: one job saves into a directory at a time (rank 0 holds it).

    The lock file is JSON (``host``, ``pid``, ``job``, ``started``); its modification time is the
    holder's heartbeat (:meth:`touch`, every ``HEARTBEAT_S`` seconds from :class:`Watch`).
    A lock is the holder's as long as the holder lives: on this host, while its pid exists; on
    another host, while the heartbeat is younger than ``STALE_AFTER_S``. The same job
    restarted (``SLURM_JOB_ID`` or torchrun's run id) takes its own lock over.
    """

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.path = self.root / LOCK_FILE
        self.held = False
        self.notes: list[str] = []  # what acquiring found and did (stale lock, leftovers)

    def _holder(self) -> dict | None:
        try:
            info = json.loads(self.path.read_text())
            return info if isinstance(info, dict) else {}
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable: treated by its age only

    def _stale(self, info: dict) -> str:
        """Why the holder of ``info`` is gone ('' when it may be alive)."""
        try:
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return "it was released"
        job = _job_id()
        # on this host the holder's pid decides, also for this job's earlier attempt (a
        # requeue or restart whose previous rank 0 still lives, e.g. still saving)
        if info.get("host") == socket.gethostname() and isinstance(info.get("pid"), int):
            if not _alive(info["pid"]):
                return f"its process {info['pid']} on this host is gone"
            return ""
        if job and info.get("job") == job:
            return f"it is this job's ({job}), from before a restart"
        if age > STALE_AFTER_S and not self._heartbeat_moves():
            return f"its heartbeat stopped {age:.0f} s ago"
        return ""

    def _heartbeat_moves(self) -> bool:
        """Whether the lock's heartbeat moves within one heartbeat period and a sixth: a lock
        that looks old only because a clock jumped or two hosts' clocks disagree is still
        touched by its live holder, and is not taken over."""
        try:
            before = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            return False
        deadline = time.monotonic() + HEARTBEAT_S * 7 / 6  # (35 s: a period and a margin)
        while time.monotonic() < deadline:
            time.sleep(min(1.0, HEARTBEAT_S / 4))
            try:
                if self.path.stat().st_mtime_ns != before:
                    return True
            except FileNotFoundError:
                return False
        return False

    def acquire(self) -> None:
        """Take the lock or raise SystemExit naming the holder; then remove (and note) what
        unfinished saves left behind, which only a dead job can have left. A file system that
        refuses the lock (full, read-only, not a directory) stops the job in one line, before
        any training that could not be saved."""
        from mfsdp.checkpoint.manifest import describe_os_error, os_error_remedy

        try:
            self._acquire()
        except NotADirectoryError as exc:
            raise SystemExit(f"mfsdp train: --save {self.root}: {exc.filename} is a file, not a "
                             "directory; choose another --save") from None
        except FileExistsError as exc:
            raise SystemExit(f"mfsdp train: --save {self.root}: {exc.filename} is a file, not a "
                             "directory; choose another --save") from None
        except OSError as exc:
            raise SystemExit(f"mfsdp train: --save {self.root}: cannot take its lock before "
                             f"training: {describe_os_error(exc)}; {os_error_remedy(exc)} or "
                             "choose another --save (nothing was trained, nothing is lost)"
                             ) from None

    def _acquire(self) -> None:
        """:meth:`acquire` without its file-system message."""
        self.root.mkdir(parents=True, exist_ok=True)
        mine = {"host": socket.gethostname(), "pid": os.getpid(), "job": _job_id(),
                "started": datetime.datetime.now().isoformat(timespec="seconds")}
        tmp = self.root / f".lock-{socket.gethostname()}-{os.getpid()}"
        tmp.write_text(json.dumps(mine))
        try:
            for _ in range(3):
                try:
                    os.link(tmp, self.path)  # atomic, also on NFS
                    self.held = True
                    break
                except FileExistsError:
                    info = self._holder()
                    if info is None:
                        continue  # released in between: try again
                    why = self._stale(info)
                    if not why:
                        age = time.time() - self.path.stat().st_mtime
                        raise SystemExit(
                            f"mfsdp train: --save {self.root} is in use by "
                            f"{('job ' + info['job'] + ', ') if info.get('job') else ''}"
                            f"pid {info.get('pid', '?')} on {info.get('host', '?')} (since "
                            f"{info.get('started', '?')}, heartbeat {age:.0f} s ago): two jobs "
                            "saving into one directory replace each other's checkpoints. Use "
                            f"another --save, or stop that job (a dead job's lock is taken over "
                            f"at once on its host, after {STALE_AFTER_S / 60:.0f} minutes "
                            f"elsewhere; {self.path} can be deleted by hand once it is dead)")
                    self.notes.append(f"took over the lock of {self.root} ({why})")
                    try:
                        self.path.unlink()
                    except FileNotFoundError:
                        pass
            if not self.held:
                raise SystemExit(f"mfsdp train: could not take the lock {self.path}: another job "
                                 "keeps taking it; is a second job starting with this --save?")
        finally:
            tmp.unlink(missing_ok=True)
        self._remove_unfinished()

    def _remove_unfinished(self) -> None:
        import shutil

        left = sorted(p for p in self.root.iterdir()
                      if p.name.startswith(UNFINISHED) and p.name != LOCK_FILE
                      and not p.name.startswith(".lock-"))
        for p in left:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        if left:
            self.notes.append(f"removed {len(left)} unfinished save(s) an earlier job left in "
                              f"{self.root}: {', '.join(p.name for p in left)}")

    def touch(self) -> None:
        """The heartbeat: the lock's modification time is now."""
        if self.held:
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> str:
        """Remove the lock (only if it is still ours). Never raises: it runs in ``finally``
        blocks, where an error would hide the one that ended the run; returns why the lock
        could not be removed ('' when it was), for a note (the next job takes it over)."""
        if not self.held:
            return ""
        self.held = False
        try:
            info = self._holder()
            if info and info.get("pid") == os.getpid() and info.get("host") == socket.gethostname():
                self.path.unlink(missing_ok=True)
        except OSError as exc:
            return (f"could not remove the lock {self.path} ({exc.strerror or exc}); the next "
                    "job on this host takes it over")
        return ""


class Watch:
    """The progress board, the hang report and the launcher watch of one rank.

    :meth:`mark` notes this rank's position (a counter and a phrase); the training loop calls it
    several times an iteration, so it posts to the job's store at most once per ``alive_s``
    seconds. A daemon thread wakes every second and posts the position with the time (the
    heartbeat) when ``alive_s`` passed without a post; when the mark has not moved for ``report_after_s`` (a little
    less than the collectives' timeout, so the report comes before the timeout's error), it
    reads every rank's post and prints one report per job; under ``torchrun``
    (``TORCHELASTIC_RUN_ID``) it ends the process when the launcher that started it is gone.
    """

    def __init__(self, timeout_s: float, lock: SaveLock | None = None):
        self.store = _store()
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.timeout_s = timeout_s
        self.report_after_s = max(timeout_s - 15.0, 0.8 * timeout_s)
        self.lock = lock
        # (counter, wall time, phrase): replaced whole, so the thread reads a consistent one
        self.position = (0, time.time(), "starting")
        self.since = time.monotonic()  # when the position last moved
        self.posted = float("-inf")  # when the position was last posted (monotonic)
        self.reported = False
        self.launcher = os.getppid() if os.environ.get("TORCHELASTIC_RUN_ID") else None
        self.alive_s = max(ALIVE_S, self.world / 250)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mfsdp-watch", daemon=True)
        self._thread.start()

    def mark(self, what: str) -> None:
        """This rank is now at ``what`` (e.g. ``iteration 3: backward``)."""
        self.position = (self.position[0] + 1, time.time(), what)
        self.since = time.monotonic()
        if self.since - self.posted > self.alive_s:  # a rank that stalls early is on the board
            self.post()

    def post(self) -> None:
        """Put this rank's position and the time (its heartbeat) on the job's store."""
        self.posted = time.monotonic()
        if self.store is not None:
            try:
                self.store.set(f"mfsdp/progress/{self.rank}",
                               json.dumps([*self.position, time.time(), socket.gethostname(),
                                           os.getpid()]))
            except Exception:  # noqa: BLE001 - the board is a diagnosis aid, never a failure
                pass

    def positions(self) -> dict[int, tuple[int, float, str, float]]:
        """Every rank's last (counter, wall time, phrase, last sign of life) on the board (ranks
        that never posted are missing)."""
        out = {}
        if self.store is None:
            return out
        previous = None
        try:
            previous = self.store.timeout
            self.store.set_timeout(datetime.timedelta(seconds=5))
        except Exception:  # noqa: BLE001
            pass
        try:
            self._read_positions(out)
        finally:
            if previous is not None:
                self.store.set_timeout(previous)
        return out

    def _read_positions(self, out: dict) -> None:
        for r in range(self.world):
            try:
                if self.store.check([f"mfsdp/progress/{r}"]):
                    seq, t, what, alive = json.loads(self.store.get(f"mfsdp/progress/{r}"))[:4]
                    out[r] = (int(seq), float(t), str(what), float(alive))
            except Exception:  # noqa: BLE001
                continue

    def hang_report(self) -> str:
        """One line: for how long this rank has waited, which ranks are behind and where."""
        pos = self.positions()
        now = time.time()
        waited = time.monotonic() - self.since
        head = (f"mfsdp train: no progress for {waited:.0f} s (--distributed-timeout-minutes "
                f"{self.timeout_s / 60:g})")
        from mfsdp.fsdp.collectives import current_wait

        inside = current_wait()
        if inside:  # what this rank itself is blocked in, when it is one of mfsdp's collectives
            head += f"; rank {self.rank} is inside mfsdp's {inside}"
        if not pos:
            return f"{head}; rank {self.rank} waits at '{self.position[2]}'"
        missing = [r for r in range(self.world) if r not in pos]
        silent = sorted(r for r, p in pos.items() if now - p[3] > 3 * self.alive_s)
        low = min(p[0] for p in pos.values())
        behind = sorted(r for r, p in pos.items() if p[0] == low)
        ahead = sorted(set(pos) - set(behind))
        parts = []
        if missing:
            parts.append(f"rank(s) {_ranks(missing)} never started")
        if silent:
            r0 = silent[0]
            parts.append(f"rank(s) {_ranks(silent)} unresponsive for {now - pos[r0][3]:.0f} s, "
                         f"last at '{pos[r0][2]}' (the process is stopped or its host is gone)")
            parts.append(_places(pos, set(pos) - set(silent), "wait at"))
        elif ahead:
            r0 = behind[0]
            parts.append(f"rank(s) {_ranks(behind)} behind, at '{pos[r0][2]}' for "
                         f"{now - pos[r0][1]:.0f} s (stalled, or stuck outside the collectives: "
                         "`py-spy dump --pid` on its host shows where)")
            parts.append(_places(pos, ahead, "wait at"))
        else:
            parts.append("every rank is at the same step: " + _places(pos, pos, "at")
                         + " (a collective that not every rank calls, or a stalled network)")
        return head + ": " + "; ".join(parts)

    def _run(self) -> None:
        last_touch = 0.0
        while not self._stop.wait(1.0):
            if time.monotonic() - self.posted > self.alive_s:
                self.post()
            if self.launcher is not None and os.getppid() != self.launcher:
                sys.stderr.write(f"mfsdp train: rank {self.rank}: the launcher that started this "
                                 f"process (pid {self.launcher}) is gone; stopping now, without "
                                 "saving, so that no orphaned rank trains on or writes into "
                                 "--save\n")
                sys.stderr.flush()
                os._exit(1)
            if self.lock is not None and time.monotonic() - last_touch > HEARTBEAT_S:
                self.lock.touch()
                last_touch = time.monotonic()
            stuck = time.monotonic() - self.since
            if not self.reported and self.world > 1 and stuck > self.report_after_s:
                self.reported = True
                # (a rank that waits for one that already said why it stopped says nothing)
                if not _reported(self.store) and _first(self.store, "hang"):
                    sys.stderr.write(self.hang_report() + "\n")
                    sys.stderr.flush()

    def stop(self) -> None:
        """End the thread (at the end of the run)."""
        self._stop.set()
        self._thread.join(timeout=5)


def _places(pos: dict, ranks: Iterable[int], verb: str) -> str:
    """``rank(s) 0-3 wait at 'x'; rank(s) 5 wait at 'y'``: the given ranks grouped by phrase."""
    by_phrase: dict[str, list[int]] = {}
    for r in sorted(ranks):
        by_phrase.setdefault(pos[r][2], []).append(r)
    return "; ".join(f"rank(s) {_ranks(rs)} {verb} '{w}'" for w, rs in by_phrase.items())


def _ranks(rs: list[int]) -> str:
    """Ranks as runs (``0-12,14-15``); past 8 runs, the first 8 and how many ranks in all."""
    rs = sorted(set(rs))
    runs: list[list[int]] = []
    for r in rs:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs[:8])
    return text + (f",... ({len(rs)} ranks)" if len(runs) > 8 else "")


def is_peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that failed because a peer rank's process went away
    (gloo's and NCCL's words for a closed connection)."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        w in text for w in ("Connection reset by peer", "Connection closed by peer",
                            "Broken pipe", "remote process exited", "Socket closed"))


def lost_ranks(store: dist.Store | None, world: int, me: int, wait_s: float = 2.0) -> str:
    """Which ranks stopped, from the progress board: those on this host whose process is gone,
    and those whose heartbeat stopped (``rank 1 (pid 4242 on node3, last posted at 'iteration
    5: ...')``, the board being up to ``ALIVE_S`` seconds behind), but not those that left on
    a SIGTERM of their own;
    '' when the board cannot tell. A killed process closes its connections before it is gone,
    so the board is read again for up to ``wait_s`` seconds."""
    if store is None:
        return ""
    posts = {}
    for r in range(world):
        if r == me:
            continue
        try:
            if store.check([f"mfsdp/progress/{r}"]):
                posts[r] = json.loads(store.get(f"mfsdp/progress/{r}"))
        except Exception:  # noqa: BLE001 - the store is gone: nothing to read
            return ""
    host = socket.gethostname()
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for r, post in sorted(posts.items()):
            try:  # it left on SIGTERM, as this rank does: not lost
                if store.check([f"{TERMINATED_KEY}/{r}"]):
                    continue
            except Exception:  # noqa: BLE001 - the store is gone
                return ""
            what, alive = str(post[2]), float(post[3])
            local = len(post) >= 6 and post[4] == host
            where = f"pid {post[5]} on {post[4]}, " if len(post) >= 6 else ""
            if (local and not _running(int(post[5]))) or time.time() - alive > 3 * ALIVE_S:
                found.append(f"rank {r} ({where}last posted at '{what}')")
        if found or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")


def is_user_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the user's to fix (a flag, a path, a checkpoint, non-finite numbers)
    rather than a bug: its message is then all there is to say."""
    from mfsdp.checkpoint.manifest import CheckpointError

    if isinstance(exc, SystemExit):
        return isinstance(exc.code, str)
    return isinstance(exc, CheckpointError)


def is_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that timed out (gloo's or NCCL's words for it)."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("Timed out" in text or "timed out" in text
                                              or "Timeout" in text)


def report_error(exc: BaseException, debug: bool) -> int:
    """Say what ended the run, once per job, and return the exit status.

    The first rank of the job to get here speaks (the ranks agree through the job's store);
    every later rank stays silent, whatever ended it (most often the first rank's exit, seen
    as a closed connection). A user error (``is_user_error``): its message in one line, no
    traceback, status 2. SIGINT (Ctrl-C): one line, status 130. A peer rank that went away (killed,
    out of memory, a lost node): one line naming it from the progress board, status 1. A
    timed-out collective: one
    line (the hang report said more). Anything else is a bug: its traceback. ``debug``: every
    rank prints its traceback."""
    import traceback

    store = _store()
    if debug:
        traceback.print_exception(exc)
        return 1
    if isinstance(exc, SystemExit) and not isinstance(exc.code, str):
        # a rank told to stay silent (an int), or sys.exit() (None: success)
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    from mfsdp.trainer.signals import Terminated, note_terminated

    user = is_user_error(exc)
    status = (2 if user else 130 if isinstance(exc, KeyboardInterrupt) else
              143 if isinstance(exc, Terminated) else 1)
    if isinstance(exc, Terminated):
        note_terminated()  # (the handler did already, unless it raised elsewhere)
    if _reported(store) or not _first(store, "error"):
        return status  # another rank said why the job ended
    if user:  # status 2, as every mfsdp command's user errors
        text = str(exc.code if isinstance(exc, SystemExit) else exc).strip()
        line = text if text.startswith("mfsdp") else f"mfsdp train: error: {text}"
        sys.stderr.write(line + "\n")
    elif isinstance(exc, KeyboardInterrupt):
        sys.stderr.write("mfsdp train: interrupted (SIGINT, Ctrl-C): stopped without saving; "
                         "the checkpoints already in --save are complete (a save under way is "
                         "discarded)\n")
    elif is_timeout(exc):
        sys.stderr.write(f"mfsdp train: a collective timed out: {exc}\n")
    elif is_peer_lost(exc) or isinstance(exc, Terminated):
        import signal

        # torchrun SIGTERMs the other ranks once it sees one die: say it first (the process
        # leaves right after, and torchrun SIGKILLs it after its shutdown timeout anyway)
        try:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        except ValueError:  # not the main thread
            pass
        me = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        who = lost_ranks(store, world, me)
        if not who and isinstance(exc, Terminated):
            sys.stderr.write("mfsdp train: SIGTERM: stopped without saving (start with "
                             "--exit-signal-handler to save first); the checkpoints already in "
                             "--save are complete (a save under way is discarded)\n")
            sys.stderr.flush()
            return status
        who = who or "a peer rank"
        sys.stderr.write(f"mfsdp train: {who} stopped (killed, out of memory, or its node "
                         "failed), so the other ranks stop too; the checkpoints in --save are "
                         "complete: resume from the latest (torchrun --max-restarts restarts the "
                         "ranks by itself)\n")
    else:
        traceback.print_exception(exc)
    sys.stderr.flush()
    return status
