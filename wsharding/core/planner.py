"""The lookahead planner: gather layer l+1 while layer l computes, into the other slot.

The runner's layer loop (the sequence of SGLang's weight sharding for Kimi K3)::

    planner.reset()
    planner.pre_dispatch(start_layer)
    for i in range(start_layer, end_layer):
        planner.maybe_dispatch(i + 1)      # gather of i+1 on the side, gated on done(i-1)
        planner.wait_ready_once(i)         # at the start of layer i (the layer calls it)
        hidden = layers[i](hidden)
        planner.update_done_event(i, layers[i])

Rules it keeps:

* **Two slots, one gate.** The gather of layer l+1 writes the slot that layer l-1 used, so it starts
  only once layer l-1 has finished reading it ([Note: the gate]).
* **Wait at most once.** ``wait_ready_once`` waits on a layer's gather once per step.
* **Nothing decided inside forward.** Which layers are sharded, their slots, their gates, the events
  and the side stream are fixed at init; a step only replays the same launch/wait sequence, which is
  what a CUDA graph needs to capture it.
* **Lookahead off** (for comparison): every gather is issued at its layer's start and waited on at
  once, so its whole time is exposed. On CPU ranks gloo gathers on its own thread: overlap is real.
* **Plug-ins** (:class:`~wsharding.core.plugins.PlannerPlugin`) issue what lies outside the sequence.

[Note: the gate]
The sharded layers take slots A and B in turn, so the gather of layer l+1 overwrites the weights that
layer l-1 computes with. Started any earlier than the end of layer l-1, it would replace them while
l-1 still reads them -- on the GPU a silent race, the layer computing with half of the next layer's
bytes. So every gather has a gate: the end of the slot's previous occupant
(``SlotPool.previous_occupant``), fixed at init. On CUDA the gate is an event recorded on the compute
stream after that layer and waited on by the gather's stream, so the host never waits for it; on CPU
a gather whose gate is not yet done is held back and issued by ``update_done_event`` of the gating
layer. A previous occupant that ran in an earlier step needs no gate: the step's fork orders the
gather after it. Slots whose layer views are mapped keep the rule as it is: the layers of one parity
map the same slot pages. ``gate=False`` exists only to show the race.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from wsharding.core.backpressure import StepBackpressure
from wsharding.core.comm import CommError, Communicator, PreparedGather
from wsharding.core.edits import BoundVersions, refuse_edits, version_of
from wsharding.core.layout import FlatLayout
from wsharding.core.slots import SLOT_NAMES, SlotPool
from wsharding.core.trace import StepTrace


@dataclass
class ShardedLayer:
    """What the planner needs of one sharded layer: its layout and this rank's resident chunk."""

    layer: int
    layout: FlatLayout
    chunk: torch.Tensor
    #: ``(label, weight)`` of the weights bound to the layer's slot views, whose version counters
    #: its waits check ([Note: in-place edits of bound weights]).
    weights: tuple[tuple[str, torch.Tensor], ...] = ()


class PlannerClosedError(CommError):
    """The planner's weight sharding was closed: its slots and chunks are gone."""


class WeightShardPlanner:
    """Issues and waits on the per-layer gathers of one model's sharded layers."""

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
    ) -> None:
        self.comm = comm
        self.layers = layers
        self.slots = slots
        self.lookahead = lookahead
        #: Only for demonstrating the race the gate prevents: never turn it off for real use.
        self.gate = gate
        self.sharded_ids = sorted(layers)
        self.device = comm.device
        self.cuda = self.device.type == "cuda"
        # Everything a layer's gather needs, worked out once ([Note: the hot path]).
        self.gathers: dict[int, PreparedGather] = {
            i: comm.prepare_gather(
                slots.full_buffer(i), st.chunk,
                what=f"layer {i}: gather of {st.layout.total_bytes} B into slot {SLOT_NAMES[slots.slot_of(i)]}")
            for i, st in layers.items()
        }
        self.slot_of = {i: slots.slot_of(i) for i in layers}
        # [Note: in-place edits of bound weights]: each layer's bound weights and their versions now.
        self.versions = BoundVersions({i: st.weights for i, st in layers.items()}, comm.rank)
        self._bound, self._bound_versions = self.versions.aliases, self.versions.at_finalize
        self._prev = {i: slots.previous_occupant(i) for i in layers}
        #: Layers that gate a later gather (the previous occupant of some layer's slot).
        self._gating = {p for p in self._prev.values() if p is not None}
        self.last_sharded = self.sharded_ids[-1] if self.sharded_ids else -1
        if self.cuda:
            self._fork = torch.cuda.Event()
            self._fork.record()
            self._step_forks = StepBackpressure(comm)  # [Note: backpressure]
            self._done = {i: self._new_event() for i in self._gating}
            self._here = self._new_event()  # the compute stream's position at a layer's start
        self._record = comm.record_event  # once: it is called per layer
        self.compute: torch.cuda.Stream | None = None
        # Per-step state: the step in which each layer was issued / waited / finished (no clearing).
        self.issued: dict[int, int] = dict.fromkeys(layers, -1)
        self.waited: dict[int, int] = dict.fromkeys(layers, -1)
        self.finished: dict[int, int] = dict.fromkeys(layers, -1)
        self._held: dict[int, int] = {}  # gating layer -> layer whose gather waits for it
        self.step_start_layer = 0
        self._end_layer: int | None = None
        self.trace_enabled = trace
        self.trace: StepTrace | None = None
        self.traces: list[StepTrace] = []
        self.step = -1
        self.closed = False
        #: Gathers issued in the current step and in total (one per sharded layer per step).
        self.gathers_this_step = 0
        self.gathers_total = 0
        self.waits_this_step = 0
        #: Gathers issued again for a layer called after its slot was given to another layer.
        self.regathers = 0
        #: What issues gathers outside the layer sequence (:class:`~wsharding.core.plugins.PlannerPlugin`,
        #: which knows the planner; the planner only calls its hooks), in call order.
        self.plugins: list[Any] = []
        for plugin in plugins:
            self.add_plugin(plugin)

    def _new_event(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record()  # torch creates the CUDA event at its first record
        return ev

    def add_plugin(self, plugin: Any) -> None:
        """Attach ``plugin``: from the next step on it is called at the planner's hooks. Every rank of
        the shard group must attach the same plug-ins (they issue collectives)."""
        if plugin.claims_first_layer and any(p.claims_first_layer for p in self.plugins):
            other = next(type(p).__name__ for p in self.plugins if p.claims_first_layer)
            raise CommError(f"{type(plugin).__name__}: this planner already gathers its first layer ahead ({other}); "
                            "use one of the two, on every rank the same")
        plugin.attach(self)
        self.plugins.append(plugin)

    def track_done(self, layer: int) -> None:
        """Record the end of ``layer`` every step from now on (a plug-in gates a gather on it)."""
        if layer not in self._gating:
            self._gating.add(layer)
            if self.cuda:
                self._done[layer] = self._new_event()

    def done_event(self, layer: int) -> torch.cuda.Event | None:
        """CUDA: the event recorded at the end of ``layer`` (one that :meth:`track_done` or a gate
        tracks); None on CPU."""
        return self._done[layer] if self.cuda else None

    # ---- the sequence ----------------------------------------------------------------------------
    def reset(self) -> None:
        """Start a step: forget which gathers were issued and waited on."""
        if self.closed:
            raise PlannerClosedError("this weight sharding was closed (WeightSharding.close()): its slots and "
                                     "chunks are freed; build and shard the model again to run it")
        if self.trace is not None:
            self.traces.append(self.trace)
        self.step += 1
        self._held.clear()
        self.gathers_this_step = 0
        self.waits_this_step = 0
        if self.cuda:
            # Once per step (6.6 us on an H200), not once per layer.
            self.compute = torch.cuda.current_stream(self.device)
        self.trace = StepTrace(self.step, self.comm.rank, self.cuda, self.device) if self.trace_enabled else None

    def pre_dispatch(self, start_layer: int, end_layer: int | None = None) -> None:
        """Issue the gather of the first sharded layer in ``[start_layer, end_layer)``.

        ``end_layer`` bounds the step: :meth:`maybe_dispatch` issues nothing at or past it, so a
        partial range never leaves a gather that nobody waits on (under CUDA-graph capture such a
        gather would be work the capture never joins). Every rank must use the same range.
        """
        self.step_start_layer = start_layer
        self._end_layer = end_layer
        self.comm.raise_if_failed(f"step {self.step + 1}")
        if self.cuda:
            if not torch.cuda.is_current_stream_capturing():
                self._backpressure()
            # Fork: the side streams must not overwrite a slot that the previous step's last layers
            # may still be reading on the compute stream (and under capture, they join the capture here).
            self._record(self._fork, self.compute)
            self.comm.fork(self._fork)
        if self.trace is not None:
            self.trace.start()
        for plugin in self.plugins:
            plugin.step_start(self, start_layer)
        if self.lookahead:
            first = next((i for i in self.sharded_ids if i >= start_layer), None)
            if first is not None and (end_layer is None or first < end_layer) and self.issued[first] != self.step:
                self._dispatch(first)

    def _backpressure(self) -> None:  # [Note: backpressure]: the one host wait of a step
        self._step_forks.wait(self.step, self.compute)

    def maybe_dispatch(self, layer: int) -> None:
        """With lookahead, issue the gather of ``layer`` now (held back until its gate is done)."""
        if layer > self.last_sharded and self.plugins:
            for plugin in self.plugins:
                plugin.after_last_dispatch(self)
            return
        if (not self.lookahead or self.issued.get(layer, self.step) == self.step
                or (self._end_layer is not None and layer >= self._end_layer) or layer in self._held.values()):
            return
        self._dispatch(layer)

    def wait_ready_once(self, layer: int) -> None:
        """At the start of ``layer``: make sure its weights are in its slot. Waits at most once per step.

        A layer called again after its slot was handed to another layer (for example one block run on
        its own after a step) gathers its weights again, so it never computes with another layer's
        weights. That gather is a collective like any other: every rank must make the same call.
        """
        waited = self.waited.get(layer)
        if waited is None:
            return  # not a sharded layer
        if waited == self.step:
            if self.slots.occupant[self.slot_of[layer]] != layer:
                self._regather(layer)
            if tuple(map(version_of, self._bound[layer])) != self._bound_versions[layer]:
                self._refuse_edited(layer)
            return
        if self.issued[layer] != self.step:
            # Lookahead off, or a layer that was never dispatched: gather now and wait at once.
            self._release_if_held(layer)
            self._issue(layer, gated=True, here=True)
        self.waited[layer] = self.step
        self.waits_this_step += 1
        trace = self.trace
        if trace is not None:
            trace.mark(layer, "wait_start")
        try:
            self.gathers[layer].wait(self.compute)
        except CommError as e:
            raise CommError(self.stuck_message(layer, e)) from e
        self.slots.occupant[self.slot_of[layer]] = layer
        if tuple(map(version_of, self._bound[layer])) != self._bound_versions[layer]:
            self._refuse_edited(layer)
        if trace is not None:
            trace.mark(layer, "wait_end")
            trace.mark(layer, "compute_start")

    def update_done_event(self, layer: int, module: torch.nn.Module | None = None) -> None:
        """After ``layer`` ran: record that its slot may be overwritten; release a held gather."""
        if layer not in self.finished:
            return
        self.finished[layer] = self.step
        if self.cuda and layer in self._gating:
            self._record(self._done[layer], self.compute)
        if self.trace is not None:
            self.trace.mark(layer, "compute_end")
        if self._held:
            waiting = self._held.pop(layer, None)
            if waiting is not None:
                self._issue(waiting, gated=True)
        if self.plugins:
            for plugin in self.plugins:
                plugin.layer_done(self, layer)

    # ---- internals -------------------------------------------------------------------------------
    def _gate_open(self, layer: int) -> bool:
        prev = self._prev[layer]
        # A layer before this step's first layer ran in an earlier step: finished (CPU) or ordered
        # by the fork event (CUDA).
        return prev is None or prev < self.step_start_layer or self.finished[prev] == self.step

    def _dispatch(self, layer: int) -> None:
        if self.gate and not self._gate_open(layer):
            self._held[self._prev[layer]] = layer
            if self.trace is not None:
                self.trace.mark(layer, "held")
            return
        self._issue(layer, gated=self.gate)

    def _release_if_held(self, layer: int) -> None:
        for gate_layer, held in list(self._held.items()):
            if held == layer:
                del self._held[gate_layer]

    def _issue(self, layer: int, gated: bool, here: bool = False) -> None:
        g = self.gathers[layer]
        prev = self._prev[layer]
        if self.cuda and here:
            # Issued at the layer's own start (lookahead off): the gather waits for everything queued
            # on the compute stream so far, so it starts when the GPU reaches this layer. Gated only on
            # the slot's previous reader, it would start as soon as that layer ended -- with a host
            # that runs ahead of the GPU, that *is* lookahead, and "off" would measure nothing.
            self._record(self._here, self.compute)
            gate = self._here
        else:
            # CUDA: the gather waits for the end of the layer that last read this slot, when that layer
            # ran in this step (earlier steps are ordered by the fork).
            gate = (self._done[prev] if self.cuda and gated and prev is not None and prev >= self.step_start_layer
                    else None)
        trace = self.trace
        marks = trace.gather_issued(layer, SLOT_NAMES[self.slot_of[layer]]) if trace is not None else None
        try:
            if self.cuda and not gated and not self.gate:
                # Gate off (the race demonstration only): issue from a side stream that waits for nothing.
                with torch.cuda.stream(self.slots_side_stream()):
                    g.start(None, marks)
            else:
                # Waited on at once (lookahead off): handing it to an issue thread would only add its wake-up.
                g.start(gate, marks, inline=here)
        except CommError as e:
            raise CommError(self.stuck_message(layer, e)) from e
        if trace is not None and not self.cuda:
            g.add_done_callback(lambda: trace.mark(layer, "gather_end", time.perf_counter()))
        self.issued[layer] = self.step
        self.slots.occupant[self.slot_of[layer]] = None  # receiving: no layer may compute from it yet
        self.gathers_this_step += 1
        self.gathers_total += 1

    def slots_side_stream(self) -> torch.cuda.Stream:
        """A stream that waits for nothing (gate-off demonstration with a backend that gathers from
        the current stream)."""
        if getattr(self, "_free_stream", None) is None:
            self._free_stream = torch.cuda.Stream(self.device)
        return self._free_stream

    def _regather(self, layer: int) -> None:
        """Gather ``layer`` again, now, after its slot was given to another layer."""
        for plugin in self.plugins:
            plugin.before_regather(self, self.slot_of[layer])
        if self.cuda:
            self.compute = torch.cuda.current_stream(self.device)
            self._fork.record(self.compute)
            self.comm.fork(self._fork)  # everything queued so far may read the slot: wait for it
        g = self.gathers[layer]
        try:
            g.start(None, None)
            g.wait(self.compute)
        except CommError as e:
            raise CommError(self.stuck_message(layer, e)) from e
        self.slots.occupant[self.slot_of[layer]] = layer
        self.regathers += 1
        self.gathers_total += 1

    def _refuse_edited(self, layer: int) -> None:
        """A weight of ``layer`` was edited in place: give up the step cleanly and raise."""
        self.join_pending()
        refuse_edits(self.versions.edited(layer))

    def join_pending(self) -> None:
        """Wait for every gather this rank issued in this step (or for the next one) that no layer
        has waited on: a step given up by an exception (a guard's refusal) must leave no gather that
        could land in a slot during a later step. The ranks that give up the step at the same point
        issued the same gathers, so this waits only for gathers that complete."""
        stream = self.compute if self.cuda else None
        for layer, g in self.gathers.items():
            if self.issued[layer] >= self.step and self.issued[layer] != self.waited[layer]:
                g.wait(stream)
                self.issued[layer] = -1  # the slot holds it, but no layer may count on that
        self._held.clear()
        for plugin in self.plugins:
            plugin.join(self)

    def stuck_message(self, layer: int, err: Exception) -> str:
        return (f"weight gather of layer {layer} failed on rank {self.comm.rank} (step {self.step}): {err}. Every "
                f"rank of the shard group ({self.comm.world_size} ranks) must issue the same gathers every step: a "
                "rank that skips a step (for example because it has no tokens) leaves the others waiting. Run a "
                "one-token dummy step on idle ranks (wsharding.core.runner.aligned_forward).")

    def finish_step(self) -> StepTrace | None:
        """Close the step's trace (on CUDA: synchronise and resolve the events) and return it."""
        done, self.trace = self.trace, None
        if done is not None:
            done.finish()
            self.traces.append(done)
        return done

    def close(self) -> None:
        """Refuse every later step (the sharding freed the slots and chunks)."""
        for plugin in self.plugins:
            plugin.close(self)  # a gather in flight must not write into freed memory
        for g in self.gathers.values():
            g.close()  # a captured gather graph goes before the windows it references
        self.closed = True
        self.gathers.clear()
        # the aliases of the bound weights view the slots: nothing may keep those alive
        self.versions.release()
        self._bound, self._bound_versions = self.versions.aliases, self.versions.at_finalize
