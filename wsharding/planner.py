"""The lookahead planner: gather layer l+1 while layer l computes, into the other slot.

The runner's layer loop (the first seed's sequence)::

    planner.reset()
    planner.pre_dispatch(start_layer)
    for i in range(start_layer, end_layer):
        planner.maybe_dispatch(i + 1)      # gather of i+1 on the side, gated on done(i-1)
        planner.wait_ready_once(i)         # at the start of layer i (the layer calls it)
        hidden = layers[i](hidden)
        planner.update_done_event(i, layers[i])

Rules it keeps:

* **Two slots, one gate.** The gather of layer l+1 writes the slot that layer l-1 used. It may only
  start once layer l-1 has finished reading it (the gate). On CUDA the gate is an event recorded on
  the compute stream after layer l-1, waited on by the side stream; on CPU a gather whose gate is not
  yet done is held back and issued by ``update_done_event`` of the gating layer.
* **Wait at most once.** ``wait_ready_once`` waits on a layer's gather once per step; later calls
  return at once.
* **Nothing decided inside forward.** Which layers are sharded, their slots, their gates, the events
  and the side stream are fixed at init; a step only replays the same launch/wait sequence, which is
  what a CUDA graph needs to capture it.
* **Lookahead off** (for comparison): every gather is issued at its layer's start and waited on at
  once, so its whole time is exposed.

On CPU ranks (gloo) the collective runs on gloo's own thread while the main thread computes, so the
overlap measured there is real, if small.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from wsharding.comm.base import CommError, Communicator, GatherHandle
from wsharding.layout import FlatLayout
from wsharding.slots import SLOT_NAMES, SlotPool
from wsharding.trace import StepTrace


@dataclass
class ShardedLayer:
    """What the planner needs of one sharded layer: its layout and this rank's resident chunk."""

    layer: int
    layout: FlatLayout
    chunk: torch.Tensor


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
        if self.cuda:
            # A backend may bring its own stream (our NCCL binding gathers on a created stream).
            self.side_stream = getattr(comm, "stream", None) or torch.cuda.Stream(self.device)
            self._fork = torch.cuda.Event()
            self._ready = {i: torch.cuda.Event() for i in self.sharded_ids}
            self._done = {i: torch.cuda.Event() for i in self.sharded_ids}
        self._handles: dict[int, GatherHandle] = {}
        self._waited: set[int] = set()
        self._finished: set[int] = set()
        self._held: dict[int, int] = {}  # gating layer -> layer whose gather waits for it
        self._step_start_layer = 0
        self.trace_enabled = trace
        self.trace: StepTrace | None = None
        self.traces: list[StepTrace] = []
        self.step = -1
        #: Gathers issued in the current step and in total (one per sharded layer per step).
        self.gathers_this_step = 0
        self.gathers_total = 0
        self.waits_this_step = 0

    # ---- the sequence ----------------------------------------------------------------------------
    def reset(self) -> None:
        """Start a step: forget which gathers were issued and waited on."""
        if self.trace is not None:
            self.traces.append(self.trace)
        self.step += 1
        self._handles.clear()
        self._waited.clear()
        self._finished.clear()
        self._held.clear()
        self.gathers_this_step = 0
        self.waits_this_step = 0
        self.trace = StepTrace(self.step, self.comm.rank, self.cuda, self.device) if self.trace_enabled else None

    def pre_dispatch(self, start_layer: int) -> None:
        """Issue the gather of the first sharded layer at or after ``start_layer``."""
        self._step_start_layer = start_layer
        if self.cuda:
            # Fork: the side stream must not overwrite a slot that the previous step's last layers
            # may still be reading on the compute stream.
            self._fork.record()
            self.side_stream.wait_event(self._fork)
        if self.trace is not None:
            self.trace.start()
        first = next((i for i in self.sharded_ids if i >= start_layer), None)
        if first is not None and self.lookahead:
            self._dispatch(first)

    def maybe_dispatch(self, layer: int) -> None:
        """With lookahead, issue the gather of ``layer`` now (held back until its gate is done)."""
        if not self.lookahead or layer not in self.layers or layer in self._handles:
            return
        if layer in self._held.values():
            return
        self._dispatch(layer)

    def wait_ready_once(self, layer: int) -> None:
        """At the start of ``layer``: make sure its weights are in its slot. Waits at most once."""
        if layer not in self.layers or layer in self._waited:
            return
        if layer not in self._handles:
            # Lookahead off, or a layer that was never dispatched: gather now and wait at once.
            self._release_if_held(layer)
            self._issue(layer)
        self._waited.add(layer)
        self.waits_this_step += 1
        if self.trace is not None:
            self.trace.mark(layer, "wait_start")
        try:
            if self.cuda:
                torch.cuda.current_stream().wait_event(self._ready[layer])
            else:
                self._handles[layer].wait()
        except CommError as e:
            raise CommError(self._stuck_message(layer, e)) from e
        self.slots.occupy(layer)
        if self.trace is not None:
            self.trace.mark(layer, "wait_end")
            self.trace.mark(layer, "compute_start")

    def update_done_event(self, layer: int, module: torch.nn.Module | None = None) -> None:
        """After ``layer`` ran: record that its slot may be overwritten; release a held gather."""
        if layer not in self.layers:
            return
        if self.cuda:
            self._done[layer].record()
        self._finished.add(layer)
        if self.trace is not None:
            self.trace.mark(layer, "compute_end")
        waiting = self._held.pop(layer, None)
        if waiting is not None:
            self._issue(waiting)

    # ---- internals -------------------------------------------------------------------------------
    def _gate_open(self, layer: int) -> bool:
        prev = self.slots.previous_occupant(layer)
        # A layer before this step's first layer ran in an earlier step: finished (CPU) or ordered
        # by the fork event (CUDA).
        return prev is None or prev < self._step_start_layer or prev in self._finished

    def _dispatch(self, layer: int) -> None:
        if self.gate and not self._gate_open(layer):
            self._held[self.slots.previous_occupant(layer)] = layer
            if self.trace is not None:
                self.trace.mark(layer, "held")
            return
        self._issue(layer)

    def _release_if_held(self, layer: int) -> None:
        for gate_layer, held in list(self._held.items()):
            if held == layer:
                del self._held[gate_layer]

    def _issue(self, layer: int) -> None:
        st = self.layers[layer]
        full = self.slots.full_buffer(layer)
        what = f"layer {layer}: gather of {st.layout.total_bytes} B into slot {SLOT_NAMES[self.slots.slot_of(layer)]}"
        if self.trace is not None:
            self.trace.mark(layer, "issue")
            self.trace.set_slot(layer, SLOT_NAMES[self.slots.slot_of(layer)])
        if self.cuda:
            prev = self.slots.previous_occupant(layer)
            with torch.cuda.stream(self.side_stream):
                if self.gate and prev is not None and prev >= self._step_start_layer:
                    self.side_stream.wait_event(self._done[prev])
                if self.trace is not None:
                    self.trace.mark(layer, "gather_start")
                handle = self.comm.all_gather_into(full, st.chunk, what=what)
                self._ready[layer].record(self.side_stream)
                if self.trace is not None:
                    self.trace.mark(layer, "gather_end")
        else:
            if self.trace is not None:
                self.trace.mark(layer, "gather_start")
            try:
                handle = self.comm.all_gather_into(full, st.chunk, async_op=True, what=what)
            except CommError as e:
                raise CommError(self._stuck_message(layer, e)) from e
            if self.trace is not None:
                trace, when = self.trace, time.perf_counter
                add = getattr(handle, "add_done_callback", None)
                if add is not None:
                    add(lambda: trace.mark(layer, "gather_end", when()))
                else:
                    trace.mark(layer, "gather_end")
        self._handles[layer] = handle
        self.gathers_this_step += 1
        self.gathers_total += 1

    def _stuck_message(self, layer: int, err: Exception) -> str:
        return (
            f"weight gather of layer {layer} failed on rank {self.comm.rank} (step {self.step}): {err}. "
            f"Every rank of the shard group ({self.comm.world_size} ranks) must issue the same gathers "
            "every step: a rank that skips a step (for example because it has no tokens) leaves the "
            "others waiting. Run a one-token dummy step on idle ranks (wsharding.shard.aligned_forward)."
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
