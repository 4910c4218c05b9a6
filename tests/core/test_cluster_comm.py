"""Rank processes and the torch.distributed backend on CPU ranks (gloo)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from wsharding.core.comm import CommError
from wsharding.core.context import ClusterError
from wsharding.core.groups import shard_group_of, shard_group_ranks
from wsharding.core.layout import FlatLayout
from wsharding.lab.cluster import RankCluster, RemoteError, TaskTimeout, WorkerDied

MIXED = [
    ("qkv", (24, 16), torch.bfloat16),
    ("router", (3, 16), torch.float32),
    ("down", (13, 7), torch.float8_e4m3fn),
    ("up", (7, 13), torch.float16),
    ("tiny", (5,), torch.int8),
    ("bytes", (33,), torch.uint8),
]


# ---- tasks (module level: spawned ranks import them by name) ------------------------------------
def who_am_i(ctx) -> dict:
    return {"rank": ctx.rank, "pid": os.getpid(), "emulation": ctx.emulation}


def reference_tensors(layout: FlatLayout, seed: int) -> dict[str, torch.Tensor]:
    """Random bytes viewed as each entry's dtype (NaNs included): compared as bytes, never as values."""
    gen = torch.Generator().manual_seed(seed)
    return {e.name: torch.randint(0, 256, (e.nbytes,), dtype=torch.uint8, generator=gen).view(e.dtype).view(e.shape)
            for e in layout.entries}


def gather_layout(ctx, layout: FlatLayout, seed: int) -> dict:
    """Fill this rank's chunk of a poisoned buffer, gather in place, compare every byte and view."""
    comm = ctx.shard_comm(layout.group_size)
    ref = reference_tensors(layout, seed)
    full = comm.alloc(layout.total_bytes)
    full.fill_(0xAB)  # bytes the gather forgets to write are seen as mismatches
    chunk = layout.chunk(full, comm.rank)
    layout.fill_chunk(comm.rank, ref, chunk)
    comm.all_gather_into(full, chunk)
    views = layout.views(full)
    return {"rank": ctx.rank, "mode": comm.mode, "mismatched_bytes": int((full != layout.pack(ref)).sum()),
            "views_equal": all(torch.equal(views[n].view(torch.uint8), ref[n].view(torch.uint8)) for n in layout.names)}


def raise_on_rank(ctx, bad_rank: int):
    if ctx.rank == bad_rank:
        raise ValueError(f"deliberate failure on rank {ctx.rank}")
    return ctx.rank


def raise_then_others_block(ctx):
    if ctx.rank == 0:
        raise ValueError("rank 0 leaves before the collective")
    ctx.comm.barrier()  # the other ranks wait here for rank 0, which never comes
    return ctx.rank


def die_on_rank(ctx, bad_rank: int):
    if ctx.rank == bad_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # the survivors would wait far longer than the test allows
    return ctx.rank


def sleep_for(ctx, seconds: float):
    time.sleep(seconds)
    return ctx.rank


def async_gather(ctx, nbytes_per_rank: int):
    comm = ctx.comm
    full = comm.alloc(nbytes_per_rank * comm.world_size)
    full.zero_()
    chunk = full.narrow(0, comm.rank * nbytes_per_rank, nbytes_per_rank)
    chunk.fill_(comm.rank + 1)
    handle = comm.all_gather_into(full, chunk, async_op=True)
    handle.wait()
    expected = torch.arange(1, comm.world_size + 1, dtype=torch.uint8).repeat_interleave(nbytes_per_rank)
    # not in place: a separate chunk tensor gathered into a separate buffer
    other = torch.full((nbytes_per_rank,), 9, dtype=torch.uint8)
    out = torch.zeros(nbytes_per_rank * comm.world_size, dtype=torch.uint8)
    comm.all_gather_into(out, other)
    return bool(torch.equal(full, expected)), bool(torch.all(out == 9)), handle.is_completed()


def split_groups_gather(ctx, group_size: int):
    """Each shard group gathers its own data (seed = group index): groups must not mix."""
    layout = FlatLayout(MIXED, group_size)
    comm = ctx.shard_comm(group_size)
    group_index = ctx.rank // group_size
    ref = reference_tensors(layout, seed=100 + group_index)
    full = comm.alloc(layout.total_bytes)
    chunk = layout.chunk(full, comm.rank)
    layout.fill_chunk(comm.rank, ref, chunk)
    comm.all_gather_into(full, chunk)
    return group_index, comm.rank, comm.world_size, bool(torch.equal(full, layout.pack(ref)))


def bad_gather_args(ctx):
    comm = ctx.comm
    try:
        comm.all_gather_into(torch.zeros(10, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8))
    except CommError as e:
        return str(e)
    return "no error"


# ---- tests --------------------------------------------------------------------------------------
def test_shard_groups():
    assert shard_group_ranks(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert shard_group_ranks(8) == [list(range(8))]
    assert shard_group_ranks(16) == [list(range(8)), list(range(8, 16))]
    with pytest.raises(ValueError, match="group_size 8 is larger than the world of 3 rank"):
        shard_group_ranks(3, 8)  # never clipped to the world
    assert shard_group_of(6, 8, 4) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="shard group size 4 does not divide world size 6"):
        shard_group_ranks(6, 4)
    with pytest.raises(ValueError, match="world_size: must be >= 1, got 0"):
        shard_group_ranks(0, 4)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_mixed_dtype_gather_is_byte_exact(cluster_of, n):
    cluster = cluster_of(n)
    layout = FlatLayout(MIXED, n)
    reports = cluster.run(gather_layout, layout, seed=n)
    assert [r["rank"] for r in reports] == list(range(n))
    for r in reports:
        assert r["mismatched_bytes"] == 0 and r["views_equal"]
        assert r["mode"] == "cpu-gloo"
    infos = cluster.run(who_am_i)
    assert all("emulated" in i["emulation"] for i in infos)
    assert len({i["pid"] for i in infos}) == n


def test_world_4_in_two_groups_of_2(cluster_of):
    """Two shard groups of consecutive ranks, each gathering its own data. World 4 shows what world 8
    in groups of 4 would (the groups' ranks, sizes and data) on the session's 4-rank cluster, without
    starting 8 rank processes."""
    results = cluster_of(4).run(split_groups_gather, 2)
    assert results == [(r // 2, r % 2, 2, True) for r in range(4)]


@pytest.mark.parametrize("n", [1, 3])
def test_async_and_out_of_place_gather(cluster_of, n):
    assert cluster_of(n).run(async_gather, 48) == [(True, True, True)] * n


def test_gather_argument_errors(cluster_of):
    msgs = cluster_of(2).run(bad_gather_args)
    assert all("full has 10 bytes, expected chunk (3) x world size (2) = 6" in m for m in msgs)


@pytest.fixture(scope="module")
def fragile():
    """A cluster of its own for the failure tests: they kill and restart its workers."""
    c = RankCluster(2, backend="gloo", task_timeout=30, collective_timeout=20)
    yield c
    c.close()


def test_remote_exception_names_rank_and_traceback(fragile):
    with pytest.raises(RemoteError) as info:
        fragile.run(raise_on_rank, 1)
    err = info.value
    assert err.rank == 1 and err.exc_type == "ValueError"
    assert "deliberate failure on rank 1" in str(err)
    assert "raise_on_rank" in err.remote_traceback
    # no collective was pending: the cluster is still usable without a restart
    starts = fragile.starts
    assert fragile.run(raise_on_rank, 5) == [0, 1]
    assert fragile.starts == starts


def test_failing_rank_with_others_in_collective_restarts(fragile):
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match="rank 0 leaves before the collective") as info:
        fragile.run(raise_then_others_block)
    assert "did not finish" in str(info.value)
    assert time.monotonic() - t0 < 15
    starts = fragile.starts
    assert fragile.run(raise_on_rank, 5) == [0, 1]
    assert fragile.starts == starts + 1


def test_killed_worker_raises_within_bound(fragile):
    fragile.start()
    t0 = time.monotonic()
    with pytest.raises(WorkerDied, match=r"rank 1 died \(exit code -9, killed by SIGKILL\) during die_on_rank"):
        fragile.run(die_on_rank, 1)
    assert time.monotonic() - t0 < 10
    assert not fragile.running
    assert fragile.run(raise_on_rank, 5) == [0, 1]  # restarted on demand


def test_task_timeout(fragile):
    t0 = time.monotonic()
    with pytest.raises(TaskTimeout, match=r"ranks \[0, 1\] did not answer sleep_for within 1.0 s"):
        fragile.run_with(sleep_for, (30,), timeout=1.0)
    assert time.monotonic() - t0 < 8


def test_main_module_tasks_are_refused(fragile):
    def local(ctx):  # pragma: no cover - never sent
        return 1

    local.__module__ = "__main__"
    with pytest.raises(ClusterError, match="defined in __main__"):
        fragile.run(local)
    with pytest.raises(ClusterError, match="lambda"):
        fragile.run(lambda ctx: 1)


def test_context_manager_leaves_no_process():
    with RankCluster(2, backend="gloo") as c:
        pids = [i["pid"] for i in c.run(who_am_i)]
    assert not c.running
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not [p for p in mp.active_children() if p.name.startswith("wsharding-rank") and p.pid in pids]


def test_bad_cluster_arguments():
    with pytest.raises(ClusterError, match="world_size: must be >= 1, got 0"):
        RankCluster(0)
    with pytest.raises(ClusterError, match="unknown backend 'mpi'"):
        RankCluster(2, backend="mpi")
    if not torch.cuda.is_available():
        with pytest.raises(ClusterError, match="backend 'nccl' with 2 ranks needs 2 GPUs"):
            RankCluster(2, backend="nccl")
