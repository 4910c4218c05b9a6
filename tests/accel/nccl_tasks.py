"""Rank tasks for the GPU tests of our NCCL backend (``tests/accel/test_gpu_nccl.py``): a rank that
goes missing, a gather captured in a CUDA graph, and the gathers the communicator refuses; plus
:func:`nccl_cluster`, the cluster those tests (and ``tests/lab/test_gpu_nccl_roundtrip.py``) run on.

Spawned rank processes import these tasks by name (``tests.accel.nccl_tasks.graph_replay``): the
repository root is on ``sys.path`` under pytest, and the ranks inherit it.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from wsharding.accel.nccl.library import MIN_MULTI_RANK_GPU, default_library
from wsharding.core.context import RankContext
from wsharding.core.units import MiB
from wsharding.lab.cluster import RankCluster


def nccl_cluster(n: int) -> RankCluster:
    """``n`` ranks for our NCCL communicator: one per GPU, or several on one GPU when the loaded NCCL
    allows it (>= 2.30); skips the test otherwise, saying which library was loaded."""
    gpus = torch.cuda.device_count()
    if n > gpus and not default_library().supports(MIN_MULTI_RANK_GPU):
        pytest.skip(f"{n} ranks on {gpus} GPU(s) need NCCL >= 2.30; the loaded one is "
                    f"{default_library().version_str} ({default_library().path}): set WSHARDING_NCCL_LIBRARY")
    env = {"NCCL_MULTI_RANK_GPU_ENABLE": "1"} if n > gpus else {}
    return RankCluster(n, backend="gloo", task_timeout=300, collective_timeout=120, env=env)


def pattern(rank: int, n: int, salt: int, device: torch.device) -> torch.Tensor:
    """``n`` bytes that differ by rank, salt and position and are never zero. (The notebook's
    ``gather_roundtrip`` in the teaching layer keeps its own copy: the library's tests do not import
    the teaching layer, and the teaching layer does not import the tests.)"""
    i = torch.arange(n, device=device, dtype=torch.int64)
    return ((i * 31 + rank * 17 + salt * 3 + 1) % 253 + 1).to(torch.uint8)


def missing_rank(ctx: RankContext, timeout_s: float = 5.0, cta_policy: int = 2, how: str = "leave") -> dict[str, Any]:
    """The last rank misses the gather; the others gather and must fail with an error within
    ``timeout_s``, not hang. ``how="leave"``: it aborts its communicator and returns (a crashed or
    exited rank); ``how="skip"``: it stays alive but never joins (an idle rank skipping a step),
    so only our timeout can end the wait."""
    from wsharding.accel.nccl.communicator import from_context
    from wsharding.core.comm import CommError

    comm = from_context(ctx, cta_policy=cta_policy, timeout_s=timeout_s)
    full = comm.alloc(4 * MiB, tag="layer.0.full")
    comm.register_all()
    n = full.numel() // comm.world_size
    if comm.rank == comm.world_size - 1:
        if how == "skip":
            time.sleep(timeout_s + 3.0)  # alive, but in no collective
        comm.abort()  # what a crashed or early-exiting rank looks like to its peers
        comm.close()
        return {"rank": comm.rank, "left": True}
    t0 = time.monotonic()
    err = None
    try:
        comm.all_gather_into(full, full[comm.rank * n:(comm.rank + 1) * n], async_op=True).synchronize()
    except CommError as e:  # CommTimeout, or NCCL's own ncclRemoteError when it sees the peer leave
        err = f"{type(e).__name__}: {e}"
    elapsed = time.monotonic() - t0
    comm.close()
    return {"rank": comm.rank, "left": False, "error": err, "elapsed_s": elapsed, "aborted": comm.aborted}


def graph_replay(ctx: RankContext | None, size: int = 8 * MiB, replays: int = 3, cta_policy: int = 2) -> dict[str, Any]:
    """Capture fork -> gather -> compute -> join in a CUDA graph and replay it; before each replay
    every rank writes new bytes into its chunk, so a correct replay must gather the new bytes.
    The compute (``full`` as int32, times 3 plus 1) is exact, so graph and eager compare bitwise.

    ``ctx=None``: world size 1 in this process.
    """
    from wsharding.accel.nccl.communicator import NcclCommunicator, from_context

    comm = (from_context(ctx, cta_policy=cta_policy, timeout_s=60) if ctx is not None
            else NcclCommunicator(device=0, cta_policy=cta_policy, timeout_s=60))
    with comm:
        dev, world, rank = comm.device, comm.world_size, comm.rank
        full = comm.alloc(size, tag="layer.0.full")
        comm.register_all()
        n = size // world
        chunk = full[rank * n:(rank + 1) * n]
        chunk.copy_(pattern(rank, n, 0, dev))
        # Warm up outside the capture: NCCL sets up its connections (and the compute its kernels)
        # on first use, which must not happen while a graph is being captured.
        comm.all_gather_into(full, chunk)
        full.view(torch.int32) * 3 + 1
        comm.synchronize()
        torch.cuda.synchronize(dev)
        comm.barrier()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        # thread_local: NCCL's own threads may make CUDA calls while this thread captures.
        with torch.cuda.stream(s), torch.cuda.graph(g, stream=s, capture_error_mode="thread_local"):
            comm.all_gather_into(full, chunk).wait()
            out = full.view(torch.int32) * 3 + 1
        torch.cuda.current_stream(dev).wait_stream(s)
        results = []
        for i in range(1, replays + 1):
            chunk.copy_(pattern(rank, n, i, dev))
            torch.cuda.synchronize(dev)
            comm.barrier()  # every rank has written its new chunk before anyone gathers
            g.replay()
            torch.cuda.synchronize(dev)
            want = torch.cat([pattern(r, n, i, dev) for r in range(world)])
            results.append(bool(torch.equal(full, want)) and bool(torch.equal(out, want.view(torch.int32) * 3 + 1)))
        comm.barrier()
        del g
        return {"rank": rank, "replays_equal": results, "mode": comm.mode}


def default_stream_refused() -> str:
    """The error text when a gather is asked to run on the legacy default stream."""
    from wsharding.accel.nccl.communicator import NcclCommunicator
    from wsharding.core.comm import CommError

    with NcclCommunicator(device=0) as comm:
        full = comm.alloc(4096, tag="x")
        comm.register_all()
        try:
            comm.all_gather_into(full, full, stream=torch.cuda.default_stream(comm.device))
        except CommError as e:
            return str(e)
    return ""


def unregistered_refused() -> str:
    """The error when a gather uses memory outside any registered window."""
    from wsharding.accel.nccl.communicator import NcclCommunicator
    from wsharding.core.comm import CommError

    with NcclCommunicator(device=0) as comm:
        plain = torch.empty(4096, dtype=torch.uint8, device=comm.device)
        try:
            comm.all_gather_into(plain, plain)
        except CommError as e:
            return str(e)
    return ""


__all__ = ["default_stream_refused", "graph_replay", "missing_rank", "nccl_cluster", "pattern",
           "unregistered_refused"]
