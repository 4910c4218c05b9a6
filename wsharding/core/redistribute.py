"""Finalize's redistribution, one layer at a time: row shards -> flat chunks (SGLang's weight sharding
for Kimi K3, "finalize 时重排成 flat chunk"), with the linear's after-loading step run on the gathered full
weight.

[Note: finalize peak] A layer's row shards are packed into slot A and freed *before* its chunk is
allocated, and each full weight is rebuilt in slot B, in place: rows and chunks never coexist
beyond one layer's padding, and the design's temporary full weight costs nothing extra. The peak is
``R/N + padding/N + 2 slots`` plus one weight in flight (a transient of the backend or of loading).

Before any of it the ranks agree (:func:`agree_or_raise`): the same layouts on every rank, every
rank able to finalize, and the same bytes in every target kept as built ([Note: digest before the
shrink] in :mod:`wsharding.core.replicas`) -- in buffers of their own, since a slot's size is one of
the things that may differ.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from wsharding.core.comm import Communicator
from wsharding.core.contract import ParallelLinear, rebind_tensor
from wsharding.core.layout import SUPPORTED_DTYPES, FlatLayout
from wsharding.core.replicas import replica_difference, replicas_refusal
from wsharding.core.rowloaders import ShardingError, ShardTarget
from wsharding.core.slots import SlotPool


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
    if not isinstance(m, ParallelLinear):
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


#: One rank's fixed-size record in the first exchange of :func:`agree_or_raise`: a load flag, the
#: digest of its layout description, the description's length, and the digest of its weights'
#: digests (all zero on a rank with none to compare).
_RECORD = struct.Struct("<B32sQ32s")
#: One target's entry in the exchange of weight digests: whether the rank has one, and the digest.
_DIGEST = struct.Struct("<BQ")


def describe_layouts(layouts: Mapping[int, FlatLayout], world_size: int) -> dict[str, Any]:
    """Every sharded layer's layout as plain data: what the ranks of a group must agree on."""
    return {
        "world_size": world_size,
        "layers": [
            [i, {
                "weights": [[e.name, SUPPORTED_DTYPES[e.dtype], list(e.shape), e.offset, e.nbytes] for e in lay.entries],
                "alignment": lay.alignment,
                "chunk_alignment": lay.chunk_alignment,
                "total_bytes": lay.total_bytes,
                "group_size": lay.group_size,
            }]
            for i, lay in sorted(layouts.items())
        ],
    }


def _names(layer: dict[str, Any] | None) -> str:
    if layer is None or not layer["weights"]:
        return "nothing"
    names = [w[0] for w in layer["weights"]]
    return f"{names[0]} only" if len(names) == 1 else ", ".join(names)


def first_difference(a: dict[str, Any], b: dict[str, Any], ra: int, rb: int) -> str:
    """The first place where rank ``ra``'s layout description ``a`` and rank ``rb``'s ``b`` differ, in
    words: the layer, the weight, and both ranks' values."""
    if a["world_size"] != b["world_size"]:
        return f"rank {ra} is in a group of {a['world_size']} ranks, rank {rb} in one of {b['world_size']}"
    la, lb = dict((i, x) for i, x in a["layers"]), dict((i, x) for i, x in b["layers"])
    for i in sorted(set(la) | set(lb)):
        x, y = la.get(i), lb.get(i)
        if x is None or y is None or [w[0] for w in x["weights"]] != [w[0] for w in y["weights"]]:
            return f"layer {i}: rank {ra} shards {_names(x)}, rank {rb} shards {_names(y)}"
        for (name, dta, sha, offa, na), (_, dtb, shb, offb, nb) in zip(x["weights"], y["weights"], strict=True):
            if (dta, sha) != (dtb, shb):
                return f"layer {i} {name}: rank {ra} has {dta} {sha}, rank {rb} has {dtb} {shb}"
            if (offa, na) != (offb, nb):
                return (f"layer {i} {name}: rank {ra} places it at byte {offa} ({na} B), rank {rb} at byte {offb} "
                        f"({nb} B)")
        for key in ("group_size", "alignment", "chunk_alignment", "total_bytes"):
            if x[key] != y[key]:
                return f"layer {i}: {key.replace('_', ' ')} {x[key]} on rank {ra}, {y[key]} on rank {rb}"
    return f"rank {ra} and rank {rb} describe their layouts differently"


def _gather_bytes(comm: Communicator, data: bytes, tag: str, what: str) -> list[bytes]:
    """Every rank's ``data`` (the same length on every rank), in rank order: one gather in a fresh
    buffer, whose size depends on nothing a rank may disagree on (a slot's does)."""
    n, world = len(data), comm.world_size
    full = comm.alloc(n * world, tag=tag)
    comm.register_all()  # collective; only this buffer is pending, the same size on every rank
    try:
        mine = full.narrow(0, comm.rank * n, n)
        mine.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        comm.all_gather_into(full, mine, what=what)
        out = bytes(full.cpu().tolist())
    finally:
        comm.release([full])  # collective, as the registration was
    return [out[r * n : (r + 1) * n] for r in range(world)]


def agree_or_raise(comm: Communicator, layouts: Mapping[int, FlatLayout], problems: list[str], *,
                   tag: str = "agree", digests: Mapping[str, int] | None = None) -> None:
    """Every rank learns whether all ranks declared the same layouts, whether any rank cannot
    finalize, and whether their replicas hold the same bytes, so that all raise together rather
    than some waiting in a gather that never comes.

    Collective, and it must come before anything whose size depends on the layouts (the slots,
    their registration, the gathers): ranks that declared different targets, shapes, blocks or
    ``sharded_layers`` would otherwise pair gathers of different weights -- of the same size, a
    silently wrong model; of another size, an error or an aborted process on some backends. First a
    gather of a fixed-size record per rank (load flag, digest of the layout description, its
    length); only when the digests differ, a gather of the descriptions padded to the longest, so
    every rank raises the same :class:`ShardingError` naming the first difference.

    ``digests``: this rank's digest of each target kept as built, by label (``"layer 1 fc1.weight"``,
    [Note: digest before the shrink]); None or empty where there is nothing to compare. The record
    carries a digest of them; only when those differ between ranks that have digests, a gather of
    every target's digest (the layouts agree by then, so it is the same size on every rank), and
    every rank raises the same error naming the first weight that differs and which ranks hold what.
    """
    text = json.dumps(describe_layouts(layouts, comm.world_size), sort_keys=True, separators=(",", ":")).encode()
    labels = [f"layer {i} {e.name}" for i, lay in sorted(layouts.items()) for e in lay.entries]
    mine = b"".join(_DIGEST.pack(*((1, digests[k]) if digests and k in digests else (0, 0))) for k in labels)
    held = hashlib.sha256(mine).digest() if digests else bytes(32)
    record = _RECORD.pack(1 if problems else 0, hashlib.sha256(text).digest(), len(text), held)
    records = [_RECORD.unpack(r) for r in _gather_bytes(comm, record, tag, "finalize: every rank's layout and load check")]
    bad = [r for r, (flag, *_) in enumerate(records) if flag]
    # A rank that cannot finalize first: one that gave up before declaring (abandon_sharding) has no
    # layouts, and "it shards nothing" would hide its own error.
    if not bad and len({digest for _, digest, _, _ in records}) > 1:
        longest = max(length for _, _, length, _ in records)
        texts = _gather_bytes(comm, text.ljust(longest, b" "), f"{tag}.layouts", "finalize: every rank's layout")
        described = [json.loads(t) for t in texts]
        other = next(r for r, (_, digest, *_) in enumerate(records) if digest != records[0][1])
        raise ShardingError(
            "finalize refused on every rank: the ranks of this group declared different sharded layouts -- "
            f"{first_difference(described[0], described[other], 0, other)}. Every layer's gather pairs the same "
            "bytes on every rank, so declare the same targets on every rank of the group: the same model, the same "
            "targets (or patterns) and the same sharded_layers")
    if problems:
        raise ShardingError(f"finalize refused on rank {comm.rank}: " + "; ".join(problems) +
                            ". Load every row from a checkpoint (load_checkpoint) before finalize, or build the "
                            "model with real weights and keep_initial_weights=True.")
    if bad:
        raise ShardingError(f"finalize refused: rank(s) {bad} cannot finalize (see their errors); rank "
                            f"{comm.rank} stops too so that no rank waits in a gather")
    if len({h for *_, h in records if h != bytes(32)}) > 1:
        # Every rank decides this from the records alone, so all take part in this gather or none.
        rows = _gather_bytes(comm, mine, f"{tag}.replicas", "finalize: every rank's weight digests")
        per_rank = [{k: d for k, (has, d) in zip(labels, _DIGEST.iter_unpack(row), strict=True) if has} for row in rows]
        differ = replica_difference(labels, per_rank)
        if differ is not None:
            raise ShardingError(replicas_refusal(*differ))


def redistribute_layer(comm: Communicator, layout: FlatLayout, targets: list[ShardTarget], slots: SlotPool,
                       chunks: dict[int, torch.Tensor], layer: int, tag: str,
                       seen: Callable[[str, int | None], None]) -> torch.Tensor:
    """Finalize of one layer (steps 1-4 of :meth:`WeightSharding.finalize`, [Note: finalize peak]):
    allocates the layer's chunk into ``chunks[layer]``, fills it, binds the weights to slot views."""
    i = layer
    rank, world = comm.rank, comm.world_size
    pack, staging = slots.buffers[0], slots.buffers[1]  # slots A and B (a third, if any, stays free)
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
