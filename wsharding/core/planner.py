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

[Note: the gate]
A gather into a slot overwrites the weights of the slot's previous occupant. Started any earlier than
the end of that layer, it would replace them while the layer still reads them -- on the GPU a silent
race, the layer computing with half of the next layer's bytes. So every gather has a gate: the end of
the slot's previous occupant in this step. A schedule of depth ``k`` over ``k + 1`` slots issues each
gather after its gate on the host already ([Note: the gate, for depth k] in
:mod:`wsharding.core.schedule`); on CUDA the gather still waits on the event recorded at the gate's
end, because its kernels may be queued. A schedule that issues a gather before its gate has ended
(deeper than its slots: the notebook's race) has it held back and issued by ``block_end`` of the gate.
A previous occupant that ran in an earlier step needs no gate: the step's fork orders the gather after
it. ``gate=False`` exists only to show the race.

[Note: checked at use]
The schedule is right only if the model calls its blocks as planned: in order, each once, on one
thread, every rank the same. A model can do otherwise -- a reversed loop, a block or a linear called
on its own, a second thread, a peer that fails inside a block -- so every block about to compute (and
every target linear called outside its block) confirms in O(1) that its slot holds its own layer:
the planner keeps, per slot, the layer whose gather into it completed (joined without error) and
nothing was issued into it since. If not, the layer is a *miss*: with ``on_miss="gather"`` (the
default) it is gathered now, synchronously, and a warning says why, once per reason; with
``on_miss="raise"`` the forward raises. A miss leaves the schedule for the rest of the step (the order
it assumed is gone) and gathers through the communicator's channel for gathers outside the steps
(:meth:`~wsharding.core.comm.Communicator.gather_outside_steps`), so that a rank that misses alone --
a debugging call of one block -- waits there and times out instead of pairing its gather with a peer's
next step. A block that raises gives up the step cleanly: this rank still issues every gather its
peers issue in this step (they are the right layers' bytes for them) and joins them; a gather that
fails marks its slot empty and fails the forward that joins it, naming the layer, the step and the
group. A second thread entering a step while one runs is refused.

[Note: one collective sequence per step]
The steps' gathers of all ranks pair by their order on the channel: the k-th gather a rank issues
meets the k-th of every peer. So every rank issues every gather of its step's schedule, whatever its
blocks did: one that misses gives the schedule up by issuing all the rest at once, before its gather
outside the steps (a peer that did not miss completes its step exact while the lone miss waits on the
other channel and times out); one that refuses (``on_miss="raise"``) issues the rest as it gives the
step up. Left unissued, a peer's pending gathers would pair with this rank's next step -- layer 2 of
one rank beside layer 0 of the other: wrong outputs on every rank, no error, for steps, until a
timeout. Only a gather of the step that failed (its channel broken) stops the rest.

[Note: the stamp of a gather outside the steps]
The channel for gathers outside the steps pairs whatever its ranks send: rank 0 calling block 0 on
its own while rank 1 calls block 1 would give each a layer made of both layers' chunks. So each rank
sends its chunk with a 16-byte stamp after it (a magic number, the layer, the step) and every rank
compares all stamps it received before a byte is written into the slot: different ones raise
:class:`MismatchedGatherError` on every rank of the gather, the slot left as it was. The stamp
travels in a host buffer the gather is staged in (both backends take this rare, warned path through
host memory anyway; the buffer lives only for the call), so no layout, resident byte or formula
changes, and the steps' own gathers pay nothing.

[Note: the hot path]: a block's start and end cost a thread-id compare, a slot lookup and, where the
schedule says so, a gather's start; everything else is decided when the schedule is made.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from wsharding.core.backpressure import StepBackpressure
from wsharding.core.comm import CommError, Communicator, PreparedGather
from wsharding.core.edits import BoundVersions, refuse_edits, version_of
from wsharding.core.errors import InvalidArgument, ShardingError, require_bool
from wsharding.core.layout import FlatLayout
from wsharding.core.schedule import GatherSchedule, ScheduledGather, lookahead_schedule, slot_name
from wsharding.core.slots import SlotPool
from wsharding.core.trace import StepTrace

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


@dataclass(frozen=True)
class _Plan:
    """A schedule flattened for the hot path: its issue order, where each hook's gathers end in it."""

    schedule: GatherSchedule
    order: list[ScheduledGather]
    starts: dict[int, int]
    ends: dict[int, int]
    at_start: int


class PlannerClosedError(CommError):
    """The planner's weight sharding was closed: its slots and chunks are gone."""


class ConcurrentStepError(ShardingError):
    """A second thread entered a sharded forward while a step of this model runs in another."""


class MismatchedGatherError(ShardingError):
    """A gather combined chunks of different layers or steps ([Note: the stamp of a gather outside the
    steps]): refused on every rank of the gather, nothing written into its slot."""


#: The stamp's bytes: a magic number, the layer (int32) and the step (int64), in the host's byte order.
STAMP_BYTES = 16
_STAMP_MAGIC = 0x5753_4844  # "WSHD"


def stamp_of(layer: int, step: int) -> torch.Tensor:
    """The 16-byte stamp of ``layer``'s gather in ``step`` (a uint8 tensor on the host)."""
    t = torch.empty(STAMP_BYTES, dtype=torch.uint8)
    t[:8].view(torch.int32).copy_(torch.tensor([_STAMP_MAGIC, layer], dtype=torch.int32))
    t[8:].view(torch.int64).fill_(step)
    return t


def read_stamp(raw: torch.Tensor) -> tuple[int, int] | None:
    """``(layer, step)`` of a stamp's 16 bytes; None when they are not a stamp (no magic number)."""
    raw = raw.contiguous()
    magic, layer = raw[:8].view(torch.int32).tolist()
    if magic != _STAMP_MAGIC:
        return None
    return layer, int(raw[8:].view(torch.int64).item())


class ScheduleMissWarning(UserWarning):
    """A layer about to compute found its slot without its own bytes and was gathered now ([Note:
    checked at use])."""


#: Why a sharded model cannot be pickled, deep-copied or ``torch.save``d whole, and the way out.
NOT_COPIED = (
    "a sharded model cannot be copied or saved whole (copy.deepcopy, torch.save(model), pickle): its sharded "
    "weights are views of slots that every step refills with another layer, and it holds its shard group's "
    "planner and communicator, which belong to this process. To save or copy its weights, take "
    "WeightSharding.full_state_dict(model) on every rank of the shard group (or wsharding.checkpoint."
    "save_checkpoint); to have a second copy of the model, build it and shard it again")


#: Why a sharded model cannot be exported.
EXPORT_REFUSED = (
    "torch.export of a sharded model: its forward gathers each layer's weights into slots that the next "
    "gather overwrites, collectives with every rank of the shard group that no exported graph can hold. Export "
    "the model before it is sharded (or export one block, unsharded); run the sharded model eagerly")


class WeightShardPlanner:
    """Replays one model's gather schedule and checks every layer's slot before it computes."""

    def __init__(
        self,
        comm: Communicator,
        layers: dict[int, ShardedLayer],
        slots: SlotPool,
        *,
        lookahead: bool = True,
        trace: bool = False,
        gate: bool = True,
        plugins: Sequence[Any] = (),
        on_miss: str = "gather",
    ) -> None:
        if on_miss not in ("gather", "raise"):
            raise InvalidArgument(f"on_miss must be 'gather' or 'raise', got {on_miss!r}")
        self.comm = comm
        self.layers = layers
        self.slots = slots
        #: Gathers in flight ahead of the computing layer (slots - 1).
        self.depth = slots.count - 1
        self.on_miss = on_miss
        #: Only for demonstrating the race the gate prevents: never turn it off for real use.
        self.gate = gate
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
        self.compute: torch.cuda.Stream | None = None
        # ---- what the slots hold ([Note: checked at use]) ----
        n = slots.count
        #: Per slot: the layer whose gather into it completed, with nothing issued into it since.
        self._holds: list[int | None] = [None] * n
        #: Per slot: the layer whose gather into it is issued and not joined, and how to join it.
        self._inflight: list[int | None] = [None] * n
        self._joins: list[Callable[[], None] | None] = [None] * n
        #: Gathers issued for the next step (layer -> its slot), taken over by the next step's start.
        self._ahead: dict[int, int] = {}
        # ---- the step ----
        self._owner: int | None = None  # the thread running a step (or a block outside one)
        self._lock = threading.Lock()
        self._outside = False  # a block runs outside any step
        self._expect = -1  # the block the schedule expects next
        self._computing: int | None = None  # the block between its block_start and block_end
        self._missed = False  # the step left its schedule ([Note: checked at use])
        self._failed = False  # a gather of the step failed: nothing more is issued
        self._warned: set[str] = set()
        self._finished: dict[int, int] = dict.fromkeys(layers, -1)
        self._held: dict[int, list[ScheduledGather]] = {}
        self._order: list[ScheduledGather] = []
        self._pos = 0
        self._start_end: dict[int, int] = {}
        self._end_end: dict[int, int] = {}
        self.step_start_layer = 0
        self.trace_enabled = trace
        self.trace: StepTrace | None = None
        self.traces: list[StepTrace] = []
        self.step = -1
        self.closed = False
        #: Gathers issued in the current step and in total (one per sharded layer per step).
        self.gathers_this_step = 0
        self.gathers_total = 0
        self.waits_this_step = 0
        #: Layers gathered outside the schedule because their slot did not hold them ([Note: checked at use]).
        self.misses = 0
        #: Schedule policies attached (:class:`~wsharding.core.plugins.PlannerPlugin`), in order.
        self.plugins: list[Any] = []
        self._lookahead = require_bool(lookahead, "lookahead")
        self._schedule_fn: ScheduleFn | None = None
        self._schedules: dict[tuple[int, int | None, bool], _Plan] = {}
        self._taken: set[int] = set()  # layers whose gather of this step was issued ahead of it
        for plugin in plugins:
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

    def _plan(self, start: int, end: int | None) -> _Plan:
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
            # Flattened for the hot path: the issue order, and where each hook's gathers end in it.
            order = list(sched.at_step_start)
            starts, ends = {}, {}
            for b in range(sched.start, sched.end):
                if sched.at_block_start.get(b):
                    order += sched.at_block_start[b]
                    starts[b] = len(order)
                if sched.at_block_end.get(b):
                    order += sched.at_block_end[b]
                    ends[b] = len(order)
            plan = self._schedules[key] = _Plan(sched, order, starts, ends, len(sched.at_step_start))
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

    # ---- the step ---------------------------------------------------------------------------------
    def begin_step(self, start_layer: int = 0, end_layer: int | None = None) -> None:
        """Start a step over blocks ``[start_layer, end_layer)`` and issue its first gathers.

        Every rank of the shard group runs the same steps over the same ranges. The step ends at
        :meth:`end_step`; a step of the same thread left open (an exception outside any block) is
        ended first."""
        if self.closed:
            raise PlannerClosedError("this weight sharding was closed (WeightSharding.close()): its slots and "
                                     "chunks are freed; build and shard the model again to run it")
        if torch.compiler.is_exporting():
            # A step is a sequence of collectives into slots that the next step overwrites: there is no
            # graph of it to export, and torch's own failure ("Can't remap async version of inplace op",
            # a skipped builtin) names neither the cause nor the way out.
            raise ShardingError(EXPORT_REFUSED)
        me = threading.get_ident()
        if self._owner == me and not self._outside:
            self.end_step()
        if not self._lock.acquire(blocking=False):
            self._refuse_thread("starts a step")
        try:
            self._open_step(start_layer, end_layer, me)
        except BaseException:
            self._close_step()
            raise

    def _open_step(self, start_layer: int, end_layer: int | None, me: int) -> None:
        self._owner = me
        self._outside = False
        if self.trace is not None:
            self.traces.append(self.trace)
        self.step += 1
        self.gathers_this_step = 0
        self.waits_this_step = 0
        self._missed = self._failed = False
        self._held.clear()
        self.step_start_layer = start_layer
        self._expect = start_layer
        if self.cuda:
            # Once per step (6.6 us on an H200), not once per layer.
            self.compute = torch.cuda.current_stream(self.device)
        self.trace = StepTrace(self.step, self.comm.rank, self.cuda, self.device) if self.trace_enabled else None
        plan = self._plan(start_layer, end_layer)
        self._order, self._start_end, self._end_end = plan.order, plan.starts, plan.ends
        self._pos = 0
        self.comm.raise_if_failed(f"step {self.step}")
        capturing = self.cuda and torch.cuda.is_current_stream_capturing()
        if self.cuda:
            if not capturing:
                self._backpressure()
            # Fork: the side streams must not overwrite a slot that the previous step's last layers
            # may still be reading on the compute stream (and under capture, they join the capture here).
            self._record(self._fork, self.compute)
            self.comm.fork(self._fork)
        if self.trace is not None:
            self.trace.start()
        self._taken.clear()
        if self._ahead:
            self._take_ahead(capturing)
        self._issue_upto(plan.at_start)

    def _backpressure(self) -> None:  # [Note: backpressure]: the one host wait of a step
        self._step_forks.wait(self.step, self.compute)

    def _take_ahead(self, capturing: bool) -> None:
        """The gathers issued for this step by the previous one (or before it): this step's now."""
        pending = [layer for layer, slot in self._ahead.items() if self._inflight[slot] == layer]
        if capturing and pending:
            # joined ahead (a draft's first layer waited on before the graph) is fine: the graph reads a
            # slot that already holds it; still in flight, the graph would have to join what it never issued
            first = pending[0]
            raise CommError(
                f"layer {first}: its gather for this step was issued ahead, before the capture, on rank "
                f"{self.comm.rank}; a CUDA graph must hold every gather it waits on. Turn the prefetch off "
                "(NextStepPrefetch.enabled = False) and run one eager step before capturing")
        used = {g.layer for g in self._order if not g.next_step}
        for layer, slot in self._ahead.items():
            if layer in used:
                self._taken.add(layer)
                self.gathers_this_step += 1
                continue
            # This step does not use it (it starts past that layer): join it, nothing stays in flight.
            if self._inflight[slot] == layer:
                self._join_slot(slot)
            for p in self.plugins:
                p.ahead_cancelled(layer)
        self._ahead.clear()

    def block_start(self, block: int) -> None:
        """Block ``block`` is about to compute: its own layer's bytes are in its slot when this
        returns ([Note: checked at use]); then the gathers this hook issues are issued."""
        self._computing = block
        if self._owner != threading.get_ident() or block != self._expect or self._outside:
            self._irregular_start(block)
            return
        self._expect = block + 1
        end = self._start_end.get(block)
        if end is not None and self._pos < end and self._order[self._pos].layer == block:
            g = self._order[self._pos]  # lookahead off: its own gather first, joined at once
            self._pos += 1
            self._issue(g, here=True)
        slot = self.slot_of.get(block)
        if slot is not None:
            self.waits_this_step += 1
            trace = self.trace
            if self._holds[slot] != block:
                self._join_or_miss(block, slot)
            elif trace is not None:  # joined already (ahead of the step)
                trace.mark(block, "wait_start")
                trace.mark(block, "wait_end")
            if tuple(map(version_of, self._bound[block])) != self._bound_versions[block]:
                self._refuse_edited(block)
        if end is not None and end > self._pos:
            self._issue_upto(end)
        if slot is not None and self.trace is not None:
            self.trace.mark(block, "compute_start")  # once the gathers it hides are issued

    def block_end(self, block: int) -> None:
        """Block ``block`` finished computing: record its end (a gate), issue what this hook issues
        and what was held behind this block."""
        self._computing = None
        if self._outside and self._owner == threading.get_ident():
            self._outside = False
            self._owner = None
            self._lock.release()
            return
        if block in self._finished:
            self._finished[block] = self.step
            if self.cuda:
                self._record(self._done[block], self.compute)
            if self.trace is not None:
                self.trace.mark(block, "compute_end")
        if self._owner != threading.get_ident():
            return
        if self._held:
            for g in self._held.pop(block, ()):
                self._issue(g)
        if self._missed or self._failed:
            return
        end = self._end_end.get(block)
        if end is not None and end > self._pos:
            self._issue_upto(end)

    def ensure(self, layer: int) -> None:
        """A target linear of ``layer`` is about to compute: make sure its slot holds it (a linear
        called on its own, outside its block's forward). O(1) when it does."""
        slot = self.slot_of.get(layer)
        if slot is None or self._holds[slot] == layer:
            return
        if self._owner is None:  # outside any step: the same as calling the block on its own
            self._irregular_start(layer)
            self.block_end(layer)
            return
        if self._owner != threading.get_ident():
            self._refuse_thread(f"runs layer {layer}")
        self._join_or_miss(layer, slot)

    def reads_own_layer(self, layer: int) -> bool:
        """True while block ``layer`` computes on this thread with its own bytes in its slot: its
        weights may then be read directly (``F.linear(x, self.fc.weight)`` in a block's forward;
        [Note: reads of a bound weight] in ``wsharding/core/bound.py``)."""
        slot = self.slot_of.get(layer)
        return (self._computing == layer and self._owner == threading.get_ident() and slot is not None
                and self._holds[slot] == layer and not self._failed)

    def end_step(self) -> None:
        """End the step: issue every gather of the schedule not yet issued (a block skipped or given
        up: the peers issue them) and join every gather of this step nobody joined, so that none
        lands in a slot later. Idempotent; the next step may start on another thread."""
        if self._owner != threading.get_ident():
            return
        if self._outside:
            self._close_step()
            return
        try:
            if not self._failed:  # [Note: one collective sequence per step]: missed or refused, still issued
                self._drain()
            if not self._failed:
                for s, layer in enumerate(self._inflight):
                    if layer is not None and layer not in self._ahead:
                        self._join_slot(s)
        finally:
            self._close_step()

    def abort_step(self) -> None:
        """A block (or the model between blocks) raised: give the step up cleanly ([Note: checked at
        use]) -- the gathers the peers still issue are issued and joined, so theirs complete with the
        right bytes and nothing lands in a slot later. Errors of the communicator while doing so are
        left to the exception that is already on its way."""
        try:
            self.end_step()
        except CommError:
            self._close_step()

    def _close_step(self) -> None:
        self._held.clear()
        self._owner = None
        self._outside = False
        self._expect = -1
        self._computing = None
        if self._lock.locked():
            self._lock.release()

    def _drain(self) -> None:
        if self._pos < len(self._order):
            if self.cuda:  # whatever this rank queued may still read the slots: order the rest after it
                self._record(self._fork, torch.cuda.current_stream(self.device))
                self.comm.fork(self._fork)
            while self._pos < len(self._order):
                g = self._order[self._pos]
                self._pos += 1
                self._issue(g, ungated=True)
        for gs in list(self._held.values()):
            for g in gs:
                self._issue(g, ungated=True)
        self._held.clear()

    # ---- issue and join -----------------------------------------------------------------------------
    def _issue_upto(self, end: int) -> None:
        order = self._order
        while self._pos < end:
            g = order[self._pos]
            self._pos += 1
            self._issue(g)

    def _issue(self, g: ScheduledGather, *, here: bool = False, ungated: bool = False) -> None:
        layer, slot = g.layer, g.slot
        if g.next_step and not self._next_step_on():
            return
        if layer in self._taken and not g.next_step:
            return  # issued ahead of this step (the previous step's end, a draft's prefetch)
        gate_layer = g.gate
        if (self.gate and not ungated and gate_layer is not None and self._finished[gate_layer] != self.step):
            self._held.setdefault(gate_layer, []).append(g)  # [Note: the gate]: issued at its end
            if self.trace is not None:
                self.trace.mark(layer, "held")
            return
        if self._inflight[slot] is not None:
            self._join_slot(slot)  # a gather still landing in this slot lands first
        prepared = self.gathers[layer]
        gate = None
        if self.cuda:
            if here:
                # Issued at the layer's own start (lookahead off): the gather waits for everything queued
                # on the compute stream so far, so it starts when the GPU reaches this layer -- with a
                # host that runs ahead of the GPU, that *is* lookahead, and "off" would measure nothing.
                self._record(self._here, self.compute)
                gate = self._here
            elif self.gate and not ungated and gate_layer is not None:
                gate = self._done[gate_layer]
        trace = self.trace
        marks = trace.gather_issued(layer, slot_name(slot)) if trace is not None else None
        self._holds[slot] = None  # receiving: no layer may compute from it until it is joined
        try:
            if self.cuda and not self.gate:
                # Gate off (the race demonstration only): issue from a side stream that waits for nothing.
                with torch.cuda.stream(self.free_stream()):
                    prepared.start(None, marks)
            else:
                # Waited on at once (lookahead off): handing it to an issue thread would only add its wake-up.
                prepared.start(gate, marks, inline=here)
        except CommError as e:
            self._fail(layer, slot, e)
        if trace is not None and not self.cuda:
            prepared.add_done_callback(lambda: trace.mark(layer, "gather_end", time.perf_counter()))
        self._inflight[slot] = layer
        self._joins[slot] = None
        self.gathers_total += 1
        if g.next_step:
            self._ahead[layer] = slot
            for p in self.plugins:
                p.ahead_issued(layer)
        else:
            self.gathers_this_step += 1

    def _next_step_on(self) -> bool:
        """The next step's gather is issued only where every rank issues it the same way: lookahead and
        gate on, untraced, not under capture (a CUDA graph replays alone), the policy enabled."""
        if not (self._lookahead and self.gate and self.trace is None):
            return False
        if self.cuda and torch.cuda.is_current_stream_capturing():
            return False
        return all(p.enabled for p in self.plugins if p.claims_first_layer)

    def _join_or_miss(self, layer: int, slot: int, why: str = "its gather was not where the schedule put it",
                      kind: str = "missed") -> None:
        if self._inflight[slot] == layer:
            self._join_slot(slot, counted=True)
            if self._holds[slot] == layer:
                return
        if self._owner is None or self._failed:
            raise ShardingError(f"layer {layer} on rank {self.comm.rank}: its slot does not hold its weights and "
                                "no step is running to gather them")
        self._miss(layer, slot, why, kind)

    def _join_slot(self, slot: int, *, counted: bool = False) -> None:
        layer = self._inflight[slot]
        if layer is None:
            return
        join = self._joins[slot]
        trace = self.trace
        if trace is not None and counted:
            trace.mark(layer, "wait_start")
        try:
            if join is not None:
                join()
            else:
                self.gathers[layer].wait(self.compute if self.cuda else None)
        except CommError as e:
            self._fail(layer, slot, e)
        self._inflight[slot] = None
        self._joins[slot] = None
        self._holds[slot] = layer
        if counted and trace is not None:
            trace.mark(layer, "wait_end")

    def _fail(self, layer: int, slot: int, err: Exception) -> None:
        """A gather failed: its slot holds nothing usable, the step issues nothing more, and the
        forward raises."""
        self._holds[slot] = None
        self._inflight[slot] = None
        self._joins[slot] = None
        self._failed = True
        raise CommError(self.stuck_message(layer, err)) from err

    # ---- misses ([Note: checked at use]) -----------------------------------------------------------------
    def _irregular_start(self, block: int) -> None:
        """A block called off the schedule: outside any step, on another thread, or out of order."""
        me = threading.get_ident()
        if self._owner is None:
            if not self._lock.acquire(blocking=False):
                self._refuse_thread(f"runs block {block}")
            self._owner, self._outside = me, True
            if self.compute is None and self.cuda:
                self.compute = torch.cuda.current_stream(self.device)
            slot = self.slot_of.get(block)
            if slot is not None and self._holds[slot] != block:
                try:
                    if self._inflight[slot] == block:
                        self._join_slot(slot)
                    if self._holds[slot] != block:
                        self._miss(block, slot, "it was called outside a step and its slot holds another layer",
                                   "outside a step")
                except BaseException:
                    self.block_end(block)
                    raise
            return
        if self._owner != me:
            self._refuse_thread(f"runs block {block}")
        if self._outside:  # a block inside a block outside any step: nothing to plan
            slot = self.slot_of.get(block)
            if slot is not None and self._holds[slot] != block:
                self._miss(block, slot, "it was called outside a step and its slot holds another layer", "outside a step")
            return
        # In a step, off the expected order: the schedule's order is gone for the rest of this step.
        why = f"block {block} ran where the schedule expected block {self._expect}"
        self._missed = True
        self._expect = block + 1
        slot = self.slot_of.get(block)
        if slot is not None and self._holds[slot] != block:
            self._join_or_miss(block, slot, why, "out of order")

    def _miss(self, layer: int, slot: int, why: str, kind: str = "missed") -> None:
        """Gather ``layer`` now, synchronously, on the channel for gathers outside the steps."""
        where = f"layer {layer} on rank {self.comm.rank}"
        if self.on_miss == "raise":
            self.abort_step()
            raise ShardingError(f"{where}: {why}, so its slot does not hold its weights (on_miss='raise'). Call the "
                                "blocks as the model's forward does -- in order, once each, inside a step -- or "
                                "shard with on_miss='gather' to have such a layer gathered on its own")
        if self._owner is not None and not self._outside:
            self._missed = True
            if not self._failed:
                # [Note: one collective sequence per step]: the rest of the step's gathers now, so that the
                # peers' complete whether or not they miss too (a lone miss then times out alone).
                self._drain()
        self._warn(f"{where}: {why}; gathered it now, synchronously, outside the schedule (every rank must make "
                   "the same call)", kind)
        for s in range(len(self._inflight)):
            if self._inflight[s] is not None:
                self._join_slot(s)  # nothing may land in a slot after this
        before = self._holds[slot]
        self._holds[slot] = None  # receiving
        try:
            self._gather_outside(layer, f"layer {layer}: gather outside the schedule")
        except (CommError, MismatchedGatherError) as e:
            # Nothing was written into the slot (the gather is staged): it still holds what it held, a
            # gather for the next step landed there included; the step's own channel is untouched, so
            # _failed stays off and its gathers are still issued.
            self._holds[slot] = before
            if isinstance(e, MismatchedGatherError):
                raise
            raise CommError(f"weight gather of layer {layer} failed on rank {self.comm.rank} (step {self.step}), "
                            f"outside the steps: {e}. Its slot was not written. A layer gathered outside the steps "
                            "needs the same call on every rank of the shard group") from e
        for ahead, s in list(self._ahead.items()):
            if s == slot:  # a gather for the next step landed here: given up, the next step gathers it anew
                del self._ahead[ahead]
                for p in self.plugins:
                    p.ahead_cancelled(ahead)
        self._holds[slot] = layer
        self.misses += 1
        self.gathers_total += 1

    def _gather_outside(self, layer: int, what: str) -> None:
        """Gather ``layer`` on the channel outside the steps, each rank's chunk sent with its stamp, and
        refuse it on every rank when the stamps differ ([Note: the stamp of a gather outside the steps])."""
        full, chunk = self.slots.full_buffer(layer), self.layers_chunk(layer)
        n = self.comm.world_size
        if n == 1:  # no peer to pair with
            self.comm.gather_outside_steps(full, chunk, what=what)
            return
        c = chunk.numel()
        # Staged in host memory: both backends' channel for these gathers goes through it anyway.
        send = torch.empty(c + STAMP_BYTES, dtype=torch.uint8)
        send[:c].copy_(chunk)
        send[c:].copy_(stamp_of(layer, self.step))
        recv = torch.empty(n * (c + STAMP_BYTES), dtype=torch.uint8)
        self.comm.gather_outside_steps(recv, send, what=what)
        rows = recv.view(n, c + STAMP_BYTES)
        sent = [read_stamp(rows[r, c:]) for r in range(n)]
        if any(got != (layer, self.step) for got in sent):
            told = ", ".join(f"rank {r} sent " + ("no stamp" if got is None else f"layer {got[0]} of step {got[1]}")
                             for r, got in enumerate(sent))
            raise MismatchedGatherError(
                f"layer {layer} on rank {self.comm.rank}: its gather outside the steps was paired with other gathers: "
                f"{told}. Nothing was written into its slot. A block (or linear) called outside the "
                "model's forward gathers its layer on its own: every rank of the shard group must make the same "
                "call, the same layer after the same steps")
        full.view(n, c).copy_(rows[:, :c])

    def layers_chunk(self, layer: int) -> torch.Tensor:
        """What the layer's gather sends: its resident chunk (in place over its view when mapped)."""
        return self.layers[layer].chunk

    def _warn(self, text: str, kind: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(f"{text} ([Note: checked at use]; shown once per reason; on_miss='raise' makes it an "
                          "error)", ScheduleMissWarning, stacklevel=4)

    def _refuse_thread(self, what: str) -> None:
        raise ConcurrentStepError(
            f"rank {self.comm.rank}: a thread {what} of this sharded model while another thread runs a step of it. "
            "The slots hold one layer set at a time, so two forwards would compute with each other's weights. Serve "
            "concurrent requests by batching them into one forward, or serialise the calls (one lock around "
            "model(...))")

    def _between_steps(self, what: str) -> None:
        if self._owner is not None and not self._outside:
            raise ShardingError(f"{what}: a step is running; change the planner between steps, on every rank the same")

    # ---- gathers issued ahead of a step by someone else (a draft's first layer) -------------------------
    def hand_over(self, layer: int, join: Callable[[], None]) -> None:
        """A gather of ``layer`` into its slot was just issued for the next step by the caller (outside any
        step); ``join()`` makes it visible to the current stream. The next step joins it instead of
        issuing its own. Every rank must hand over the same gathers."""
        if self.closed:
            raise PlannerClosedError(f"layer {layer}: this weight sharding was closed")
        slot = self.slot_of[layer]
        if self._inflight[slot] is not None:
            self._join_slot(slot)
        self._holds[slot] = None
        self._inflight[slot] = layer
        self._joins[slot] = join
        self._ahead[layer] = slot
        self.gathers_total += 1

    def join_ahead(self, layer: int) -> None:
        """Join the gather of ``layer`` issued ahead (the current stream waits; CPU: blocks)."""
        slot = self.slot_of[layer]
        if self._inflight[slot] == layer:
            self._join_slot(slot)

    @property
    def ahead_layers(self) -> list[int]:
        """Layers whose gather for the next step is issued (a prefetch in flight or joined)."""
        return sorted(self._ahead)

    def occupancy(self) -> dict[str, int | None]:
        """``{"A": layer or None, ...}``: the layer whose bytes each slot holds now (None: receiving, or
        nothing it could compute with)."""
        return {slot_name(s): layer for s, layer in enumerate(self._holds)}

    # ---- the slots lent to a gather outside the planner (full_state_dict) ------------------------------
    def lend_slots(self) -> None:
        """Between steps: join every gather in flight (a prefetch for the next step is given up: the next
        step gathers its layer by its schedule) and forget what the slots hold, before someone else
        gathers into them. Every rank the same (it changes the next step's collectives)."""
        self._between_steps("lend_slots")
        for s, layer in enumerate(self._inflight):
            if layer is not None:
                self._join_slot(s)
        for layer in self._ahead:
            for p in self.plugins:
                p.ahead_cancelled(layer)
        self._ahead.clear()
        self._holds = [None] * len(self._holds)

    def filled(self, layer: int) -> None:
        """``layer``'s slot was just filled with its bytes by a gather outside the planner."""
        self._holds[self.slot_of[layer]] = layer

    # ---- errors and the end ---------------------------------------------------------------------------
    def _refuse_edited(self, layer: int) -> None:
        """A weight of ``layer`` was edited in place: give up the step cleanly and raise."""
        self.abort_step()
        refuse_edits(self.versions.edited(layer))

    def stuck_message(self, layer: int, err: Exception) -> str:
        return (f"weight gather of layer {layer} failed on rank {self.comm.rank} (step {self.step}): {err}. Its slot "
                f"is marked empty and is never read. Every rank of the shard group ({self.comm.world_size} ranks) "
                "must issue the same gathers every step: a rank that skips a step (for example because it has no "
                "tokens) or stops leaves the others waiting. Run a one-token dummy step on idle ranks "
                "(wsharding.core.runner.aligned_forward).")

    def finish_step(self) -> StepTrace | None:
        """End the step (:meth:`end_step`), close its trace (on CUDA: synchronise and resolve the events)
        and return it."""
        self.end_step()
        done, self.trace = self.trace, None
        if done is not None:
            done.finish()
            self.traces.append(done)
        return done

    def free_stream(self) -> torch.cuda.Stream:
        """A stream that waits for nothing (gate-off demonstration)."""
        if getattr(self, "_free_stream", None) is None:
            self._free_stream = torch.cuda.Stream(self.device)
        return self._free_stream

    def close(self) -> None:
        """Refuse every later step (the sharding freed the slots and chunks)."""
        for s, layer in enumerate(self._inflight):
            if layer is not None:  # a gather in flight must not write into freed memory
                try:
                    self._join_slot(s)
                except CommError:
                    pass
        if self.cuda and self._ahead:
            torch.cuda.synchronize(self.device)
        self._ahead.clear()
        for p in self.plugins:
            p.close(self)
        for g in self.gathers.values():
            g.close()  # a captured gather graph goes before the windows it references
        self.closed = True
        self.gathers.clear()
        # the aliases of the bound weights view the slots: nothing may keep those alive
        self.versions.release()
        self._bound, self._bound_versions = self.versions.aliases, self.versions.at_finalize
