"""A gather issued now, not prepared: :meth:`NcclCommunicator.all_gather_into` (which calls
:func:`all_gather_into` here, through the communicator's public face) and its handle.

The per-layer gathers are prepared once (``gather.py``); this one checks and converts its arguments
at every call, for what runs a gather once or rarely -- the copy-engine set-up at init, tests,
benchmarks. Like a prepared gather it never blocks the host: the handle's ``wait()`` orders the
caller's stream, and only ``synchronize()`` waits (with the communicator's timeout).
"""

from __future__ import annotations

from typing import Any

import torch

from wsharding.accel.nccl.binding import NCCL_SUCCESS, NCCL_UINT8
from wsharding.core.comm import CommError, check_gather_args


class NcclGatherHandle:
    """A gather in flight on the communicator's stream (see :meth:`NcclCommunicator.all_gather_into`)."""

    def __init__(self, comm: Any, event: torch.cuda.Event, what: str) -> None:
        self.comm = comm
        self.event = event
        self.what = what

    def wait(self) -> None:
        """Order the caller's current stream after the gather (does not block the host)."""
        torch.cuda.current_stream(self.comm.device).wait_event(self.event)

    def is_completed(self) -> bool:
        return self.event.query()

    def synchronize(self, timeout_s: float | None = None) -> None:
        """Block the host until the gather finished; abort and raise :class:`CommTimeout` after
        ``timeout_s`` (default: the communicator's), e.g. when a rank never joined."""
        self.comm.poll_until(self.event.query, self.what, timeout_s)


def all_gather_into(
    comm: Any,
    full: torch.Tensor,
    chunk: torch.Tensor,
    *,
    async_op: bool = False,
    stream: torch.cuda.Stream | None = None,
    what: str = "ncclAllGather",
) -> NcclGatherHandle:
    """Gather every rank's ``chunk`` into ``full`` on ``stream`` (default: the communicator's ``stream``).

    The gather stream first waits for the caller's current stream (so ``chunk`` is ready);
    ``wait()`` on the handle makes the caller's current stream wait for the gather. Both
    buffers must lie in registered windows (that is what the copy engine needs).
    ``async_op=False`` calls ``wait()`` before returning; neither blocks the host.
    """
    comm.check_open()
    check_gather_args(comm, full, chunk)
    for name, t in (("full", full), ("chunk", chunk)):
        comm.require_window(t, name, what)
    comm.drain_issued(what)
    s = stream if stream is not None else comm.stream
    if s.cuda_stream == 0:
        raise CommError(f"{what}: refusing the legacy default stream (NCCL 2.28 copy-engine collectives fail on "
                        "it); pass a created torch.cuda.Stream")
    current = torch.cuda.current_stream(comm.device)
    if current.cuda_stream != s.cuda_stream:
        s.wait_stream(current)
    comm.raise_if_failed(what)
    with comm.lock:
        rc = comm.nccl.ncclAllGather(chunk.data_ptr(), full.data_ptr(), chunk.numel(), NCCL_UINT8, comm.handle,
                                     s.cuda_stream)
    if rc != NCCL_SUCCESS:
        comm.complete(rc, what)
    event = torch.cuda.Event()
    event.record(s)
    comm.gathers_issued += 1
    if torch.cuda.is_current_stream_capturing():
        comm.watchdog.pause_for_capture()
    else:
        comm.watchdog.watch(event, what)
    handle = NcclGatherHandle(comm, event, what)
    if not async_op:
        handle.wait()
    return handle
