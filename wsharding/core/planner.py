"""The planner: replays a step's gather schedule, and lets no layer compute with bytes that are not its own.

A step, driven by the runner's layer loop (:func:`wsharding.core.runner.run_layers`) or by the
wrappers :func:`~wsharding.core.runner.shard_blocks` puts around a model's blocks::

    planner.begin_step(start, end)     # fork; issue the schedule's step-start gathers
    for i in range(start, end):
        planner.block_start(i)         # join layer i's gather (checked), issue what this hook issues
        hidden = layers[i](hidden)
        planner.block_end(i)           # record i's end (a gate), issue what this hook issues
    planner.end_step()                 # issue what a peer would still issue, join what nobody joined

Which gather is issued at which hook, into which slot and behind which gate is one value, a
:class:`~wsharding.core.schedule.GatherSchedule`, made once per step range by a function -- lookahead
depth ``k`` (:func:`~wsharding.core.schedule.lookahead_schedule`), changed by the policies attached as
plug-ins (:mod:`wsharding.core.plugins`: the next step's first gather). The planner holds no other
policy; a newcomer who wants another one writes a function that returns a schedule.

The planner is three parts, each in its own file: what each slot holds and what is landing in it
(:mod:`wsharding.core.slot_state`), the replay of the schedule (:mod:`wsharding.core.replay`) and the
owner of a step -- one thread, misses, a step given up (:mod:`wsharding.core.step_owner`). This file
puts them together with the schedule policy, the observers ([Note: observers] in
:mod:`wsharding.core.observe`) and what is done between steps.

[Note: the gate]
A gather into a slot overwrites the weights of the slot's previous occupant. Started any earlier than
the end of that layer, it would replace them while the layer still reads them -- on the GPU a silent
race, the layer computing with half of the next layer's bytes. So every gather has a gate: the end of
the slot's previous occupant in this step. A schedule of depth ``k`` over ``k + 1`` slots issues each
gather after its gate on the host already ([Note: the gate, for depth k] in
:mod:`wsharding.core.schedule`); on CUDA the gather still waits on the event recorded at the gate's
end, because its kernels may be queued. A schedule that issues a gather before its gate has ended
(deeper than its slots) has it held back and issued by ``block_end`` of the gate. A previous
occupant that ran in an earlier step needs no gate: the step's fork orders the gather after it. A
schedule whose gathers name no gate is replayed as it says: that is the race.

[Note: the hot path]: a block's start and end cost a thread-id compare, a slot lookup and, where the
schedule says so, a gather's start; everything else is decided when the schedule is made.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from wsharding.core.backpressure import StepBackpressure
from wsharding.core.comm import CommError, Communicator, PreparedGather
from wsharding.core.edits import BoundVersions
from wsharding.core.errors import ShardingError, require_bool
from wsharding.core.layout import FlatLayout
from wsharding.core.observe import StepObserver
from wsharding.core.options import ShardingOptions
from wsharding.core.replay import Plan, flatten
from wsharding.core.schedule import GatherSchedule, lookahead_schedule, slot_name
from wsharding.core.slot_state import SlotState
from wsharding.core.slots import SlotPool
from wsharding.core.stamp import STAMP_BYTES, LandedSamples, MismatchedGatherError, read_stamp, stamp_of
from wsharding.core.step_owner import (
    EXPORT_REFUSED,
    ConcurrentStepError,
    PlannerClosedError,
    ScheduleMissWarning,
    StepOwner,
)
from wsharding.core.trace import StepTrace, StepTracer

__all__ = [
    "EXPORT_REFUSED", "NOT_COPIED", "STAMP_BYTES", "ConcurrentStepError", "MismatchedGatherError",
    "PlannerClosedError", "ScheduleFn", "ScheduleMissWarning", "ShardedLayer", "WeightShardPlanner", "read_stamp",
    "stamp_of",
]

#: ``(sharded layers, slot of each, start, end) -> GatherSchedule``: a schedule policy's shape.
ScheduleFn = Callable[[Sequence[int], Mapping[int, int], int, int | None], GatherSchedule]


@dataclass
class ShardedLayer:
    """What the planner needs of one sharded layer: its layout and this rank's resident chunk."""

    layer: int
    layout: FlatLayout
    chunk: torch.Tensor
    #: ``(label, weight)`` of the weights bound to the layer's slot views, whose version counters
    #: its checks read ([Note: in-place edits of bound weights]).
    weights: tuple[tuple[str, torch.Tensor], ...] = ()


#: Why a sharded model cannot be pickled, deep-copied or ``torch.save``d whole, and the way out.
NOT_COPIED = (
    "a sharded model cannot be copied or saved whole (copy.deepcopy, torch.save(model), pickle): its sharded "
    "weights are views of slots that every step refills with another layer, and it holds its shard group's "
    "planner and communicator, which belong to this process. To save or copy its weights, take "
    "WeightSharding.full_state_dict(model) on every rank of the shard group (or wsharding.checkpoint."
    "save_checkpoint); to have a second copy of the model, build it and shard it again")


class WeightShardPlanner(StepOwner):
    """Replays one model's gather schedule and checks every layer's slot before it computes."""

    def __init__(self, comm: Communicator, layers: dict[int, ShardedLayer], slots: SlotPool,
                 options: ShardingOptions | None = None, observers: list[StepObserver] | None = None) -> None:
        options = options if options is not None else ShardingOptions()
        self.comm = comm
        self.layers = layers
        self.slots = slots
        #: Gathers in flight ahead of the computing layer (slots - 1).
        self.depth = slots.count - 1
        self.on_miss = options.on_miss
        self.sharded_ids = sorted(layers)
        self.last_sharded = self.sharded_ids[-1] if self.sharded_ids else -1
        self.device = comm.device
        self.cuda = self.device.type == "cuda"
        self.slot_of = {i: slots.slot_of(i) for i in layers}
        # Everything a layer's gather needs, worked out once ([Note: the hot path]).
        self.gathers: dict[int, PreparedGather] = {
            i: comm.prepare_gather(
                slots.full_buffer(i), st.chunk,
                what=f"layer {i}: gather of {st.layout.total_bytes} B into slot {slot_name(slots.slot_of(i))}")
            for i, st in layers.items()
        }
        # [Note: the sample of a steps' gather]: CPU ranks with peers (collective: every rank builds its planner)
        samples = (LandedSamples(comm, {i: st.chunk for i, st in layers.items()},
                                 {i: slots.full_buffer(i) for i in layers})
                   if not self.cuda and comm.world_size > 1 and layers else None)
        self.state = SlotState(slots.count, self.gathers, self.slot_of, samples)
        # [Note: in-place edits of bound weights]: each layer's bound weights and their versions now.
        self.versions = BoundVersions({i: st.weights for i, st in layers.items()}, comm.rank)
        self._bound, self._bound_versions = self.versions.aliases, self.versions.at_finalize
        if self.cuda:
            self._fork = torch.cuda.Event()
            self._fork.record()
            self._step_forks = StepBackpressure(comm)  # [Note: backpressure]
            self._done = {i: self._new_event() for i in layers}
            self._here = self._new_event()  # the compute stream's position at a layer's start
        self._record = comm.record_event  # once: it is called per layer
        #: Who watches the steps ([Note: observers]): the sharding's list, shared.
        self.observers: list[StepObserver] = observers if observers is not None else []
        self._tracer = StepTracer()
        self.closed = False
        #: Schedule policies attached (:class:`~wsharding.core.plugins.PlannerPlugin`), in order.
        self.plugins: list[Any] = []
        self._lookahead = options.lookahead
        self._schedule_fn: ScheduleFn | None = None
        self._schedules: dict[tuple[int, int | None, bool], Plan] = {}
        self._init_step()
        self.trace_enabled = options.trace
        for plugin in options.plugins:
            self.add_plugin(plugin)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """A sharded model is not copied or saved whole: ``pickle``, ``copy.deepcopy`` and
        ``torch.save(model)`` reach its planner through its hooks and blocks, and are refused here."""
        raise ShardingError(NOT_COPIED)

    def _new_event(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record()  # torch creates the CUDA event at its first record
        return ev

    # ---- the schedule -----------------------------------------------------------------------------
    @property
    def lookahead(self) -> bool:
        """Whether gathers are issued ahead (the schedule of depth :attr:`depth`) or each at its layer's
        start (lookahead off, the baseline). Switched between steps, on every rank the same."""
        return self._lookahead

    @lookahead.setter
    def lookahead(self, on: bool) -> None:
        self._between_steps("lookahead")
        self._lookahead = require_bool(on, "lookahead")

    def add_plugin(self, plugin: Any) -> None:
        """Attach a schedule policy: from the next step on, every schedule goes through its ``shape``.
        Every rank of the shard group must attach the same ones (they change the collectives)."""
        self._between_steps("add_plugin")
        if plugin.claims_first_layer and any(p.claims_first_layer for p in self.plugins):
            other = next(type(p).__name__ for p in self.plugins if p.claims_first_layer)
            raise CommError(f"{type(plugin).__name__}: this planner already gathers its first layer ahead ({other}); "
                            "use one of the two, on every rank the same")
        plugin.attach(self)
        self.plugins.append(plugin)
        self._schedules.clear()

    def set_schedule(self, fn: ScheduleFn | None) -> None:
        """Replace the lookahead policy by ``fn(sharded, slot_of, start, end)`` (None: depth
        :attr:`depth`). Between steps, on every rank the same. A schedule that issues a gather before
        its gate has ended has it held back ([Note: the gate])."""
        self._between_steps("set_schedule")
        self._schedule_fn = fn
        self._schedules.clear()

    def schedule(self, start: int = 0, end: int | None = None) -> GatherSchedule:
        """The schedule of a step over blocks ``[start, end)``, made once per range."""
        return self._plan(start, end).schedule

    def _plan(self, start: int, end: int | None) -> Plan:
        key = (start, end, self._lookahead)
        plan = self._schedules.get(key)
        if plan is None:
            if not self._lookahead:
                sched = lookahead_schedule(self.sharded_ids, self.slot_of, 0, start, end)
            elif self._schedule_fn is not None:
                sched = self._schedule_fn(self.sharded_ids, self.slot_of, start, end)
            else:
                sched = lookahead_schedule(self.sharded_ids, self.slot_of, self.depth, start, end)
            for plugin in self.plugins:
                sched = plugin.shape(sched)
            self._check_schedule(sched)
            plan = self._schedules[key] = flatten(sched)
        return plan

    def _check_schedule(self, sched: GatherSchedule) -> None:
        this_step = [g.layer for g in sched.order() if not g.next_step]
        want = [i for i in self.sharded_ids if sched.start <= i < sched.end]
        if sorted(this_step) != want:
            raise ShardingError(f"schedule: the step over blocks [{sched.start}, {sched.end}) must gather each of its "
                                f"sharded layers {want} once; it gathers {this_step}")
        bad = [g for g in sched.order() if g.slot != self.slot_of[g.layer]]
        if bad:
            raise ShardingError(f"schedule: layer {bad[0].layer} gathers into slot {slot_name(bad[0].slot)}, but its "
                                f"weights view slot {slot_name(self.slot_of[bad[0].layer])}")

    def _next_step_on(self) -> bool:
        """The next step's gather is issued only where every rank issues it the same way: lookahead on,
        untraced, not under capture (a CUDA graph replays alone), the policy enabled."""
        if not self._lookahead or self._tracer.trace is not None:
            return False
        if self.cuda and torch.cuda.is_current_stream_capturing():
            return False
        return all(p.enabled for p in self.plugins if p.claims_first_layer)

    # ---- tracing: an observer ([Note: observers]) ---------------------------------------------------------
    @property
    def trace_enabled(self) -> bool:
        """Whether every step is traced (a :class:`~wsharding.core.trace.StepTracer` observes it)."""
        return self._tracer in self.observers

    @trace_enabled.setter
    def trace_enabled(self, on: bool) -> None:
        if require_bool(on, "trace") and self._tracer not in self.observers:
            self.observers.append(self._tracer)
        elif not on and self._tracer in self.observers:
            self.observers.remove(self._tracer)

    @property
    def trace(self) -> StepTrace | None:
        """The trace of the step running now (None when untraced, or between steps)."""
        return self._tracer.trace

    @property
    def traces(self) -> list[StepTrace]:
        """The traces of the finished steps."""
        return self._tracer.traces

    def finish_step(self) -> StepTrace | None:
        """End the step (:meth:`end_step`), tell the observers (a trace is closed: on CUDA the events
        are synchronised and resolved) and return the step's trace (None when untraced)."""
        if not self.observers:
            return self._end_step()
        with self._observed("finish_step"):
            return self._finish_step()

    def _finish_step(self) -> StepTrace | None:
        self._end_step()
        done = None
        for o in list(self.observers):
            got = o.step_ended()
            done = got if done is None else done
        return done

    # ---- gathers issued ahead of a step by someone else (a draft's first layer) -------------------------
    def hand_over(self, layer: int, join: Callable[[], None]) -> None:
        """A gather of ``layer`` into its slot was just issued for the next step by the caller (outside any
        step); ``join()`` makes it visible to the current stream. The next step joins it instead of
        issuing its own. Every rank must hand over the same gathers."""
        if self.closed:
            raise PlannerClosedError(f"layer {layer}: this weight sharding was closed")
        slot = self.slot_of[layer]
        self._join_slot(slot)
        self.state.receiving(slot, layer, self.step + 1, join)
        self.gathers_total += 1

    def join_ahead(self, layer: int) -> None:
        """Join the gather of ``layer`` issued ahead (the current stream waits; CPU: blocks)."""
        slot = self.slot_of[layer]
        if self.state.landing(slot) == layer:
            self._join_slot(slot)

    @property
    def ahead_layers(self) -> list[int]:
        """Layers whose gather for the next step is issued (a prefetch in flight or joined)."""
        return sorted(self.state.ahead(self.step))

    def occupancy(self) -> dict[str, int | None]:
        """``{"A": layer or None, ...}``: the layer whose bytes each slot holds now (None: receiving, or
        nothing it could compute with)."""
        return self.state.occupancy()

    # ---- the slots lent to a gather outside the planner (full_state_dict) ------------------------------
    def lend_slots(self) -> None:
        """Between steps: join every gather in flight (a prefetch for the next step is given up: the next
        step gathers its layer by its schedule) and forget what the slots hold, before someone else
        gathers into them. Every rank the same (it changes the next step's collectives)."""
        self._between_steps("lend_slots")
        for s in self.state.landing_slots():
            self._join_slot(s)
        for layer in self.state.ahead(self.step):
            for p in self.plugins:
                p.ahead_cancelled(layer)
        for s in range(self.slots.count):
            self.state.forget(s)

    def filled(self, layer: int) -> None:
        """``layer``'s slot was just filled with its bytes by a gather outside the planner."""
        self.state.filled(self.slot_of[layer], layer, self.step)

    def layers_chunk(self, layer: int) -> torch.Tensor:
        """What the layer's gather sends: its resident chunk (in place over its view when mapped)."""
        return self.layers[layer].chunk

    def _between_steps(self, what: str) -> None:
        if self._owner is not None and not self._outside:
            raise ShardingError(f"{what}: a step is running; change the planner between steps, on every rank the same")

    # ---- the end ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Refuse every later step (the sharding freed the slots and chunks)."""
        for s in self.state.landing_slots():  # a gather in flight must not write into freed memory
            try:
                self._join_slot(s)
            except (CommError, MismatchedGatherError):
                pass
        ahead = self.state.ahead(self.step)
        if self.cuda and ahead:
            torch.cuda.synchronize(self.device)
        for slot in ahead.values():
            self.state.not_ahead(slot)
        for p in self.plugins:
            p.close(self)
        for g in self.gathers.values():
            g.close()  # a captured gather graph goes before the windows it references
        self.closed = True
        self.state.samples = None  # they read the slots in place: not after the memory is released
        self.gathers.clear()
        # the aliases of the bound weights view the slots: nothing may keep those alive
        self.versions.release()
        self._bound, self._bound_versions = self.versions.aliases, self.versions.at_finalize
