"""A rank's start-up and shutdown in production: join the process group the way ``torchrun``
(or a plain launcher) describes it, say who this rank is, and leave without the interpreter's
teardown aborting a finished run.

A training script of your own starts and ends with these::

    torchrun --nproc-per-node 8 my_train.py

    # my_train.py
    from mfsdp.runtime import init_from_env, shutdown

    init_from_env()             # the default process group, NCCL on GPUs, gloo otherwise
    ...                         # fully_shard, train, save
    shutdown(exit_code=0)       # barrier, destroy the groups, leave at once

The in-process multi-rank launcher of the tests and recipes (``mfsdp.launch.launch``) lives apart
and uses :func:`shutdown` for its ranks.
"""

from __future__ import annotations

import os
import sys

__all__ = ["init_from_env", "shutdown"]


def init_from_env(backend: str | None = None, timeout_s: float = 600.0) -> None:
    """Initialise the default process group from ``torchrun``'s (or a plain launcher's) variables.

    Like ``dist.init_process_group(backend)`` with the ``env://`` rendezvous (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), with one difference that matters when
    ``torchrun --max-restarts N`` restarts the workers after a rank died: the rendezvous keys are
    prefixed with ``TORCHELASTIC_RESTART_COUNT``. Without the prefix the restarted ranks can read
    the dead worker's gloo address, still in the agent's store from the previous round, and fail
    with "connectFullMesh failed ... Connection refused" (PyTorch 2.13: a plain script that kills
    one of two ranks fails about every other restart; with the prefix none did).

    ``backend`` ``None`` picks NCCL when CUDA is available (after ``torch.cuda.set_device`` to
    ``LOCAL_RANK``) and gloo otherwise.
    """
    import datetime

    import torch
    import torch.distributed as dist

    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_from_env: {', '.join(missing)} not set; start the job with "
                           "torchrun (or set them for a world of one)")
    cuda = torch.cuda.is_available() if backend is None else "nccl" in backend
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if backend is None:
        backend = "nccl" if cuda else "gloo"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=timeout_s)
    # Under torchrun the agent hosts the store (TORCHELASTIC_USE_AGENT_STORE); otherwise rank 0 does.
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=(rank == 0 and not agent), timeout=timeout,
                          wait_for_workers=False)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"mfsdp/restart{restart}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def shutdown(barrier: bool = True, exit_code: int | None = None) -> None:
    """End this rank's part in the job: wait for the peers, destroy every process group, free
    what still refers to them, and (with ``exit_code``) end the process at once.

    Why more than ``dist.destroy_process_group()``: a gloo group whose Python object is still
    referenced keeps its worker threads after the destroy, and they free the last collectives'
    work objects late. Such a work can hold a tensor that Python owns; freeing it needs the GIL,
    which no thread can take once the interpreter is finalising, so the process aborts with
    "terminate called without an active exception" after all its output was correct (PyTorch
    2.13, gloo, 2 ranks on 2 cores: 2 of 40 trainer runs). Collecting garbage after the destroy
    frees the groups that only our objects held (freeing a group joins its threads); PyTorch
    keeps one reference of its own to a group once a sharded DTensor was built on it, so a
    script that must never abort ends with ``exit_code``: standard streams and logging are
    flushed and the process leaves by ``os._exit``, without the interpreter's teardown. The
    entry points of mfsdp (``mfsdp.train``, ``mfsdp.examples``, ``mfsdp convert`` under
    torchrun, the launcher's ranks) end that way.

    ``barrier=False`` skips the wait for the peers (after an error, when a peer may never
    arrive). Without a process group only the garbage collection (and the exit) happen.
    """
    import gc

    import torch.distributed as dist

    try:
        if dist.is_initialized():
            try:
                if barrier and dist.get_world_size() > 1:
                    dist.barrier()  # nobody tears down while a peer still talks
            finally:
                dist.destroy_process_group()
        gc.collect()
    finally:
        if exit_code is not None:
            import logging

            logging.shutdown()
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(exit_code)


def proc_status_mib(field: str) -> float | None:
    """A memory line of this process's ``/proc/self/status`` (``"VmRSS"``, ``"VmHWM"``) in
    MiB; ``None`` where ``/proc`` does not give it (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None
