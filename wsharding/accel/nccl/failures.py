"""How our NCCL communicator waits, and how a failure becomes an error instead of a hang.

Three ways an NCCL call can go wrong, and where each is caught:

* **It returns an error code.** :meth:`~NcclWaits.fail` aborts the communicator (the peers' collective is left
  unmatched: the abort ends it for them too) and raises :class:`~wsharding.accel.nccl.binding.NcclError`
  with ``ncclGetErrorString`` and ``ncclGetLastError``.
* **It stays in progress** (a non-blocking communicator, or a host-side collective step whose peer
  never came). :meth:`~NcclWaits.complete` and :meth:`~NcclWaits.poll_until` poll ``ncclCommGetAsyncError`` with the
  communicator's timeout; :meth:`~NcclWaits.spin_until_launched` does the same without sleeping, on the hot path.
  Past the timeout the communicator is aborted and :class:`CommTimeout` raised.
* **It fails later, on the GPU** (a gather whose peer never arrives). The watchdog thread
  (``watchdog.py``) finds it off the hot path and aborts; the next call that issues or waits raises
  what it found (:meth:`~NcclWaits.raise_if_failed`). If no such call comes, the host is held behind the stuck
  gather and :meth:`~NcclWaits.end_stuck_process` ends the process with its last words.

They are the methods of :class:`NcclWaits`, a base of :class:`NcclCommunicator`, which declares
what they read (``handle``, ``aborted``, ``closed``, ``watchdog``, ``lock``, ...) and the one thing
they do to the communicator: :meth:`abort` it.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from wsharding.accel.nccl.binding import NCCL_IN_PROGRESS, NCCL_SUCCESS, NcclBinding, NcclError
from wsharding.core.comm import CommError
from wsharding.fatal import end_process

if TYPE_CHECKING:
    from wsharding.accel.nccl.watchdog import Watchdog


class CommTimeout(CommError):
    """An NCCL operation did not complete within the timeout; the communicator was aborted."""


class NcclWaits:
    """The waits of an NCCL communicator and its failures turned into errors (see the module's
    docstring). What they read, the communicator sets up; :meth:`abort` is the communicator's."""

    #: ``ncclComm_t``; None before init and after close.
    handle: int | None
    #: The ctypes binding of the loaded libnccl.
    nccl: NcclBinding
    rank: int
    world_size: int
    mode: str
    #: How long any operation may stay in progress before the communicator is aborted.
    timeout_s: float
    #: The thread that finds errors off the hot path (None before it starts).
    watchdog: Watchdog | None
    #: Held around NCCL calls that the watchdog's abort (from its thread) must not interleave with.
    lock: threading.RLock
    aborted: bool
    closed: bool

    def abort(self) -> None:
        raise NotImplementedError

    def async_state(self) -> int:
        """``ncclCommGetAsyncError``: 0 done, 7 in progress, anything else an error."""
        state = ctypes.c_int(0)
        self.nccl.check(self.nccl.ncclCommGetAsyncError(self.handle, ctypes.byref(state)), "ncclCommGetAsyncError",
                        self.handle)
        return state.value

    def poll_until(self, done: Callable[[], bool], what: str, timeout_s: float | None = None) -> None:
        """Poll ``done()`` and the communicator's async error until ``done()`` is true; abort and
        raise on an async error or after the timeout. This is how a missing rank becomes an error."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        pause = 1e-5
        while True:
            state = self.async_state() if self.handle else NCCL_SUCCESS
            if state not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
                err = NcclError(what, state, self.nccl.error_string(state), self.nccl.last_error(self.handle))
                self.abort()
                raise err
            if done():
                return
            if time.monotonic() > deadline:
                self.abort()
                raise CommTimeout(
                    f"{what} on rank {self.rank} of {self.world_size} ({self.mode}) did not complete within {limit:.1f} s: "
                    "a rank is missing or stuck in a different collective; the NCCL communicator was aborted"
                )
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def complete(self, rc: int, what: str) -> None:
        """Check a call's result; for in-progress (non-blocking comm) poll until done or timeout."""
        if rc in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            # A non-blocking communicator may still be busy even after ncclSuccess: NCCL refuses the
            # next call ("Attempt to use communicator before the previous operation returned
            # ncclSuccess") until the async state is success, so always poll it.
            self.poll_until(lambda: self.async_state() == NCCL_SUCCESS, what)
            return
        else:
            self.fail(rc, what)

    def fail(self, rc: int, what: str) -> None:
        """A call returned an error: abort and raise it."""
        err = NcclError(what, rc, self.nccl.error_string(rc), self.nccl.last_error(self.handle))
        self.abort()
        raise err

    def spin_until_launched(self, what: str) -> None:
        """Hot path: after ncclInProgress, poll the async state without sleeping until the launch is
        done (success) -- it takes microseconds; abort and raise on an error or after the timeout."""
        state = ctypes.c_int(NCCL_IN_PROGRESS)
        ref = ctypes.byref(state)
        get = self.nccl.ncclCommGetAsyncError
        deadline = None
        polls = 0
        while True:
            rc = get(self.handle, ref)
            if rc != NCCL_SUCCESS:
                self.fail(rc, f"ncclCommGetAsyncError after {what}")
            if state.value == NCCL_SUCCESS:
                return
            if state.value != NCCL_IN_PROGRESS:
                self.fail(state.value, what)
            polls += 1
            if polls % 4096 == 0:
                now = time.monotonic()
                deadline = deadline or now + self.timeout_s
                if now > deadline:
                    self.abort()
                    raise CommTimeout(f"{what} on rank {self.rank}: NCCL did not finish launching it within "
                                      f"{self.timeout_s:.1f} s; the communicator was aborted")

    def raise_if_failed(self, what: str) -> None:
        """Raise the error the watchdog found (or that this communicator is unusable), naming ``what``
        and this rank; nothing when all is well. Called where a gather is issued."""
        err = self.watchdog.error if self.watchdog is not None else None
        if err is not None:
            self.watchdog.delivered = True  # the host is not held: the watchdog need not end the process
            raise CommError(f"{what} on rank {self.rank} of {self.world_size} ({self.mode}): {err}; the NCCL "
                            "communicator was aborted")
        if self.closed or self.aborted:
            raise CommError(f"{what}: the NCCL communicator of rank {self.rank} is "
                            f"{'aborted' if self.aborted else 'closed'}")

    def check_open(self) -> None:
        """Raise unless the communicator can still be used (not closed, not aborted)."""
        if self.closed or self.aborted:
            raise CommError(f"NCCL communicator of rank {self.rank} is {'aborted' if self.aborted else 'closed'}")

    # ---- the watchdog's side ([Note: blocking communicator]: it watches gathers in both modes) -----
    def async_error_text(self) -> str | None:
        """For the watchdog: ``ncclCommGetAsyncError`` as an error text, or None when fine."""
        with self.lock:
            if not self.handle or self.aborted:
                return None
            state = ctypes.c_int(0)
            rc = self.nccl.ncclCommGetAsyncError(self.handle, ctypes.byref(state))
        code = rc if rc != NCCL_SUCCESS else state.value
        if code in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            return None
        return f"NCCL reported {self.nccl.error_string(code)} ({code}): {self.nccl.last_error(self.handle)}"

    def abort_from_watchdog(self, reason: str) -> None:
        """For the watchdog: abort, holding the lock the host takes around its NCCL calls."""
        with self.lock:
            self.abort()

    def end_stuck_process(self, message: str) -> None:
        """For the watchdog: the host never came for its error ([Note: a host held behind a stuck
        gather] in ``wsharding/fatal.py``): end the process, naming the rank."""
        end_process(f"rank {self.rank} of {self.world_size} ({self.mode}): {message}")
