"""The planner's calls timed inside a forward (wsharding.lab.bench.planner_calls): which calls count,
that they still run, and that the planner gets its own methods back. Timings are never asserted."""

from __future__ import annotations

import pytest

from wsharding.lab.bench.planner_calls import CALLS, PlannerCallTimer


class _Planner:
    def __init__(self) -> None:
        self.log: list[str] = []

    def reset(self) -> None:
        self.log.append("reset")

    def pre_dispatch(self, start: int, end: int | None = None) -> None:
        self.log.append("pre_dispatch")

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
