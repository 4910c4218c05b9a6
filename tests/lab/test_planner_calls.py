"""The planner's calls timed inside a forward (wsharding.lab.bench.planner_calls): which calls count,
that they still run, and that the planner gets its own methods back. Timings are never asserted."""

from __future__ import annotations

import pytest

from wsharding.lab.bench import planner_calls
from wsharding.lab.bench.planner_calls import CALLS, GPU_WAITS, PlannerCallTimer


class _Planner:
    def __init__(self) -> None:
        self.log: list[str] = []

    def reset(self) -> None:
        self.log.append("reset")

    def pre_dispatch(self, start: int, end: int | None = None) -> None:
        self.log.append("pre_dispatch")
        self._backpressure()

    def _backpressure(self) -> None:
        self.log.append("backpressure")

    def pre_dispatch_after_prefetch(self, start: int, end: int | None = None) -> None:
        self.pre_dispatch(start, end)  # a timed call made from a call that is not timed

    def maybe_dispatch(self, layer: int) -> None:
        self.log.append(f"dispatch {layer}")

    def wait_ready_once(self, layer: int) -> None:
        self.log.append(f"wait {layer}")

    def update_done_event(self, layer: int, module: object = None) -> None:
        self.log.append(f"done {layer}")
        self.maybe_dispatch(layer + 2)  # a timed call from inside a timed one: counted once, with it

    def finish_step(self) -> None:
        self.log.append("finish")


def _step(p: _Planner, layers: int) -> None:
    p.reset()
    p.pre_dispatch_after_prefetch(0, layers)
    for i in range(layers):
        p.maybe_dispatch(i + 1)
        p.wait_ready_once(i)
        p.update_done_event(i)
    p.finish_step()


def test_every_call_counted_once_and_run():
    p = _Planner()
    _step(p, 3)
    untimed = list(p.log)
    p.log.clear()
    with PlannerCallTimer(p) as timer:
        _step(p, 3)
    assert p.log == untimed  # every call still ran, in the same order
    # per step: reset, pre_dispatch, finish_step; per layer: dispatch, wait, done (the nested dispatch in it not again)
    assert timer.calls == 3 + 3 * 3
    assert list(timer.by_call) == list(CALLS) and sum(timer.by_call.values()) == pytest.approx(timer.seconds, rel=1e-9)
    assert not any(name in p.__dict__ for name in CALLS)  # the class's own methods again
    _step(p, 1)
    assert timer.calls == 12  # nothing counted after the block


def test_the_wait_for_the_gpu_is_timed_apart(monkeypatch):
    # A clock only the calls advance: pre_dispatch works 1 s and, inside it, waits 4 s for the GPU
    # (backpressure); every other call works 2 s. Without the split pre_dispatch would count 5 s.
    clock = [0.0]
    monkeypatch.setattr(planner_calls.time, "perf_counter", lambda: clock[0])
    p = _Planner()
    real_pre, real_wait = p.pre_dispatch, p._backpressure

    def pre_dispatch(start: int, end: int | None = None) -> None:
        clock[0] += 1.0
        real_pre(start, end)

    def backpressure() -> None:
        clock[0] += 4.0
        real_wait()

    def works(inner):
        def call(*args, **kwargs):
            clock[0] += 2.0
            return inner(*args, **kwargs)
        return call

    p.pre_dispatch, p._backpressure = pre_dispatch, backpressure
    for name in ("reset", "maybe_dispatch", "wait_ready_once", "update_done_event", "finish_step"):
        setattr(p, name, works(getattr(p, name)))
    with PlannerCallTimer(p) as timer:
        timer._overhead_s = 0.0
        _step(p, 2)
    assert "backpressure" in p.log and GPU_WAITS == ("_backpressure",)
    assert timer.waiting_s == 4.0
    assert timer.by_call["pre_dispatch"] == 1.0
    # reset, finish_step; per layer dispatch, wait, done (its nested dispatch: 2 s more, in done's)
    assert timer.by_call["update_done_event"] == 2 * 4.0
    assert timer.seconds == 1.0 + 2 * 2.0 + 2 * (2.0 + 2.0 + 4.0)
