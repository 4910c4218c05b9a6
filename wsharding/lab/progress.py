"""A long command says what it is doing: each stage on its own line as it starts, on standard error.

``wsharding demo`` works for 15-20 s on CPU ranks, ``bench serve`` for tens of seconds, most of it inside
the rank processes; a user who sees nothing for that long cannot tell a slow stage from a hang. Standard
error, so that a command's report (or its JSON on stdout with ``--json -``) stays clean; on a terminal the
running stage also ticks its elapsed seconds in place (a line that rewrites itself), in a file or a pipe
only the lines are written.

Rank processes write to the same standard error (they inherit it): rank 0 tells its own stages with
:func:`rank_stage`, so the longest stage -- the ranks' work -- is told step by step too.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


class Stages:
    """``stages.start("what")`` ends the running stage (its time is printed) and starts the next;
    ``stages.done()`` ends the last one."""

    def __init__(self, command: str, stream: TextIO | None = None, *, tick_s: float = 1.0) -> None:
        self.command = command
        self.stream = stream if stream is not None else sys.stderr
        self.tick_s = tick_s
        self._what: str | None = None
        self._t0 = 0.0
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def _tty(self) -> bool:
        return bool(getattr(self.stream, "isatty", lambda: False)())

    def start(self, what: str) -> None:
        self._end()
        self._what, self._t0 = what, time.perf_counter()
        self.stream.write(f"{self.command}: {what} ...\n")
        self.stream.flush()
        if self._tty():
            self._stop.clear()
            self._ticker = threading.Thread(target=self._tick, name="wsharding-progress", daemon=True)
            self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(self.tick_s):
            self.stream.write(f"\r  {time.perf_counter() - self._t0:5.0f} s")
            self.stream.flush()

    def _end(self) -> None:
        if self._what is None:
            return
        if self._ticker is not None:
            self._stop.set()
            self._ticker.join()
            self._ticker = None
            self.stream.write("\r")
        self.stream.write(f"  ({self._what}: {time.perf_counter() - self._t0:.1f} s)\n")
        self.stream.flush()
        self._what = None

    def done(self) -> None:
        self._end()


def rank_stage(rank: int, command: str | None, what: str) -> None:
    """On rank 0 of a command that asked for progress (``command`` not None): one line on standard error."""
    if command is not None and rank == 0:
        print(f"{command}: rank 0: {what}", file=sys.stderr, flush=True)
