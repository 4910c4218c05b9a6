"""How our NCCL communicator ends: closed in order, aborted, or closed at interpreter exit.

An orderly close is collective and runs in this order, because each step needs the one before:

1. the shardings whose tensors view our memory close first (so that their model raises instead of
   reading freed memory);
2. the watchdog stops; the issue thread runs what was handed to it and stops ([Note: the issue
   thread]);
3. the gather stream drains, and the captured graphs are destroyed (they reference the windows,
   and NCCL's deregistration and destroy wait for every graph that references the communicator);
4. the ranks agree over gloo, then deregister the windows (collective), free the memory, and
   finalize and destroy the communicator.

On an error -- or when a collective step of the close fails -- the communicator is aborted instead
and only the memory is freed ([Note: abort with a stuck gather] says when not even that).

The communicator owns one :class:`Teardown`, which holds what only the ending needs -- the callbacks
of the shardings to close first, and the thread of an abort -- and reads the communicator through
its public face (its handle, watchdog, issue thread, pool, graphs and waits).
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from wsharding.core.comm import CommError

# Every communicator not yet closed, closed at interpreter exit (best effort: the driver reclaims the
# rest when the process ends).
_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def close_at_exit(comm: Any) -> None:
    """Have ``comm.close()`` run at interpreter exit unless it was closed before."""
    _LIVE.add(comm)


@atexit.register
def _close_all() -> None:
    for c in list(_LIVE):
        try:
            c.close()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass


class Teardown:
    """How one communicator ends (see the module's docstring): its close, its abort, and whether an
    abort left its memory allocated. ``comm``: the :class:`~wsharding.accel.nccl.communicator.NcclCommunicator`
    that owns it, read and ended through its public attributes and methods."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        #: Callbacks of the users whose tensors view the communicator's memory (weight shardings),
        #: held weakly: run before it is freed.
        self.callbacks: list[weakref.WeakMethod] = []
        #: The thread ``ncclCommAbort`` runs on ([Note: abort with a stuck gather]); None: no abort yet.
        self.abort_thread: threading.Thread | None = None

    def on_close(self, callback: Callable[[], None]) -> None:
        self.callbacks.append(weakref.WeakMethod(callback))

    @property
    def leaked(self) -> bool:
        """True when an abort did not finish (a gather stuck on the GPU): the memory stays allocated."""
        return self.abort_thread is not None and self.abort_thread.is_alive()

    def close(self) -> None:
        """Close the shardings that use the memory, then deregister windows, free the memory, finalize
        and destroy (or abort) the communicator."""
        comm = self.comm
        callbacks, self.callbacks = self.callbacks, []
        for ref in callbacks:
            fn = ref()
            if fn is not None and not (comm.closed or comm.aborted):
                fn()
        if not comm.closed:
            self.end(error=comm.aborted)

    def end(self, error: bool) -> None:
        """Deregister windows (collective), free memory, finalize + destroy; on an error, or when a
        collective step times out, abort first and only free memory."""
        comm = self.comm
        if comm.watchdog is not None:
            comm.watchdog.stop()
        try:
            if comm.issuing is not None:
                self._stop_issuing(drain=not error and not comm.aborted)
            if comm.handle and not comm.aborted and not error:
                error = not self._deregister()
            if error:
                self.abort()
            if not comm.aborted:
                torch.cuda.synchronize(comm.device)  # no copy may still touch the memory we free
                comm.graphs.destroy_all()  # (when the deregistration above did not run)
            if not self.leaked:  # [Note: abort with a stuck gather]
                comm.pool.free_all()
            if comm.handle and not comm.aborted:
                comm.complete(comm.nccl.ncclCommFinalize(comm.handle), "ncclCommFinalize")
                if not comm.aborted:
                    comm.nccl.check(comm.nccl.ncclCommDestroy(comm.handle), "ncclCommDestroy")
        finally:
            comm.handle = None
            comm.closed = True
            _LIVE.discard(comm)

    def _stop_issuing(self, drain: bool) -> None:
        """Let the issue thread run what was handed to it (an orderly close), then stop it."""
        comm = self.comm
        if drain:
            try:
                comm.drain_issued("close")
            except CommError:
                pass  # the drain aborted the communicator
        comm.issuing.stop()

    def _deregister(self) -> bool:
        """The collective part of a close; False when a peer is gone (the close becomes an abort)."""
        comm = self.comm
        try:
            comm.synchronize()
            comm.graphs.destroy_all()  # they reference windows; NCCL's destroy waits for them
            # Deregistration is collective, and on a blocking communicator it would wait for a peer
            # that is gone with no timeout: agree over gloo first, whose failure (a dead peer closes
            # its sockets) or timeout turns the close into an abort.
            comm.exchange("close")
            comm.pool.deregister_all()
        except CommError:
            pass  # poll_until / complete aborted the communicator already
        except (RuntimeError, ValueError):  # gloo: a peer is gone, or the group was destroyed
            return False
        return True

    def abort(self) -> None:
        """``ncclCommAbort``: ends pending operations; windows go with the communicator.

        [Note: abort with a stuck gather]
        A copy-engine gather whose peer never came waits on the GPU for a flag the peer would write,
        and NCCL 2.28's abort neither writes it nor returns while that wait holds the stream (seen on
        two H200s: the calling thread never came back). So the abort runs on a thread of its own; we
        wait ``abort_wait_s`` for it and go on either way, and the memory of a communicator whose
        abort did not finish is left allocated (``leaked``): freeing memory that a stuck stream still
        addresses could hang too. The host gets its error; the process is expected to end, and the
        driver reclaims everything at exit.
        """
        comm = self.comm
        if comm.handle and not comm.aborted:
            comm.aborted = True
            if comm.issuing is not None:  # before the graphs it launches are destroyed
                comm.issuing.stop()
            for b in comm.pool.buffers:
                b.window = None
            self.abort_thread = threading.Thread(target=self._abort_now, args=(comm.handle,),
                                                 name=f"wsharding-nccl-abort-r{comm.rank}", daemon=True)
            self.abort_thread.start()
            self.abort_thread.join(comm.abort_wait_s)

    def _abort_now(self, handle: int) -> None:
        # NCCL's abort, like its destroy, waits until no graph references the communicator.
        try:
            self.comm.graphs.destroy_all()
        finally:
            self.comm.nccl.ncclCommAbort(handle)
