"""What a rank holds after finalize, from the layers' layouts: the one resident formula.

Its chunk of every sharded layer plus ``S`` slots (``S = k + 1`` for lookahead depth ``k``; two by
default): ``sum_l |T_l|/N + S max_l |T_l|`` -- or, when the slots are views mapped over the chunks,
``sum_l |T_l|/N + S (N-1)/N max_l |T_l|``. Each
allocation is rounded up to the backend's unit. The sharding checks what it allocated against it;
the cost model (:mod:`wsharding.costmodel.bill`) prices a model with it.
"""

from __future__ import annotations

from collections.abc import Iterable

from wsharding.core.layout import FlatLayout
from wsharding.core.units import align_up


def resident_parts(layouts: Iterable[FlatLayout], world_size: int, granularity: int = 1, *,
                   mapped: bool, slots: int = 2) -> tuple[int, int]:
    """``(chunk bytes, slot bytes)`` a rank holds after finalize for these layer layouts, each
    allocation rounded up to ``granularity``. Mapped, a slot keeps the peers' ``N-1`` pieces of the
    largest chunk (its own piece is every layer's chunk); plain, it holds the largest layer whole."""
    layouts = list(layouts)
    chunks = sum(align_up(lay.chunk_bytes, granularity) for lay in layouts)
    if mapped:
        return chunks, slots * (world_size - 1) * align_up(max(lay.chunk_bytes for lay in layouts), granularity)
    return chunks, slots * align_up(max(lay.total_bytes for lay in layouts), granularity)


def resident_formula(layouts: Iterable[FlatLayout], world_size: int, granularity: int = 1, *, mapped: bool,
                     slots: int = 2) -> int:
    """The bytes of :func:`resident_parts`, summed."""
    return sum(resident_parts(layouts, world_size, granularity, mapped=mapped, slots=slots))
