"""The plan of a step's gathers, decided once: which layer's gather is issued at which hook, into
which slot, behind which gate -- and which gather each block joins.

A step has hooks at fixed points: its start, each block's start (after the block joined its own
gather) and each block's end. A :class:`GatherSchedule` lists, for each hook, the gathers issued
there, in the one order every rank issues them (collectives pair by order). The planner
(:mod:`wsharding.core.planner`) only replays it; a policy is a function that returns a schedule:

* :func:`lookahead_schedule` -- depth ``k``: the gather of layer ``L`` is issued when block ``L - k``
  starts (at the step's start for the first ``k``), into slot ``position % (k + 1)``; ``k = 0`` is
  lookahead off: each layer's gather issued at its own block's start and joined at once;
* :func:`with_next_step_first` -- the same plus the *next* step's first gather, issued during this
  step's last block ([Note: the next step's first gather] in ``wsharding/core/next_step.py``).

[Note: the gate, for depth k]
With ``k + 1`` slots the gather of the sharded layer at position ``p`` overwrites the slot of the
layer at ``p - (k + 1)``, its gate. Issued at the start of block ``L - k``, it comes after that
layer on the host: sharded layers are distinct block indices, so the gate layer is at most
``L - k - 1``. On CPU ranks that is all the gate needs (a layer's compute is done when its block
returns); on CUDA the layer's kernels may still be queued, so the gather waits on the event
recorded at its end (or, for a gate that ran in an earlier step, on the step's fork). A schedule
never holds a gather back: the order of the hooks is the gate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from wsharding.core.errors import require_int


@dataclass(frozen=True)
class ScheduledGather:
    """One gather of a step: ``layer`` into ``slot``, after the end of ``gate`` in this step (None:
    ordered by the step's fork). ``next_step``: it is the next step's gather, issued in this one."""

    layer: int
    slot: int
    gate: int | None
    next_step: bool = False
    #: Issued at its own block's start and joined at once (lookahead off): nothing to hide it behind.
    inline: bool = False


@dataclass(frozen=True)
class GatherSchedule:
    """Every gather of one step over blocks ``[start, end)``, by hook, in issue order."""

    #: The sharded layers the step runs, in order.
    layers: tuple[int, ...]
    #: Slot of every sharded layer (fixed for the sharding: its weights are views of that slot).
    slot_of: Mapping[int, int]
    #: Gathers ahead of the layer computing (0: lookahead off).
    depth: int
    start: int
    end: int
    at_step_start: tuple[ScheduledGather, ...] = ()
    at_block_start: Mapping[int, tuple[ScheduledGather, ...]] = field(default_factory=dict)
    at_block_end: Mapping[int, tuple[ScheduledGather, ...]] = field(default_factory=dict)

    def order(self) -> list[ScheduledGather]:
        """Every gather of the step, in the order of the hooks that issue them."""
        out = list(self.at_step_start)
        for b in range(self.start, self.end):
            out += self.at_block_start.get(b, ())
            out += self.at_block_end.get(b, ())
        return out

    @property
    def gates(self) -> frozenset[int]:
        """Layers whose end a gather of this schedule waits for (their end events are recorded)."""
        return frozenset(g.gate for g in self.order() if g.gate is not None)

    def describe(self) -> list[str]:
        """One line per hook that issues something: ``"block 3 start: gather 5 -> slot B (after 2)"``."""
        name = lambda g: (f"gather {g.layer}{' (next step)' if g.next_step else ''} -> slot {slot_name(g.slot)}"  # noqa: E731
                          + (f" (after {g.gate})" if g.gate is not None else ""))
        lines = [f"step start: {', '.join(map(name, self.at_step_start))}"] if self.at_step_start else []
        for b in range(self.start, self.end):
            if self.at_block_start.get(b):
                lines.append(f"block {b} start: {', '.join(map(name, self.at_block_start[b]))}")
            if self.at_block_end.get(b):
                lines.append(f"block {b} end: {', '.join(map(name, self.at_block_end[b]))}")
        return lines


def slot_name(slot: int) -> str:
    """A, B, C, ... (slot 26 and on: S26)."""
    return chr(ord("A") + slot) if slot < 26 else f"S{slot}"


def slot_binding(sharded: Sequence[int], slots: int) -> dict[int, int]:
    """The slot of each sharded layer: its position among them modulo the slot count."""
    return {layer: k % slots for k, layer in enumerate(sorted(sharded))}


def check_depth(depth: object, sharded_layers: int | None = None) -> int:
    """``prefetch_depth`` as an int >= 1 -- and, once the ``sharded_layers`` are known, at most one less
    than their count (``L - 1`` gathers ahead already keep every sharded layer in its own slot; a deeper
    one would allocate slots that no layer is ever gathered into) -- or :class:`InvalidArgument` naming
    the value ([Note: whole numbers only] in ``core/errors.py``)."""
    todo = "pass an int >= 1 (1: the design's two slots); it keeps depth + 1 slots"
    if sharded_layers is None:
        return require_int(depth, "prefetch_depth", minimum=1, todo=todo)
    most = max(1, sharded_layers - 1)
    return require_int(depth, "prefetch_depth", minimum=1, maximum=most,
                       todo=f"{todo}; {sharded_layers} sharded layer(s) fill at most {most + 1} slots, so at most "
                            f"depth {most}")


def lookahead_schedule(sharded: Sequence[int], slot_of: Mapping[int, int], depth: int, start: int = 0,
                       end: int | None = None) -> GatherSchedule:
    """The gathers of a step over blocks ``[start, end)`` with ``depth`` gathers ahead (0: off).

    The gate of each gather is the last earlier layer of the step in the same slot ([Note: the gate,
    for depth k]); a layer of an earlier step is ordered by the step's fork instead.
    """
    stop = (max(sharded) + 1 if sharded else start) if end is None else end
    layers = tuple(i for i in sorted(sharded) if start <= i < stop)
    last_in: dict[int, int] = {}
    at_start: list[ScheduledGather] = []
    at_block: dict[int, list[ScheduledGather]] = {}
    for layer in layers:
        slot = slot_of[layer]
        g = ScheduledGather(layer, slot, last_in.get(slot), inline=depth == 0)
        last_in[slot] = layer
        hook = layer - depth
        if depth > 0 and hook <= start:
            at_start.append(g)
        else:
            at_block.setdefault(hook, []).append(g)
    return GatherSchedule(layers, dict(slot_of), depth, start, stop, tuple(at_start),
                          {b: tuple(gs) for b, gs in at_block.items()})


def with_next_step_first(schedule: GatherSchedule) -> GatherSchedule:
    """``schedule`` plus the next step's first gather, issued when its last sharded block starts --
    or at that block's end, when the last block itself reads the first layer's slot.

    Only a step that runs every sharded layer ends this way (a partial range or lookahead off:
    ``schedule`` unchanged)."""
    every = sorted(schedule.slot_of)
    if schedule.depth == 0 or not schedule.layers or list(schedule.layers) != every:
        return schedule
    first, last = schedule.layers[0], schedule.layers[-1]
    slot = schedule.slot_of[first]
    gate = max(i for i in schedule.layers if schedule.slot_of[i] == slot)
    g = ScheduledGather(first, slot, gate, next_step=True)
    starts, ends = dict(schedule.at_block_start), dict(schedule.at_block_end)
    if gate < last:
        starts[last] = (*starts.get(last, ()), g)
    else:
        ends[last] = (*ends.get(last, ()), g)
    return GatherSchedule(schedule.layers, schedule.slot_of, schedule.depth, schedule.start, schedule.end,
                          schedule.at_step_start, starts, ends)
