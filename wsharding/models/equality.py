"""The toy decoder sharded against its replicated twin on every rank: outputs bit for bit, gathers,
waits and bytes (the demo, the notebooks and the tests run it on their ranks)."""

from __future__ import annotations

from typing import Any

import torch

from wsharding.comm_by_name import shard_comm_for
from wsharding.core.comm import is_slice_of
from wsharding.core.context import RankContext
from wsharding.core.next_step import NextStepPrefetch
from wsharding.core.runner import aligned_forward
from wsharding.models import DecoderConfig, build_pair, decoder_config
from wsharding.models.kv_cache import model_bytes, sharded_model_bytes


def tokens_for(rank: int, step: int, counts: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """This rank's tokens at ``step``: ``counts[step][rank]`` ids (0 means an idle rank)."""
    n = counts[step % len(counts)][rank % len(counts[0])]
    g = torch.Generator().manual_seed(7919 * rank + step)
    return torch.randint(0, vocab, (n,), generator=g).to(device)


def model_equality(ctx: RankContext, preset: str | DecoderConfig, counts: list[list[int]], *, lookahead: bool = True,
                   group_size: int | None = None, seed: int = 0, comm: str = "torch",
                   prefetch_next_step: bool = False, map_own_chunk: bool | str = False,
                   close: bool = False, issue_thread: bool = False) -> dict[str, Any]:
    """Build the replicated and sharded models, run ``len(counts)`` steps with ``counts[step][rank]``
    tokens on this rank (idle ranks run a one-token dummy step), compare outputs bit for bit.
    ``prefetch_next_step``: a :class:`~wsharding.core.next_step.NextStepPrefetch` plug-in ([Note: the next step's first gather]); ``map_own_chunk``:
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
        "group": list(comm.group_ranks),
        "map_own_chunk": ws.map_own_chunk,
        "map_own_chunk_reason": ws.map_own_chunk_reason,
    }
    if close:
        ws.close()
        result["pool_bytes"] = (pool_before, pool.allocated_bytes if pool is not None else None)
    return result
