"""What happened in a step, per layer: gather issue/start/end, wait start/end, compute start/end,
and the slot used. Off by default: :class:`StepTracer` is an observer ([Note: observers] in
:mod:`wsharding.core.observe`) that a sharding attaches when asked (``trace=True``), so an untraced
step never touches it.

CPU ranks: times from ``time.perf_counter`` (the gather's end is stamped by gloo's completion
callback, on gloo's thread). CUDA: events recorded on the stream where each thing happens, resolved
into times after the step (``finish``), so tracing never synchronises inside the step.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from wsharding.core.observe import StepObserver

KINDS = (
    "issue", "held", "gather_start", "gather_end", "wait_start", "wait_end", "compute_start", "compute_end",
)


class StepTrace:
    """Per-layer timestamps of one step on one rank, in microseconds from the step's start."""

    def __init__(self, step: int, rank: int, cuda: bool, device: torch.device | None = None) -> None:
        self.step = step
        self.rank = rank
        self.cuda = cuda
        self.device = device
        self._t0: float | None = None
        self._start_event: torch.cuda.Event | None = None
        self._raw: dict[int, dict[str, Any]] = {}
        self.slots: dict[int, str] = {}
        self.layers: dict[int, dict[str, float]] = {}

    def start(self) -> None:
        self._t0 = time.perf_counter()
        if self.cuda:
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()

    def mark(self, layer: int, kind: str, t: float | None = None) -> None:
        if self.cuda and kind not in ("issue", "held"):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()  # on the current stream: side stream for gathers, compute stream otherwise
            self._raw.setdefault(layer, {})[kind] = ev
        else:
            self._raw.setdefault(layer, {})[kind] = time.perf_counter() if t is None else t

    def event(self, layer: int, kind: str) -> torch.cuda.Event:
        """A timing event for ``kind`` that the caller records on the stream where it happens (the
        copy or gather stream of a backend)."""
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()  # torch creates the CUDA event at its first record; the caller records it again
        self._raw.setdefault(layer, {})[kind] = ev
        return ev

    def set_slot(self, layer: int, slot: str) -> None:
        self.slots[layer] = slot

    def gather_issued(self, layer: int, slot: str) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """Mark a gather issued into ``slot``: CUDA, the (start, end) events its backend records around
        it; CPU, its start now (its end comes from the gather's done callback) and None."""
        self.mark(layer, "issue")
        self.set_slot(layer, slot)
        if self.cuda:
            return self.event(layer, "gather_start"), self.event(layer, "gather_end")
        self.mark(layer, "gather_start")
        return None

    def finish(self) -> None:
        """Resolve every mark into microseconds since the step's start."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        t0 = self._t0 if self._t0 is not None else 0.0
        for layer, marks in self._raw.items():
            out = {}
            for kind, v in marks.items():
                if isinstance(v, torch.cuda.Event):
                    out[kind] = self._start_event.elapsed_time(v) * 1e3
                else:
                    out[kind] = (v - t0) * 1e6
            self.layers[layer] = out

    def records(self) -> list[dict[str, Any]]:
        """One dict per layer: step, rank, layer, slot and every mark (µs)."""
        return [
            {"step": self.step, "rank": self.rank, "layer": layer, "slot": self.slots.get(layer), **marks}
            for layer, marks in sorted(self.layers.items())
        ]

    def exposed_gather_us(self) -> float:
        """Time the compute stream spent waiting while a gather still ran, in this step: per layer the
        overlap of its wait with its gather. A wait is measured between two events on the compute
        stream, so it also holds any time the GPU idled for the host to queue the next work; at a
        host-bound step with short gathers that alone made "exposed" exceed the gathers (a fraction of
        3.97 at world size 1 with mapped views, whose gathers copy nothing). The overlap never does."""
        total = 0.0
        for m in self.layers.values():
            if "wait_start" not in m or "wait_end" not in m:
                continue
            if "gather_end" in m and "gather_start" in m:
                total += max(0.0, min(m["wait_end"], m["gather_end"]) - max(m["wait_start"], m["gather_start"]))
            else:
                total += m["wait_end"] - m["wait_start"]
        return total

    def gather_us(self) -> float:
        """Sum of gather durations (start to end) in this step."""
        return sum(m["gather_end"] - m["gather_start"] for m in self.layers.values() if "gather_end" in m)


class StepTracer(StepObserver):
    """Records a :class:`StepTrace` of every step: the observer behind ``trace=True``."""

    def __init__(self) -> None:
        #: The trace of the step running now (None between steps).
        self.trace: StepTrace | None = None
        #: The traces of the finished steps, oldest first.
        self.traces: list[StepTrace] = []

    def step_started(self, step: int, rank: int, device: Any) -> None:
        if self.trace is not None:  # a step that ended without finish_step: kept as it is
            self.traces.append(self.trace)
        cuda = device is not None and device.type == "cuda"
        self.trace = StepTrace(step, rank, cuda, device)
        self.trace.start()

    def gather_issued(self, layer: int, slot: str, gather: Any) -> tuple[Any, Any] | None:
        trace = self.trace
        if trace is None:
            return None
        return trace.gather_issued(layer, slot)

    def gather_started(self, layer: int, gather: Any) -> None:
        trace = self.trace
        if trace is not None and not trace.cuda:  # its end from the gather's done callback (gloo's thread)
            gather.add_done_callback(lambda: trace.mark(layer, "gather_end", time.perf_counter()))

    def layer_point(self, layer: int, point: str) -> None:
        if self.trace is not None:
            self.trace.mark(layer, point)

    def step_ended(self) -> StepTrace | None:
        done, self.trace = self.trace, None
        if done is not None:
            done.finish()
            self.traces.append(done)
        return done
