"""The owner of a step: one thread runs it, every block is checked at use, a miss is recovered and a
step given up still issues what its peers issue.

The planner (:class:`~wsharding.core.planner.WeightShardPlanner`) is a :class:`StepOwner` with a
schedule policy: this class holds the calls a step makes -- ``begin_step``, ``block_start``,
``block_end``, ``ensure``, ``end_step`` -- and what they do when the model keeps to the plan and
when it does not. What each slot holds is :class:`~wsharding.core.slot_state.SlotState`'s to say,
and which gather is due when is :class:`~wsharding.core.replay.Replay`'s.

[Note: checked at use]
The schedule is right only if the model calls its blocks as planned: in order, each once, on one
thread, every rank the same. A model can do otherwise -- a reversed loop, a block or a linear called
on its own, a second thread, a peer that fails inside a block -- so every block about to compute (and
every target linear called outside its block) confirms in O(1) that its slot holds its own layer:
the slot's state is ``READY`` with that layer (its gather completed and nothing was issued into it
since). If not, the layer is a *miss*: with ``on_miss="gather"`` (the default) it is gathered now,
synchronously, and a warning says why, once per reason; with ``on_miss="raise"`` the forward raises.
A miss leaves the schedule for the rest of the step (the order it assumed is gone) and gathers
through the communicator's channel for gathers outside the steps
(:meth:`~wsharding.core.comm.Communicator.gather_outside_steps`), so that a rank that misses alone --
a debugging call of one block -- waits there and times out instead of pairing its gather with a
peer's next step. A block that raises gives up the step cleanly: this rank still issues every gather
its peers issue in this step (they are the right layers' bytes for them) and joins them; a gather
that fails marks its slot empty and fails the forward that joins it, naming the layer, the step and
the group. A second thread entering a step while one runs is refused.

[Note: one collective sequence per step]
The steps' gathers of all ranks pair by their order on the channel: the k-th gather a rank issues
meets the k-th of every peer. So every rank issues every gather of its step's schedule, whatever its
blocks did: one that misses gives the schedule up by issuing all the rest at once, before its gather
outside the steps (a peer that did not miss completes its step exact while the lone miss waits on the
other channel and times out); one that refuses (``on_miss="raise"``) issues the rest as it gives the
step up. Left unissued, a peer's pending gathers would pair with this rank's next step -- layer 2 of
one rank beside layer 0 of the other: wrong outputs on every rank, no error, for steps, until a
timeout. Only a gather of the step that failed (its channel broken) stops the rest.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from wsharding.core.comm import CommError
from wsharding.core.edits import refuse_edits, version_of
from wsharding.core.errors import ShardingError
from wsharding.core.observe import WAIT_FOR_GPU, StepObserver
from wsharding.core.replay import Plan, Replay
from wsharding.core.schedule import ScheduledGather, slot_name
from wsharding.core.slot_state import EMPTY, SlotState
from wsharding.core.stamp import MismatchedGatherError, gather_stamped


class PlannerClosedError(CommError):
    """The planner's weight sharding was closed: its slots and chunks are gone."""


class ConcurrentStepError(ShardingError):
    """A second thread entered a sharded forward while a step of this model runs in another."""


class ScheduleMissWarning(UserWarning):
    """A layer about to compute found its slot without its own bytes and was gathered now ([Note:
    checked at use])."""


#: Why a sharded model cannot be exported.
EXPORT_REFUSED = (
    "torch.export of a sharded model: its forward gathers each layer's weights into slots that the next "
    "gather overwrites, collectives with every rank of the shard group that no exported graph can hold. Export "
    "the model before it is sharded (or export one block, unsharded); run the sharded model eagerly")


class StepOwner:
    """The step calls of a planner. The planner sets up what they read (its ``__init__``) and supplies
    ``_plan(start, end)``, ``_next_step_on()`` and ``plugins``."""

    comm: Any
    state: SlotState
    slot_of: dict[int, int]
    observers: list[StepObserver]
    plugins: list[Any]
    on_miss: str
    cuda: bool

    def _init_step(self) -> None:
        self.replay = Replay(self._issue, self._seen_held)
        self._ready = self.state.ready  # the slot state's own list, read on the hot path
        self._owner: int | None = None  # the thread running a step (or a block outside one)
        self._lock = threading.Lock()
        self._outside = False  # a block runs outside any step
        self._expect = -1  # the block the schedule expects next
        self._computing: int | None = None  # the block between its block_start and block_end
        self._missed = False  # the step left its schedule ([Note: checked at use])
        self._failed = False  # a gather of the step failed: nothing more is issued
        self._warned: set[str] = set()
        self.step = -1
        self.step_start_layer = 0
        self.compute: torch.cuda.Stream | None = None
        #: Gathers issued in the current step and in total (one per sharded layer per step).
        self.gathers_this_step = 0
        self.gathers_total = 0
        self.waits_this_step = 0
        #: Layers gathered outside the schedule because their slot did not hold them ([Note: checked at use]).
        self.misses = 0

    # ---- the calls, as the observers see them ([Note: observers]) ----------------------------------------
    def begin_step(self, start_layer: int = 0, end_layer: int | None = None) -> None:
        """Start a step over blocks ``[start_layer, end_layer)`` and issue its first gathers.

        Every rank of the shard group runs the same steps over the same ranges. The step ends at
        :meth:`end_step`; a step of the same thread left open (an exception outside any block) is
        ended first."""
        if not self.observers:
            return self._begin_step(start_layer, end_layer)
        with self._observed("begin_step"):
            self._begin_step(start_layer, end_layer)

    def block_start(self, block: int) -> None:
        """Block ``block`` is about to compute: its own layer's bytes are in its slot when this
        returns ([Note: checked at use]); then the gathers this hook issues are issued."""
        if not self.observers:
            return self._block_start(block)
        with self._observed("block_start"):
            self._block_start(block)

    def block_end(self, block: int) -> None:
        """Block ``block`` finished computing: record its end (a gate), issue what this hook issues
        and what was held behind this block."""
        if not self.observers:
            return self._block_end(block)
        with self._observed("block_end"):
            self._block_end(block)

    def ensure(self, layer: int) -> None:
        """A target linear of ``layer`` is about to compute: make sure its slot holds it (a linear
        called on its own, outside its block's forward). O(1) when it does."""
        if not self.observers:
            slot = self.slot_of.get(layer)
            if slot is None or self._ready[slot] == layer:  # [Note: the hot path]: the usual answer, inline
                return None
            return self._ensure(layer)
        with self._observed("ensure"):
            self._ensure(layer)

    def end_step(self) -> None:
        """End the step: issue every gather of the schedule not yet issued (a block skipped or given
        up: the peers issue them) and join every gather of this step nobody joined, so that none
        lands in a slot later. Idempotent; the next step may start on another thread."""
        if not self.observers:
            return self._end_step()
        with self._observed("end_step"):
            self._end_step()

    @contextmanager
    def _observed(self, name: str) -> Iterator[None]:
        observers = list(self.observers)
        for o in observers:
            o.call(name)
        try:
            yield
        finally:
            for o in observers:
                o.returned(name)

    def _point(self, layer: int, point: str) -> None:
        for o in self.observers:
            o.layer_point(layer, point)

    def _seen_held(self, layer: int) -> None:
        if self.observers:
            self._point(layer, "held")

    # ---- a step kept to its plan ---------------------------------------------------------------------
    def _begin_step(self, start_layer: int, end_layer: int | None) -> None:
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
            self._end_step()
        if not self._lock.acquire(blocking=False):
            self._refuse_thread("starts a step")
        try:
            self._open_step(start_layer, end_layer, me)
        except BaseException:
            self._close_step()
            raise

    def _open_step(self, start_layer: int, end_layer: int | None, me: int) -> None:
        self._owner, self._outside = me, False
        self.step += 1
        self.gathers_this_step = self.waits_this_step = 0
        self._missed = self._failed = False
        self.step_start_layer = self._expect = start_layer
        if self.cuda:
            # Once per step (6.6 us on an H200), not once per layer.
            self.compute = torch.cuda.current_stream(self.device)
        plan = self._plan(start_layer, end_layer)
        self.comm.raise_if_failed(f"step {self.step}")
        capturing = self.cuda and torch.cuda.is_current_stream_capturing()
        if self.cuda:
            if not capturing:
                self._wait_for_gpu()
            # Fork: the side streams must not overwrite a slot that the previous step's last layers
            # may still be reading on the compute stream (and under capture, they join the capture here).
            self._record(self._fork, self.compute)
            self.comm.fork(self._fork)
        for o in self.observers:
            o.step_started(self.step, self.comm.rank, self.device)
        self._take_ahead(plan, capturing)
        self.replay.begin(plan)

    def _wait_for_gpu(self) -> None:  # [Note: backpressure]: the one host wait of a step
        if not self.observers:
            return self._step_forks.wait(self.step, self.compute)
        with self._observed(WAIT_FOR_GPU):
            self._step_forks.wait(self.step, self.compute)

    def _take_ahead(self, plan: Plan, capturing: bool) -> None:
        """The gathers issued for this step by the previous one (or before it): this step's now, or
        joined and given up when this step does not gather their layer."""
        ahead = self.state.ahead(self.step - 1)
        if not ahead:
            return
        pending = [layer for layer, slot in ahead.items() if self.state.landing(slot) == layer]
        if capturing and pending:
            # joined ahead (a draft's first layer waited on before the graph) is fine: the graph reads a
            # slot that already holds it; still in flight, the graph would have to join what it never issued
            raise CommError(
                f"layer {pending[0]}: its gather for this step was issued ahead, before the capture, on rank "
                f"{self.comm.rank}; a CUDA graph must hold every gather it waits on. Turn the prefetch off "
                "(NextStepPrefetch.enabled = False) and run one eager step before capturing")
        used = {g.layer for g in plan.order if not g.next_step}
        for layer, slot in ahead.items():
            if layer in used:
                self.gathers_this_step += 1
                continue
            if self.state.landing(slot) == layer:
                self._join_slot(slot)
            self.state.not_ahead(slot)
            for p in self.plugins:
                p.ahead_cancelled(layer)

    def _block_start(self, block: int) -> None:
        self._computing = block
        if self._owner != threading.get_ident() or block != self._expect or self._outside:
            self._irregular_start(block)
            return
        self._expect = block + 1
        self.replay.own_gather(block)
        slot = self.slot_of.get(block)
        if slot is not None:
            self.waits_this_step += 1
            if self._ready[slot] != block:
                self._join_or_miss(block, slot)
            elif self.observers:  # joined already (ahead of the step)
                self._point(block, "wait_start")
                self._point(block, "wait_end")
            if tuple(map(version_of, self._bound[block])) != self._bound_versions[block]:
                self._refuse_edited(block)
        self.replay.block_start(block)
        if slot is not None and self.observers:
            self._point(block, "compute_start")  # once the gathers it hides are issued

    def _block_end(self, block: int) -> None:
        self._computing = None
        me = threading.get_ident()
        if self._outside and self._owner == me:
            self._close_step()
            return
        if block in self.slot_of:
            if self.cuda:
                self._record(self._done[block], self.compute)
            if self.observers:
                self._point(block, "compute_end")
        if self._owner == me:
            self.replay.block_end(block, not (self._missed or self._failed))

    def _ensure(self, layer: int) -> None:
        slot = self.slot_of.get(layer)
        if slot is None or self._ready[slot] == layer:
            return
        if self._owner is None:  # outside any step: the same as calling the block on its own
            self._irregular_start(layer)
            self._block_end(layer)
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
                and self._ready[slot] == layer and not self._failed)

    def _end_step(self) -> None:
        if self._owner != threading.get_ident():
            return
        if self._outside:
            self._close_step()
            return
        try:
            if not self._failed:  # [Note: one collective sequence per step]: missed or refused, still issued
                self._drain()
            if not self._failed:
                for s in self.state.landing_slots(upto_step=self.step):  # not the next step's
                    self._join_slot(s)
        finally:
            self._close_step()

    def abort_step(self) -> None:
        """A block (or the model between blocks) raised: give the step up cleanly ([Note: checked at
        use]) -- the gathers the peers still issue are issued and joined, so theirs complete with the
        right bytes and nothing lands in a slot later. Errors of the communicator while doing so are
        left to the exception that is already on its way."""
        try:
            self._end_step()
        except CommError:
            self._close_step()

    def _close_step(self) -> None:
        self.replay.end()
        self._owner = None
        self._outside = False
        self._expect = -1
        self._computing = None
        if self._lock.locked():
            self._lock.release()

    def _drain(self) -> None:
        """Issue what is left of the step's schedule at once, gates ignored."""
        left = self.replay.rest()
        if not left:
            return
        if self.cuda:  # whatever this rank queued may still read the slots: order the rest after it
            self._record(self._fork, torch.cuda.current_stream(self.device))
            self.comm.fork(self._fork)
        for g in left:
            self._issue(g, False, True)

    # ---- issue and join -------------------------------------------------------------------------------
    def _issue(self, g: ScheduledGather, here: bool, ungated: bool) -> None:
        """Start gather ``g`` (the replay's ``issue``): ``here`` at its own block's start (lookahead off),
        ``ungated`` with the step given up."""
        layer, slot = g.layer, g.slot
        if g.next_step:
            if not self._next_step_on():
                return
            step = self.step + 1
        elif self.state.issued_for(layer, self.step):
            return  # issued ahead of this step (the previous step's end, a draft's prefetch)
        else:
            step = self.step
        if self.state.landing(slot) is not None:
            self._join_slot(slot)  # a gather still landing in this slot lands first
        gate = None
        if self.cuda:
            if here:
                # Issued at the layer's own start (lookahead off): the gather waits for everything queued
                # on the compute stream so far, so it starts when the GPU reaches this layer -- with a
                # host that runs ahead of the GPU, that *is* lookahead, and "off" would measure nothing.
                self._record(self._here, self.compute)
                gate = self._here
            elif not ungated and g.gate is not None:
                gate = self._done[g.gate]
        marks = None
        for o in self.observers:
            marks = o.gather_issued(layer, slot_name(slot), self.state.gathers[layer]) or marks
        try:
            # Waited on at once (lookahead off): handing it to an issue thread would only add its wake-up.
            prepared = self.state.start(slot, layer, step, gate, marks, here)
        except CommError as e:
            self._fail(layer, e)
        for o in self.observers:
            o.gather_started(layer, prepared)
        self.gathers_total += 1
        if g.next_step:
            for p in self.plugins:
                p.ahead_issued(layer)
        else:
            self.gathers_this_step += 1

    def _join_or_miss(self, layer: int, slot: int, why: str = "its gather was not where the schedule put it",
                      kind: str = "missed") -> None:
        if self.state.landing(slot) == layer:
            self._join_slot(slot, counted=True)
            if self.state.holds(slot) == layer:
                return
        if self._owner is None or self._failed:
            raise ShardingError(f"layer {layer} on rank {self.comm.rank}: its slot does not hold its weights and "
                                "no step is running to gather them")
        self._miss(layer, slot, why, kind)

    def _join_slot(self, slot: int, *, counted: bool = False) -> None:
        layer = self.state.landing(slot)
        if layer is None:
            return
        seen = counted and self.observers
        if seen:
            self._point(layer, "wait_start")
        try:
            self.state.join(slot, self.compute if self.cuda else None)
        except CommError as e:
            self._fail(layer, e)
        except MismatchedGatherError:
            self._failed = True  # the group is out of step: every later gather would pair wrongly too
            raise
        if seen:
            self._point(layer, "wait_end")

    def _fail(self, layer: int, err: Exception) -> None:
        """A gather failed: its slot holds nothing usable (the slot state says so already), the step
        issues nothing more, and the forward raises."""
        self._failed = True
        raise CommError(self.stuck_message(layer, err)) from err

    def stuck_message(self, layer: int, err: Exception) -> str:
        return (f"weight gather of layer {layer} failed on rank {self.comm.rank} (step {self.step}): {err}. Its slot "
                f"is marked empty and is never read. Every rank of the shard group ({self.comm.world_size} ranks) "
                "must issue the same gathers every step: a rank that skips a step (for example because it has no "
                "tokens) or stops leaves the others waiting. Run a one-token dummy step on idle ranks "
                "(wsharding.core.runner.aligned_forward).")

    # ---- misses ([Note: checked at use]) -----------------------------------------------------------------
    def _irregular_start(self, block: int) -> None:
        """A block called off the schedule: outside any step, on another thread, or out of order."""
        me = threading.get_ident()
        slot = self.slot_of.get(block)
        if self._owner is None:
            if not self._lock.acquire(blocking=False):
                self._refuse_thread(f"runs block {block}")
            self._owner, self._outside = me, True
            if self.compute is None and self.cuda:
                self.compute = torch.cuda.current_stream(self.device)
            if slot is not None and self.state.holds(slot) != block:
                try:
                    if self.state.landing(slot) == block:
                        self._join_slot(slot)
                    if self.state.holds(slot) != block:
                        self._miss(block, slot, "it was called outside a step and its slot holds another layer",
                                   "outside a step")
                except BaseException:
                    self._block_end(block)
                    raise
            return
        if self._owner != me:
            self._refuse_thread(f"runs block {block}")
        if self._outside:  # a block inside a block outside any step: nothing to plan
            if slot is not None and self.state.holds(slot) != block:
                self._miss(block, slot, "it was called outside a step and its slot holds another layer", "outside a step")
            return
        # In a step, off the expected order: the schedule's order is gone for the rest of this step.
        why = f"block {block} ran where the schedule expected block {self._expect}"
        self._missed = True
        self._expect = block + 1
        if slot is not None and self.state.holds(slot) != block:
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
        for s in self.state.landing_slots():
            self._join_slot(s)  # nothing may land in a slot after this
        before = self.state.set_state(slot, EMPTY)  # receiving
        try:
            self._gather_outside(layer, f"layer {layer}: gather outside the schedule")
        except (CommError, MismatchedGatherError) as e:
            # Nothing was written into the slot (the gather is staged): it still holds what it held, a
            # gather for the next step landed there included; the step's own channel is untouched, so
            # _failed stays off and its gathers are still issued.
            self.state.set_state(slot, before)
            if isinstance(e, MismatchedGatherError):
                raise
            raise CommError(f"weight gather of layer {layer} failed on rank {self.comm.rank} (step {self.step}), "
                            f"outside the steps: {e}. Its slot was not written. A layer gathered outside the steps "
                            "needs the same call on every rank of the shard group") from e
        replaced = self.state.filled(slot, layer, self.step)
        if replaced is not None:  # a gather for the next step landed here: given up, the next step gathers it anew
            for p in self.plugins:
                p.ahead_cancelled(replaced)
        self.misses += 1
        self.gathers_total += 1

    def _gather_outside(self, layer: int, what: str) -> None:
        """Gather ``layer`` on the channel outside the steps, stamped ([Note: the stamp of a gather
        outside the steps] in :mod:`wsharding.core.stamp`)."""
        gather_stamped(self.comm, self.slots.full_buffer(layer), self.layers_chunk(layer), layer, self.step, what)

    def _warn(self, text: str, kind: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(f"{text} ([Note: checked at use]; shown once per reason; on_miss='raise' makes it an "
                          "error)", ScheduleMissWarning, stacklevel=5)

    def _refuse_thread(self, what: str) -> None:
        raise ConcurrentStepError(
            f"rank {self.comm.rank}: a thread {what} of this sharded model while another thread runs a step of it. "
            "The slots hold one layer set at a time, so two forwards would compute with each other's weights. Serve "
            "concurrent requests by batching them into one forward, or serialise the calls (one lock around "
            "model(...))")

    def _refuse_edited(self, layer: int) -> None:
        """A weight of ``layer`` was edited in place: give up the step cleanly and raise."""
        self.abort_step()
        refuse_edits(self.versions.edited(layer))
