"""How our NCCL communicator waits, and how a failure becomes an error instead of a hang.

Three ways an NCCL call can go wrong, and where each is caught:

* **It returns an error code.** :func:`fail` aborts the communicator (the peers' collective is left
  unmatched: the abort ends it for them too) and raises :class:`~wsharding.accel.nccl.binding.NcclError`
  with ``ncclGetErrorString`` and ``ncclGetLastError``.
* **It stays in progress** (a non-blocking communicator, or a host-side collective step whose peer
  never came). :func:`complete` and :func:`poll_until` poll ``ncclCommGetAsyncError`` with the
  communicator's timeout; :func:`spin_until_launched` does the same without sleeping, on the hot path.
  Past the timeout the communicator is aborted and :class:`CommTimeout` raised.
* **It fails later, on the GPU** (a gather whose peer never arrives). The watchdog thread
  (``watchdog.py``) finds it off the hot path and aborts; the next call that issues or waits raises
  what it found (:func:`raise_if_failed`). If no such call comes, the host is held behind the stuck
  gather and :func:`end_stuck_process` ends the process with its last words.

The functions take the communicator as their first argument: :class:`NcclCommunicator` binds them as
its methods, so they read and write its state (``handle``, ``aborted``, ``watchdog``, ``lock``).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from typing import Any

from wsharding.accel.nccl.binding import NCCL_IN_PROGRESS, NCCL_SUCCESS, NcclError
from wsharding.core.comm import CommError
from wsharding.fatal import end_process


class CommTimeout(CommError):
    """An NCCL operation did not complete within the timeout; the communicator was aborted."""


def async_state(comm: Any) -> int:
    """``ncclCommGetAsyncError``: 0 done, 7 in progress, anything else an error."""
    state = ctypes.c_int(0)
    comm.nccl.check(comm.nccl.ncclCommGetAsyncError(comm.handle, ctypes.byref(state)), "ncclCommGetAsyncError",
                    comm.handle)
    return state.value


def poll_until(comm: Any, done: Callable[[], bool], what: str, timeout_s: float | None = None) -> None:
    """Poll ``done()`` and the communicator's async error until ``done()`` is true; abort and
    raise on an async error or after the timeout. This is how a missing rank becomes an error."""
    limit = comm.timeout_s if timeout_s is None else timeout_s
    deadline = time.monotonic() + limit
    pause = 1e-5
    while True:
        state = comm.async_state() if comm.handle else NCCL_SUCCESS
        if state not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            err = NcclError(what, state, comm.nccl.error_string(state), comm.nccl.last_error(comm.handle))
            comm.abort()
            raise err
        if done():
            return
        if time.monotonic() > deadline:
            comm.abort()
            raise CommTimeout(
                f"{what} on rank {comm.rank} of {comm.world_size} ({comm.mode}) did not complete within {limit:.1f} s: "
                "a rank is missing or stuck in a different collective; the NCCL communicator was aborted"
            )
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


def complete(comm: Any, rc: int, what: str) -> None:
    """Check a call's result; for in-progress (non-blocking comm) poll until done or timeout."""
    if rc in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
        # A non-blocking communicator may still be busy even after ncclSuccess: NCCL refuses the
        # next call ("Attempt to use communicator before the previous operation returned
        # ncclSuccess") until the async state is success, so always poll it.
        comm.poll_until(lambda: comm.async_state() == NCCL_SUCCESS, what)
        return
    else:
        comm.fail(rc, what)


def fail(comm: Any, rc: int, what: str) -> None:
    """A call returned an error: abort and raise it."""
    err = NcclError(what, rc, comm.nccl.error_string(rc), comm.nccl.last_error(comm.handle))
    comm.abort()
    raise err


def spin_until_launched(comm: Any, what: str) -> None:
    """Hot path: after ncclInProgress, poll the async state without sleeping until the launch is
    done (success) -- it takes microseconds; abort and raise on an error or after the timeout."""
    state = ctypes.c_int(NCCL_IN_PROGRESS)
    ref = ctypes.byref(state)
    get = comm.nccl.ncclCommGetAsyncError
    deadline = None
    polls = 0
    while True:
        rc = get(comm.handle, ref)
        if rc != NCCL_SUCCESS:
            comm.fail(rc, f"ncclCommGetAsyncError after {what}")
        if state.value == NCCL_SUCCESS:
            return
        if state.value != NCCL_IN_PROGRESS:
            comm.fail(state.value, what)
        polls += 1
        if polls % 4096 == 0:
            now = time.monotonic()
            deadline = deadline or now + comm.timeout_s
            if now > deadline:
                comm.abort()
                raise CommTimeout(f"{what} on rank {comm.rank}: NCCL did not finish launching it within "
                                  f"{comm.timeout_s:.1f} s; the communicator was aborted")


def raise_if_failed(comm: Any, what: str) -> None:
    """Raise the error the watchdog found (or that this communicator is unusable), naming ``what``
    and this rank; nothing when all is well. Called where a gather is issued."""
    err = comm.watchdog.error if comm.watchdog is not None else None
    if err is not None:
        comm.watchdog.delivered = True  # the host is not held: the watchdog need not end the process
        raise CommError(f"{what} on rank {comm.rank} of {comm.world_size} ({comm.mode}): {err}; the NCCL "
                        "communicator was aborted")
    if comm.closed or comm.aborted:
        raise CommError(f"{what}: the NCCL communicator of rank {comm.rank} is "
                        f"{'aborted' if comm.aborted else 'closed'}")


def check_open(comm: Any) -> None:
    """Raise unless the communicator can still be used (not closed, not aborted)."""
    if comm.closed or comm.aborted:
        raise CommError(f"NCCL communicator of rank {comm.rank} is {'aborted' if comm.aborted else 'closed'}")


# ---- the watchdog's side ([Note: blocking communicator]: it watches gathers in both modes) ---------
def async_error_text(comm: Any) -> str | None:
    """For the watchdog: ``ncclCommGetAsyncError`` as an error text, or None when fine."""
    with comm.lock:
        if not comm.handle or comm.aborted:
            return None
        state = ctypes.c_int(0)
        rc = comm.nccl.ncclCommGetAsyncError(comm.handle, ctypes.byref(state))
    code = rc if rc != NCCL_SUCCESS else state.value
    if code in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
        return None
    return f"NCCL reported {comm.nccl.error_string(code)} ({code}): {comm.nccl.last_error(comm.handle)}"


def abort_from_watchdog(comm: Any, reason: str) -> None:
    """For the watchdog: abort, holding the lock the host takes around its NCCL calls."""
    with comm.lock:
        comm.abort()


def end_stuck_process(comm: Any, message: str) -> None:
    """For the watchdog: the host never came for its error ([Note: a host held behind a stuck
    gather] in ``wsharding/fatal.py``): end the process, naming the rank."""
    end_process(f"rank {comm.rank} of {comm.world_size} ({comm.mode}): {message}")
