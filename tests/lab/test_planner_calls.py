"""The planner's calls timed inside a forward (wsharding.lab.bench.planner_calls): which calls count,
that they still run, and that the planner gets its own methods back. Timings are never asserted."""

from __future__ import annotations

import pytest

from wsharding.lab.bench import planner_calls
from wsharding.lab.bench.planner_calls import CALLS, GPU_WAITS, PlannerCallTimer


class _Planner:
    def __init__(self) -> None:
        self.log: list[str] = []

    def begin_step(self, start: int, end: int | None = None) -> None:
        self.log.append("begin")
        self._backpressure()

    def _backpressure(self) -> None:
        self.log.append("backpressure")

    def begin_after_prefetch(self, start: int, end: int | None = None) -> None:
        self.begin_step(start, end)  # a timed call made from a call that is not timed

    def block_start(self, layer: int) -> None:
        self.log.append(f"start {layer}")
        self.ensure(layer)  # a timed call from inside a timed one: counted once, with it

    def ensure(self, layer: int) -> None:
        self.log.append(f"ensure {layer}")

    def block_end(self, layer: int) -> None:
        self.log.append(f"end {layer}")

    def end_step(self) -> None:
        self.log.append("end step")

    def finish_step(self) -> None:
        self.log.append("finish")
        self.end_step()


def _step(p: _Planner, layers: int) -> None:
    p.begin_after_prefetch(0, layers)
    for i in range(layers):
        p.block_start(i)
        p.block_end(i)
    p.finish_step()


def test_every_call_counted_once_and_run():
    p = _Planner()
    _step(p, 3)
    untimed = list(p.log)
    p.log.clear()
    with PlannerCallTimer(p) as timer:
        _step(p, 3)
    assert p.log == untimed  # every call still ran, in the same order
    # per step: begin_step, finish_step (its end_step not again); per layer: start, end (the ensure in start not again)
    assert timer.calls == 2 + 2 * 3
    assert list(timer.by_call) == list(CALLS) and sum(timer.by_call.values()) == pytest.approx(timer.seconds, rel=1e-9)
    assert not any(name in p.__dict__ for name in CALLS)  # the class's own methods again
    _step(p, 1)
    assert timer.calls == 8  # nothing counted after the block


def test_the_wait_for_the_gpu_is_timed_apart(monkeypatch):
    # A clock only the calls advance: begin_step works 1 s and, inside it, waits 4 s for the GPU
    # (backpressure); every other call works 2 s. Without the split begin_step would count 5 s.
    clock = [0.0]
    monkeypatch.setattr(planner_calls.time, "perf_counter", lambda: clock[0])
    p = _Planner()
    real_begin, real_wait = p.begin_step, p._backpressure

    def begin_step(start: int, end: int | None = None) -> None:
        clock[0] += 1.0
        real_begin(start, end)

    def backpressure() -> None:
        clock[0] += 4.0
        real_wait()

    def works(inner):
        def call(*args, **kwargs):
            clock[0] += 2.0
            return inner(*args, **kwargs)
        return call

    p.begin_step, p._backpressure = begin_step, backpressure
    for name in ("block_start", "ensure", "block_end", "end_step", "finish_step"):
        setattr(p, name, works(getattr(p, name)))
    with PlannerCallTimer(p) as timer:
        timer._overhead_s = 0.0
        _step(p, 2)
    assert "backpressure" in p.log and GPU_WAITS == ("_backpressure",)
    assert timer.waiting_s == 4.0
    assert timer.by_call["begin_step"] == 1.0
    # finish_step and its end_step: 4 s; per layer start (with its ensure: 4 s) and end (2 s)
    assert timer.by_call["block_start"] == 2 * 4.0
    assert timer.seconds == 1.0 + 4.0 + 2 * (4.0 + 2.0)
