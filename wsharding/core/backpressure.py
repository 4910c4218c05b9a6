"""Backpressure: the host may run at most two steps ahead of the GPU.

[Note: backpressure]
The host never waits for the GPU inside a step, but across steps it must not run ahead forever: when
a peer goes missing, the copy-engine gather waits on the GPU for a flag the peer never writes, and
``ncclCommAbort`` does not release that wait (NCCL 2.28). A host that keeps issuing steps then fills
CUDA's launch queue and blocks inside a kernel launch, where no error can reach it -- a hang. So at
the start of step s the planner checks that the GPU has started step s-2 (an event recorded at every
step's fork, two in turn; one query, under a microsecond, when it has). When it has not, it polls
that event and the communicator's watchdog: the GPU catching up ends the wait, a watchdog error
raises it. Two steps of queued work are more than the GPU needs to stay busy.
"""

from __future__ import annotations

import time

import torch

from wsharding.core.comm import Communicator


class StepBackpressure:
    """The fork events of the last two steps, in turn, and the wait on the older one."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.forks = (torch.cuda.Event(), torch.cuda.Event())
        for ev in self.forks:
            ev.record()
        self.step = -1

    def wait(self, step: int, compute: torch.cuda.Stream) -> None:
        """At the start of ``step``: wait (polling the watchdog) until the GPU has started ``step - 2``,
        then mark this step's start on ``compute``. Once per step."""
        if self.step == step:
            return  # pre_dispatch called again in the same step: its event is this step's own
        self.step = step
        ev = self.forks[step % 2]
        while True:
            try:
                if ev.query():
                    break
            except RuntimeError:
                break  # last recorded inside a CUDA-graph capture: it tells nothing about eager steps
            self.comm.raise_if_failed(f"step {step}: waiting for the GPU to reach step {step - 2}")
            time.sleep(2e-4)
        self.comm.record_event(ev, compute)
