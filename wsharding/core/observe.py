"""What a sharding lets others watch: observers, called at named points of finalize and of every step.

[Note: observers]
Tracing a step, timing the planner's calls or labelling them for a profiler is watching, not
sharding, so none of it is written into the planner: a sharding keeps one list of observers
(``WeightSharding.observers``, the same list as its planner's ``observers``) and calls each at the
named points below, in order, on the model's thread. An observer subclasses :class:`StepObserver`
and overrides the points it needs; the rest do nothing. With no observer attached a point costs
one test of an empty list. Observers are attached and removed between steps; they must not change
what the planner does (they see, they do not steer), so every rank may attach different ones -- but
for the planner's own tracer (``trace=True``): a traced step issues no gather for the next step
(:class:`~wsharding.accel.next_step.NextStepPrefetch`), so trace every rank of a group or none.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: The planner calls that a step makes on the model's thread, each reported by ``call`` and ``returned``.
CALLS = ("begin_step", "block_start", "block_end", "ensure", "end_step", "finish_step")
#: The one place where a call waits for the GPU rather than works ([Note: backpressure]), reported
#: as a call of its own inside ``begin_step``.
WAIT_FOR_GPU = "wait_for_gpu"
#: What ``layer_point`` reports of a sharded layer, in a step's order.
LAYER_POINTS = ("held", "wait_start", "wait_end", "compute_start", "compute_end")


class StepObserver:
    """One observer of a sharding; every point's default does nothing."""

    def call(self, name: str) -> None:
        """A planner call of :data:`CALLS` (or :data:`WAIT_FOR_GPU`) begins; calls may nest."""

    def returned(self, name: str) -> None:
        """The call ``name`` returned or raised."""

    def step_started(self, step: int, rank: int, device: Any) -> None:
        """A step begins (its first gathers not yet issued)."""

    def gather_issued(self, layer: int, slot: str, gather: Any) -> tuple[Any, Any] | None:
        """``layer``'s gather into ``slot`` is about to start. An observer may return the (start, end)
        CUDA events the communicator records around it (a tracer does); the first one returned is used."""
        return None

    def gather_started(self, layer: int, gather: Any) -> None:
        """``layer``'s gather started (``gather``: the communicator's prepared gather, in flight)."""

    def layer_point(self, layer: int, point: str) -> None:
        """A sharded layer reached ``point`` (:data:`LAYER_POINTS`) in the step."""

    def step_ended(self) -> Any:
        """The step ended (``finish_step``); an observer may return what it recorded (a tracer, the trace)."""
        return None

    def finalize_stage(self, stage: str, layer: int | None) -> None:
        """Finalize passed ``stage`` (``"slots"``, then per layer ``"rows packed"``, ``"chunk"``,
        ``"weights"``...) of ``layer``."""


@contextmanager
def observing(observers: list[StepObserver], *attached: StepObserver) -> Iterator[None]:
    """Within the block, ``attached`` are in ``observers`` (a sharding's or its planner's list): the
    way to watch a few steps and leave nothing behind."""
    observers.extend(attached)
    try:
        yield
    finally:
        for o in attached:
            if o in observers:
                observers.remove(o)
