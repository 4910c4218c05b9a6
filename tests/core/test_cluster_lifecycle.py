"""The cluster's last gaps: a task that cannot be unpickled on a rank, workers that outlive a
SIGKILLed parent, the rendezvous port, and the control group when ranks outnumber GPUs."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from wsharding.core.context import ClusterError
from wsharding.core.emulation import SHARED_GPU_TORCH_NOTE
from wsharding.lab.cluster import RankCluster, RemoteError, choose_backend

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parents[1]


# ---- tasks and arguments (module level: spawned ranks import them by name) -----------------------
def _explode_on_load(what: str):
    raise ValueError(f"cannot rebuild {what} here")


class BreaksOnLoad:
    """Pickles fine in the parent; unpickling it (on a rank) raises."""

    def __reduce__(self):
        return (_explode_on_load, ("BreaksOnLoad",))


def echo_rank(ctx, *args):
    return ctx.rank


class _Cycle:
    """An object that refers to itself: only the cycle collector frees it."""

    def __init__(self) -> None:
        self.me = self


def collector_state(ctx) -> dict:
    """What the collector sees on this rank: how many objects are frozen, and whether a cycle made by
    this task is freed by ``gc.collect()`` (a weak reference to it dies)."""
    import gc
    import weakref

    cycle = _Cycle()
    ref = weakref.ref(cycle)
    del cycle
    gc.collect()
    return {"frozen": gc.get_freeze_count(), "cycle_freed": ref() is None}


def mark_and_wait(ctx, folder: str, how: str):
    """Write this rank's pid, then get stuck: rank 0 in a collective that rank 1 never joins, rank 1
    asleep (``how="cpu"``), or every rank in a long GPU wait (``how="gpu"``)."""
    Path(folder, f"rank{ctx.rank}.pid").write_text(str(os.getpid()))
    if how == "gpu":
        torch.cuda._sleep(1 << 62)  # a kernel that spins far longer than the test lives
        torch.cuda.synchronize()
    elif ctx.rank == 0:
        ctx.comm.barrier()
    else:
        time.sleep(600)
    return ctx.rank


def held_then_ended(ctx, seconds: float):
    """Rank 1: a helper thread ends the process (:func:`wsharding.fatal.end_process`) while the main
    thread is held -- a stand-in for a CUDA synchronization behind a gather whose peer is gone."""
    from wsharding.fatal import end_process

    if ctx.rank == 1:
        threading.Thread(target=end_process, args=("layer 3: gather did not complete within 5.0 s",)).start()
        time.sleep(seconds)
    return ctx.rank


PARENT = """
import sys, threading
sys.path.insert(0, {tests!r})
from wsharding.lab.cluster import RankCluster
from test_cluster_lifecycle import mark_and_wait

def go():
    c = RankCluster(2, backend={backend!r}, task_timeout=900, collective_timeout=900)
    c.run(mark_and_wait, {folder!r}, {how!r})

if {from_thread!r}:
    t = threading.Thread(target=go)
    t.start()
    t.join()
else:
    go()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has exited: it only waits to be reaped by whoever adopted it
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _start_parent(tmp_path: Path, how: str, from_thread: bool, backend: str = "gloo") -> tuple[subprocess.Popen, list[int]]:
    code = PARENT.format(tests=str(TESTS), backend=backend, folder=str(tmp_path), how=how, from_thread=from_thread)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    parent = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT)
    deadline = time.monotonic() + 180
    files = [tmp_path / "rank0.pid", tmp_path / "rank1.pid"]
    while not all(f.exists() and f.read_text() for f in files):
        if parent.poll() is not None or time.monotonic() > deadline:
            parent.kill()
            pytest.fail(f"the parent exited ({parent.returncode}) or its ranks did not start in time")
        time.sleep(0.2)
    return parent, [int(f.read_text()) for f in files]


def _kill_parent_and_watch(parent: subprocess.Popen, pids: list[int], seconds: float) -> list[int]:
    """SIGKILL the parent (no Python code of it runs), then return the ranks still alive after
    ``seconds`` (or as soon as none is)."""
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(10)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


# ---- tests --------------------------------------------------------------------------------------
def test_unpicklable_task_is_a_remote_error_and_the_ranks_live_on(cluster_of):
    cluster = cluster_of(2)
    starts = cluster.starts
    with pytest.raises(RemoteError, match=r"could not be unpickled on rank 0: ValueError: cannot rebuild BreaksOnLoad") as info:
        cluster.run(echo_rank, BreaksOnLoad())
    assert info.value.rank == 0 and info.value.exc_type == "_TaskUnpicklable"
    assert "rank 1 also raised _TaskUnpicklable" in str(info.value)
    # no rank died and no collective was pending: the same workers answer the next task
    assert cluster.run(echo_rank) == [0, 1] and cluster.starts == starts


def test_a_rank_ended_by_its_watchdog_says_why(cluster_of):
    """[Note: a host held behind a stuck gather]: the rank's last words reach the caller as its error
    (without them: "rank 1 died (exit code 70)" and no reason), and the next run restarts the ranks."""
    cluster = cluster_of(2)
    starts = cluster.starts
    with pytest.raises(RemoteError) as info:
        cluster.run_with(held_then_ended, (120,), timeout=60)
    assert info.value.rank == 1 and info.value.exc_type == "CommError"
    assert info.value.remote_message == "layer 3: gather did not complete within 5.0 s (the rank process was ended)"
    assert not cluster.running
    assert cluster.run(echo_rank) == [0, 1] and cluster.starts == starts + 1


def test_ranks_die_with_a_sigkilled_parent_even_inside_a_wait(tmp_path):
    parent, pids = _start_parent(tmp_path, "cpu", from_thread=False)
    left = _kill_parent_and_watch(parent, pids, 15.0)
    assert left == [], f"ranks {left} outlived their SIGKILLed parent"


def test_without_the_death_signal_a_stuck_rank_outlives_its_parent(tmp_path):
    """What the death signal guards against: started from a non-main thread it is not armed (the
    kernel would tie it to that thread), and ranks stuck in a wait then survive a SIGKILLed parent."""
    parent, pids = _start_parent(tmp_path, "cpu", from_thread=True)
    try:
        assert _kill_parent_and_watch(parent, pids, 3.0) == pids
    finally:
        for pid in pids:  # our own orphans: end them by id
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.gpu
def test_gpu_ranks_die_with_a_sigkilled_parent_inside_a_gpu_wait(tmp_path):
    if torch.cuda.device_count() < 1:
        pytest.skip("needs a GPU")
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    parent, pids = _start_parent(tmp_path, "gpu", from_thread=False, backend=backend)
    assert _kill_parent_and_watch(parent, pids, 15.0) == []


def test_start_up_objects_are_frozen_and_a_task_garbage_is_still_collected(cluster_of):
    """[Note: start-up objects frozen]: without the freeze nothing is frozen (``frozen == 0``) and each
    ``gc.collect()`` of a task walks torch's objects again; with it, a task's own cycles are freed as before."""
    states = cluster_of(2).run(collector_state)
    assert [s["cycle_freed"] for s in states] == [True, True]
    assert all(s["frozen"] > 50_000 for s in states), [s["frozen"] for s in states]


def test_rendezvous_port_is_held_from_the_start():
    """The parent hosts the rendezvous store on a port the kernel picked: nobody else can bind it
    while the cluster lives (no window between choosing the port and using it)."""
    with RankCluster(1, backend="gloo") as c:
        port = c.rendezvous_port
        assert isinstance(port, int) and port > 0
        with socket.socket() as s, pytest.raises(OSError) as info:
            s.bind(("127.0.0.1", port))
        assert info.value.errno == 98  # EADDRINUSE
        assert c.run(echo_rank) == [0]
    assert c.rendezvous_port is None


def test_ranks_outnumbering_gpus_get_a_gloo_control_group(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert choose_backend(4, "nccl", 2) == ("gloo", [0, 0, 1, 1])
    assert choose_backend(2, "nccl", 1) == ("nccl", [0, 1])
    assert choose_backend(2, "nccl", 2) == ("gloo", [0, 0])  # room for 4, but two ranks land on GPU 0
    assert choose_backend(4, "auto", 2) == ("gloo", [0, 0, 1, 1])
    assert choose_backend(3, "auto") == ("gloo", [None] * 3)  # not enough GPUs: CPU processes
    c = RankCluster(4, backend="nccl", ranks_per_gpu=2)  # not started: only its plan
    assert (c.backend, c.on_gpus, c.shared_gpu) == ("gloo", True, True)
    assert c.emulation.startswith("emulated: several ranks time-slice one GPU")
    assert c.env["NCCL_MULTI_RANK_GPU_ENABLE"] == "1"
    with pytest.raises(ClusterError, match="ranks_per_gpu: must be >= 1, got 0"):
        choose_backend(2, "nccl", 0)
    assert "cannot run with several ranks per GPU" in SHARED_GPU_TORCH_NOTE and "\n" not in SHARED_GPU_TORCH_NOTE


@pytest.mark.gpu
def test_gpu_several_ranks_on_one_gpu_start_and_refuse_the_torch_comm():
    if torch.cuda.device_count() < 1:
        pytest.skip("needs a GPU")
    with RankCluster(2, backend="nccl", ranks_per_gpu=2) as c:
        assert c.backend == "gloo" and c.mode == "gpu-gloo-shared"
        with pytest.raises(RemoteError, match="cannot run with several ranks per GPU"):
            c.run(torch_comm_mode)


def torch_comm_mode(ctx):
    return ctx.comm.mode


def test_a_lock_a_task_kept_is_not_reported_leaked_at_exit():
    """[Note: named semaphores at a worker's exit]: a rank exits with os._exit, which skipped the
    finalizer of every multiprocessing lock a task kept (tqdm keeps one per process), and the parent's
    resource tracker reported them at shutdown: "There appear to be 2 leaked semaphore objects"."""
    code = ("from wsharding.lab.cluster import RankCluster\n"
            "from tests.ranktasks import keep_a_process_lock\n"
            "with RankCluster(2, backend='gloo') as c:\n"
            "    assert c.run(keep_a_process_lock) == [0, 1]\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "leaked semaphore" not in out.stderr, out.stderr[-2000:]
