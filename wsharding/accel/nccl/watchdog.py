"""The watchdog: NCCL errors and stuck gathers are found off the hot path.

Why a thread: a gather issued on a stream returns to Python at once, so nothing on the hot path can
see that a peer never joined or that NCCL failed asynchronously -- and polling
``ncclCommGetAsyncError`` or querying events there would cost every layer host time. Instead the
hot path appends (event, what, when) for every gather it issues (a deque append), and this thread,
every ``period_s``:

* drops the gathers whose event completed (a completed event means all earlier ones on that stream
  completed too, and the events are reused step after step, so a later record only makes an entry
  look younger -- never done too early);
* if the oldest gather still in flight is older than ``timeout_s``, or ``ncclCommGetAsyncError``
  reports an error, it stores the error and aborts the communicator (``ncclCommAbort`` may be
  called from another thread; it does not release a copy-engine gather stuck on the GPU, see
  [Note: abort with a stuck gather] in ``teardown.py``).

The next call that issues or waits through the communicator raises that error, naming the layer and
the rank (:meth:`raise_if_failed`); the host never blocks on the GPU to find out. If no such call
comes for ``stuck_after_s`` after the error -- the host thread is held inside a CUDA synchronization
behind the stuck gather, see [Note: a host held behind a stuck gather] in ``wsharding/fatal.py`` --
the thread calls ``on_stuck(error)``, which ends the process with its last words said.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

import torch


class Watchdog:
    """Watches the gathers in flight on one communicator. ``check_async()`` returns an error text or
    None; ``abort(reason)`` tears the communicator down (both supplied by the communicator)."""

    def __init__(
        self,
        check_async: Callable[[], str | None],
        abort: Callable[[str], None],
        *,
        timeout_s: float,
        period_s: float = 0.05,
        name: str = "wsharding-nccl-watchdog",
        lock: threading.RLock | None = None,
        on_stuck: Callable[[str], None] | None = None,
        stuck_after_s: float = 3.0,
    ) -> None:
        self.timeout_s = timeout_s
        self.period_s = period_s
        self.on_stuck = on_stuck
        self.stuck_after_s = stuck_after_s
        #: Set by the hot path when it raised the error: the host is not held, nothing to end.
        self.delivered = False
        self._check_async = check_async
        self._abort = abort
        self._inflight: collections.deque[tuple[torch.cuda.Event, str, float]] = collections.deque()
        self._stop = threading.Event()
        #: Held while querying events; the hot path takes it to pause the watchdog for a capture.
        self.lock = lock or threading.RLock()
        #: True while a CUDA graph is being captured: querying an event that the capture is recording
        #: would invalidate the capture, so nothing is queried until the next eager gather.
        self.paused = False
        #: The error found, once found (read by the hot path: a plain attribute read).
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, event: torch.cuda.Event, what: str) -> None:
        """Hot path: remember a gather in flight (its completion event). O(1), no CUDA call."""
        self._inflight.append((event, what, time.monotonic()))
        self.paused = False

    def pause_for_capture(self) -> None:
        """Called (once per captured gather) before events are recorded inside a CUDA-graph capture:
        stop querying, and forget the gathers in flight (their events are about to be recorded in the
        graph; the capture is ordered after them)."""
        if not self.paused:
            with self.lock:
                self.paused = True
                self._inflight.clear()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.check_once()
            except Exception as e:  # noqa: BLE001 - the thread must report, not die silently
                self.error = self.error or f"the watchdog failed: {type(e).__name__}: {e}"
                return
            if self.error is not None:
                self.escalate_if_stuck()
                return

    def escalate_if_stuck(self) -> bool:
        """After an error: wait ``stuck_after_s`` for the hot path to raise it (``delivered``); if it
        does not, and the watchdog was not stopped, call ``on_stuck``. Returns whether it did."""
        if self.on_stuck is None or self.error is None:
            return False
        if self._stop.wait(self.stuck_after_s) or self.delivered:
            return False
        self.on_stuck(f"{self.error}; no call through the communicator came back for this error within "
                      f"{self.stuck_after_s:.1f} s: the host thread is held in a CUDA synchronization behind "
                      "the stuck gather, which nothing can release")
        return True

    def check_once(self, now: float | None = None) -> str | None:
        """One round of checks (the thread's loop body; tests call it directly)."""
        q = self._inflight
        if not self.lock.acquire(timeout=self.period_s):
            return self._check_lock_held(now)
        try:
            if self.paused:
                return self.error
            while q:
                event, what, since = q[0]
                try:
                    if not event.query():
                        break
                except RuntimeError:
                    # The event was recorded again inside a CUDA-graph capture since (the planner's
                    # events serve eager steps and captures alike): it no longer tells about this
                    # gather, which the capture was ordered after. Nothing to watch here any more.
                    pass
                q.popleft()
        finally:
            self.lock.release()
        if self.error is None:
            msg = self._check_async()
            if msg is None and q:
                event, what, since = q[0]
                age = (time.monotonic() if now is None else now) - since
                if age > self.timeout_s:
                    msg = (f"{what} did not complete within {self.timeout_s:.1f} s: a rank of the group is missing "
                           "or stuck in a different collective")
            if msg is not None:
                self.error = msg
                self._abort(msg)
        return self.error

    def _check_lock_held(self, now: float | None) -> str | None:
        """The host thread holds the communicator's lock: it is inside an NCCL call. Normally for
        microseconds; if the oldest gather is past the timeout meanwhile, NCCL did not return (a
        blocking call waiting for a peer that is gone). Nothing here can take the lock to abort, so
        the error is only stored -- the host, held inside NCCL, never comes for it, and
        :meth:`escalate_if_stuck` ends the process."""
        if self.error is None and self._inflight:
            _event, what, since = self._inflight[0]
            if (time.monotonic() if now is None else now) - since > self.timeout_s:
                self.error = (f"{what} did not complete within {self.timeout_s:.1f} s, and the host thread has been "
                              "inside a call into NCCL meanwhile (a rank of the group is missing or stuck)")
        return self.error

    def pending(self) -> int:
        """Gathers not yet seen complete."""
        return len(self._inflight)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.period_s + 1.0)

    def describe(self) -> dict[str, Any]:
        return {"timeout_s": self.timeout_s, "period_s": self.period_s, "pending": self.pending(),
                "error": self.error}
