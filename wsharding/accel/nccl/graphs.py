"""The CUDA graphs our NCCL communicator captured: it owns every one, and destroys them before itself.

Since NCCL 2.26 ``ncclCommDestroy`` and ``ncclCommAbort`` wait until every graph that references the
communicator is gone ([Note: a gather launched as a graph] in ``wsharding/accel/captured_launch.py``),
so a graph that a Python object still held would hold the close, or the abort thread, forever. The
communicator therefore keeps them in one :class:`CapturedGraphs`, a closed weight sharding drops its
own, and the teardown destroys the rest first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from wsharding.accel.captured_launch import CapturedLaunch
from wsharding.accel.cuda_driver import CudaDriverError
from wsharding.core.comm import CommError


class CapturedGraphs:
    """Every graph captured on one communicator, until it is dropped or the communicator ends.

    ``lock``: the communicator's, held around NCCL calls that its watchdog's abort must not interleave
    with (a capture records NCCL calls)."""

    def __init__(self, lock: threading.RLock) -> None:
        self.lock = lock
        self.launches: list[CapturedLaunch] = []

    def capture(self, stream: int, record: Callable[[int], None], what: str, *, rank: int) -> CapturedLaunch:
        """Capture what ``record(stream)`` queues (NCCL calls on the communicator) into a graph kept
        here ([Note: a gather launched as a graph]). Collective when ``record`` is: every rank
        captures the same calls in the same order."""
        with self.lock:
            try:
                launch = CapturedLaunch(stream, record, what)
            except CudaDriverError as e:
                raise CommError(f"{what}: capturing the gather into a CUDA graph failed on rank {rank}: {e}. "
                                "Pass gather_launch='direct' to the communicator to call NCCL per layer "
                                "instead") from e
        return self.keep(launch)

    def keep(self, launch: CapturedLaunch) -> CapturedLaunch:
        """Own ``launch``: it is destroyed with the others, before the communicator."""
        self.launches.append(launch)
        return launch

    def drop(self, launch: CapturedLaunch) -> None:
        """Destroy one captured graph (a closed weight sharding's gather)."""
        if launch in self.launches:
            self.launches.remove(launch)
        launch.destroy()

    def destroy_all(self) -> None:
        """Destroy every graph still kept (at close, and before the abort)."""
        launches, self.launches = self.launches, []
        for launch in launches:
            launch.destroy()

    def __len__(self) -> int:
        return len(self.launches)
