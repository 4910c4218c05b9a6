"""Every path the package reads is a regular file of a bounded size, or it is refused before it is opened.

[Note: only regular files] Opening a FIFO for reading waits until some process opens it for
writing -- forever when none does -- and ``open()`` is not a collective: no timeout of the package
(a collective's, a task's) is running there, so a rank stuck in it never wakes, and its peers wait in
the next collective until theirs fires. A character device such as ``/dev/zero`` opens at once but
never ends: a reader that reads to the end (JSON, YAML) grows until it is killed. ``os.stat`` does
not open the file -- it answers at once for a FIFO or a device -- so every reader of the package
calls :func:`require_regular_file` first. A symlink is followed (``os.stat``, not ``os.lstat``): a
link to a regular file is fine, a link to a FIFO is refused as what it points at.

The file is then opened with ``O_NONBLOCK`` and checked again with ``fstat`` (:func:`open_regular_file`):
a path replaced by a FIFO between the two calls is refused rather than waited on (``O_NONBLOCK``
changes nothing for a regular file). :func:`read_regular_file` reads a whole small file -- a model
description, an index, a report -- and never more than its limit, even from a file that grows
(or a ``/proc`` file whose size says 0).

Each caller passes its own error class (a checkpoint's :class:`~wsharding.safetensors_file.SafetensorsError`,
the CLI's ``InputError``, ...) so that its callers catch what they always caught.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from wsharding.core.errors import InvalidArgument

#: The rule every refusal states, once.
RULE = ("only regular files are read: opening a FIFO waits for a writer, forever if none comes, and a device such "
        "as /dev/zero never ends")
#: The largest JSON report of the package's own commands read back (``demo --figures-from``, the
#: saved bench runs): the largest committed one is tens of KB, a demo trace of many steps a few MB.
MAX_REPORT_BYTES = 64 << 20
#: Why a file of a parsed format has a size limit at all.
SIZE_RULE = "the limit bounds what parsing an untrusted file may cost"


def describe_kind(mode: int) -> str:
    """What ``mode`` (an ``st_mode``) is, in words: ``"a FIFO (named pipe)"``, ``"a folder"``, ..."""
    for test, words in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                        (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return words
    return f"not a regular file (mode {stat.S_IFMT(mode):#o})"


def _link_note(path: str | os.PathLike) -> str:
    """`` (a symlink to TARGET)`` when ``path`` is a symlink: the kind refused is its target's."""
    try:
        return f" (a symlink to {os.path.realpath(path)})" if os.path.islink(path) else ""
    except OSError:
        return ""


def require_regular_file(path: str | os.PathLike, what: str, *, max_bytes: int | None, todo: str,
                         error: type[Exception] = InvalidArgument) -> os.stat_result:
    """The ``os.stat`` of ``path`` when it is a regular file (a symlink is followed) of at most
    ``max_bytes`` bytes (None: any size); otherwise raise ``error`` before anything opens it.

    The message names ``what`` and the path, says what the path is (missing, a folder, a FIFO, a
    character device, too large), the rule, and ``todo`` -- what to pass instead. See
    [Note: only regular files]: ``os.stat`` never blocks on a FIFO; opening one does.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError as e:
        raise error(f"{what} {path} does not exist ({e.strerror}); {todo}") from None
    except OSError as e:  # a symlink loop, a parent that is not a folder, no permission
        raise error(f"{what} {path}: cannot look at it ({e.strerror}); {todo}") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{what} {path}{_link_note(path)}: {describe_kind(st.st_mode)}, not a regular file; {RULE}; {todo}")
    if max_bytes is not None and st.st_size > max_bytes:
        raise error(f"{what} {path}: {st.st_size} bytes, over the {max_bytes} bytes it may take ({SIZE_RULE}); "
                    f"{todo}")
    return st


def open_regular_file(path: str | os.PathLike, what: str, *, max_bytes: int | None, todo: str,
                      error: type[Exception] = InvalidArgument) -> int:
    """A read-only file descriptor of ``path`` once :func:`require_regular_file` accepted it, and
    ``fstat`` says the file opened is that one (the caller closes it)."""
    before = require_regular_file(path, what, max_bytes=max_bytes, todo=todo, error=error)
    try:
        # O_NONBLOCK: should the path have become a FIFO since the stat, open returns at once instead of
        # waiting for a writer; on a regular file it changes nothing.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise error(f"{what} {path}: cannot open it ({e.strerror}); {todo}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
        os.close(fd)
        raise error(f"{what} {path}: replaced while it was opened, now {describe_kind(st.st_mode)}; {RULE}; {todo}")
    return fd


def read_regular_file(path: str | os.PathLike, what: str, *, max_bytes: int, todo: str,
                      error: type[Exception] = InvalidArgument) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them: a larger file is refused
    by its size before it is opened, and one that grows past the limit while read (or a ``/proc``
    file, whose size says 0) is refused after ``max_bytes + 1`` bytes, never read to its end."""
    fd = open_regular_file(path, what, max_bytes=max_bytes, todo=todo, error=error)
    try:
        parts, left = [], max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            parts.append(chunk)
            left -= len(chunk)
    except OSError as e:
        raise error(f"{what} {path}: cannot read it ({e.strerror}); {todo}") from None
    finally:
        os.close(fd)
    if left <= 0:
        raise error(f"{what} {path}: more than {max_bytes} bytes, the most it may take ({SIZE_RULE}); {todo}")
    return b"".join(parts)


def read_saved_report(path: str | os.PathLike) -> Any:
    """The JSON of a report a wsharding command saved (the saved bench runs, found by a glob of their
    names), read with :func:`read_regular_file`: a FIFO whose name matched the glob hung the reader,
    and a report is at most :data:`MAX_REPORT_BYTES`."""
    raw = read_regular_file(path, "saved report", max_bytes=MAX_REPORT_BYTES,
                            todo="pass a JSON report a wsharding command wrote")
    return json.loads(raw)
