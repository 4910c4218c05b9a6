"""Rank tasks that exercise the NCCL backend, used by the notebooks (``02_communication``,
``06_end_to_end``) and by ``tests/lab/test_gpu_nccl_roundtrip.py``.

They live in the package because spawned rank processes import tasks by name. The library's own GPU
tests of the backend keep their tasks next to them, in ``tests/accel/nccl_tasks.py``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from wsharding.core.context import RankContext


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


__all__ = ["gather_roundtrip", "group_unique_ids"]
