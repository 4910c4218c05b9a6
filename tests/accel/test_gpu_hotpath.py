"""GPU: the hot path never holds the host, and a missing rank is an error, not a hang."""

from __future__ import annotations

import pytest
import torch

from tests.accel.hotpath_tasks import host_not_held, missing_rank
from wsharding.comm_by_name import multi_rank_per_gpu_supported
from wsharding.lab.cluster import RankCluster

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _ours() -> bool:
    from wsharding.comm_by_name import ours_supported

    return ours_supported()


@pytest.mark.parametrize("model", ["small", "tiny-blocks"])
@pytest.mark.parametrize("comm", ["torch", "nccl"])
@pytest.mark.parametrize("lookahead", [True, False])
def test_gpu_forward_returns_while_the_gpu_still_sleeps(comm, lookahead, model):
    if _gpus() < 1:
        pytest.skip("needs a GPU")
    if comm == "nccl" and not _ours():
        pytest.skip("needs NCCL >= 2.28.3 with symmetric windows")
    if comm == "nccl" and _gpus() < 2 and multi_rank_per_gpu_supported():
        # two ranks on the one GPU: the gathers have a peer, so they launch their captured graphs
        cluster = RankCluster(2, backend="gloo", task_timeout=300)
    else:
        cluster = RankCluster(min(_gpus(), 2), backend="nccl", task_timeout=300)
    with cluster as c:
        for r in c.run(host_not_held, comm, lookahead, model):
            # deterministic: the sleep queued in front takes ~1 s of GPU time; a host wait anywhere in
            # the forward (a sync, a poll, a .item()) would have let it finish first
            assert r["returned_while_gpu_busy"], r
            assert r["gathers"] > 0


def _two_ranks_of_ours(task_timeout: float) -> RankCluster:
    """Two ranks for our NCCL communicator: one per GPU, or both on one GPU (NCCL >= 2.30)."""
    if _gpus() >= 2 and _ours():
        return RankCluster(2, backend="nccl", task_timeout=task_timeout)
    if multi_rank_per_gpu_supported():
        return RankCluster(2, backend="gloo", task_timeout=task_timeout)
    pytest.skip("needs 2 GPUs, or NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1 for 2 ranks on one GPU")


@pytest.mark.parametrize("blocking", [True, False])
def test_gpu_missing_rank_mid_forward_is_an_error_within_the_timeout(blocking):
    cluster = _two_ranks_of_ours(90)
    # Rank 0 steps back to back. Without the watchdog it would step for the whole 60 s and report no
    # error; without the planner's backpressure it would fill the launch queue and hang in a launch
    # (TaskTimeout here).
    with cluster as c:
        r0, r1 = c.run(missing_rank, 5.0, blocking)
    assert r1["error"] is None and r0["blocking"] is blocking
    assert r0["error"] is not None and "rank 0" in r0["error"] and "layer" in r0["error"], r0
    assert r0["seconds"] < 30, r0  # the timeout (5 s) plus the watchdog's period, never a hang


def test_gpu_gathers_launched_as_graphs_equal_direct_calls_and_go_with_the_sharding():
    cluster = _two_ranks_of_ours(300)
    from tests.accel.hotpath_tasks import launch_modes_equal

    with cluster as c:
        for r in c.run(launch_modes_equal, "small"):
            assert r["gather_launch"] == "graph" and r["launch"] == ["graph"]
            # one graph per gather, one more per gather that copies its own chunk in
            assert r["graphs_while_open"] == r["sharded_layers"] + r["copying_gathers"] > 0
            assert r["equal"] == [(how, [True] * 3) for how in ("graph", "direct", "graph")], r
            # the graphs go before the sharding's windows: NCCL's destroy would wait for them forever
            assert r["graphs_after_close"] == 0


# ---- [Note: the issue thread] (wsharding/accel/issue_thread.py) -----------------------------------------
def _issue_thread_cluster(task_timeout: float) -> RankCluster:
    if _gpus() < 1 or not _ours():
        pytest.skip("needs a GPU and NCCL >= 2.28.3 with symmetric windows")
    if _gpus() < 2 and multi_rank_per_gpu_supported():
        return RankCluster(2, backend="gloo", task_timeout=task_timeout)  # peers: the NCCL graphs run
    return RankCluster(min(_gpus(), 2), backend="nccl", task_timeout=task_timeout)


@pytest.mark.parametrize("lookahead", [True, False])
def test_gpu_issue_thread_equals_replicated_and_holds_no_host(lookahead):
    from wsharding.models.equality import model_equality

    counts = [[3, 5], [6, 2], [0, 3], [1, 8]]
    with _issue_thread_cluster(300) as c:
        counts = [row[: c.world_size] for row in counts]
        for r in c.run(model_equality, "small", counts, lookahead=lookahead, comm="nccl", issue_thread=True):
            assert r["max_abs_diff"] == 0.0 and all(e in (True, None) for e in r["equal"]) and any(r["equal"])
            assert r["gathers"] == [len(r["sharded_layers"])] * len(counts)
            # lookahead: every gather went through the thread (warm-up step included); off: none did
            # (a gather waited on at once is issued inline)
            assert (r["issue_thread_pushes"] > 0) is lookahead, r
        for r in c.run(host_not_held, "nccl", lookahead, "small", issue_thread=True):
            assert r["returned_while_gpu_busy"], r
            assert (r["issue_thread_pushes"] > 0) is lookahead


def test_gpu_issue_thread_error_names_the_layer_and_aborts():
    from tests.accel.hotpath_tasks import issue_thread_error

    if _gpus() < 1 or not _ours():
        pytest.skip("needs a GPU and NCCL >= 2.28.3 with symmetric windows")
    with RankCluster(1, backend="nccl", task_timeout=120) as c:
        (r,) = c.run(issue_thread_error)
    assert r["sharded_layers"] >= 3 and r["pushes"] > 0
    assert r["error"] is not None and "CUresult 1" in r["error"] and "rank 0" in r["error"], r
    assert "layer" in r["error"] and r["aborted"], r


#: A stand-in for cuStreamWaitEvent that spins first: an issue thread that lags the model's thread by
#: ``delay_us`` per gated gather, so that a layer reaches its wait long before its gather was issued.
SLOW_WAIT_C = r"""
#include <time.h>
typedef int (*wait_fn)(void *, void *, unsigned);
wait_fn real_wait;
double delay_us;
int slow_wait(void *stream, void *event, unsigned flags) {
    struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
    double end = t.tv_sec * 1e6 + t.tv_nsec * 1e-3 + delay_us, now;
    do { clock_gettime(CLOCK_MONOTONIC, &t); now = t.tv_sec * 1e6 + t.tv_nsec * 1e-3; } while (now < end);
    return real_wait(stream, event, flags);
}
"""


def slow_issue_thread_equality(ctx, guard: bool, delay_us: float = 20000.0) -> dict:
    """The ToyDecoder ``small`` with an issue thread that lags (SLOW_WAIT_C); ``guard=False`` takes
    away the check that a gather was issued before its layer waits on its ready event."""
    import ctypes
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    from wsharding.accel.cuda_driver import driver
    from wsharding.accel.issue_thread import driver_issue_thread, fn_address
    from wsharding.accel.nccl.gather import NcclPreparedGather
    from wsharding.comm_by_name import shard_comm_for
    from wsharding.models import build_pair, decoder_config

    d = Path(tempfile.mkdtemp())
    (d / "slow.c").write_text(SLOW_WAIT_C)
    subprocess.run([shutil.which("cc") or "gcc", "-O1", "-shared", "-fPIC", str(d / "slow.c"), "-o", str(d / "slow.so")],
                   check=True)
    slow = ctypes.CDLL(str(d / "slow.so"))
    cu = driver()
    ctypes.c_void_p.in_dll(slow, "real_wait").value = fn_address(cu._cuStreamWaitEvent)
    ctypes.c_double.in_dll(slow, "delay_us").value = delay_us
    c = shard_comm_for(ctx, "nccl")
    # plain slots: a layer's gather copies into its slot, so a wait on a stale record reads stale bytes
    replicated, sharded = build_pair(decoder_config("small"), c, map_own_chunk=False)
    kept = NcclPreparedGather._wait_issued
    if not guard:
        NcclPreparedGather._wait_issued = lambda self: setattr(self, "seq", 0)
    equal = []
    try:
        with torch.no_grad():
            c.issuer = driver_issue_thread("a lagging issue thread", wait=fn_address(slow.slow_wait))
            for step in range(3):
                x = torch.arange(4 + step, device=c.device) % 50
                equal.append(bool(torch.equal(replicated(x), sharded(x))))
            pushes = c.issuer.pushes
            c.set_issue_thread(False)  # runs what is left, then stops
    finally:
        NcclPreparedGather._wait_issued = kept
    return {"equal": equal, "pushes": pushes, "sharded_layers": len(sharded.weight_sharding.sharded_layer_ids)}


@pytest.mark.parametrize("guard", [True, False])
def test_gpu_a_layer_waits_until_its_gather_was_issued(guard):
    """[Note: the issue thread], "issued before waited on": the thread lags 20 ms per gated gather. With
    the check, every output is bitwise the replicated one; without it, a layer's stream waits on the
    previous step's record of its ready event and computes with what its slot held before."""
    if _gpus() < 1 or not _ours():
        pytest.skip("needs a GPU and NCCL >= 2.28.3 with symmetric windows")
    with RankCluster(1, backend="nccl", task_timeout=300) as c:  # a cluster of its own: the task patches a class
        (r,) = c.run(slow_issue_thread_equality, guard)
    assert r["pushes"] > r["sharded_layers"]
    if guard:
        assert r["equal"] == [True] * 3, r
    else:
        assert not all(r["equal"]), r
