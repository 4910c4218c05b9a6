"""The replay of one step's schedule: which gathers are due at each hook, in the one order every rank
issues them.

A :class:`~wsharding.core.schedule.GatherSchedule` is flattened once per step range into a
:class:`Plan` -- its issue order and where each hook's gathers end in it -- and a step walks that
order with one position. Each hook issues the gathers up to its end; a gather whose gate has not
ended in this step is held back and issued at the gate's end ([Note: the gate] in
:mod:`wsharding.core.planner`); a step given up issues everything left at once, gates ignored
([Note: one collective sequence per step] in :mod:`wsharding.core.step_owner`). The replay decides
*when*; the owner of the step (``issue``) decides how.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from wsharding.core.schedule import GatherSchedule, ScheduledGather


@dataclass(frozen=True)
class Plan:
    """A schedule flattened for the hot path: its issue order, where each hook's gathers end in it."""

    schedule: GatherSchedule
    order: tuple[ScheduledGather, ...]
    #: Block -> the position in ``order`` where its start's (its end's) gathers end.
    starts: dict[int, int]
    ends: dict[int, int]
    at_start: int


def flatten(schedule: GatherSchedule) -> Plan:
    order = list(schedule.at_step_start)
    starts, ends = {}, {}
    for b in range(schedule.start, schedule.end):
        if schedule.at_block_start.get(b):
            order += schedule.at_block_start[b]
            starts[b] = len(order)
        if schedule.at_block_end.get(b):
            order += schedule.at_block_end[b]
            ends[b] = len(order)
    return Plan(schedule, tuple(order), starts, ends, len(schedule.at_step_start))


#: ``issue(gather, here, ungated)``: start one gather (``here``: at its own block's start, joined at
#: once; ``ungated``: its gate ignored, the step is given up).
Issue = Callable[[ScheduledGather, bool, bool], None]


class Replay:
    """One step at a time: the position in its plan, and the gathers held behind their gates."""

    def __init__(self, issue: Issue, held: Callable[[int], None]) -> None:
        self.issue = issue
        self.on_held = held  # a gather was held back (an observer's point)
        self.plan: Plan | None = None
        self.order: tuple[ScheduledGather, ...] = ()
        self.pos = 0
        #: Gate layer -> the gathers held until its end in this step.
        self.held: dict[int, list[ScheduledGather]] = {}
        #: Blocks that ended in this step (the gates that are open).
        self.ended: set[int] = set()

    def begin(self, plan: Plan) -> None:
        """A step over ``plan`` starts: issue its step-start gathers."""
        self.plan, self.order, self.pos = plan, plan.order, 0
        self.held.clear()
        self.ended.clear()
        self.upto(plan.at_start)

    def own_gather(self, block: int) -> None:
        """Block ``block`` is about to start: its own gather first, when the schedule issues it at
        the block's start (lookahead off: joined at once)."""
        end = self.plan.starts.get(block)
        if end is not None and self.pos < end and self.order[self.pos].layer == block:
            g = self.order[self.pos]
            self.pos += 1
            self.issue(g, True, False)

    def block_start(self, block: int) -> None:
        """Block ``block`` was checked: what its start issues."""
        end = self.plan.starts.get(block)
        if end is not None:
            self.upto(end)

    def block_end(self, block: int, in_schedule: bool) -> None:
        """Block ``block`` ended: its gate opens (what was held behind it is issued); then, while the
        step keeps to its schedule, what this hook issues."""
        self.ended.add(block)
        if self.held:
            for g in self.held.pop(block, ()):
                self.issue(g, False, False)
        if in_schedule:
            end = self.plan.ends.get(block)
            if end is not None:
                self.upto(end)

    def upto(self, end: int) -> None:
        while self.pos < end:
            g = self.order[self.pos]
            self.pos += 1
            if g.gate is not None and g.gate not in self.ended:
                self.held.setdefault(g.gate, []).append(g)  # [Note: the gate]: issued at its end
                self.on_held(g.layer)
                continue
            self.issue(g, False, False)

    def rest(self) -> list[ScheduledGather]:
        """Everything of the step not issued yet, held ones included, taken off the replay: the step
        is given up and issues them at once, gates ignored."""
        left = list(self.order[self.pos:])
        self.pos = len(self.order)
        for gs in self.held.values():
            left += gs
        self.held.clear()
        return left

    def end(self) -> None:
        self.held.clear()
