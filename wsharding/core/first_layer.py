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
    draft(tokens)        # the step: it finds its first layer's gather handed over, and joins it

Why not the shared side stream: there it queues behind the target model's gathers (the design saw
~25 us of overlap). The fork orders the prefetch after everything already queued on the compute
stream -- the previous draft step, which may still read the slot it overwrites, included. On CPU
ranks the same calls hold an async gloo handle, waited on by :meth:`FirstLayerPrefetch.wait`.

The plug-in issues the gather itself (its own stream) and hands it over to the planner
(:meth:`~wsharding.core.planner.WeightShardPlanner.hand_over`): from then on the planner knows the slot
is receiving, and the next step joins that gather instead of issuing its own.
"""

from __future__ import annotations

import torch

from wsharding.core.comm import CommError, GatherHandle, is_slice_of
from wsharding.core.planner import PlannerClosedError, WeightShardPlanner
from wsharding.core.plugins import PlannerPlugin
from wsharding.core.schedule import slot_name


class FirstLayerPrefetch(PlannerPlugin):
    """Gathers the planner's first sharded layer ahead of the step that uses it."""

    claims_first_layer = True

    def __init__(self) -> None:
        #: Prefetches issued, and cold starts (:meth:`wait` with nothing prefetched: gathered inline).
        self.prefetches = 0
        self.cold_starts = 0
        self._handle: GatherHandle | None = None
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
        what = f"layer {first}: prefetch of {st.layout.total_bytes} B into slot {slot_name(p.slot_of[first])}"
        p.join_ahead(first)  # a gather of it still in flight lands first
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
        p.hand_over(first, self._join)
        self.prefetches += 1

    def _join(self) -> None:
        """The planner joins the handed-over gather: CUDA, the current stream waits for it; CPU, block."""
        handle, self._handle = self._handle, None
        if handle is None:
            return
        if self.planner.cuda:
            torch.cuda.current_stream(self.planner.device).wait_event(self._ready)
        else:
            handle.wait()

    def wait(self) -> None:
        """Make the first layer's weights ready before the step: CUDA, the current stream waits for
        the prefetch (no host wait); CPU, block on it. With nothing prefetched (a cold start) the
        gather is issued now and waited on at once: inline, its whole time exposed."""
        if self._handle is None:
            self.cold_starts += 1
            self.prefetch()
        self.planner.join_ahead(self.first_layer)

    def close(self, planner: WeightShardPlanner) -> None:
        self._handle = None  # the planner joined it before closing
