"""The host time a real forward spends inside the planner and the communicator, measured in place.

Two other numbers of ``bench step`` bound it from either side, and neither is it:

* the bare planner loop (:func:`~wsharding.lab.bench.step.planner_host_us`) runs the calls with no
  layer between them, so a gather handed to the issue thread is waited for at once -- it times the
  thread's latency, which a forward hides behind the layer's own launches;
* the paired difference of the sharded and replicated forwards (``host_overhead_*``) holds our
  calls and everything else that differs, torch's own launches slowing included.

:class:`PlannerCallTimer` is an observer of the planner's six calls on the model's thread
(``begin_step``, ``end_step``, ``finish_step`` per step; ``block_start``, ``block_end`` and the
layer's own check, ``ensure``, per layer; [Note: observers] in ``wsharding/core/observe.py``) for a
few real forwards, and adds up the time spent inside them:
issue, hand-over to the thread, the check that it ran, the stream waits and event records. The
timer's own cost (two ``perf_counter`` calls) is measured around a call that does nothing and taken
off, so what is left is the calls' own time.

[Note: steady forwards, the GPU wait taken out]
A decode loop runs forward after forward without draining the GPU, so the calls are timed that way
by default. Where the GPU is the bound (two ranks time-slicing one GPU, or a large gather), the
planner's backpressure (reported as the call ``wait_for_gpu`` inside ``begin_step``) makes the host wait for the
GPU to reach the step before last: that is the GPU's time, not the host's, so it is timed apart
(``waiting_s``) and taken off the call it ran in. With ``drain`` the GPU is synchronised before each
forward instead (outside the timing): the calls then run on an idle GPU, as the first step of a
burst does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from wsharding.core.observe import CALLS, WAIT_FOR_GPU, StepObserver, observing

#: Where a call waits for the GPU rather than works: timed apart ([Note: steady forwards, the GPU wait taken out]).
GPU_WAITS = (WAIT_FOR_GPU,)

__all__ = ["CALLS", "GPU_WAITS", "PlannerCallTimer", "planner_calls_us_per_layer"]


class PlannerCallTimer(StepObserver):
    """Times the planner's own calls inside real forwards, on the model's thread.

    Why: neither the bare planner loop nor the difference of two whole forwards is what the planner
    costs a real step (see the module's docstring); timing each call in place is. Use::

        with PlannerCallTimer(planner) as t:
            model(x)
        t.seconds      # spent inside the planner's calls, the timer's own cost taken off
        t.calls        # how many calls were timed
        t.by_call      # seconds per call name, one entry per name in CALLS
        t.waiting_s    # seconds the calls waited for the GPU (GPU_WAITS), not counted in ``seconds``

    It observes the planner ([Note: observers] in ``wsharding/core/observe.py``) inside the block and
    is removed from its observers on exit. A call made from inside a timed one (``ensure`` from a
    block's start, ``end_step`` from ``finish_step``) is counted once, with the outer one."""

    def __init__(self, planner: Any) -> None:
        self.planner = planner
        self.seconds = 0.0
        self.calls = 0
        self.by_call = dict.fromkeys(CALLS, 0.0)
        self.waiting_s = 0.0
        self._open: list[tuple[str, float]] = []  # the calls running now, outermost first, and their start
        self._waited_inside = 0.0  # GPU waits inside the timed call now running
        self._overhead_s = _timer_overhead_s()
        self._within: Any = None

    def __repr__(self) -> str:
        """What was timed so far, in microseconds, without the planner's internals."""
        calls = ", ".join(f"{name} {sec * 1e6:.1f} us" for name, sec in self.by_call.items() if sec)
        return (f"PlannerCallTimer({self.calls} calls, {self.seconds * 1e6:.1f} us inside them"
                + (f": {calls}" if calls else "") + f"; {self.waiting_s * 1e6:.1f} us waiting for the GPU)")

    def call(self, name: str) -> None:
        if not self._open:
            self._waited_inside = 0.0
        self._open.append((name, time.perf_counter()))

    def returned(self, name: str) -> None:
        _, t0 = self._open.pop()
        took = time.perf_counter() - t0
        if name in GPU_WAITS:
            self.waiting_s += took
            self._waited_inside += took
            return
        if self._open:  # inside another timed call: counted with it
            return
        took -= self._overhead_s + self._waited_inside
        self.seconds += took
        self.by_call[name] += took
        self.calls += 1

    def __enter__(self) -> PlannerCallTimer:
        self._within = observing(self.planner.observers, self)
        self._within.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._within.__exit__(*exc)


def _timer_overhead_s(samples: int = 2001) -> float:
    """The median time ``perf_counter() - perf_counter()`` reads around a call that does nothing."""
    clock = time.perf_counter

    def nothing() -> None:
        return None

    reads = []
    for _ in range(samples):
        t0 = clock()
        nothing()
        reads.append(clock() - t0)
    return sorted(reads)[samples // 2]


def planner_calls_us_per_layer(planner: Any, forward: Callable[[], Any], steps: int, layers: int,
                               drain: Callable[[], None] | None = None) -> tuple[float, dict[str, float], float]:
    """Microseconds per sharded layer that ``steps`` calls of ``forward`` spend inside the planner's
    calls, the same for each call, and the microseconds per layer they waited for the GPU (not in the
    first two). Forwards run back to back; ``drain`` (the GPU synchronised) runs before each, outside
    the timing, to time the calls on an idle GPU ([Note: steady forwards, the GPU wait taken out])."""
    with PlannerCallTimer(planner) as timer:
        for _ in range(steps):
            if drain is not None:
                drain()
            forward()
    if drain is not None:
        drain()
    per_layer = lambda s: s / (steps * layers) * 1e6  # noqa: E731
    return (per_layer(timer.seconds), {name: per_layer(s) for name, s in timer.by_call.items()},
            per_layer(timer.waiting_s))
