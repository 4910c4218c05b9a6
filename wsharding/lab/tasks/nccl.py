"""Rank tasks that exercise the NCCL backend on GPUs (used by the GPU tests and the notebook).

They live in the package because spawned rank processes import tasks by name.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from wsharding.core.context import RankContext
from wsharding.core.units import MiB


def _pattern(rank: int, n: int, salt: int, device: torch.device) -> torch.Tensor:
    i = torch.arange(n, device=device, dtype=torch.int64)
    return ((i * 31 + rank * 17 + salt * 3 + 1) % 253 + 1).to(torch.uint8)


def _free_device_bytes() -> int:
    free, _total = torch.cuda.mem_get_info()
    return int(free)


def gather_roundtrip(ctx: RankContext | None, sizes: list[int], cta_policy: int = 2, steps: int = 100,
                     ce_probe: bool = True) -> dict[str, Any]:
    """Byte-exact in-place gathers from symmetric windows at each size, the copy-engine check,
    and ``steps`` further gathers with device memory measured before and after.

    ``ctx=None`` runs at world size 1 in this process (no torch.distributed).
    """
    from wsharding.accel.nccl.communicator import NcclCommunicator, from_context
    from wsharding.accel.nccl.probe import copy_engine_check

    comm = (from_context(ctx, cta_policy=cta_policy, timeout_s=60) if ctx is not None
            else NcclCommunicator(device=0, cta_policy=cta_policy, timeout_s=60))
    out: dict[str, Any] = {"rank": comm.rank, "mode": comm.mode, "emulation": comm.emulation,
                           "nccl": comm.library.describe(), "sizes": [], "ranks_per_gpu": comm.ranks_per_gpu}
    with comm:
        world, rank, dev = comm.world_size, comm.rank, comm.device
        # Allocate in an order different from the registration order: register_all sorts by tag.
        bufs = {}
        for i in reversed(range(len(sizes))):
            bufs[i] = comm.alloc(sizes[i], tag=f"layer.{i}.full")
        out["registered"] = comm.register_all()
        out["order"] = list(comm.pool.registered_order)
        out["aligned"] = all(b.ptr % 4096 == 0 for b in comm.pool.buffers)
        out["zero_copy"] = all(b.tensor.data_ptr() == b.ptr for b in comm.pool.buffers)
        for i, size in enumerate(sizes):
            full = bufs[i]
            n = size // world
            chunk = full[rank * n:(rank + 1) * n]
            full.fill_(0xAB)
            chunk.copy_(_pattern(rank, n, i, dev))
            comm.all_gather_into(full, chunk, async_op=True).synchronize()
            want = torch.cat([_pattern(r, n, i, dev) for r in range(world)])
            bad = int((full != want).sum())
            out["sizes"].append({"size": size, "mismatched_bytes": bad})
        probe_i = len(sizes) - 1
        full = bufs[probe_i]
        n = sizes[probe_i] // world
        if ce_probe:
            out["ce_check"] = copy_engine_check(comm, full, full[rank * n:(rank + 1) * n])
        # Memory growth over many steps (the per-call handle and event must not leak).
        chunk = full[rank * n:(rank + 1) * n]
        for _ in range(5):
            comm.all_gather_into(full, chunk)
        comm.synchronize()
        torch.cuda.synchronize(dev)
        before = (torch.cuda.memory_allocated(dev), _free_device_bytes())
        t0 = time.perf_counter()
        for _ in range(steps):
            comm.all_gather_into(full, chunk)
        comm.synchronize()
        torch.cuda.synchronize(dev)
        after = (torch.cuda.memory_allocated(dev), _free_device_bytes())
        out["steps"] = {"n": steps, "seconds": time.perf_counter() - t0, "torch_allocated_delta": after[0] - before[0],
                        "device_free_delta": after[1] - before[1]}
        out["gathers_issued"] = comm.gathers_issued
        out["after_steps_ok"] = bool((full == torch.cat([_pattern(r, n, probe_i, dev) for r in range(world)])).all())
        comm.barrier()
    out["closed"] = comm.closed and not comm.aborted
    return out


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
        chunk.copy_(_pattern(rank, n, 0, dev))
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
            chunk.copy_(_pattern(rank, n, i, dev))
            torch.cuda.synchronize(dev)
            comm.barrier()  # every rank has written its new chunk before anyone gathers
            g.replay()
            torch.cuda.synchronize(dev)
            want = torch.cat([_pattern(r, n, i, dev) for r in range(world)])
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


__all__ = ["default_stream_refused", "gather_roundtrip", "graph_replay", "missing_rank",
           "unregistered_refused"]


def group_unique_ids(ctx: RankContext, group_size: int) -> dict[str, Any]:
    """The unique-id exchange of :class:`~wsharding.accel.nccl.NcclCommunicator`, run on its own over this
    rank's shard group: the gloo group from ``from_context``'s helper, rank 0 of each group making a
    real ``ncclGetUniqueId`` (it needs libnccl, not a GPU), every member receiving its group's id.

    This is the part of the constructor that decides which ranks end up in one communicator; the rest
    (``ncclCommInitRankConfig``, windows) needs GPUs (``tests/models/test_gpu_sharding.py``).
    """
    import torch.distributed as dist

    from wsharding.accel.nccl.binding import NcclBinding
    from wsharding.accel.nccl.group import exchange_over, gloo_shard_group_for, group_members, share_unique_id
    from wsharding.accel.nccl.library import default_library

    group = gloo_shard_group_for(ctx, group_size)
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    raw = share_unique_id(NcclBinding(default_library()), rank, lambda obj: exchange_over(group, size, obj))
    return {"rank": ctx.rank, "rank_in_group": rank, "group_size": size,
            "group": list(group_members(group, size)), "unique_id": raw.hex()}
