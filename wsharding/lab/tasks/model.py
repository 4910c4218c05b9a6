"""Rank tasks for the sharded decoder: equality against the replicated twin, and timed steps.

They live in the package because spawned ranks import tasks by name; tests, the demo and the
notebooks all call them.
"""

from __future__ import annotations

from typing import Any

import torch

from wsharding.accel.next_step import NextStepPrefetch
from wsharding.core.comm import is_slice_of
from wsharding.core.context import RankContext
from wsharding.core.errors import InvalidArgument
from wsharding.core.runner import aligned_forward
from wsharding.models import DecoderConfig, build_pair, decoder_config
from wsharding.models.kv_cache import model_bytes, sharded_model_bytes


def tokens_for(rank: int, step: int, counts: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """This rank's tokens at ``step``: ``counts[step][rank]`` ids (0 means an idle rank)."""
    n = counts[step % len(counts)][rank % len(counts[0])]
    g = torch.Generator().manual_seed(7919 * rank + step)
    return torch.randint(0, vocab, (n,), generator=g).to(device)


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
    import os

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
    g = ctx.world_size if group_size is None else min(group_size, ctx.world_size)
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


def model_equality(ctx: RankContext, preset: str | DecoderConfig, counts: list[list[int]], *, lookahead: bool = True,
                   group_size: int | None = None, seed: int = 0, comm: str = "torch",
                   prefetch_next_step: bool = False, map_own_chunk: bool | str = False,
                   close: bool = False, issue_thread: bool = False) -> dict[str, Any]:
    """Build the replicated and sharded models, run ``len(counts)`` steps with ``counts[step][rank]``
    tokens on this rank (idle ranks run a one-token dummy step), compare outputs bit for bit.
    ``prefetch_next_step``: a :class:`~wsharding.accel.next_step.NextStepPrefetch` plug-in ([Note: the next step's first gather]); ``map_own_chunk``:
    [Note: the own chunk mapped, not copied] (``in_place_gathers`` counts the gathers that copy nothing
    of their own); plain slots unless asked, ``"auto"`` as the package's default. ``close``: close the sharding at the end and report the communicator's device
    bytes before the build and after the close (our NCCL communicator; None for the others).
    ``issue_thread``: the gathers issued by our NCCL communicator's native thread ([Note: the issue
    thread]); it is stopped again at the end (the communicator is kept for later tasks)."""
    cfg = decoder_config(preset)
    comm_name, comm = comm, shard_comm_for(ctx, comm, group_size)
    if issue_thread:
        comm.set_issue_thread(True)  # the same communicator again below (kept in ctx.store)
        try:
            return model_equality(ctx, preset, counts, lookahead=lookahead, group_size=group_size, seed=seed,
                                  comm=comm_name, prefetch_next_step=prefetch_next_step, map_own_chunk=map_own_chunk,
                                  close=close) | {"issue_thread_pushes": comm.issuer.pushes}
        finally:
            comm.set_issue_thread(False)
    pool = comm.pool
    pool_before = pool.allocated_bytes if pool is not None else None
    replicated, sharded = build_pair(cfg, comm, seed=seed, lookahead=lookahead, map_own_chunk=map_own_chunk)
    ws = sharded.weight_sharding
    next_step = NextStepPrefetch.switch(ws.planner, prefetch_next_step)
    equal, max_diff, gathers, waits = [], 0.0, [], []
    with torch.no_grad():
        for step in range(len(counts)):
            x = tokens_for(ctx.rank, step, counts, cfg.vocab, comm.device)
            out_s = aligned_forward(sharded, x, sharded.dummy_tokens)
            gathers.append(ws.planner.gathers_this_step)
            waits.append(ws.planner.waits_this_step)
            if out_s is None:
                equal.append(None)
                continue
            out_r = replicated(x)
            equal.append(bool(torch.equal(out_r, out_s)))
            max_diff = max(max_diff, float((out_r.float() - out_s.float()).abs().max()))
    result = {
        "rank": ctx.rank,
        "equal": equal,
        "max_abs_diff": max_diff,
        "gathers": gathers,
        "waits": waits,
        "next_step_prefetches": next_step.prefetches if next_step is not None else 0,
        # the gather's own rule for "nothing of its own to copy" (NcclPreparedGather.in_place)
        "in_place_gathers": sum(is_slice_of(ws.slots.gather_chunk(i, ws.chunks[i]), ws.slots.full_buffer(i), comm.rank)
                                for i in ws.sharded_layer_ids),
        "sharded_layers": ws.sharded_layer_ids,
        "replicated_bytes": ws.replicated_bytes(),
        "resident_bytes": ws.resident_bytes(),
        "formula_bytes": ws.formula_bytes(),
        "slot_bytes": ws.slots.slot_bytes,
        "chunk_bytes": [ws.layouts[i].chunk_bytes for i in ws.sharded_layer_ids],
        # what the communicator's allocator holds for this sharding (our NCCL communicator): the
        # resident bytes seen from the other side
        "pool_bytes_sharded": pool.allocated_bytes - pool_before if pool is not None else None,
        "layout_bytes": [ws.layouts[i].total_bytes for i in ws.sharded_layer_ids],
        # what the KV-cache comparison counts for each model (kv_cache.model_bytes): the sharded one's
        # mapped layer views own no memory and must not count
        "model_bytes": {"replicated": model_bytes(replicated), "sharded": sharded_model_bytes(sharded, ws)},
        "mode": comm.mode,
        "group": group_of(comm),
        "map_own_chunk": ws.map_own_chunk,
        "map_own_chunk_reason": ws.map_own_chunk_reason,
    }
    if close:
        ws.close()
        result["pool_bytes"] = (pool_before, pool.allocated_bytes if pool is not None else None)
    return result
