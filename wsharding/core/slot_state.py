"""What each slot holds and what is landing in it: the one account the planner keeps.

A slot is in one of three states, and records the last gather issued into it -- its layer and the
step it was issued for:

* ``EMPTY``: nothing a layer could compute with (never filled, given up, or its gather failed);
* ``LANDING``: the gather of ``layer`` is issued and not joined; no layer may read the slot;
* ``READY``: the gather of ``layer`` completed (joined without error) and nothing was issued into
  the slot since: ``layer`` may compute from it ([Note: checked at use] in :mod:`wsharding.core.step_owner`).

The step a gather was issued for says the rest: a gather issued for a later step than the one
running is *ahead* (the next step's first gather, a draft's prefetch), and a step that starts finds
its own ahead-issued gathers already there and does not issue them again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from wsharding.core.comm import PreparedGather
from wsharding.core.schedule import slot_name
from wsharding.core.stamp import LandedSamples

EMPTY, LANDING, READY = "empty", "landing", "ready"


@dataclass
class Slot:
    """One slot's state, and the last gather issued into it."""

    state: str = EMPTY
    #: The layer of the last gather issued into the slot (None: none since it was given up).
    layer: int | None = None
    #: The step that gather was issued for.
    step: int = -1
    #: How to join it, when someone else issued it (a draft's prefetch); None: the prepared gather's wait.
    join: Callable[[], None] | None = None


class SlotState:
    """Every slot's :class:`Slot`, and the prepared gather of every sharded layer into its slot."""

    def __init__(self, count: int, gathers: dict[int, PreparedGather], slot_of: dict[int, int],
                 samples: LandedSamples | None = None) -> None:
        self.slots = [Slot() for _ in range(count)]
        #: Per slot, the layer it holds ready, else None: the same account, kept as a list for the one
        #: read a block makes before it computes ([Note: the hot path] in wsharding/core/planner.py).
        self.ready: list[int | None] = [None] * count
        #: The check of what landed ([Note: the sample of a steps' gather]); None where none is made.
        self.samples = samples
        #: Everything a layer's gather needs, worked out once ([Note: the hot path]).
        self.gathers = gathers
        self.slot_of = slot_of

    # ---- what a slot holds ---------------------------------------------------------------------------
    def holds(self, slot: int) -> int | None:
        """The layer whose bytes the slot holds, ready to compute with; None when none."""
        return self.ready[slot]

    def landing(self, slot: int) -> int | None:
        """The layer whose gather into the slot is issued and not joined; None when none."""
        s = self.slots[slot]
        return s.layer if s.state is LANDING else None

    def issued_for(self, layer: int, step: int) -> bool:
        """Whether ``layer``'s gather for ``step`` was issued already (ahead of the step)."""
        s = self.slots[self.slot_of[layer]]
        return s.layer == layer and s.step == step

    def ahead(self, step: int) -> dict[int, int]:
        """``{layer: slot}`` of the gathers issued for a step after ``step`` (landing or joined)."""
        return {s.layer: k for k, s in enumerate(self.slots)
                if s.layer is not None and s.step > step and s.state is not EMPTY}

    def occupancy(self) -> dict[str, int | None]:
        """``{"A": layer or None, ...}``: the layer whose bytes each slot holds now (None: receiving,
        or nothing it could compute with)."""
        return {slot_name(k): self.holds(k) for k in range(len(self.slots))}

    # ---- changes --------------------------------------------------------------------------------------
    def receiving(self, slot: int, layer: int, step: int, join: Callable[[], None] | None = None) -> None:
        """A gather of ``layer`` for ``step`` was issued into ``slot``."""
        s = self.slots[slot]
        s.state, s.layer, s.step, s.join = LANDING, layer, step, join
        self.ready[slot] = None

    def filled(self, slot: int, layer: int, step: int) -> int | None:
        """``slot`` holds ``layer`` now (gathered outside the schedule); returns the layer of a gather
        issued ahead that it replaced, if any."""
        s = self.slots[slot]
        replaced = s.layer if s.step > step and s.layer != layer else None
        s.state, s.layer, s.step, s.join = READY, layer, step, None
        self.ready[slot] = layer
        return replaced

    def emptied(self, slot: int) -> None:
        """Nothing usable in ``slot`` (its gather failed): the record of what was issued stays."""
        s = self.slots[slot]
        s.state, s.join = EMPTY, None
        self.ready[slot] = None

    def forget(self, slot: int) -> None:
        """Nothing in ``slot``, and no gather issued into it (lent to a gather outside the planner)."""
        self.slots[slot] = Slot()
        self.ready[slot] = None

    def set_state(self, slot: int, state: str) -> str:
        """Set ``slot``'s state alone (a gather outside the schedule is receiving into it, or was
        refused and left it as it was); returns the state it had."""
        s = self.slots[slot]
        before, s.state = s.state, state
        self.ready[slot] = s.layer if state is READY else None
        return before

    def not_ahead(self, slot: int) -> None:
        """The gather in ``slot`` no longer counts for the step it was issued for (given up unused)."""
        self.slots[slot].step = -1

    # ---- gathers --------------------------------------------------------------------------------------
    def start(self, slot: int, layer: int, step: int, gate: Any, marks: Any, inline: bool) -> PreparedGather:
        """Start ``layer``'s gather into ``slot`` for ``step`` (behind ``gate``, a CUDA event or None).
        A gather still landing in the slot is joined first by the caller."""
        prepared = self.gathers[layer]
        s = self.slots[slot]
        s.state, s.layer, s.step, s.join = EMPTY, layer, step, None  # receiving: not yet in flight
        self.ready[slot] = None
        prepared.start(gate, marks, inline=inline)
        s.state = LANDING
        return prepared

    def join(self, slot: int, stream: torch.cuda.Stream | None) -> int | None:
        """Wait for the gather landing in ``slot`` (``stream`` waits, on CUDA; the host, on CPU); the
        slot then holds its layer. A failed gather, or one whose bytes are another gather's ([Note: the
        sample of a steps' gather]), leaves the slot empty and raises. Returns the layer."""
        s = self.slots[slot]
        if s.state is not LANDING:
            return None
        join, s.join = s.join, None
        s.state = EMPTY  # whatever happens now, the slot is not read until the join succeeded
        self.ready[slot] = None
        if join is not None:
            join()
        else:
            self.gathers[s.layer].wait(stream)
        if self.samples is not None:
            self.samples.check(s.layer, s.step)
        s.state = READY
        self.ready[slot] = s.layer
        return s.layer

    def landing_slots(self, upto_step: int | None = None) -> list[int]:
        """The slots a gather is landing in (only those issued for ``upto_step`` or earlier, when given)."""
        return [k for k, s in enumerate(self.slots)
                if s.state is LANDING and (upto_step is None or s.step <= upto_step)]
