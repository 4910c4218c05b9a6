"""Ending a process that cannot go on, with its last words said.

[Note: a host held behind a stuck gather]
A copy-engine gather whose peer is gone waits on the GPU for a flag that never comes, and nothing
releases it: ``ncclCommAbort`` does not (see [Note: abort with a stuck gather] in
``wsharding/accel/nccl/teardown.py``). A host thread that synchronizes with that stream -- ``.item()``,
``.cpu()``, ``torch.equal`` on a GPU tensor, a copy from pageable memory -- is then held inside a
CUDA call for good: it never reaches the planner call that would raise the watchdog's error. (So is
a host held inside a blocking NCCL call that waits for a peer: the watchdog then cannot even take
the communicator's lock to abort, and finds the overdue gather without it.) Seen on
two H200s: a rank whose peer was killed mid-step sat in ``torch.equal`` with no error and no end.

Such a process cannot do anything useful again, so the watchdog ends it, as torch's own
ProcessGroupNCCL watchdog does after a collective timeout: the error goes to stderr, every
registered last-words handler runs (a rank process of :mod:`wsharding.lab.cluster` sends the error to
its parent, so the caller sees *why* the rank ended), and the process exits with
:data:`EXIT_CODE`. The driver reclaims the GPU memory at exit.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable

#: The exit code of a process ended here (EX_SOFTWARE in sysexits.h: an internal error).
EXIT_CODE = 70

_LAST_WORDS: list[Callable[[str], None]] = []
_ENDING = threading.Lock()


def add_last_words(handler: Callable[[str], None]) -> None:
    """Run ``handler(message)`` before :func:`end_process` exits (it must not block for long)."""
    _LAST_WORDS.append(handler)


def remove_last_words(handler: Callable[[str], None]) -> None:
    if handler in _LAST_WORDS:
        _LAST_WORDS.remove(handler)


def end_process(message: str) -> None:
    """Say ``message`` on stderr and through every last-words handler, then ``os._exit(EXIT_CODE)``.

    ``os._exit`` and not ``sys.exit``: the caller is a helper thread, and the main thread is held
    inside a CUDA call -- interpreter shutdown would wait for it forever."""
    if not _ENDING.acquire(blocking=False):
        return  # another thread is ending the process already
    try:
        sys.stderr.write(f"wsharding: ending this process (exit code {EXIT_CODE}): {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    for handler in list(_LAST_WORDS):
        try:
            handler(message)
        except Exception:  # noqa: BLE001, S110 - last words must never keep the process alive
            pass
    os._exit(EXIT_CODE)
