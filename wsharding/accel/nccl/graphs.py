"""The CUDA graphs our NCCL communicator captured: it owns every one, and destroys them before itself.

Since NCCL 2.26 ``ncclCommDestroy`` and ``ncclCommAbort`` wait until every graph that references the
communicator is gone ([Note: a gather launched as a graph] in ``wsharding/accel/captured_launch.py``),
so a graph that a Python object still held would hold the close, or the abort thread, forever. The
communicator therefore keeps the list (``_graphs``), a closed weight sharding drops its own, and the
teardown destroys the rest first.

The functions take the communicator as their first argument: :class:`NcclCommunicator` binds them as
its methods.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from wsharding.accel.captured_launch import CapturedLaunch
from wsharding.accel.cuda_driver import CudaDriverError
from wsharding.core.comm import CommError


def capture(comm: Any, stream: int, record: Callable[[int], None], what: str) -> CapturedLaunch:
    """Capture what ``record(stream)`` queues (NCCL calls on this communicator) into a graph that
    this communicator owns and destroys before itself ([Note: a gather launched as a graph]).
    Collective when ``record`` is: every rank captures the same calls in the same order."""
    comm._check_open()
    comm.drain_issued(what)
    with comm.lock:
        try:
            launch = CapturedLaunch(stream, record, what)
        except CudaDriverError as e:
            raise CommError(f"{what}: capturing the gather into a CUDA graph failed on rank {comm.rank}: {e}. "
                            "Pass gather_launch='direct' to the communicator to call NCCL per layer "
                            "instead") from e
    comm._graphs.append(launch)
    return launch


def drop_graph(comm: Any, launch: CapturedLaunch) -> None:
    """Destroy one captured graph (a closed weight sharding's gather)."""
    if launch in comm._graphs:
        comm._graphs.remove(launch)
    launch.destroy()


def destroy_graphs(comm: Any) -> None:
    """Destroy every graph captured on the communicator (at close, and before the abort)."""
    graphs, comm._graphs = comm._graphs, []
    for launch in graphs:
        launch.destroy()
