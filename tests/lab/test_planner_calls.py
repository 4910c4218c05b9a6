"""The planner's calls timed inside a forward (wsharding.lab.bench.planner_calls): which calls count,
that they still run, and that the timer leaves the planner as it found it -- an observer, never a patch.
Timings are never asserted, except with a clock only the calls advance."""

from __future__ import annotations

import torch

from tests.core.test_library_edges import Block, Loopback
from wsharding.core.observe import StepObserver
from wsharding.core.runner import shard_blocks
from wsharding.lab.bench import planner_calls
from wsharding.lab.bench.planner_calls import CALLS, GPU_WAITS, PlannerCallTimer


class _Model(torch.nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(8, seed=i) for i in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x


def _sharded(layers: int = 3):
    model = _Model(layers)
    ws = shard_blocks(model, "layers", ["fc"], Loopback())
    return model, ws


class _Log(StepObserver):
    def __init__(self) -> None:
        self.seen: list[str] = []

    def call(self, name: str) -> None:
        self.seen.append(name)


def test_every_call_of_a_real_step_counted_once_and_the_planner_left_as_it_was():
    model, ws = _sharded(3)
    planner = ws.planner
    methods = dict(vars(planner))
    x = torch.randn(2, 8)
    with torch.no_grad():
        untimed = model(x)
        log = _Log()
        with PlannerCallTimer(planner) as timer:
            planner.observers.append(log)
            timed = model(x)
            planner.observers.remove(log)
    assert torch.equal(untimed, timed)  # the calls still ran: the same output
    # per step: begin_step, finish_step (its end_step not again); per layer: start, the checks of the
    # block's forward and of its linear, end
    assert log.seen == ["begin_step"] + ["block_start", "ensure", "ensure", "block_end"] * 3 + ["finish_step"]
    assert timer.calls == 2 + 4 * 3
    assert list(timer.by_call) == list(CALLS) and abs(sum(timer.by_call.values()) - timer.seconds) < 1e-12
    assert planner.observers == [] and vars(planner).keys() == methods.keys()  # nothing left behind, nothing set
    with torch.no_grad():
        model(x)
    assert timer.calls == 14  # nothing counted after the block
    ws.close()


class _Planner:
    """Reports its calls to its observers as the planner does: ``begin_step`` waits for the GPU inside
    (``wait_for_gpu``), ``block_start`` calls ``ensure``, ``finish_step`` calls ``end_step``."""

    def __init__(self, clock: list[float]) -> None:
        self.observers: list[StepObserver] = []
        self.clock = clock

    def _call(self, name: str, works: float, *inner: tuple[str, float]) -> None:
        for o in self.observers:
            o.call(name)
        self.clock[0] += works
        for sub in inner:
            self._call(*sub)
        for o in self.observers:
            o.returned(name)

    def step(self, layers: int) -> None:
        self._call("begin_step", 1.0, ("wait_for_gpu", 4.0))
        for _ in range(layers):
            self._call("block_start", 2.0, ("ensure", 2.0))
            self._call("block_end", 2.0)
        self._call("finish_step", 2.0, ("end_step", 2.0))


def test_the_wait_for_the_gpu_is_timed_apart(monkeypatch):
    # A clock only the calls advance: begin_step works 1 s and, inside it, waits 4 s for the GPU;
    # every other call works 2 s. Without the split begin_step would count 5 s.
    clock = [0.0]
    monkeypatch.setattr(planner_calls.time, "perf_counter", lambda: clock[0])
    p = _Planner(clock)
    with PlannerCallTimer(p) as timer:
        timer._overhead_s = 0.0
        p.step(2)
    assert GPU_WAITS == ("wait_for_gpu",)
    assert timer.waiting_s == 4.0
    assert timer.by_call["begin_step"] == 1.0
    # finish_step and its end_step: 4 s; per layer start (with its ensure: 4 s) and end (2 s)
    assert timer.by_call["block_start"] == 2 * 4.0
    assert timer.seconds == 1.0 + 4.0 + 2 * (4.0 + 2.0)
    assert timer.calls == 2 + 2 * 2 and p.observers == []
