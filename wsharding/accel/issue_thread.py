"""A native thread that issues the layers' gathers, so the model's Python thread only hands them over.

[Note: the issue thread]
At decode sizes the step is bound by the host: the Python thread that launches a layer's kernels is
also the one that puts the next layer's gather on its streams, and a gather's launch costs that
thread 11-13 us on the one-H200 host and 46-55 us per layer on the two-H200 host, most of it inside
``cuGraphLaunch``. The launch cannot be batched per step ([Note: one graph per layer, not per step] in
``captured_launch.py``), but it need not run on the model's thread: each layer's driver calls -- the
wait for the gate, the graph launch, the ready record -- are prepared once as a *program*, and a
native thread (``issue_thread.c``) runs the programs in the order they were pushed. A push is one
ctypes call; the model's thread goes on.

Why native and not a Python thread: a Python thread would need the GIL between its driver calls,
and takes it from the model's thread (measured on a 2-core CPU machine with a 13 us stand-in for the
launch: a Python issue thread made the model's thread slower than issuing inline).

What keeps it correct (the Python callers' side of the contract):

* **One order.** Every driver call on the gather and copy streams goes through the queue, or is
  made after :meth:`IssueThread.drain`: NCCL needs every rank's collectives in the same order, and a
  stream runs its work in the order it was queued.
* **Issued before waited on.** The compute stream may only wait on a gather's ready event once the
  thread has recorded it: before that, the event still holds the previous step's record, and the
  wait would pass at once (a layer computing with the weights of another layer).
  :meth:`IssueThread.wait_issued` makes sure; with lookahead it has always happened already.
* **A gate is not recorded again before the wait on it was issued.** ``cuStreamWaitEvent`` waits on
  the record the event holds when the wait is *issued*; were the gate recorded again first, the
  gather would wait for a later layer -- one that itself waits for this gather. The rule above keeps
  this one: the planner records a gate again only after a later layer of the next step ran, and
  before that layer computed, every gather that waits on the gate was seen issued.
* **Errors reach the model's thread.** A driver call that fails stops the queue (later entries are
  skipped, not run) and the next check on the model's thread raises it, naming the layer.

It is off by default until it is measured on two GPUs; ``NcclCommunicator(issue_thread=True)``
turns it on.

The C file is compiled at first use with the system's C compiler into a per-user cache (like
``torch.utils.cpp_extension``, but 200 lines of C need no build system); a machine without one gets
:class:`IssueThreadUnavailable`, which says so.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from wsharding.core.errors import InvalidArgument, WshardingError

SOURCE = Path(__file__).with_name("issue_thread.c")

#: Op kinds of a program (issue_thread.c).
OP_WAIT, OP_WAIT_GATE, OP_LAUNCH, OP_RECORD = 1, 2, 3, 4
MAX_OPS = 8


class IssueThreadUnavailable(WshardingError, RuntimeError):
    """The issue thread's C file could not be compiled or loaded here."""


class IssueThreadError(WshardingError, RuntimeError):
    """A driver call made by the issue thread failed."""


class Op(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("a", ctypes.c_void_p), ("b", ctypes.c_void_p)]


class Program(ctypes.Structure):
    """The driver calls of one layer's gather, in order (kept alive by the gather that owns it)."""

    _fields_ = [("n", ctypes.c_int32), ("ops", Op * MAX_OPS)]


def cache_dir() -> Path:
    """Where the compiled library goes: ``$WSHARDING_CACHE`` or ``~/.cache/wsharding``."""
    root = os.environ.get("WSHARDING_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "wsharding")
    return Path(root)


def build_library(source: Path = SOURCE, out_dir: Path | None = None) -> Path:
    """Compile ``source`` into a shared library (once per source text), return its path."""
    text = source.read_bytes()
    key = hashlib.sha256(text + sys.platform.encode()).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    lib = out_dir / f"{source.stem}-{key}.so"
    if lib.exists():
        return lib
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise IssueThreadUnavailable(f"no C compiler (cc, gcc, or $CC) to build {source.name}: install one "
                                     "(apt install gcc), or leave the issue thread off")
    out_dir.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: several rank processes may build at once.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    cmd = [cc, "-O2", "-std=c11", "-shared", "-fPIC", "-pthread", str(source), "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        os.unlink(tmp)
        raise IssueThreadUnavailable(f"the C compiler {cc!r} could not be run to build {source.name} ({e}): set $CC "
                                     "to a working one, or leave the issue thread off") from e
    if done.returncode != 0:
        os.unlink(tmp)
        raise IssueThreadUnavailable(f"compiling {source.name} failed ({' '.join(cmd)}):\n{done.stderr.strip()}")
    os.replace(tmp, lib)
    return lib


_LIB: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    """The compiled issue thread library, typed (built on first use)."""
    global _LIB
    if _LIB is None:
        lib = ctypes.CDLL(str(build_library()))
        p, u64, i32, d = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int32, ctypes.c_double
        for name, res, args in (
            ("ws_issuer_new", p, (p, p, p, p, p, d)),
            ("ws_issuer_push", u64, (p, ctypes.POINTER(Program), p)),
            ("ws_issuer_issued_ptr", p, (p,)),
            ("ws_issuer_pushed_ptr", p, (p,)),
            ("ws_issuer_error_ptr", p, (p,)),
            ("ws_issuer_wait", u64, (p, u64, d)),
            ("ws_issuer_error", i32, (p, ctypes.POINTER(u64), ctypes.POINTER(i32), ctypes.POINTER(p))),
            ("ws_issuer_exited", i32, (p,)),
            ("ws_issuer_stop", None, (p,)),
            ("ws_issuer_free", i32, (p,)),
        ):
            f = getattr(lib, name)
            f.restype, f.argtypes = res, args
        _LIB = lib
    return _LIB


def fn_address(f: ctypes._CFuncPtr) -> int:
    """The C address of a ctypes-bound function (what the thread calls)."""
    return ctypes.cast(f, ctypes.c_void_p).value or 0


class IssueThread:
    """One native thread running pushed programs in order (see the module's note).

    ``wait``, ``launch`` and ``record`` are the addresses of functions with the signatures of
    ``cuStreamWaitEvent``, ``cuGraphLaunch`` and ``cuEventRecord``; ``ctx_set`` and ``ctx`` make the
    caller's CUDA context current on the thread (``cuCtxSetCurrent``), or are 0 where there is none.
    """

    def __init__(self, *, wait: int, launch: int, record: int, ctx_set: int = 0, ctx: int = 0,
                 spin_us: float | None = None, name: str = "issue thread") -> None:
        self._lib = library()
        self.name = name
        #: How long the thread spins for the next push before it sleeps: a push that finds it asleep
        #: pays for waking it (a futex call, microseconds). ``$WSHARDING_ISSUE_SPIN_US``, default 50.
        self.spin_us = float(os.environ.get("WSHARDING_ISSUE_SPIN_US", 50.0) if spin_us is None else spin_us)
        self._q = self._lib.ws_issuer_new(ctx_set or None, ctx or None, wait, launch, record, self.spin_us)
        if not self._q:
            raise IssueThreadUnavailable(f"{name}: could not start the native thread")
        self._push = self._lib.ws_issuer_push
        # The issued counter read as memory (an aligned 8-byte load, atomic on the CPUs we run on):
        # the hot path checks it once or twice per layer, and a ctypes call costs a microsecond or more.
        self._issued_now = ctypes.c_uint64.from_address(self._lib.ws_issuer_issued_ptr(self._q))
        self._pushed_now = ctypes.c_uint64.from_address(self._lib.ws_issuer_pushed_ptr(self._q))
        self._error_now = ctypes.c_int32.from_address(self._lib.ws_issuer_error_ptr(self._q))
        self._error_text: str | None = None  # kept when the thread is freed
        #: What each pushed program issues, for errors ("layer 3: gather of ..."): by program address.
        self._what: dict[int, str] = {}
        self.pushes = 0
        self.waits = 0  # wait_issued calls that found the entry not yet issued
        self.closed = False

    @staticmethod
    def program(ops: Sequence[tuple[int, int, int]]) -> Program:
        """A program from ``(kind, a, b)`` triples (see ``issue_thread.c`` for each kind's a and b)."""
        if not 0 < len(ops) <= MAX_OPS:
            raise InvalidArgument(f"a program has 1 to {MAX_OPS} driver calls, got {len(ops)}")
        p = Program()
        p.n = len(ops)
        for i, (kind, a, b) in enumerate(ops):
            if kind not in (OP_WAIT, OP_WAIT_GATE, OP_LAUNCH, OP_RECORD):
                raise InvalidArgument(f"unknown op kind {kind}")
            p.ops[i].kind, p.ops[i].a, p.ops[i].b = kind, a or None, b or None
        return p

    def name_program(self, program: Program, what: str) -> None:
        self._what[ctypes.addressof(program)] = what

    def push(self, program: Program, gate: int = 0) -> int:
        """Hot path: queue ``program`` with this push's gate event (0: none); returns its seq."""
        if self.closed:
            raise IssueThreadError(f"{self.name} was stopped: nothing more can be issued")
        seq = self._push(self._q, ctypes.byref(program), gate or None)
        self.pushes += 1
        return seq

    @property
    def issued(self) -> int:
        """The seq of the last entry run (or skipped after an error)."""
        return self._issued_now.value

    @property
    def pushed(self) -> int:
        return self._pushed_now.value

    def error(self) -> str | None:
        """The first failed driver call, as text, or None."""
        if self._q is None:
            return self._error_text
        seq, op, program = ctypes.c_uint64(), ctypes.c_int32(), ctypes.c_void_p()
        rc = self._lib.ws_issuer_error(self._q, ctypes.byref(seq), ctypes.byref(op), ctypes.byref(program))
        if not rc:
            return None
        if seq.value == 0:
            return f"{self.name}: making the CUDA context current on the thread failed with CUresult {rc}"
        what = self._what.get(program.value or 0, "an unnamed program")
        return (f"{self.name}: {what}: driver call {op.value} of push {seq.value} failed with CUresult {rc}; "
                "the pushes after it were not run")

    def wait_issued(self, seq: int, *, poll: Callable[[], None] | None = None, timeout_s: float = 60.0,
                    what: str = "") -> None:
        """Return once entry ``seq`` was run; raise :class:`IssueThreadError` if a call failed.

        ``poll`` runs between waits of a millisecond (the communicator's ``raise_if_failed``: the
        watchdog may have found an error meanwhile); ``timeout_s`` bounds the whole wait.
        """
        if self._issued_now.value < seq:
            if self._q is None:
                raise IssueThreadError(f"{what or self.name}: the issue thread was stopped before it issued "
                                       "this gather")
            self.waits += 1
            deadline = time.monotonic() + timeout_s
            while self._lib.ws_issuer_wait(self._q, seq, 1000.0) < seq:
                if self._lib.ws_issuer_exited(self._q):
                    raise IssueThreadError(f"{what or self.name}: the issue thread was stopped before it issued "
                                           "this gather")
                if poll is not None:
                    poll()
                if time.monotonic() > deadline:
                    raise IssueThreadError(f"{what or self.name}: not issued within {timeout_s:.1f} s (the issue "
                                           "thread is held inside a driver call)")
        if self._error_now.value:
            msg = self.error()
            raise IssueThreadError(f"{what}: {msg}" if what else msg)

    def drain(self, **kw) -> None:
        """Return once everything pushed so far was run (before a direct call on the same streams)."""
        self.wait_issued(self.pushed, **kw)

    def stop(self, timeout_s: float = 2.0) -> bool:
        """End the thread after its current driver call (entries not yet run are dropped) and free
        it; returns False when it did not end within ``timeout_s`` (it is then left running)."""
        if self.closed:
            return True
        self.closed = True
        self._lib.ws_issuer_stop(self._q)
        deadline = time.monotonic() + timeout_s
        while not self._lib.ws_issuer_exited(self._q):
            if time.monotonic() > deadline:
                return False
            time.sleep(1e-4)
        # What the Python side still reads, copied out of the memory about to be freed.
        self._error_text = self.error()
        self._issued_now = ctypes.c_uint64(self._issued_now.value)
        self._pushed_now = ctypes.c_uint64(self._pushed_now.value)
        self._error_now = ctypes.c_int32(self._error_now.value)
        self._lib.ws_issuer_free(self._q)
        self._q = None
        return True

    def __repr__(self) -> str:
        state = "stopped" if self.closed else f"pushed {self.pushes}"
        return f"IssueThread({self.name!r}, {state})"


def driver_issue_thread(name: str, *, wait: int | None = None, spin_us: float | None = None) -> IssueThread:
    """An :class:`IssueThread` on the CUDA driver (``wsharding.accel.cuda_driver``), in the calling
    thread's current context. ``wait``: another function in place of ``cuStreamWaitEvent`` (tests
    that make the thread fail or lag)."""
    from wsharding.accel.cuda_driver import driver

    cu = driver()
    return IssueThread(wait=wait or fn_address(cu._cuStreamWaitEvent), launch=fn_address(cu._cuGraphLaunch),
                       record=fn_address(cu._cuEventRecord), ctx_set=fn_address(cu._cuCtxSetCurrent),
                       ctx=cu.current_context(), spin_us=spin_us, name=name)
