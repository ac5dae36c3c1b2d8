"""The multi-rank launcher: real gloo ranks, results in rank order, errors and hangs surface."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from mfsdp.launch import LaunchTimeout, RankError, launch
from mfsdp.examples.hello import rank_info


def _rank_and_gather(scale):
    t = torch.tensor([float(dist.get_rank())]) * scale
    out = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return dist.get_rank(), [x.item() for x in out]


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("bad shard size on purpose")
    dist.barrier()  # rank 0 waits here for a rank that never comes
    return "unreachable"


def _hang_on_last_rank(pid_file):
    with open(f"{pid_file}.{dist.get_rank()}", "w") as f:
        f.write(str(os.getpid()))
    if dist.get_rank() == dist.get_world_size() - 1:
        time.sleep(3600)
    return dist.get_rank()


def _exit_hard():
    if dist.get_rank() == 0:
        os._exit(7)
    return dist.get_rank()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_in_rank_order(world_size):
    results = launch(_rank_and_gather, world_size, args=(2.0,))
    assert [r for r, _ in results] == list(range(world_size))
    for _, gathered in results:
        assert gathered == [2.0 * r for r in range(world_size)]


def test_rank_info_all_reduce():
    info = launch(rank_info, 3)
    assert [i["all_reduce_sum"] for i in info] == [6.0, 6.0, 6.0]
    assert len({i["pid"] for i in info}) == 3 and all(i["backend"] == "gloo" for i in info)


def test_exception_on_one_rank_surfaces_with_message_and_traceback():
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(_fail_on_rank_one, 2, timeout=60)
    assert info.value.rank == 1
    assert info.value.exc_type == "ValueError"
    assert "bad shard size on purpose" in str(info.value)
    assert "_fail_on_rank_one" in info.value.remote_traceback
    assert time.monotonic() - start < 30  # the waiting rank was killed, not waited for


def test_hung_rank_is_killed_at_timeout(tmp_path):
    pid_file = tmp_path / "pid"
    start = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(_hang_on_last_rank, 2, args=(str(pid_file),), timeout=8)
    assert 8 <= time.monotonic() - start < 30
    assert info.value.pending == [1]
    pid = int((tmp_path / "pid.1").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the hung process is gone


def test_rank_dying_without_result_is_reported():
    with pytest.raises(RankError, match="exited with code 7"):
        launch(_exit_hard, 2, timeout=60)


def test_back_to_back_and_concurrent_launches_do_not_collide():
    for _ in range(2):
        assert launch(rank_info, 2, timeout=60)[1]["all_reduce_sum"] == 3.0
    results, errors = [], []

    def run():
        try:
            results.append(launch(rank_info, 2, timeout=60))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 2


def test_functions_that_workers_cannot_import_are_refused():
    with pytest.raises(ValueError, match="cannot be imported by a worker"):
        launch(lambda: 1, 2)
    with pytest.raises(ValueError, match="world_size=0"):
        launch(rank_info, 0)


def _wrap_train_and_drop(strategy: str) -> dict:
    """Shard, train two steps, drop the model; report whether anything kept it alive."""
    import gc
    import weakref

    import mfsdp
    from mfsdp.models import Block, ToyModel

    torch.manual_seed(0)
    model = ToyModel(dim=16, hidden=32, num_blocks=2)
    model, opt = mfsdp.fully_shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                   fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
    refs = [weakref.ref(model), weakref.ref(opt)] + [weakref.ref(c) for c in (
        model.fsdp_state().comms.dp, model.fsdp_state().comms.dp_ag)]
    del model, opt
    gc.collect()
    return {"alive": [r() is not None for r in refs]}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_a_dropped_model_and_its_communicators_are_freed(strategy):
    # Parameter hooks are owned by C++ tensors, invisible to Python's garbage collector: a hook
    # holding its bucket or reducer strongly kept every model (and its process groups) alive.
    for res in launch(_wrap_train_and_drop, 2, args=(strategy,)):
        assert res["alive"] == [False] * 4, res


def test_shutdown_exit_code_ends_the_process_without_teardown(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "s.py"
    # An atexit handler would run in a normal exit; os._exit skips it, and what was printed
    # before (without a newline, still buffered) is flushed.
    script.write_text("import atexit\nfrom mfsdp.runtime import shutdown\n"
                      "atexit.register(lambda: print('teardown ran'))\n"
                      "print('done', end='')\nshutdown(exit_code=3)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 3
    assert proc.stdout == "done"


def _sleep_and_say_pid(pid_file):
    with open(f"{pid_file}.{dist.get_rank()}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
    return dist.get_rank()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its new parent to reap it has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads process states from /proc")
def test_ranks_end_when_the_launching_process_is_killed(tmp_path):
    import signal
    import subprocess
    import sys

    pid_file = tmp_path / "pid"
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
         "from mfsdp.launch import launch; "
         f"launch('test_launch:_sleep_and_say_pid', 2, args=({str(pid_file)!r},), timeout=600)"])
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"pid.{r}").exists() for r in range(2)):
            assert parent.poll() is None and time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.1)
        pids = [int((tmp_path / f"pid.{r}").read_text()) for r in range(2)]
        assert all(_alive(p) for p in pids)
        parent.send_signal(signal.SIGKILL)  # no cleanup runs in the parent
        parent.wait()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), "a rank outlived its launcher by 10 s"
    finally:
        if parent.poll() is None:
            parent.kill()


def _pid_and_gather(scale):
    return os.getpid(), _rank_and_gather(scale)


def test_a_pool_runs_calls_in_the_same_ranks_and_restarts_them_after_a_failure(tmp_path):
    from mfsdp.launch import RankPool

    with RankPool(2) as pool:
        assert pool.fresh
        first = pool.run(_pid_and_gather, args=(2.0,), timeout=60)
        assert not pool.fresh
        second = pool.run(_pid_and_gather, args=(3.0,), timeout=60)
        # the same processes ran both calls, each with its own arguments, in rank order
        assert [pid for pid, _ in first] == [pid for pid, _ in second]
        assert [r for _, r in first] == [(0, [0.0, 2.0]), (1, [0.0, 2.0])]
        assert [r for _, r in second] == [(0, [0.0, 3.0]), (1, [0.0, 3.0])]
        assert pool.starts == 1
        with pytest.raises(RankError, match="bad shard size on purpose") as info:
            pool.run(_fail_on_rank_one, timeout=60)
        assert info.value.rank == 1
        for pid, _ in second:  # the failed ranks are gone
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        assert pool.fresh
        third = pool.run(_pid_and_gather, args=(1.0,), timeout=60)  # in new ranks
        assert pool.starts == 2
        assert {pid for pid, _ in third}.isdisjoint(pid for pid, _ in second)
        assert [r for _, r in third] == [(0, [0.0, 1.0]), (1, [0.0, 1.0])]
        with pytest.raises(LaunchTimeout) as timeout:
            pool.run(_hang_on_last_rank, args=(str(tmp_path / "pid"),), timeout=5)
        assert timeout.value.pending == [1]
        with pytest.raises(ProcessLookupError):
            os.kill(int((tmp_path / "pid.1").read_text()), 0)
        assert pool.run(rank_info, timeout=60)[1]["all_reduce_sum"] == 3.0
        pids = [pid for pid, _ in pool.run(_pid_and_gather, args=(1.0,), timeout=60)]
    for pid in pids:  # closing the pool ended its ranks
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
