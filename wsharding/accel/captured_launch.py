"""Stream work captured once into a CUDA graph, then launched with one driver call.

[Note: a gather launched as a graph]
Each ``ncclAllGather`` call does its argument checks, plan building and enqueue on the host, every time:
19-20 us of host per in-place copy-engine gather on a blocking communicator (measured on two H200s),
twice the whole budget of 10 us per layer for the planner and communicator together. The gather of a
layer is the same call every step (same pointers, same count, same stream), so it is captured into a
CUDA graph once, at finalize, and each step launches the graph: one ``cuGraphLaunch`` instead of NCCL's
host path.

NCCL supports capturing every collective, with three rules that shape this file's users:
* Whether a launch is captured is a collective property, and launching a graph that holds a captured
  collective is a collective call: every rank captures the same gathers in the same order (they are
  prepared at finalize, in layer order, on every rank) and launches them in the same order.
* The graphs must be destroyed before the communicator: since NCCL 2.26, ``ncclCommDestroy`` waits
  until every graph that references the communicator is gone, and would wait forever for one that a
  Python object still holds. The communicator therefore owns every graph it captured and destroys
  them first at teardown.
* The capture runs in *relaxed* mode: the communicator's watchdog thread keeps querying events while
  this thread captures, which the default (global) mode would turn into a failed capture.

The capture records only the stream work; the event waits and records around it stay plain calls
on the stream, so the gates of the planner keep their per-step meaning.

[Note: one graph per layer, not per step]
Why not capture a whole step's gathers into one graph and launch it once per step (one launch instead
of one per layer)? Each gather must wait for its gate -- the end of the layer that last read its slot
-- and at the step's start that end is not queued yet. The gate can move onto the GPU (a flag the
compute stream writes after the layer, ``cuStreamWriteValue32``; a graph node that waits for it,
``cuStreamWaitValue32``), and that works in isolation (a flag-gated copy in a graph is held until
another stream writes the flag, and resets it). But then GPU work waits for host work that has not been
issued yet, which CUDA does not allow for: anything that synchronizes the whole device while a step runs
-- loading a kernel at its first use, which happened inside the first forward with lazy and with eager
module loading alike, or ``cudaFree`` when the allocator gives memory back -- waits for the gather
stream, which waits for the host, which waits in that call. Tried on one H200: the first forward
deadlocked, and the watchdog ended the process after its timeout. A gather is therefore launched when
its gate is already queued: one launch per layer.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

from wsharding.accel.cuda_driver import CudaDriver, CUgraph, CUgraphExec, check_cu, driver

#: CUstreamCaptureMode: other threads may make any CUDA call while this one captures.
CU_STREAM_CAPTURE_MODE_RELAXED = 2


class CapturedLaunch:
    """What ``record(stream)`` queues on ``stream``, captured once; :meth:`launch` queues it again.

    ``record`` must queue work only on ``stream`` (or on streams it joins back into ``stream``) and
    must not wait on the host for the GPU: nothing it queues runs during the capture.
    """

    def __init__(self, stream: int, record: Callable[[int], None], what: str,
                 cu: CudaDriver | None = None) -> None:
        self.what = what
        self._destroy_lock = threading.Lock()
        self._cu = cu or driver()
        self._graph = CUgraph()
        self._exec = CUgraphExec()
        cu = self._cu
        check_cu(cu._cuStreamBeginCapture_v2(stream, CU_STREAM_CAPTURE_MODE_RELAXED), f"{what}: cuStreamBeginCapture")
        try:
            record(stream)
        finally:
            # End the capture even when `record` failed, so the stream is usable again.
            rc = cu._cuStreamEndCapture(stream, ctypes.byref(self._graph))
        check_cu(rc, f"{what}: cuStreamEndCapture")
        check_cu(cu._cuGraphInstantiateWithFlags(ctypes.byref(self._exec), self._graph, 0),
                 f"{what}: cuGraphInstantiate")
        check_cu(cu._cuGraphUpload(self._exec, stream), f"{what}: cuGraphUpload")
        #: The launch function and its graph, looked up once: the hot path is one ctypes call.
        self._launch = cu._cuGraphLaunch
        self._handle = self._exec.value

    @property
    def alive(self) -> bool:
        return self._handle is not None

    @property
    def exec_handle(self) -> int | None:
        """The instantiated graph (``CUgraphExec``) as an int, for a caller that launches it with its
        own ``cuGraphLaunch`` (the issue thread's programs); None once destroyed."""
        return self._handle

    def launch(self, stream: int) -> None:
        """Hot path: queue the captured work on ``stream``."""
        rc = self._launch(self._handle, stream)
        if rc:
            check_cu(rc, f"{self.what}: cuGraphLaunch")

    def destroy(self) -> None:
        """Free the graph (idempotent, and safe from two threads: a sharding closing while the
        communicator's abort thread frees every graph). A launch already queued still runs: CUDA
        defers the release."""
        with self._destroy_lock:
            if self._handle is None:
                return
            self._handle = None
        cu = self._cu
        check_cu(cu._cuGraphExecDestroy(self._exec), f"{self.what}: cuGraphExecDestroy")
        check_cu(cu._cuGraphDestroy(self._graph), f"{self.what}: cuGraphDestroy")

    def __repr__(self) -> str:
        return f"CapturedLaunch({self.what!r}, {'alive' if self.alive else 'destroyed'})"
