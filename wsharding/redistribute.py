"""Finalize's redistribution, one layer at a time: row shards -> flat chunks (first seed,
"finalize 时重排成 flat chunk"), with the linear's after-loading step run on the gathered full weight.

[Note: finalize peak] A layer's row shards are packed into slot A and freed *before* its chunk is
allocated, and each full weight is rebuilt in slot B, in place: rows and chunks never coexist
beyond one layer's padding, and the seed's temporary full weight costs nothing extra. The peak is
``R/N + padding/N + 2 slots`` plus one weight in flight (a transient of the backend or of loading).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from wsharding.comm.base import Communicator
from wsharding.layout import FlatLayout
from wsharding.linear.base import LinearBase, rebind_tensor
from wsharding.rowloaders import ShardingError, ShardTarget
from wsharding.slots import SlotPool


def set_weight_data(module: nn.Module, data: torch.Tensor) -> torch.Tensor:
    """Give ``module.weight`` new data, keeping the Parameter object; a meta parameter cannot take
    real data in place, so it is replaced by one of the same class with the same attributes."""
    p = module.weight
    if not p.is_meta:
        rebind_tensor(module, "weight", data)
        return p
    new = torch.Tensor._make_subclass(type(p), data, p.requires_grad)
    new.__dict__.update(p.__dict__)
    module._parameters["weight"] = new
    return new


def process_full_weight(t: ShardTarget, weight: torch.Tensor) -> torch.Tensor:
    """Run the target linear's after-loading step on its full weight ``weight`` (in place)."""
    m = t.module
    if not isinstance(m, LinearBase):
        return weight
    rebind_tensor(m, "weight", weight)
    m.process_weights_after_loading()
    out = m.weight.data
    if out.dtype != t.dtype or tuple(out.shape) != t.shape:
        raise ShardingError(
            f"{t.label}: {type(m.quant_method).__name__}.process_weights_after_loading turned the weight into "
            f"{out.dtype} {list(out.shape)}; the layout was fixed at declare for {t.dtype} {list(t.shape)}. A method "
            "that changes its weight's format cannot be sharded: leave this linear out of the targets."
        )
    if out.data_ptr() != weight.data_ptr():
        weight.copy_(out)
    return weight


def agree_or_raise(comm: Communicator, slots: SlotPool, problems: list[str]) -> None:
    """Every rank learns whether any rank cannot finalize (one gather of one byte per rank, in
    slot B), so all raise together rather than some waiting in a gather that never comes."""
    world = comm.world_size
    flags = slots.buffers[1].narrow(0, 0, world)
    mine = flags.narrow(0, comm.rank, 1)
    mine.fill_(1 if problems else 0)
    comm.all_gather_into(flags, mine, what="finalize: every rank's load check")
    bad = [r for r, f in enumerate(flags.tolist()) if f]
    if problems:
        raise ShardingError(f"finalize refused on rank {comm.rank}: " + "; ".join(problems) +
                            ". Load every row from a checkpoint (load_checkpoint) before finalize, or build the "
                            "model with real weights and keep_initial_weights=True.")
    if bad:
        raise ShardingError(f"finalize refused: rank(s) {bad} cannot finalize (see their errors); rank "
                            f"{comm.rank} stops too so that no rank waits in a gather")


def redistribute_layer(comm: Communicator, layout: FlatLayout, targets: list[ShardTarget], slots: SlotPool,
                       chunks: dict[int, torch.Tensor], layer: int, tag: str,
                       seen: Callable[[str, int | None], None]) -> torch.Tensor:
    """Finalize of one layer (steps 1-4 of :meth:`WeightSharding.finalize`, [Note: finalize peak]):
    allocates the layer's chunk into ``chunks[layer]``, fills it, binds the weights to slot views."""
    i = layer
    rank, world = comm.rank, comm.world_size
    pack, staging = slots.buffers
    parked = slots.scratch_views(i)
    packed: dict[str, torch.Tensor] = {}
    off = 0
    for t in targets:
        if t.mode != "rows":
            continue
        rows = t.module.weight.data.contiguous().view(-1).view(torch.uint8)
        packed[t.entry] = pack.narrow(0, off, rows.numel())
        packed[t.entry].copy_(rows)
        off += rows.numel()
        rebind_tensor(t.module, "weight", parked[t.entry])  # frees the row shard
    if packed:
        seen("rows packed", i)
    chunk = slots.alloc_chunk(comm, i, tag)
    chunk.zero_()
    views = slots.views(i)  # a mapped pool builds the layer's view over its chunk only now
    chunks[i] = chunk
    seen("chunk", i)
    lo, hi = layout.chunk_range(rank)
    for t in targets:
        e = layout.entry(t.entry)
        if t.mode == "rows":
            full = staging.narrow(0, 0, e.nbytes)
            mine = full.narrow(0, rank * (e.nbytes // world), e.nbytes // world)
            mine.copy_(packed[t.entry])
            comm.all_gather_into(full, mine, what=f"finalize of {t.label}")
            weight = full.view(t.dtype).view(t.shape)
        else:
            weight = t.module.weight.data
        weight = process_full_weight(t, weight)
        src = weight.contiguous().view(-1).view(torch.uint8)
        a, b = max(lo, e.offset), min(hi, e.end)
        if a < b:
            chunk[a - lo : b - lo].copy_(src[a - e.offset : b - e.offset])
        rebind_tensor(t.module, "weight", views[t.entry])  # a full-shape weight is freed here
    seen("done", i)
    return chunk
