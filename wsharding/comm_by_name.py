"""The communicator a rank gathers with, chosen by name, and what this machine's GPUs allow.

``"torch"`` is torch.distributed over the rank's shard group (gloo on CPU ranks, NCCL on GPUs);
``"nccl"`` our NCCL binding (:mod:`wsharding.accel.nccl`); ``"auto"`` ours where this machine runs
it, else torch's. The demo, the benchmarks, the notebooks' tasks and the tests all choose this way.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from wsharding.core.context import RankContext
from wsharding.core.errors import InvalidArgument
from wsharding.core.groups import check_group_size


def ours_supported() -> bool:
    """True when this machine can run our NCCL communicator: CUDA, and a libnccl with symmetric
    windows and the copy engine (>= 2.28.3)."""
    if not torch.cuda.is_available():
        return False
    from wsharding.accel.nccl.library import NcclLibraryError, default_library

    try:
        return bool(default_library().describe().get("copy_engine_allgather"))
    except NcclLibraryError:
        return False


def multi_rank_per_gpu_supported() -> bool:
    """True when several ranks may share this machine's GPU with our NCCL communicator: a GPU, a
    libnccl >= 2.30 and ``NCCL_MULTI_RANK_GPU_ENABLE=1`` (NCCL's multi-rank-per-GPU mode)."""
    if not torch.cuda.is_available() or os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
        return False
    from wsharding.accel.nccl.library import NcclLibraryError, default_library

    try:
        return bool(default_library().describe().get("multi_rank_per_gpu"))
    except NcclLibraryError:
        return False


def shard_comm_for(ctx: RankContext, comm: str = "torch", group_size: int | None = None):
    """The communicator the sharded layers gather with, over this rank's shard group.

    ``group_size`` (default: the whole world) cuts the world into groups ``(rank // g) * g``, as the
    intra-node groups of 8 of SGLang's weight sharding for Kimi K3; each group shards one copy of the
    weights between its members.
    ``"torch"``: torch.distributed over this rank's shard group (gloo on CPU, NCCL on GPUs).
    ``"nccl"``: our ctypes NCCL communicator over the group -- one unique id per group, buffers from
    ``ncclMemAlloc`` registered as symmetric windows of the group, CTA policy 2, so gathers take the
    copy-engine path. Created once per rank and group size, kept in ``ctx.store`` (creating a
    communicator is collective and slow).
    ``"auto"``: ``"nccl"`` when :func:`ours_supported`, else ``"torch"``.
    """
    if comm == "auto":
        comm = "nccl" if ours_supported() else "torch"
    # never clipped to the world: a group the world cannot hold is refused, naming the world size
    g = ctx.world_size if group_size is None else check_group_size(ctx.world_size, group_size,
                                                                   where=f"rank {ctx.rank}: shard_comm_for")
    if comm == "torch":
        return ctx.shard_comm(g)
    if comm != "nccl":
        raise InvalidArgument(f"unknown communicator {comm!r}: use 'torch', 'nccl' or 'auto'")
    key = "_wsharding_nccl_comm" if g == ctx.world_size else f"_wsharding_nccl_comm.g{g}"
    if key not in ctx.store:
        from wsharding.accel.nccl import from_context

        ctx.store[key] = from_context(ctx, group_size=None if g == ctx.world_size else g)
    return ctx.store[key]


def is_ours(comm: Any) -> bool:
    """True when ``comm`` is our NCCL communicator: what only it has (its gather stream, watchdog,
    issue thread and group list) is read after this check, not probed for."""
    from wsharding.accel.nccl.communicator import NcclCommunicator

    return isinstance(comm, NcclCommunicator)


def graph_unsupported(comm: Any) -> str | None:
    """Why a step over ``comm`` cannot be captured in a CUDA graph here, or None when it can (the
    rule of ``bench step --graph`` and ``demo --graph``)."""
    if comm.device.type != "cuda":
        return "CUDA graphs need GPUs (these are CPU ranks)"
    if comm.world_size == 1:
        return None
    if not is_ours(comm):
        return "capturing gathers needs our NCCL communicator (--comm nccl)"
    if comm.shared_gpu:
        return "several ranks share one GPU: capturing their gathers hung when tried there"
    return None


def group_of(comm: Any) -> list[int]:
    """Global ranks of a communicator's shard group (either backend), in group order."""
    if is_ours(comm):
        return list(comm.group_ranks)
    import torch.distributed as dist

    group = comm.group  # TorchDistComm: None is the whole world
    return list(dist.get_process_group_ranks(group)) if group is not None else list(range(dist.get_world_size()))
