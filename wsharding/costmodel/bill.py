"""The memory bill, exact from the layers' flat layouts: the one resident formula.

What a rank holds after finalize is its chunk of every sharded layer plus two ping-pong slots:
``sum_l |T_l|/N + 2 * max_l |T_l|``, or with ``map_own_chunk`` (the slots are views mapped over the
chunks) ``sum_l |T_l|/N + 2 * (N-1)/N * max_l |T_l|``. That arithmetic is written once, in
:func:`wsharding.core.resident.resident_parts`: the sharding checks what a rank really allocated
against it, and :func:`bill_for_layouts` prices a model with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from wsharding.core.layout import FlatLayout
from wsharding.core.resident import resident_parts
from wsharding.core.units import align_up
from wsharding.costmodel.checks import CostModelError, require_int


@dataclass(frozen=True)
class Bill:
    """Bytes per GPU, replicated versus sharded, computed exactly from the layers' flat layouts.

    gross_saving_bytes  = R: the figure SGLang's weight sharding for Kimi K3 calls "reclaimed"
                          (what stops being replicated);
    shard_saving_bytes  = R - sum_l |T_l|/N: what the shards give back (~ (1 - 1/N) R);
    net_saving_bytes    = shard_saving - 2 max_l |T_l|: what is really free for the KV cache.
    """

    ranks: int
    layers: int
    replicated_bytes: int
    resident_shard_bytes: int
    largest_layer_bytes: int
    slot_bytes: int
    padding_bytes: int
    #: The layers gather into views mapped over their chunks ([Note: the own chunk mapped, not
    #: copied]): after finalize a slot keeps only the peers' pages, (N-1)/N of it.
    map_own_chunk: bool = False
    #: Every chunk and slot is rounded up to this many bytes (a backend's allocation unit; 1: none).
    granularity: int = 1
    #: Slots gathered into: lookahead depth + 1 (two at the default depth 1).
    slots: int = 2

    @property
    def finalize_slot_bytes(self) -> int:
        """The slots while finalize runs: whole, mapped or not (finalize rebuilds weights in them)."""
        return self.slots * align_up(self.largest_layer_bytes, self.granularity)

    @property
    def sharded_resident_bytes(self) -> int:
        """What a rank holds after finalize: its chunks plus the slots."""
        return self.resident_shard_bytes + self.slot_bytes

    @property
    def gross_saving_bytes(self) -> int:
        return self.replicated_bytes

    @property
    def shard_saving_bytes(self) -> int:
        return self.replicated_bytes - self.resident_shard_bytes

    @property
    def net_saving_bytes(self) -> int:
        return self.replicated_bytes - self.sharded_resident_bytes


def bill_for_layouts(
    layer_layouts: Sequence[FlatLayout], n_layers_total: int | None = None, ranks: int | None = None,
    map_own_chunk: bool = False, *, granularity: int = 1, slots: int = 2,
) -> Bill:
    """The exact memory :class:`Bill` of sharded layers given by their :class:`FlatLayout` s.

    ``layer_layouts``: one layout per sharded layer; if ``n_layers_total`` is larger, the list is
    a repeating pattern cycled up to that many layers (e.g. one layout for 92 identical layers).
    ``ranks`` defaults to the layouts' group size and must match it. Resident shards are the
    chunks (``total_bytes / N`` each), ``slots`` (lookahead depth + 1) of ``max total_bytes`` each, R
    counts only payload. ``map_own_chunk``: the slots keep ``slots * (N-1) * max chunk_bytes`` after finalize (build the
    layouts with ``chunk_alignment=MAPPED_PAGE_BYTES``, as the sharding does). ``granularity``:
    each chunk and each slot is rounded up to a multiple of it, as a backend that allocates in
    units does (the padding and R are the layouts' own, unrounded).
    """
    if not layer_layouts:
        raise CostModelError("layer_layouts: need at least one layout")
    sizes = {lay.group_size for lay in layer_layouts}
    if len(sizes) != 1:
        raise CostModelError(f"layer_layouts: group sizes differ ({sorted(sizes)}); one shard group has one N")
    n = sizes.pop()
    if ranks is not None and ranks != n:
        raise CostModelError(f"ranks: {ranks} does not match the layouts' group_size {n}")
    g = require_int(granularity, "granularity", minimum=1)
    total = len(layer_layouts) if n_layers_total is None else require_int(n_layers_total, "n_layers_total", minimum=1)
    if total < len(layer_layouts):
        raise CostModelError(f"n_layers_total: {total} is fewer than the {len(layer_layouts)} layouts given")
    layouts = [layer_layouts[i % len(layer_layouts)] for i in range(total)]
    largest = max(lay.total_bytes for lay in layouts)
    k = require_int(slots, "slots", minimum=2)
    resident_shard_bytes, slot_bytes = resident_parts(layouts, n, g, mapped=map_own_chunk, slots=k)
    return Bill(
        ranks=n,
        layers=total,
        replicated_bytes=sum(lay.payload_bytes for lay in layouts),
        resident_shard_bytes=resident_shard_bytes,
        largest_layer_bytes=largest,
        slot_bytes=slot_bytes,
        padding_bytes=sum(lay.total_bytes - lay.payload_bytes for lay in layouts),
        map_own_chunk=map_own_chunk,
        granularity=g,
        slots=k,
    )
