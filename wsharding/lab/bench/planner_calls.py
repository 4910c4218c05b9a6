"""The host time a real forward spends inside the planner and the communicator, measured in place.

Two other numbers of ``bench step`` bound it from either side, and neither is it:

* the bare planner loop (:func:`~wsharding.lab.bench.step.planner_host_us`) runs the calls with no
  layer between them, so a gather handed to the issue thread is waited for at once -- it times the
  thread's latency, which a forward hides behind the layer's own launches;
* the paired difference of the sharded and replicated forwards (``host_overhead_*``) holds our
  calls and everything else that differs, torch's own launches slowing included.

:class:`PlannerCallTimer` wraps the planner's six calls on the model's thread (``reset``,
``pre_dispatch``, ``finish_step`` per step; ``maybe_dispatch``, ``wait_ready_once``,
``update_done_event`` per layer) for a few real forwards, and adds up the time spent inside them:
issue, hand-over to the thread, the check that it ran, the stream waits and event records. The
timer's own cost (two ``perf_counter`` calls) is measured around a call that does nothing and taken
off, so what is left is the calls' own time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

#: The planner's calls that a step makes on the model's thread.
CALLS = ("reset", "pre_dispatch", "maybe_dispatch", "wait_ready_once", "update_done_event", "finish_step")


class PlannerCallTimer:
    """``with PlannerCallTimer(planner) as t: model(x)`` -> ``t.seconds`` spent inside the planner's
    calls (timer cost taken off), ``t.calls`` counted, ``t.by_call`` the seconds of each of
    :data:`CALLS`. The calls go back to the class's own methods on exit."""

    def __init__(self, planner: Any) -> None:
        self.planner = planner
        self.seconds = 0.0
        self.calls = 0
        self.by_call = dict.fromkeys(CALLS, 0.0)
        self._depth = 0  # a timed call made from inside another (pre_dispatch from the draft's variant)
        self._overhead_s = _timer_overhead_s()

    def _timed(self, name: str, inner: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return inner(*args, **kwargs)
            self._depth += 1
            t0 = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                took = clock() - t0 - self._overhead_s
                self.seconds += took
                self.by_call[name] += took
                self.calls += 1
                self._depth -= 1

        return timed

    def __enter__(self) -> PlannerCallTimer:
        for name in CALLS:
            setattr(self.planner, name, self._timed(name, getattr(self.planner, name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for name in CALLS:
            self.planner.__dict__.pop(name, None)


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
                               drain: Callable[[], None] | None = None) -> tuple[float, dict[str, float]]:
    """Microseconds per sharded layer that ``steps`` calls of ``forward`` spend inside the planner's
    calls, and the same for each call; ``drain`` (the GPU synchronised) runs before each forward,
    outside the timing, so that a full launch queue or the planner's backpressure never holds a call."""
    with PlannerCallTimer(planner) as timer:
        for _ in range(steps):
            if drain is not None:
                drain()
            forward()
    if drain is not None:
        drain()
    per_layer = lambda s: s / (steps * layers) * 1e6  # noqa: E731
    return per_layer(timer.seconds), {name: per_layer(s) for name, s in timer.by_call.items()}
