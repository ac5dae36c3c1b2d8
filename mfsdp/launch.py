"""In-process multi-rank launcher for recipes and tests (a production rank starts and ends with
:mod:`mfsdp.runtime` instead).

``launch(fn, world_size)`` starts ``world_size`` real processes, joins them into one
``torch.distributed`` process group (gloo on CPU), runs ``fn(*args, **kwargs)`` on each and
returns the results in rank order::

    >>> from mfsdp.launch import launch
    >>> from mfsdp.examples.hello import rank_info
    >>> [r["rank"] for r in launch(rank_info, world_size=2)]
    [0, 1]

``RankPool(world_size)`` keeps its ranks between calls: ``pool.run(fn)`` as ``launch`` does, with
the ranks' start-up (``import torch``, the process group) paid once for many calls.

Why processes started with ``subprocess`` and not ``multiprocessing``: sphinx-gallery runs a recipe
as a fake ``__main__`` module, and ``multiprocessing``'s spawn start method re-imports ``__main__``
in every child (re-running the whole recipe), while fork is unsafe once torch has started threads.
A worker started as ``python -m mfsdp.launch`` imports only the module that holds ``fn``, so ``fn``
must live in an importable module (not in ``__main__``); the parent's ``sys.path`` is handed on.

The rendezvous uses a ``TCPStore`` that the parent opens on port 0 (the kernel picks a free port and
the parent holds it for the whole run), so launches that run back to back or side by side never
collide on a port.
"""

from __future__ import annotations

import importlib
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from mfsdp import runtime

__all__ = ["launch", "RankPool", "RankError", "LaunchTimeout"]

_GRACE_S = 3.0  # after one rank fails, how long the others get to finish before they are killed


class RankError(RuntimeError):
    """A rank raised an exception; carries the rank, the exception type and its remote traceback."""

    def __init__(self, rank: int, exc_type: str, message: str, remote_traceback: str):
        # exc_type is "ProcessExit" when the rank died without raising (signal, exit code)
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.remote_traceback = remote_traceback
        super().__init__(
            f"rank {rank} raised {exc_type}: {message}\n\n--- traceback on rank {rank} ---\n"
            f"{remote_traceback}"
        )


class LaunchTimeout(TimeoutError):
    """Some ranks did not finish within the timeout; they were killed."""

    def __init__(self, timeout: float, pending: list[int], output_tail: str):
        self.pending = pending
        super().__init__(
            f"ranks {pending} did not finish within {timeout:g} s and were killed "
            f"(a rank waiting in a collective that another rank never called hangs like this)."
            + (f"\n--- last output ---\n{output_tail}" if output_tail else "")
        )


@dataclass
class _Job:
    """What one worker needs, written by the parent to a pickle file."""

    target: str  # "module:qualname" of the function to run
    args: tuple
    kwargs: dict
    world_size: int
    store_port: int
    backend: str | None
    threads: int


def _target_name(fn: Callable | str) -> str:
    if isinstance(fn, str):
        if ":" not in fn:
            raise ValueError(f"fn={fn!r}: a string target must read 'package.module:function'")
        return fn
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if module is None or qualname is None:
        raise TypeError(f"fn={fn!r} is not a function; pass a module-level function")
    if module == "__main__" or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"fn={module}.{qualname} cannot be imported by a worker process: workers run "
            "module-level functions of importable modules. Move it into a module (for a recipe, "
            "call a function from mfsdp) and pass it, or pass the string 'module:function'."
        )
    return f"{module}:{qualname}"


def _resolve(target: str) -> Callable:
    module_name, qualname = target.split(":", 1)
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def launch(
    fn: Callable | str,
    world_size: int,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    timeout: float = 300.0,
    backend: str | None = "gloo",
    threads_per_rank: int = 1,
    echo: bool = False,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` real ranks and return their results in rank order.

    Args:
        fn: a module-level function of an importable module, or ``"module:function"``.
        world_size: number of ranks (processes) to start.
        args, kwargs: passed to ``fn`` on every rank; must be picklable, as must the results.
        timeout: seconds until all ranks are killed and :class:`LaunchTimeout` is raised.
        backend: ``torch.distributed`` backend (``"gloo"`` on CPU, ``"nccl"`` with one GPU per rank,
            ``None`` for what ``init_process_group()`` picks without one).
        threads_per_rank: ``torch.set_num_threads`` in each rank (1 keeps 8 ranks on 2 cores sane).
        echo: print every rank's captured stdout/stderr after the run (prefixed with the rank).
        env: extra environment variables for the workers.

    Raises:
        RankError: the first rank (in time) that raised, with its message and traceback.
        LaunchTimeout: some ranks did not finish in time; every rank was killed.
    """
    import torch.distributed as dist

    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: must be a positive integer")
    target = _target_name(fn)
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    workdir = Path(tempfile.mkdtemp(prefix="mfsdp-launch-"))
    job = _Job(target, tuple(args), dict(kwargs or {}), world_size, store.port, backend,
               threads_per_rank)
    (workdir / "job.pkl").write_bytes(pickle.dumps(job))
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p)
    child_env.setdefault("OMP_NUM_THREADS", str(threads_per_rank))
    child_env.update(env or {})
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        for rank in range(world_size):
            log = open(workdir / f"rank{rank}.log", "wb")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "mfsdp.launch", str(workdir), str(rank), str(os.getpid())],
                stdout=log, stderr=subprocess.STDOUT, env=child_env, start_new_session=True,
            ))
        return _collect(procs, workdir, world_size, timeout, echo)
    finally:
        _kill(procs)
        for log in logs:
            log.close()
        del store
        for f in workdir.iterdir():
            f.unlink()
        workdir.rmdir()


def _collect(procs, workdir: Path, world_size: int, timeout: float, echo: bool) -> list[Any]:
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    first_error: RankError | None = None
    while True:
        done = [p.poll() is not None for p in procs]
        if first_error is None:
            first_error = _first_error(procs, workdir)
            if first_error is not None:
                failed_at = time.monotonic()
        if all(done):
            break
        now = time.monotonic()
        if failed_at is not None and now - failed_at > _GRACE_S:
            break
        if now > deadline:
            pending = [r for r, d in enumerate(done) if not d]
            raise LaunchTimeout(timeout, pending, _tail(workdir, pending[0]))
        time.sleep(0.02)
    if echo:
        for rank in range(world_size):
            for line in (workdir / f"rank{rank}.log").read_text(errors="replace").splitlines():
                print(f"[rank {rank}] {line}")
    if first_error is not None:
        raise first_error
    results = []
    for rank, p in enumerate(procs):
        out = workdir / f"rank{rank}.out"
        if not out.exists():
            raise RankError(rank, "ProcessExit", f"exited with code {p.returncode} and no result",
                            _tail(workdir, rank))
        status, payload = pickle.loads(out.read_bytes())
        results.append(payload)
    return results


def _first_error(procs, workdir: Path, logdir: Path | None = None) -> RankError | None:
    """The root cause: a rank that died without a result, else the earliest-written error
    (results and errors in ``workdir``, the ranks' output in ``logdir``, default the same).

    A rank killed by a signal takes precedence: its peers' errors ("connection reset by peer")
    are consequences of its death.
    """
    for rank, p in enumerate(procs):
        code = p.poll()
        if code is not None and not (workdir / f"rank{rank}.out").exists() \
                and not (workdir / f"rank{rank}.err").exists():
            how = (f"was killed by signal {signal.Signals(-code).name}" if code < 0
                   else f"exited with code {code}")
            return RankError(rank, "ProcessExit",
                             f"{how} without a result (killed, out of memory, or os._exit)",
                             _tail(logdir or workdir, rank))
    errors = sorted(workdir.glob("rank*.err"), key=lambda f: f.stat().st_mtime_ns)
    if errors:
        rank, exc_type, message, tb = pickle.loads(errors[0].read_bytes())
        return RankError(rank, exc_type, message, tb)
    return None


def _tail(workdir: Path, rank: int, lines: int = 30) -> str:
    log = workdir / f"rank{rank}.log"
    if not log.exists():
        return ""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def _end_with_parent(parent: int, interval: float = 0.5) -> None:
    """End this rank (and its process group) when ``parent``, the launching process, is gone.

    The ranks run in a session of their own (so that a timeout can kill each one with its
    children), which also takes them out of the parent's process group: a parent killed by a
    signal, or a test runner that times out, would otherwise leave them running. A daemon thread
    polls the parent's id; once this process is re-parented, the parent is dead.
    """
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    if os.getppid() != parent:
        os.killpg(os.getpgrp(), signal.SIGKILL)
    threading.Thread(target=watch, name="mfsdp-parent-watch", daemon=True).start()


def _join(job: _Job, rank: int) -> None:
    """Set this rank's threads and environment and join the process group."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(job.threads)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(job.world_size),
                      LOCAL_WORLD_SIZE=str(job.world_size))
    store = dist.TCPStore("127.0.0.1", job.store_port, job.world_size, False)
    if job.backend == "nccl" or (job.backend is None and torch.cuda.is_available()):
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(job.backend, store=store, rank=rank, world_size=job.world_size)


def _worker(workdir: Path, rank: int) -> int:
    job: _Job = pickle.loads((workdir / "job.pkl").read_bytes())
    if not job.target:
        return _pool_worker(workdir, rank, job)
    try:
        _join(job, rank)
        result = _resolve(job.target)(*job.args, **job.kwargs)
        payload = pickle.dumps(("ok", result))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        # Report before anything closes a socket: the peers' errors ("connection closed") are
        # consequences of this one and must be written later than it.
        _write(workdir / f"rank{rank}.err",
               pickle.dumps((rank, type(exc).__name__, str(exc), traceback.format_exc())))
        return 1
    runtime.shutdown(barrier=False)  # each rank reports on its own: a hung peer must not hold it back
    _write(workdir / f"rank{rank}.out", payload)
    return 0


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    tmp.rename(path)


def _pool_worker(workdir: Path, rank: int, job: _Job) -> int:
    """A :class:`RankPool` rank: join once, then run job ``0``, ``1``, ... as the parent writes
    each one's ``N/job.pkl``; end at ``stop`` or at the first job that raises (0 or 1)."""
    import gc

    try:
        _join(job, rank)
    except BaseException as exc:  # noqa: BLE001 - reported as job 0's error
        (workdir / "0").mkdir(exist_ok=True)
        _write(workdir / "0" / f"rank{rank}.err",
               pickle.dumps((rank, type(exc).__name__, str(exc), traceback.format_exc())))
        return 1
    n = 0
    while True:
        jobdir = workdir / str(n)
        while not (jobdir / "job.pkl").exists():
            if (workdir / "stop").exists():
                return 0
            time.sleep(0.01)
        task: _Job = pickle.loads((jobdir / "job.pkl").read_bytes())
        try:
            payload = pickle.dumps(("ok", _resolve(task.target)(*task.args, **task.kwargs)))
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
            _write(jobdir / f"rank{rank}.err",
                   pickle.dumps((rank, type(exc).__name__, str(exc), traceback.format_exc())))
            return 1
        _write(jobdir / f"rank{rank}.out", payload)
        del payload
        gc.collect()
        n += 1


class RankPool:
    """``world_size`` ranks that run one function after another: :func:`~mfsdp.launch.launch`
    for many calls, with the ranks' start-up paid once
    (``with RankPool(2) as pool: pool.run(fn, args=...)``).

    A call that raises on some rank or times out ends the ranks (their state is unknown); the
    next :meth:`~mfsdp.launch.RankPool.run` starts fresh ones.
    :attr:`~mfsdp.launch.RankPool.fresh` says whether the running ranks have run nothing yet,
    for a caller that reruns a failure in ranks that ran nothing before it.
    """

    def __init__(self, world_size: int, *, backend: str | None = "gloo",
                 threads_per_rank: int = 1, env: dict[str, str] | None = None):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r}: must be a positive integer")
        self.world_size, self.backend, self.threads, self.env = (
            world_size, backend, threads_per_rank, dict(env or {}))
        self.starts = 0  # how many times ranks were started
        self._procs: list[subprocess.Popen] = []
        self._logs: list = []
        self._workdir: Path | None = None
        self._store = None
        self._next = 0

    @property
    def fresh(self) -> bool:
        """True when no ranks run, or the running ones have run no call yet."""
        return not self._procs or self._next == 0

    def run(self, fn: Callable | str, args: tuple = (), kwargs: dict | None = None, *,
            timeout: float = 300.0) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; the results in rank order (as
        :func:`~mfsdp.launch.launch`).

        Raises :class:`~mfsdp.launch.RankError` or :class:`~mfsdp.launch.LaunchTimeout` as
        :func:`~mfsdp.launch.launch` does; the ranks are then ended and the next call starts
        new ones."""
        target = _target_name(fn)
        if not self._procs or any(p.poll() is not None for p in self._procs):
            self._stop()
            self._start()
        assert self._workdir is not None
        jobdir = self._workdir / str(self._next)
        jobdir.mkdir(exist_ok=True)
        self._next += 1
        _write(jobdir / "job.pkl", pickle.dumps(_Job(target, tuple(args), dict(kwargs or {}),
                                                     self.world_size, 0, None, 0)))
        try:
            return _collect_job(self._procs, jobdir, self._workdir, self.world_size, timeout)
        except BaseException:
            self._stop()
            raise

    def close(self) -> None:
        """End the ranks (they leave at once between calls) and remove their files."""
        if self._workdir is not None and self._procs:
            (self._workdir / "stop").touch()
            end = time.monotonic() + 2.0
            while time.monotonic() < end and any(p.poll() is None for p in self._procs):
                time.sleep(0.01)
        self._stop()

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        import torch.distributed as dist

        self._store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
        self._workdir = Path(tempfile.mkdtemp(prefix="mfsdp-pool-"))
        job = _Job("", (), {}, self.world_size, self._store.port, self.backend, self.threads)
        (self._workdir / "job.pkl").write_bytes(pickle.dumps(job))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p)
        env.setdefault("OMP_NUM_THREADS", str(self.threads))
        env.update(self.env)
        for rank in range(self.world_size):
            log = open(self._workdir / f"rank{rank}.log", "wb")
            self._logs.append(log)
            self._procs.append(subprocess.Popen(
                [sys.executable, "-m", "mfsdp.launch", str(self._workdir), str(rank),
                 str(os.getpid())],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
        self._next = 0
        self.starts += 1

    def _stop(self) -> None:
        _kill(self._procs)
        for log in self._logs:
            log.close()
        self._procs, self._logs, self._store = [], [], None
        if self._workdir is not None:
            import shutil

            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None


def _collect_job(procs, jobdir: Path, logdir: Path, world_size: int,
                 timeout: float) -> list[Any]:
    """Wait for one :class:`RankPool` call: every rank's result in ``jobdir``, or the first
    error (the others get :data:`_GRACE_S` to report theirs), or the timeout."""
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    first_error: RankError | None = None
    outs = [jobdir / f"rank{r}.out" for r in range(world_size)]
    while not all(o.exists() for o in outs):
        if first_error is None:
            first_error = _first_error(procs, jobdir, logdir)
            if first_error is not None:
                failed_at = time.monotonic()
        now = time.monotonic()
        if failed_at is not None and now - failed_at > _GRACE_S:
            break
        if now > deadline:
            pending = [r for r, o in enumerate(outs) if not o.exists()]
            raise LaunchTimeout(timeout, pending, _tail(logdir, pending[0]))
        time.sleep(0.02)
    if first_error is not None:
        raise first_error
    return [pickle.loads(o.read_bytes())[1] for o in outs]


if __name__ == "__main__":
    # os._exit after the result is written: see shutdown() for why not the interpreter's teardown
    _end_with_parent(int(sys.argv[3]))
    runtime.shutdown(barrier=False, exit_code=_worker(Path(sys.argv[1]), int(sys.argv[2])))
