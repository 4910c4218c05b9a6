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
* **Wait at most once.** ``wait_ready_once`` waits on a layer's gather once per step; later calls
  return at once.
* **Nothing decided inside forward.** Which layers are sharded, their slots, their gates, the events
  and the side stream are fixed at init; a step only replays the same launch/wait sequence, which is
  what a CUDA graph needs to capture it.
* **Lookahead off** (for comparison): every gather is issued at its layer's start -- on CUDA, ordered
  after everything the compute stream holds at that point -- and waited on at once, so its whole
  time is exposed.

On CPU ranks (gloo) the collective runs on gloo's own thread while the main thread computes, so the
overlap measured there is real, if small.

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

[Note: the hot path]
At decode sizes a layer computes for a fraction of a millisecond, so the host time the planner spends
per layer *is* the step time unless it is a few microseconds. Everything that can be decided is
decided at init: each layer's gather is a :class:`~wsharding.comm.base.PreparedGather` (pointers,
sizes, windows, events and streams converted once), its slot, its gate layer and the events. Per
layer the planner then does dict lookups and the few stream/event calls the data path needs; the
compute stream is looked up once per step; nothing waits for the GPU; errors the GPU side finds are
raised at the next call by the communicator (its watchdog), not polled for here.

[Note: backpressure]
The host never waits for the GPU inside a step, but across steps it must not run ahead forever: when
a peer goes missing, the copy-engine gather waits on the GPU for a flag the peer never writes, and
``ncclCommAbort`` does not release that wait (NCCL 2.28). A host that keeps issuing steps then fills
CUDA's launch queue and blocks inside a kernel launch, where no error can reach it -- a hang. So at
the start of step s the planner checks that the GPU has started step s-2 (an event recorded at every
step's fork, two in turn; one query, under a microsecond, when it has). When it has not, it polls
that event and the communicator's watchdog: the GPU catching up ends the wait, a watchdog error
raises it. Two steps of queued work are more than the GPU needs to stay busy.

[Note: the next step's first gather]
The first sharded layer of a step has no earlier layer to hide its gather behind: on two H200s at
2048 tokens per rank it stood exposed ~0.7 ms per step. In a loop of steps the previous step's last
layers are such cover, and the draft model of SGLang's weight sharding for Kimi K3 uses that region
for its own first layer. With ``prefetch_next_step`` (off by default) a step that ran every
sharded layer issues the *next* step's first gather when its last sharded layer starts, gated on
the end of the last layer that reads the same slot (held until that layer is done when it is the
running one). The next step finds it issued and only waits. The rules it keeps:

* every rank issues it at the same point (the same layer range, lookahead on, untraced), so the
  collectives stay aligned;
* a layer gathered again into that slot before the next step (a layer called on its own after the
  step) first joins the prefetch, then cancels it: the next step gathers its first layer anew;
* a CUDA graph replays alone, with nothing pending before it: no prefetch is issued under capture,
  and capturing a step that would consume one is refused (turn it off and run one eager step);
* it gathers the same slot as the draft's own first-layer prefetch, so the two are not combined.

[Note: in-place edits of bound weights]
A sharded weight is a view of its slot, and every gather of its layer refills the slot from the
chunks: an in-place edit after finalize (``weight.mul_(2)``, an optimizer step) is silently undone
by the layer's next gather -- and, made while the slot holds another layer, lands in that layer's
bytes. It cannot be written back to the chunks in general (the bytes it reached may be another
layer's), so it is refused. The Parameter keeps its own version counter, which only in-place ops
through it (or its views) move -- a gather writes the slot buffer, never the Parameter -- so each
layer's wait compares its weights' versions with those at finalize: one C-level map over the
layer's few weights per layer and step. The first computation that would use (or lose) the edit
is the layer's next one, which always goes through that wait: the refusal comes before it, on
every rank that made the edit, and stays (the layer is refused from then on: its Parameters no
longer say what it computes with). ``WeightSharding.full_state_dict`` refuses it too.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass

import torch

from wsharding.comm.base import CommError, Communicator, PreparedGather
from wsharding.errors import ShardingError
from wsharding.layout import FlatLayout
from wsharding.slots import SLOT_NAMES, SlotPool
from wsharding.trace import StepTrace

_version = operator.attrgetter("_version")


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
        prefetch_next_step: bool = False,
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
        self._gathers: dict[int, PreparedGather] = {
            i: comm.prepare_gather(
                slots.full_buffer(i), st.chunk,
                what=f"layer {i}: gather of {st.layout.total_bytes} B into slot {SLOT_NAMES[slots.slot_of(i)]}")
            for i, st in layers.items()
        }
        self._slot_of = {i: slots.slot_of(i) for i in layers}
        # [Note: in-place edits of bound weights]: each layer's bound weights and their versions now.
        # Read through detached aliases, which share the Parameter's version counter: a Parameter's
        # own ``_version`` goes through its ``__torch_function__`` check, several times slower. An
        # inference tensor has no version counter (and refuses in-place edits outside inference mode).
        tracked = {i: [(label, w) for label, w in st.weights if not w.is_inference()] for i, st in layers.items()}
        self._bound = {i: tuple(w.detach() for _, w in ws) for i, ws in tracked.items()}
        self._bound_labels = {i: tuple(label for label, _ in ws) for i, ws in tracked.items()}
        self._bound_versions = {i: tuple(map(_version, ws)) for i, ws in self._bound.items()}
        self._prev = {i: slots.previous_occupant(i) for i in layers}
        #: Layers that gate a later gather (the previous occupant of some layer's slot).
        self._gating = {p for p in self._prev.values() if p is not None}
        self._last_sharded = self.sharded_ids[-1] if self.sharded_ids else -1
        #: The last layer, in step order, that reads the first layer's slot: the next step's first
        #: gather may overwrite the slot once it is done ([Note: the next step's first gather]).
        self._wrap_gate = (max(i for i in layers if self._slot_of[i] == self._slot_of[self.sharded_ids[0]])
                           if self.sharded_ids else None)
        if self._wrap_gate is not None:
            # Its end is recorded every step (one event record), so that turning the prefetch on
            # between any two steps finds a gate of this step.
            self._gating.add(self._wrap_gate)
        #: [Note: the next step's first gather]: off by default.
        self.prefetch_next_step = prefetch_next_step
        self._next_first_step = -1  # the step for which the first layer's gather was issued early
        #: Next-step prefetches issued, and those cancelled by a layer gathered into their slot.
        self.next_step_prefetches = 0
        self.next_step_cancels = 0
        if self.cuda:
            from wsharding.comm.cuda_driver import driver

            self._cu = driver()
            self._fork = torch.cuda.Event()
            self._fork.record()  # created at its first record: the handle must exist
            self._fork_handle = self._fork.cuda_event
            #: Fork events of the last two steps, in turn ([Note: backpressure]).
            self._step_forks = (torch.cuda.Event(), torch.cuda.Event())
            for ev in self._step_forks:
                ev.record()
            self._done = {i: torch.cuda.Event() for i in self._gating}
            for ev in self._done.values():
                ev.record()  # torch creates the CUDA event at its first record: the handle must exist
            self._done_handle = {i: ev.cuda_event for i, ev in self._done.items()}
            self._here = torch.cuda.Event()  # the compute stream's position at a layer's start
            self._here.record()
            self._here_handle = self._here.cuda_event
        self._backpressure_step = -1
        self._compute: torch.cuda.Stream | None = None
        self._compute_handle = 0
        # Per-step state: the step in which each layer was issued / waited / finished (no clearing).
        self._issued: dict[int, int] = dict.fromkeys(layers, -1)
        self._waited: dict[int, int] = dict.fromkeys(layers, -1)
        self._finished: dict[int, int] = dict.fromkeys(layers, -1)
        self._held: dict[int, int] = {}  # gating layer -> layer whose gather waits for it
        self._step_start_layer = 0
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
            self._compute = torch.cuda.current_stream(self.device)
            self._compute_handle = self._compute.cuda_stream
        self.trace = StepTrace(self.step, self.comm.rank, self.cuda, self.device) if self.trace_enabled else None

    def pre_dispatch(self, start_layer: int, end_layer: int | None = None) -> None:
        """Issue the gather of the first sharded layer in ``[start_layer, end_layer)``.

        ``end_layer`` bounds the step: :meth:`maybe_dispatch` issues nothing at or past it, so a
        partial range never leaves a gather that nobody waits on (under CUDA-graph capture such a
        gather would be work the capture never joins). Every rank must use the same range.
        """
        self._step_start_layer = start_layer
        self._end_layer = end_layer
        self.comm.raise_if_failed(f"step {self.step + 1}")
        if self.cuda:
            if not torch.cuda.is_current_stream_capturing():
                self._backpressure()
            # Fork: the side streams must not overwrite a slot that the previous step's last layers
            # may still be reading on the compute stream (and under capture, they join the capture here).
            self._cu.event_record(self._fork_handle, self._compute_handle)
            self.comm.fork(self._fork)
        if self.trace is not None:
            self.trace.start()
        if self._next_first_step == self.step and self._issued[self.sharded_ids[0]] == self.step:
            self._take_next_step_prefetch(start_layer)
        if self.lookahead:
            first = next((i for i in self.sharded_ids if i >= start_layer), None)
            if first is not None and (end_layer is None or first < end_layer) and self._issued[first] != self.step:
                self._dispatch(first)

    def _backpressure(self) -> None:
        """[Note: backpressure]: wait (polling the watchdog) until the GPU has started step - 2."""
        if self._backpressure_step == self.step:
            return  # pre_dispatch called again in the same step: its event is this step's own
        self._backpressure_step = self.step
        ev = self._step_forks[self.step % 2]
        while True:
            try:
                if ev.query():
                    break
            except RuntimeError:
                break  # last recorded inside a CUDA-graph capture: it tells nothing about eager steps
            self.comm.raise_if_failed(f"step {self.step}: waiting for the GPU to reach step {self.step - 2}")
            time.sleep(2e-4)
        self._cu.event_record(ev.cuda_event, self._compute_handle)

    def maybe_dispatch(self, layer: int) -> None:
        """With lookahead, issue the gather of ``layer`` now (held back until its gate is done)."""
        if self.prefetch_next_step and layer > self._last_sharded and self._next_first_step <= self.step:
            self._prefetch_next_first()
            return
        if (not self.lookahead or self._issued.get(layer, self.step) == self.step
                or (self._end_layer is not None and layer >= self._end_layer) or layer in self._held.values()):
            return
        self._dispatch(layer)

    def wait_ready_once(self, layer: int) -> None:
        """At the start of ``layer``: make sure its weights are in its slot. Waits at most once per step.

        A layer called again after its slot was handed to another layer (for example one block run on
        its own after a step) gathers its weights again, so it never computes with another layer's
        weights. That gather is a collective like any other: every rank must make the same call.
        """
        waited = self._waited.get(layer)
        if waited is None:
            return  # not a sharded layer
        if waited == self.step:
            if self.slots.occupant[self._slot_of[layer]] != layer:
                self._regather(layer)
            if tuple(map(_version, self._bound[layer])) != self._bound_versions[layer]:
                self._refuse_edited(layer)
            return
        if self._issued[layer] != self.step:
            # Lookahead off, or a layer that was never dispatched: gather now and wait at once.
            self._release_if_held(layer)
            self._issue(layer, gated=True, here=True)
        self._waited[layer] = self.step
        self.waits_this_step += 1
        trace = self.trace
        if trace is not None:
            trace.mark(layer, "wait_start")
        try:
            self._gathers[layer].wait(self._compute)
        except CommError as e:
            raise CommError(self._stuck_message(layer, e)) from e
        self.slots.occupant[self._slot_of[layer]] = layer
        if tuple(map(_version, self._bound[layer])) != self._bound_versions[layer]:
            self._refuse_edited(layer)
        if trace is not None:
            trace.mark(layer, "wait_end")
            trace.mark(layer, "compute_start")

    def update_done_event(self, layer: int, module: torch.nn.Module | None = None) -> None:
        """After ``layer`` ran: record that its slot may be overwritten; release a held gather."""
        if layer not in self._finished:
            return
        self._finished[layer] = self.step
        if self.cuda and layer in self._gating:
            self._cu.event_record(self._done_handle[layer], self._compute_handle)
        if self.trace is not None:
            self.trace.mark(layer, "compute_end")
        if self._held:
            waiting = self._held.pop(layer, None)
            if waiting is not None:
                if waiting == self.sharded_ids[0] and self._next_first_step == self.step + 1:
                    self._issue_next_first()  # the first layer is never held within its own step
                else:
                    self._issue(waiting, gated=True)

    # ---- internals -------------------------------------------------------------------------------
    def _gate_open(self, layer: int) -> bool:
        prev = self._prev[layer]
        # A layer before this step's first layer ran in an earlier step: finished (CPU) or ordered
        # by the fork event (CUDA).
        return prev is None or prev < self._step_start_layer or self._finished[prev] == self.step

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
        g = self._gathers[layer]
        prev = self._prev[layer]
        if self.cuda and here:
            # Issued at the layer's own start (lookahead off): the gather waits for everything queued
            # on the compute stream so far, so it starts when the GPU reaches this layer. Gated only on
            # the slot's previous reader, it would start as soon as that layer ended -- with a host
            # that runs ahead of the GPU, that *is* lookahead, and "off" would measure nothing.
            self._cu.event_record(self._here_handle, self._compute_handle)
            gate = self._here
        else:
            # CUDA: the gather waits for the end of the layer that last read this slot, when that layer
            # ran in this step (earlier steps are ordered by the fork).
            gate = (self._done[prev] if self.cuda and gated and prev is not None and prev >= self._step_start_layer
                    else None)
        trace = self.trace
        marks = None
        if trace is not None:
            trace.mark(layer, "issue")
            trace.set_slot(layer, SLOT_NAMES[self._slot_of[layer]])
            if self.cuda:
                marks = (trace.event(layer, "gather_start"), trace.event(layer, "gather_end"))
            else:
                trace.mark(layer, "gather_start")
        try:
            if self.cuda and not gated and not self.gate:
                # Gate off (the race demonstration only): issue from a side stream that waits for nothing.
                with torch.cuda.stream(self.slots_side_stream()):
                    g.start(None, marks)
            else:
                # Waited on at once (lookahead off): handing it to an issue thread would only add its wake-up.
                g.start(gate, marks, inline=here)
        except CommError as e:
            raise CommError(self._stuck_message(layer, e)) from e
        if trace is not None and not self.cuda:
            when = time.perf_counter
            add = getattr(g, "add_done_callback", None)
            if add is not None:
                add(lambda: trace.mark(layer, "gather_end", when()))
            else:
                trace.mark(layer, "gather_end")
        self._issued[layer] = self.step
        self.slots.occupant[self._slot_of[layer]] = None  # receiving: no layer may compute from it yet
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
        self._cancel_next_step_prefetch(self._slot_of[layer])
        if self.cuda:
            self._compute = torch.cuda.current_stream(self.device)
            self._compute_handle = self._compute.cuda_stream
            self._fork.record(self._compute)
            self.comm.fork(self._fork)  # everything queued so far may read the slot: wait for it
        g = self._gathers[layer]
        try:
            g.start(None, None)
            g.wait(self._compute)
        except CommError as e:
            raise CommError(self._stuck_message(layer, e)) from e
        self.slots.occupant[self._slot_of[layer]] = layer
        self.regathers += 1
        self.gathers_total += 1

    def edited_weights(self) -> list[str]:
        """``"<label> on rank r was changed in place after finalize (version a -> b)"`` for every bound
        weight edited in place since finalize ([Note: in-place edits of bound weights])."""
        rank = self.comm.rank
        return [f"{label} on rank {rank} was changed in place after finalize (version {v0} -> {w._version})"
                for i in self.sharded_ids
                for label, w, v0 in zip(self._bound_labels[i], self._bound[i], self._bound_versions[i], strict=True)
                if w._version != v0]

    def _refuse_edited(self, layer: int) -> None:
        """A weight of ``layer`` was edited in place: give up the step cleanly and raise."""
        self.join_pending()
        edited = [e for e in self.edited_weights() if e.startswith(f"layer {layer} ")]
        raise ShardingError(edited_message(edited))

    def join_pending(self) -> None:
        """Wait for every gather this rank issued in this step (or for the next one) that no layer
        has waited on: a step given up by an exception (a guard's refusal) must leave no gather that
        could land in a slot during a later step. The ranks that give up the step at the same point
        issued the same gathers, so this waits only for gathers that complete."""
        stream = self._compute if self.cuda else None
        for layer, g in self._gathers.items():
            if self._issued[layer] >= self.step and self._issued[layer] != self._waited[layer]:
                g.wait(stream)
                self._issued[layer] = -1  # the slot holds it, but no layer may count on that
        self._held.clear()
        if self._next_first_step > self.step:
            self._next_first_step = -1

    def _stuck_message(self, layer: int, err: Exception) -> str:
        return (
            f"weight gather of layer {layer} failed on rank {self.comm.rank} (step {self.step}): {err}. "
            f"Every rank of the shard group ({self.comm.world_size} ranks) must issue the same gathers "
            "every step: a rank that skips a step (for example because it has no tokens) leaves the "
            "others waiting. Run a one-token dummy step on idle ranks (wsharding.runner.aligned_forward)."
        )

    def finish_step(self) -> StepTrace | None:
        """Close the step's trace (on CUDA: synchronise and resolve the events) and return it."""
        if self.trace is None:
            return None
        self.trace.finish()
        done = self.trace
        self.traces.append(done)
        self.trace = None
        return done

    @property
    def prepared_gathers(self) -> dict[int, PreparedGather]:
        """Each sharded layer's prepared gather (read-only use: counters, benchmarks)."""
        return dict(self._gathers)

    def close(self) -> None:
        """Refuse every later step (the sharding freed the slots and chunks)."""
        if self._next_first_step > self.step:  # a next-step prefetch in flight must not write into freed memory
            self._gathers[self.first_layer].wait(torch.cuda.current_stream(self.device) if self.cuda else None)
            if self.cuda:
                torch.cuda.synchronize(self.device)
        for g in self._gathers.values():
            close = getattr(g, "close", None)  # optional in the protocol (base.py)
            if close is not None:
                close()  # a captured gather graph goes before the windows it references
        self.closed = True
        self._gathers.clear()
        # the aliases of the bound weights view the slots: nothing may keep those alive
        self._bound = dict.fromkeys(self._bound, ())
        self._bound_labels = dict.fromkeys(self._bound, ())
        self._bound_versions = dict.fromkeys(self._bound, ())

    # ---- the next step's first gather ([Note: the next step's first gather]) -------------------------
    def _prefetch_next_first(self) -> None:
        """Called once the last sharded layer starts: issue (or hold) the next step's first gather."""
        first = self.sharded_ids[0]
        if (not self.lookahead or not self.gate or self.trace is not None or self._step_start_layer > first
                or self._issued[self._last_sharded] != self.step or self._first_handle is not None
                or (self.cuda and torch.cuda.is_current_stream_capturing())):
            return
        self._next_first_step = self.step + 1
        if self._finished[self._wrap_gate] != self.step:
            self._held[self._wrap_gate] = first  # the slot's last reader is the running layer
            return
        self._issue_next_first()

    def _issue_next_first(self) -> None:
        first = self.sharded_ids[0]
        gate = self._done[self._wrap_gate] if self.cuda else None
        try:
            self._gathers[first].start(gate, None)
        except CommError as e:
            raise CommError(self._stuck_message(first, e)) from e
        self._issued[first] = self.step + 1
        self.slots.occupant[self._slot_of[first]] = None  # receiving
        self.next_step_prefetches += 1
        self.gathers_total += 1

    def _take_next_step_prefetch(self, start_layer: int) -> None:
        """pre_dispatch of a step whose first gather the previous step issued."""
        first = self.sharded_ids[0]
        if self.cuda and torch.cuda.is_current_stream_capturing():
            raise CommError(
                f"layer {first}: its gather for this step was issued by the previous eager step "
                f"(prefetch_next_step) on rank {self.comm.rank}; a CUDA graph must hold every gather it "
                "waits on. Set planner.prefetch_next_step = False and run one eager step before capturing.")
        self._next_first_step = -1  # taken: this step's end may issue the next one
        if start_layer > first:  # this step does not use it: join it, so nothing is left in flight
            self._gathers[first].wait(self._compute if self.cuda else None)
            self._issued[first] = -1
            return
        self.gathers_this_step += 1

    def _cancel_next_step_prefetch(self, slot: int) -> None:
        """A gather into ``slot`` before the next step: join the pending prefetch into it, and let
        the next step gather its first layer anew."""
        first = self.sharded_ids[0] if self.sharded_ids else None
        if first is None or self._issued[first] != self.step + 1 or self._slot_of[first] != slot:
            return
        self._gathers[first].wait(self._compute if self.cuda else None)
        self._issued[first] = -1
        self._next_first_step = -1
        self.next_step_cancels += 1

    # ---- the first layer of a model with no layer before it (the draft model) -------------------------
    # [Note: the draft's first layer]
    # A draft model runs right after the target model. Its first sharded layer has no previous layer
    # whose compute could hide its gather, so (the weight-sharding design, "CUDA graph 与 draft 模型")
    # that gather is issued *before* the draft's step, on a dedicated stream, during the region between
    # the two models (the design's ~4 ms commit step), and outside the draft's CUDA graph:
    #
    #     target(tokens)
    #     draft.planner.prefetch_first_weight_shard()   # dedicated stream, forked from the compute stream
    #     commit()                                      # any work that is not a layer
    #     draft.planner.wait_first_weight_shard()       # compute stream waits; cold start: gathers now
    #     draft(tokens)                                 # reset, pre_dispatch_after_prefetch, the layers
    #
    # Why not the shared side stream: there it queues behind the target model's gathers (the design
    # saw ~25 us of overlap). The fork orders the prefetch after everything already queued on the compute
    # stream -- the previous draft step, which may still read the slot it overwrites, included. On CPU
    # ranks the same calls hold an async gloo handle, waited on by ``wait_first_weight_shard``.
    _first_handle = None
    _first_armed = False
    _first_stream: torch.cuda.Stream | None = None
    _first_ready: torch.cuda.Event | None = None
    #: Prefetches issued, and cold starts (``wait_first_weight_shard`` with nothing prefetched: inline).
    first_prefetches = 0
    cold_starts = 0

    @property
    def first_layer(self) -> int:
        """The first sharded layer: the one :meth:`prefetch_first_weight_shard` gathers."""
        return self.sharded_ids[0]

    def first_stream(self) -> torch.cuda.Stream:
        """The dedicated stream of the first layer's prefetch (CUDA), created once, outside any step."""
        if self._first_stream is None:
            self._first_stream = torch.cuda.Stream(self.device)
        return self._first_stream

    def prefetch_first_weight_shard(self, stream: torch.cuda.Stream | None = None, *, fork: bool = True) -> None:
        """Issue the gather of the first sharded layer now, ahead of the step that uses it.

        CUDA: on ``stream`` (default: :meth:`first_stream`, dedicated; passing the stream the target's
        gathers use shows why not to), after a fork from the current stream; never waits on the host.
        CPU: an async gloo collective. Call it outside any CUDA graph; every rank must call it at the
        same point. ``fork=False`` is only for demonstrating the race the fork prevents.
        """
        if self.closed:
            raise PlannerClosedError("prefetch_first_weight_shard(): this weight sharding was closed")
        if self.prefetch_next_step:
            raise CommError("prefetch_first_weight_shard(): this planner already gathers its first layer ahead "
                            "(prefetch_next_step = True); use one of the two, on every rank the same")
        first = self.first_layer
        if self._first_handle is not None:
            raise CommError(f"layer {first}: prefetch_first_weight_shard() called twice on rank {self.comm.rank} "
                            "before wait_first_weight_shard(): one prefetch per draft step (every rank the same)")
        self.comm.raise_if_failed(f"prefetch of layer {first}")
        st, full = self.layers[first], self.slots.full_buffer(first)
        what = f"layer {first}: prefetch of {st.layout.total_bytes} B into slot {SLOT_NAMES[self._slot_of[first]]}"
        self.slots.occupant[self._slot_of[first]] = None  # receiving
        try:
            if not self.cuda:
                self._first_handle = self.comm.all_gather_into(full, st.chunk, async_op=True, what=what)
            else:
                s = stream if stream is not None else self.first_stream()
                if fork:
                    s.wait_stream(torch.cuda.current_stream(self.device))
                if self._first_ready is None:
                    self._first_ready = torch.cuda.Event()
                with torch.cuda.stream(s):  # issued from s itself: no backend adds a wait on another stream
                    own_stream = self.comm.copy_stream is not None
                    if own_stream:
                        # Our NCCL binding gathers on the stream it is given; in place, like its
                        # prepared gathers: this rank's chunk goes into its slice of the slot first.
                        n = st.chunk.numel()
                        own = full.narrow(0, self.comm.rank * n, n)
                        own.copy_(st.chunk)
                        handle = self.comm.all_gather_into(full, own, async_op=True, stream=s, what=what)
                    else:
                        # torch.distributed runs the collective on its own stream, ordered after s;
                        # waiting here orders s after it.
                        handle = self.comm.all_gather_into(full, st.chunk, async_op=True, what=what)
                        handle.wait()
                self._first_ready.record(s)
                self._first_handle = handle
        except CommError as e:
            raise CommError(self._stuck_message(first, e)) from e
        self.first_prefetches += 1
        self.gathers_total += 1

    def wait_first_weight_shard(self) -> None:
        """Make the first layer's weights ready before the step: CUDA, the current stream waits for
        the prefetch (no host wait); CPU, block on it. With nothing prefetched (a cold start) the
        gather is issued now and waited on at once: inline, its whole time exposed."""
        first = self.first_layer
        if self._first_handle is None:
            self.cold_starts += 1
            self.prefetch_first_weight_shard()
        handle, self._first_handle = self._first_handle, None
        try:
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_event(self._first_ready)
            else:
                handle.wait()
        except CommError as e:
            raise CommError(self._stuck_message(first, e)) from e
        self.slots.occupant[self._slot_of[first]] = first
        self._first_armed = True

    def pre_dispatch_after_prefetch(self, start_layer: int, end_layer: int | None = None) -> None:
        """:meth:`pre_dispatch` of a step whose first sharded layer was made ready by
        :meth:`wait_first_weight_shard`: the fork and the step's start, without issuing that layer's
        gather again; it counts as this step's gather and wait of the layer. A prefetch nobody waited
        on is waited on here; with none at all (or a step that starts past the first layer) this is
        plain :meth:`pre_dispatch`, the inline path."""
        first = self.first_layer
        if self._first_handle is not None:
            self.wait_first_weight_shard()
        if not self._first_armed or start_layer > first or (end_layer is not None and end_layer <= first):
            self.pre_dispatch(start_layer, end_layer)
            return
        self._first_armed = False
        lookahead, self.lookahead = self.lookahead, False
        try:
            self.pre_dispatch(start_layer, end_layer)  # fork and trace start, nothing issued
        finally:
            self.lookahead = lookahead
        self._issued[first] = self._waited[first] = self.step
        self.gathers_this_step += 1
        self.waits_this_step += 1
        self.slots.occupant[self._slot_of[first]] = first
        if self.trace is not None:
            for kind in ("wait_start", "wait_end", "compute_start"):
                self.trace.mark(first, kind)  # the wait happened before the step, outside it


def edited_message(edited: list[str]) -> str:
    """The refusal of weights edited in place after finalize (``edited``: lines of
    :meth:`WeightShardPlanner.edited_weights`)."""
    return (f"{'; '.join(edited)}: a sharded weight is a view of a gather slot that every gather of its layer "
            "refills from the resident chunks, so the edit is silently undone, and it cannot be written back to "
            "the chunks. Change weights before finalize, or take WeightSharding.full_state_dict(model) on every "
            "rank of the shard group, change the copy, and load it into a freshly built model that you shard "
            "again. The layer is refused from now on")
