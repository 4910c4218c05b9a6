"""A draft model's first layer, gathered before its step: a planner plug-in.

[Note: the draft's first layer]
A draft model runs right after the target model. Its first sharded layer has no previous layer
whose compute could hide its gather, so (the weight-sharding design, "CUDA graph and the draft
model") that gather is issued *before* the draft's step, on a dedicated stream, during the region
between the two models (the design's ~4 ms commit step), and outside the draft's CUDA graph::

    target(tokens)
    first = FirstLayerPrefetch.of(draft.planner)
    first.prefetch()     # dedicated stream, forked from the compute stream
    commit()             # any work that is not a layer
    first.wait()         # the compute stream waits; cold start: gathers now
    draft(tokens)        # reset, first.pre_dispatch, the layers

Why not the shared side stream: there it queues behind the target model's gathers (the design saw
~25 us of overlap). The fork orders the prefetch after everything already queued on the compute
stream -- the previous draft step, which may still read the slot it overwrites, included. On CPU
ranks the same calls hold an async gloo handle, waited on by :meth:`FirstLayerPrefetch.wait`.
"""

from __future__ import annotations

import torch

from wsharding.core.comm import CommError, GatherHandle, is_slice_of
from wsharding.core.planner import PlannerClosedError, WeightShardPlanner
from wsharding.core.plugins import PlannerPlugin
from wsharding.core.slots import SLOT_NAMES


class FirstLayerPrefetch(PlannerPlugin):
    """Gathers the planner's first sharded layer ahead of the step that uses it."""

    claims_first_layer = True

    def __init__(self) -> None:
        #: Prefetches issued, and cold starts (:meth:`wait` with nothing prefetched: gathered inline).
        self.prefetches = 0
        self.cold_starts = 0
        self._handle: GatherHandle | None = None
        self._armed = False  # waited on: the next step starts with the layer in its slot
        self._stream: torch.cuda.Stream | None = None
        self._ready: torch.cuda.Event | None = None

    @classmethod
    def of(cls, planner: WeightShardPlanner) -> FirstLayerPrefetch:
        """The plug-in attached to ``planner``, attached now if it has none (every rank the same)."""
        found = cls.attached_to(planner)
        if found is None:
            found = cls()
            planner.add_plugin(found)
        return found

    def attach(self, planner: WeightShardPlanner) -> None:
        self.planner = planner
        #: The first sharded layer: the one :meth:`prefetch` gathers.
        self.first_layer = planner.sharded_ids[0]

    def stream(self) -> torch.cuda.Stream:
        """The dedicated stream of the prefetch (CUDA), created once, outside any step."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.planner.device)
        return self._stream

    def prefetch(self, stream: torch.cuda.Stream | None = None, *, fork: bool = True) -> None:
        """Issue the gather of the first sharded layer now, ahead of the step that uses it.

        CUDA: on ``stream`` (default: :meth:`stream`, dedicated; passing the stream the target's
        gathers use shows why not to), after a fork from the current stream; never waits on the host.
        CPU: an async collective. Call it outside any CUDA graph; every rank must call it at the same
        point. ``fork=False`` is only for demonstrating the race the fork prevents.
        """
        p, first = self.planner, self.first_layer
        if p.closed:
            raise PlannerClosedError("FirstLayerPrefetch.prefetch(): this weight sharding was closed")
        if self._handle is not None:
            raise CommError(f"layer {first}: FirstLayerPrefetch.prefetch() called twice on rank {p.comm.rank} before "
                            "wait(): one prefetch per draft step (every rank the same)")
        p.comm.raise_if_failed(f"prefetch of layer {first}")
        st, full = p.layers[first], p.slots.full_buffer(first)
        what = f"layer {first}: prefetch of {st.layout.total_bytes} B into slot {SLOT_NAMES[p.slot_of[first]]}"
        p.slots.occupant[p.slot_of[first]] = None  # receiving
        try:
            if not p.cuda:
                self._handle = p.comm.all_gather_into(full, st.chunk, async_op=True, what=what)
            else:
                s = stream if stream is not None else self.stream()
                if fork:
                    s.wait_stream(torch.cuda.current_stream(p.device))
                if self._ready is None:
                    self._ready = torch.cuda.Event()
                with torch.cuda.stream(s):  # issued from s itself: no backend adds a wait on another stream
                    # In place, as the layers' own gathers: this rank's chunk goes into its slice first.
                    n = st.chunk.numel()
                    own = full.narrow(0, p.comm.rank * n, n)
                    if not is_slice_of(st.chunk, full, p.comm.rank):
                        own.copy_(st.chunk)
                    handle = p.comm.all_gather_into(full, own, async_op=True, stream=s, what=what)
                    handle.wait()  # orders s after the gather, whichever stream the backend used
                self._ready.record(s)
                self._handle = handle
        except CommError as e:
            raise CommError(p.stuck_message(first, e)) from e
        self.prefetches += 1
        p.gathers_total += 1

    def wait(self) -> None:
        """Make the first layer's weights ready before the step: CUDA, the current stream waits for
        the prefetch (no host wait); CPU, block on it. With nothing prefetched (a cold start) the
        gather is issued now and waited on at once: inline, its whole time exposed."""
        p, first = self.planner, self.first_layer
        if self._handle is None:
            self.cold_starts += 1
            self.prefetch()
        handle, self._handle = self._handle, None
        try:
            if p.cuda:
                torch.cuda.current_stream(p.device).wait_event(self._ready)
            else:
                handle.wait()
        except CommError as e:
            raise CommError(p.stuck_message(first, e)) from e
        p.slots.occupant[p.slot_of[first]] = first
        self._armed = True

    def pre_dispatch(self, start_layer: int, end_layer: int | None = None) -> None:
        """The planner's ``pre_dispatch`` for a step whose first sharded layer :meth:`wait` made ready:
        the fork and the step's start, without issuing that layer's gather again; it counts as this
        step's gather and wait of the layer. A prefetch nobody waited on is waited on here; with none
        at all (or a step that starts past the first layer) this is the plain ``pre_dispatch``."""
        p, first = self.planner, self.first_layer
        if self._handle is not None:
            self.wait()
        if not self._armed or start_layer > first or (end_layer is not None and end_layer <= first):
            p.pre_dispatch(start_layer, end_layer)
            return
        self._armed = False
        lookahead, p.lookahead = p.lookahead, False
        try:
            p.pre_dispatch(start_layer, end_layer)  # fork and trace start, nothing issued
        finally:
            p.lookahead = lookahead
        p.issued[first] = p.waited[first] = p.step
        p.gathers_this_step += 1
        p.waits_this_step += 1
        p.slots.occupant[p.slot_of[first]] = first
        if p.trace is not None:
            for kind in ("wait_start", "wait_end", "compute_start"):
                p.trace.mark(first, kind)  # the wait happened before the step, outside it

    def close(self, planner: WeightShardPlanner) -> None:
        if self._handle is not None:  # a prefetch in flight must not write into freed memory
            self._handle.wait()
            self._handle = None
            if planner.cuda:
                torch.cuda.synchronize(planner.device)
