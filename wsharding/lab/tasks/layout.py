"""Small tasks that run on every rank of a :class:`~wsharding.lab.cluster.RankCluster`.

They live in the package (not in a notebook) because spawned ranks import tasks by name.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from wsharding.core.context import RankContext
from wsharding.core.errors import InvalidArgument
from wsharding.core.layout import FlatLayout


def describe_rank(ctx: RankContext) -> dict[str, Any]:
    """Who and where this rank is: rank, world size, device, backend, mode, pid."""
    return {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "device": str(ctx.device),
        "backend": ctx.backend,
        "mode": ctx.mode,
        "emulation": ctx.emulation,
        "pid": os.getpid(),
    }


def reference_tensors(layout: FlatLayout, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic full weights for ``layout`` (the same on every rank for the same seed).

    Random bytes reinterpreted as each entry's dtype, so every bit pattern -- NaNs included -- must
    survive the trip; comparisons are therefore made on bytes, never on values.
    """
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for e in layout.entries:
        raw = torch.randint(0, 256, (e.nbytes,), dtype=torch.uint8, generator=gen)
        out[e.name] = raw.view(e.dtype).view(e.shape)
    return out


def gather_layout(ctx: RankContext, layout: FlatLayout, group_size: int | None = None, seed: int = 0) -> dict[str, Any]:
    """End to end on one rank: fill this rank's chunk from the reference weights' owned pieces,
    gather in place into a full buffer, and check every byte against the reference.

    Returns this rank's report: which pieces it owned, bytes gathered, mismatching bytes, timing.
    """
    comm = ctx.shard_comm(group_size or layout.group_size)
    if comm.world_size != layout.group_size:
        raise InvalidArgument(
            f"layout was built for N={layout.group_size} but rank {ctx.rank}'s shard group has "
            f"{comm.world_size} ranks"
        )
    ref = reference_tensors(layout, seed)
    full = comm.alloc(layout.total_bytes, tag="gather_layout")
    full.fill_(0xAB)  # poison: bytes the gather forgets to write are seen as mismatches
    chunk = layout.chunk(full, comm.rank)  # this rank's slice: the gather is in place
    layout.fill_chunk(comm.rank, {k: v.to(comm.device) for k, v in ref.items()}, chunk)
    t0 = time.perf_counter()
    comm.all_gather_into(full, chunk)
    if full.is_cuda:
        torch.cuda.synchronize(full.device)
    elapsed = time.perf_counter() - t0
    expected = layout.pack(ref)
    mismatched = int((full.cpu() != expected).sum())
    views = layout.views(full)
    view_ok = all(
        torch.equal(views[n].cpu().view(torch.uint8), ref[n].view(torch.uint8)) for n in layout.names
    )
    return {
        "rank": ctx.rank,
        "group_rank": comm.rank,
        "group_size": comm.world_size,
        "mode": comm.mode,
        "pieces": [(p.name, p.entry_start, p.entry_stop, p.chunk_start, p.chunk_stop) for p in layout.pieces(comm.rank)],
        "bytes": layout.total_bytes,
        "mismatched_bytes": mismatched,
        "views_equal": view_ok,
        "seconds": elapsed,
    }
