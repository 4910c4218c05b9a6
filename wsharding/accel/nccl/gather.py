"""One layer's gather on our NCCL communicator, prepared once, issued in O(1) host time.

[Note: no serial local copy]
The copy-engine AllGather of NCCL, given a separate send buffer, first copies this rank's own chunk
into the receive buffer and only then starts the peer copies, one after the other on the gather
stream (measured on two H200s: a 0.10 ms local DtoD copy, then the 0.56 ms PtoP copy, per layer).
An *in-place* gather (the send buffer is this rank's own slice of the receive buffer) skips the
local copy. So the own chunk is placed into the slot beforehand, by a copy on a third stream (the
copy stream) that overlaps the previous layer's gather and compute; the gather stream then runs
only peer copies, (N-1)/N * S bytes per layer, back to back.

Per layer, in order (streams: compute C, copy K, gather G)::

    K waits gate (C: the layer that last read this slot is done)
    K: own chunk -> slot[rank*C : (rank+1)*C]        ; record copied on K
    G waits copied; G: ncclAllGather in place        ; record ready on G
    C waits ready (at the layer's start, in :meth:`wait`)

When the own chunk already *is* its slice of the slot ([Note: the own chunk mapped, not copied] in
``wsharding/accel/mapped_slots.py``) there is nothing to copy: G waits for the gate itself and K is not
used. The ncclAllGather itself is launched as a CUDA graph captured at init ([Note: a gather
launched as a graph] in ``wsharding/accel/captured_launch.py``), except inside a capture of the
whole step, which records NCCL's own launch.

What the copy costs (measured on two H200s, and beside a GEMM loop on one): a same-device copy runs on
the SMs, not on a copy engine -- issued beside a persistent GEMM it waits for the GEMM to end, then
takes every SM for its ~100 us (218 MB), and ``cuMemcpyBatchAsync``'s prefer-overlap hint does not
change that. At decode sizes the SMs are mostly idle and the copy hides; at 2048 tokens per rank the
compute stream stood idle ~100 us at each layer's start, behind that layer's copy (it becomes runnable
at the same moment as the layer's first kernel: both wait for the end of the layer before). Only the
peer copies, which do use the copy engines, overlap compute for free. With N ranks the own chunk is 1/N
of the layer, so this cost shrinks as the group grows.

With the communicator's issue thread ([Note: the issue thread] in ``wsharding/accel/issue_thread.py``),
the same sequence of driver calls (:meth:`NcclPreparedGather.driver_calls`) becomes a program, made
once by the communicator's plug-in (``issuing.py``): :meth:`start` hands the gather over with its
gate, the native thread issues it, and :meth:`wait` first makes sure it was issued. Nothing here
imports the thread's module: with the thread off, the plug-in costs :meth:`start` one attribute test.

Every pointer, size and handle is an int computed at init, and the CUDA calls go through the driver
binding (``wsharding.accel.cuda_driver``), because the torch wrappers cost several times more host
time per call. World size 1 has no peers: the copy is the whole gather.
"""

from __future__ import annotations

from typing import Any

import torch

from wsharding.accel.cuda_driver import CudaDriverError, driver
from wsharding.accel.nccl.binding import NCCL_IN_PROGRESS, NCCL_SUCCESS, NCCL_UINT8
from wsharding.core.comm import CommError, check_gather_args, is_slice_of
from wsharding.core.errors import InvalidArgument


class NcclPreparedGather:
    """See the module's note. Built by :meth:`NcclCommunicator.prepare_gather`."""

    def __init__(self, comm: Any, full: torch.Tensor, chunk: torch.Tensor, what: str) -> None:
        check_gather_args(comm, full, chunk)
        comm.require_window(full, "full", what)
        self.comm = comm
        self.what = what
        self.full = full
        self.chunk = chunk
        n = chunk.numel()
        self.nbytes = n
        own = full.narrow(0, comm.rank * n, n)
        self._own_ptr = own.data_ptr()
        self._chunk_ptr = chunk.data_ptr()
        self._full_ptr = full.data_ptr()
        #: The own chunk already is its slice of the slot (nothing to copy in).
        self.in_place = is_slice_of(chunk, full, comm.rank)
        self.copied = torch.cuda.Event()
        self.ready = torch.cuda.Event() if comm.world_size > 1 else self.copied
        # torch creates the CUDA event at its first record: record once so the handles exist.
        self.copied.record(comm.copy_stream)
        self.ready.record(comm.stream)
        self._copied_ev = self.copied.cuda_event
        self._ready_ev = self.ready.cuda_event
        self._copy_stream = comm.copy_stream.cuda_stream
        self._gather_stream = comm.stream.cuda_stream
        self._cu = driver()
        #: Launches that NCCL finished on its own thread (non-blocking communicator), for the bench.
        self.in_progress_launches = 0
        #: Peers to gather from, with an NCCL call per layer. At world size 1 the copy is the whole gather.
        self._with_peers = comm.world_size > 1
        #: In place with peers: nothing to copy, so the gather stream waits for the gate itself and the
        #: copy stream is not touched (two driver calls fewer per layer).
        self._peers_only = self.in_place and self._with_peers
        #: [Note: a gather launched as a graph]: the NCCL call captured once, launched per layer.
        graphs = comm.gather_launch == "graph"
        self._graph = comm.capture(self._gather_stream, self._nccl_gather, what) if (
            graphs and self._with_peers) else None
        self._launch_graph = self._graph  # what start() launches: None while `launch` is "direct"
        #: The own-chunk copy, captured too: a large cuMemcpyDtoDAsync costs the host far more than a
        #: small one (the driver splits it), measured 35 us for 218 MB against 12 us for a graph launch.
        self._copy_graph = comm.capture(self._copy_stream, self._copy_own_chunk, f"{what} (own chunk copy)") if (
            graphs and not self.in_place) else None
        self._launch_copy_graph = self._copy_graph
        #: [Note: the issue thread]: what the communicator's plug-in (``issuing.py``) keeps here --
        #: this gather's program and the plug-in it was made for (None: made at the next hand-over),
        #: and the seq of the last push and its plug-in, until wait() saw it issued (0: none).
        self.program = self.program_for = None
        self.seq = 0
        self.seq_for = None

    @property
    def launch(self) -> str:
        """How an eager :meth:`start` reaches NCCL: ``"graph"`` (the captured call) or ``"direct"``.

        Set it the same on every rank, between steps: NCCL treats whether a collective runs from a
        graph as part of the collective, and ranks that disagree do not meet."""
        return "graph" if self._launch_graph is not None or self._launch_copy_graph is not None else "direct"

    @launch.setter
    def launch(self, how: str) -> None:
        if how not in ("graph", "direct"):
            raise InvalidArgument(f"launch must be 'graph' or 'direct', got {how!r}")
        if how == "graph" and self._graph is None and self._copy_graph is None:
            raise InvalidArgument(f"{self.what}: no captured graph to launch (communicator gather_launch="
                             f"{self.comm.gather_launch!r}, world size {self.comm.world_size})")
        graph = how == "graph"
        self.comm.drain_issued(f"{self.what}: launch = {how!r}")
        self._launch_graph = self._graph if graph else None
        self._launch_copy_graph = self._copy_graph if graph else None
        self.program = self.program_for = None  # made again for the new launch at the next start

    # ---- the per-layer hot path ------------------------------------------------------------------
    def start(self, gate: torch.cuda.Event | None = None, marks: tuple | None = None, *,
              inline: bool = False) -> None:
        """See :class:`~wsharding.core.comm.PreparedGather`. ``inline``: issue on this thread even
        with an issue thread (a gather waited on at once gains nothing from handing it over).

        In order: an error the watchdog found is raised; the issue thread, when on, takes the gather
        over; else this thread orders the streams after the gate (placing the own chunk where it must
        be copied), launches NCCL, and has the watchdog time the gather."""
        comm = self.comm
        if comm.watchdog.error is not None:
            comm.raise_if_failed(self.what)
        capturing = torch.cuda.is_current_stream_capturing()
        issuing = comm.issuing
        if issuing is not None and issuing.hand_over(self, gate, inline or capturing or marks is not None):
            return
        if capturing:
            comm.watchdog.pause_for_capture()
        if self._peers_only:
            end = self._gather_after_gate(gate, marks)
        else:
            end = self._place_own_chunk(gate, marks, capturing)
        if self._with_peers:
            self._launch_nccl(capturing)
        if marks is not None:
            self._cu.event_record(marks[1].cuda_event, end)
        comm.gathers_issued += 1
        if not capturing:  # a captured gather runs at the graph's replay, not now
            comm.watchdog.watch(self.ready, self.what)

    def _gather_after_gate(self, gate: torch.cuda.Event | None, marks: tuple | None) -> int:
        """In place with peers: the gather stream waits for the gate itself. Returns that stream."""
        cu, g = self._cu, self._gather_stream
        if gate is not None:
            cu.stream_wait_event(g, gate.cuda_event)
        if marks is not None:
            cu.event_record(marks[0].cuda_event, g)
        return g

    def _place_own_chunk(self, gate: torch.cuda.Event | None, marks: tuple | None, capturing: bool) -> int:
        """On the copy stream, after the gate: the own chunk into its slice of the slot (unless it is
        there already), then ``copied``, which the gather stream waits for ([Note: no serial local
        copy]). Returns the stream the gather ends on."""
        cu, k = self._cu, self._copy_stream
        if gate is not None:
            cu.stream_wait_event(k, gate.cuda_event)
        if marks is not None:
            cu.event_record(marks[0].cuda_event, k)
        if not self.in_place:
            copy = self._launch_copy_graph
            if copy is not None and not capturing:
                copy.launch(k)
            else:
                self._copy_own_chunk(k)
        cu.event_record(self._copied_ev, k)
        if not self._with_peers:
            return k
        cu.stream_wait_event(self._gather_stream, self._copied_ev)
        return self._gather_stream

    def _launch_nccl(self, capturing: bool) -> None:
        """The in-place ncclAllGather on the gather stream, then ``ready``: the captured graph, or
        NCCL's own launch (``launch = "direct"``, and inside a capture of the whole step, which
        records it: a graph launched into a capture would nest)."""
        comm, g = self.comm, self._gather_stream
        with comm.lock:  # the watchdog may abort the communicator from its thread
            if comm.handle is None or comm.aborted:
                comm.raise_if_failed(self.what)
            graph = self._launch_graph
            if graph is not None and not capturing:
                try:
                    graph.launch(g)
                except CudaDriverError as e:
                    comm.abort()  # the peers' gather is left unmatched: end it for them too
                    raise CommError(f"{e} on rank {comm.rank}; the NCCL communicator was aborted") from e
            else:
                self._nccl_gather(g)
        self._cu.event_record(self._ready_ev, g)

    def _copy_own_chunk(self, stream: int) -> None:
        self._cu.memcpy_dtod_async(self._own_ptr, self._chunk_ptr, self.nbytes, stream)

    def _nccl_gather(self, stream: int) -> None:
        """The in-place ncclAllGather on ``stream`` (eager, or recorded into the graph at init)."""
        comm = self.comm
        rc = comm.nccl.ncclAllGather(self._own_ptr, self._full_ptr, self.nbytes, NCCL_UINT8, comm.handle, stream)
        if rc == NCCL_IN_PROGRESS:
            # A non-blocking communicator may hand the launch to NCCL's own thread: the gather is
            # on the stream only once the async state reads success, and `ready` must be recorded
            # after it. The launch takes microseconds, so spin on the state (a sleep between polls
            # would cost the step far more); the deadline still turns a stuck launch into an error.
            comm.spin_until_launched(self.what)
            self.in_progress_launches += 1
        elif rc != NCCL_SUCCESS:
            comm.fail(rc, self.what)

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        if self.seq:
            self._wait_issued()
        s = stream if stream is not None else torch.cuda.current_stream(self.comm.device)
        self._cu.stream_wait_event(s.cuda_stream, self._ready_ev)

    def _wait_issued(self) -> None:
        """The ready event holds this start's record only once the issue thread ran it."""
        seq, self.seq = self.seq, 0
        if self.comm.issuing is self.seq_for:  # else that thread was stopped, after it ran everything pushed
            self.seq_for.wait_issued(self, seq)

    # ---- the issue thread's program ([Note: the issue thread]) ---------------------------------
    def driver_calls(self) -> list[tuple[str, int, int]] | None:
        """What :meth:`start` queues, in order, as ``(call, a, b)`` for the issue thread's program:
        ``("wait_gate", stream, 0)`` (the gate is given at each push), ``("launch", graph, stream)``,
        ``("record", event, stream)``, ``("wait", stream, event)``. None where a launch is not a graph
        (a direct NCCL call stays on the calling thread)."""
        nccl, copy = self._launch_graph, self._launch_copy_graph
        if (self._with_peers and nccl is None) or (not self.in_place and copy is None):
            return None
        g, k = self._gather_stream, self._copy_stream
        if self._peers_only:
            calls = [("wait_gate", g, 0)]
        else:
            calls = [("wait_gate", k, 0)]
            if not self.in_place:
                calls.append(("launch", copy.exec_handle, k))
            calls.append(("record", self._copied_ev, k))
            if self._with_peers:
                calls.append(("wait", g, self._copied_ev))
        if self._with_peers:
            calls += [("launch", nccl.exec_handle, g), ("record", self._ready_ev, g)]
        return calls

    # ---- the rest --------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the captured graph (idempotent); the communicator would otherwise at its close."""
        if not self.comm.aborted and not self.comm.closed:
            self.comm.drain_issued(f"{self.what}: close")  # nothing queued may launch a freed graph
        self.program = self.program_for = None
        for graph in (self._graph, self._copy_graph):
            if graph is not None:
                self.comm.drop_graph(graph)
        self._graph = self._launch_graph = self._copy_graph = self._launch_copy_graph = None

    def is_completed(self) -> bool:
        issuing = self.comm.issuing
        if self.seq and issuing is not None and not issuing.issued(self.seq):
            return False
        return self.ready.query()

    def __repr__(self) -> str:
        return (f"NcclPreparedGather({self.what!r}, {self.nbytes} B per rank, in_place={self.in_place}, "
                f"launch={self.launch!r})")
