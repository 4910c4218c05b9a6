"""The issue thread as a plug-in of our NCCL communicator ([Note: the issue thread] in
``wsharding/accel/issue_thread.py``).

It is an experimental acceleration, off by default, and then nothing here (nor the native thread's
module) is imported: the communicator's ``issuing`` is None and costs each caller one attribute
test. Switched on -- ``NcclCommunicator(issue_thread=True)`` or ``set_issue_thread(True)`` -- the
communicator holds one :class:`Issuing`, and everything between the thread, the communicator and its
prepared gathers goes through it:

* :meth:`Issuing.hand_over` -- a prepared gather's start, pushed as its program (the hot path);
* :meth:`Issuing.wait_issued` -- a gather's wait, once the thread ran its push;
* :meth:`Issuing.drain` -- before any call that reaches the gather or copy stream (or NCCL) directly;
  the communicator's ``drain_issued`` is the one place that calls it;
* :meth:`Issuing.stop` -- when the thread is switched off, at close, at abort.

What it keeps on each prepared gather (written only here, read by the gather's ``wait``):
``program`` and ``program_for`` (the gather's driver calls as a program, and the :class:`Issuing` it
was made for: made again for a new thread, or after the gather's ``launch`` changed), ``seq`` and
``seq_for`` (the last push, until its wait saw it run; 0: none).
"""

from __future__ import annotations

from typing import Any

from wsharding.accel.issue_thread import (
    OP_LAUNCH,
    OP_RECORD,
    OP_WAIT,
    OP_WAIT_GATE,
    IssueThread,
    IssueThreadError,
    IssueThreadUnavailable,
    Program,
    driver_issue_thread,
)
from wsharding.core.comm import CommError

#: The names of a prepared gather's ``driver_calls()``, as the native thread's op kinds.
OPS = {"wait": OP_WAIT, "wait_gate": OP_WAIT_GATE, "launch": OP_LAUNCH, "record": OP_RECORD}


def start_issuing(comm: Any, name: str) -> Issuing:
    """A native issue thread on the CUDA driver for ``comm``, in the calling thread's context."""
    try:
        thread = driver_issue_thread(f"{name} issue thread of rank {comm.rank}")
    except IssueThreadUnavailable as e:
        raise CommError(f"issue_thread=True on rank {comm.rank}: {e}") from e
    return Issuing(comm, thread)


class Issuing:
    """One communicator's issue thread (see the module's docstring)."""

    def __init__(self, comm: Any, thread: IssueThread) -> None:
        self.comm = comm
        self.thread = thread

    def program_of(self, gather: Any) -> Program | None:
        """``gather``'s driver calls as a program named after it, or None where its launch is not a
        graph (a direct NCCL call stays on the calling thread)."""
        calls = gather.driver_calls()
        if calls is None:
            return None
        program = IssueThread.program([(OPS[call], a, b) for call, a, b in calls])
        self.thread.name_program(program, gather.what)
        return program

    def hand_over(self, gather: Any, gate: Any, inline: bool) -> bool:
        """Hot path: push ``gather``'s program with ``gate`` (an event, or None) and return True; or,
        where the caller must issue the gather itself -- ``inline`` (trace marks, a capture, a gather
        waited on at once) or no program -- drain and return False, so the streams see one order."""
        if gather.program_for is not self:
            gather.program, gather.program_for = self.program_of(gather), self
        program = gather.program
        if program is None or inline:
            self.drain(gather.what)
            return False
        comm = self.comm
        if comm.aborted:
            comm.raise_if_failed(gather.what)
        gather.seq = self.thread.push(program, gate.cuda_event if gate is not None else 0)
        gather.seq_for = self
        comm.gathers_issued += 1
        return True

    def wait_issued(self, gather: Any, seq: int) -> None:
        """Return once push ``seq`` of ``gather`` was run, then have the watchdog time its ready event;
        a failed driver call aborts the communicator (the peers' gather is left unmatched: the abort
        ends it for them too) and raises :class:`CommError`."""
        comm = self.comm
        try:
            self.thread.wait_issued(seq, poll=lambda: comm.raise_if_failed(gather.what), timeout_s=comm.timeout_s,
                                    what=gather.what)
        except IssueThreadError as e:
            comm.abort()
            raise CommError(f"{e} on rank {comm.rank}; the NCCL communicator was aborted") from e
        comm.watchdog.watch(gather.ready, gather.what)

    def issued(self, seq: int) -> bool:
        """Whether the thread ran push ``seq`` (a plain memory read)."""
        return self.thread.issued >= seq

    def drain(self, what: str) -> None:
        """Let the thread run everything pushed so far; a failed driver call aborts and raises."""
        comm = self.comm
        try:
            self.thread.drain(poll=lambda: comm.raise_if_failed(what), timeout_s=comm.timeout_s, what=what)
        except IssueThreadError as e:
            comm.abort()  # the peers' gathers are left unmatched: end them too
            raise CommError(f"{e}; the NCCL communicator of rank {comm.rank} was aborted") from e

    def stop(self) -> bool:
        """End the thread after its current driver call (what was not run yet is dropped: drain
        first where it must run). Returns False when it did not end within the communicator's
        ``abort_wait_s``: a thread held in a driver call that long is left to end on its own -- after
        an abort the process is on its way out, like a stuck abort's."""
        return self.thread.stop(self.comm.abort_wait_s)

    def __repr__(self) -> str:
        return f"Issuing({self.thread!r})"
