"""The test suite's ranks, started once and reused (``launch`` through :class:`RankPool`).

Most multi-rank tests call :func:`mfsdp.launch.launch`, which starts ``world_size`` fresh Python
processes: each imports torch and joins a process group, about 2.5 s of a 2-core machine per
call, paid a few hundred times by the suite. ``tests/conftest.py`` replaces ``launch`` for the
tests with :func:`pooled_launch`: the same call, run in ranks kept from the previous call with the
same world size, backend, threads, environment, working directory and ``sys.path``.

What a kept rank could carry from one call into the next is reset before each call
(:func:`_call`): the peak-memory counter, torch's default RNG seed, default dtype, grad mode,
the environment and the working directory. Every ``RESTART_AFTER`` calls, and after a call that
leaves a rank with more than ``MAX_THREADS`` threads, the ranks are replaced (the groups,
threads and caches calls create do not pile up). A call that fails in kept ranks that ran
something before it is run again in fresh ranks (:func:`mfsdp.launch.launch`), and that run's
outcome is the test's: a kept rank never fails a test that passes in fresh ones, and a real
failure still fails. Tests of ``launch`` itself, and tests marked ``fresh_ranks``, use fresh
ranks always.
"""

from __future__ import annotations

import os
import sys
from collections import OrderedDict
from typing import Any, Callable

from mfsdp import launch as _launch_module
from mfsdp.launch import LaunchTimeout, RankError, RankPool

REAL_LAUNCH = _launch_module.launch
RESTART_AFTER = 40  # calls per set of kept ranks
MAX_POOLS = 2  # kept sets of ranks alive at once (the least recently used one ends)
# A call that leaves a rank with more threads than this ends the ranks: process groups and
# thread pools a call creates keep their threads (a fresh rank holds about 5), and a few
# hundred of them slow every later call down.
MAX_THREADS = 40
_TORCH_DEFAULT_SEED = 67280421310721  # torch.initial_seed() of a fresh process

enabled = True  # tests/conftest.py turns it off for the tests that need fresh ranks
_pools: OrderedDict[tuple, list] = OrderedDict()  # key -> [pool, calls run]
stats = {"pooled": 0, "fresh": 0, "reruns": 0}
reruns: list[str] = []  # the tests whose call failed in kept ranks, with the error


def _key(world_size: int, backend: str | None, threads: int) -> tuple:
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"))
    return (world_size, backend, threads, env, os.getcwd(), tuple(sys.path))


def _call(target: str, args: tuple, kwargs: dict) -> Any:
    """Run ``target`` in a kept rank as a fresh rank would: the state a call may leave behind
    is reset before it and restored after it. Returns the result and how many threads the
    process holds after it."""
    import torch

    try:
        with open("/proc/self/clear_refs", "w") as f:  # VmHWM / ru_maxrss: this call's peak
            f.write("5")
    except OSError:
        pass
    torch.manual_seed(_TORCH_DEFAULT_SEED)
    dtype, grad = torch.get_default_dtype(), torch.is_grad_enabled()
    env, cwd = dict(os.environ), os.getcwd()
    try:
        result = _launch_module._resolve(target)(*args, **kwargs)
    finally:
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
    return result, len(os.listdir("/proc/self/task"))


def pooled_launch(fn: Callable | str, world_size: int, args: tuple = (),
                  kwargs: dict | None = None, *, timeout: float = 300.0,
                  backend: str | None = "gloo", threads_per_rank: int = 1, echo: bool = False,
                  env: dict[str, str] | None = None) -> list[Any]:
    """:func:`mfsdp.launch.launch`'s signature and results, in kept ranks where it can."""
    if not enabled or echo or env or not isinstance(world_size, int) or world_size < 1:
        stats["fresh"] += 1
        return REAL_LAUNCH(fn, world_size, args, kwargs, timeout=timeout, backend=backend,
                           threads_per_rank=threads_per_rank, echo=echo, env=env)
    target = _launch_module._target_name(fn)
    key = _key(world_size, backend, threads_per_rank)
    entry = _pools.pop(key, None)
    if entry is None or entry[1] >= RESTART_AFTER:
        if entry is not None:
            entry[0].close()
        entry = [RankPool(world_size, backend=backend, threads_per_rank=threads_per_rank), 0]
    _pools[key] = entry
    while len(_pools) > MAX_POOLS:
        _pools.popitem(last=False)[1][0].close()
    pool = entry[0]
    ran_before = not pool.fresh
    entry[1] += 1
    stats["pooled"] += 1
    try:
        out = pool.run(_call, args=(target, tuple(args), dict(kwargs or {})), timeout=timeout)
        if max(threads for _, threads in out) > MAX_THREADS:
            _pools.pop(key)[0].close()  # the groups and workers it left run on: new ranks
        return [result for result, _ in out]
    except (RankError, LaunchTimeout) as exc:
        if not ran_before:
            raise
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        reruns.append(f"{test}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    stats["reruns"] += 1
    return REAL_LAUNCH(fn, world_size, args, kwargs, timeout=timeout, backend=backend,
                       threads_per_rank=threads_per_rank)


def close_all() -> None:
    """End every kept set of ranks."""
    while _pools:
        _pools.popitem()[1][0].close()
