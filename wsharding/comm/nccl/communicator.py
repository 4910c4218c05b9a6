"""``NcclCommunicator``: our own NCCL communicator over the ctypes binding.

What it adds to :class:`~wsharding.comm.torch_backend.TorchDistComm`: buffers from ``ncclMemAlloc``
registered as symmetric windows, CTA policy "zero" so that the AllGather runs on the copy engines
(no SMs taken from the GEMMs it overlaps), and a watchdog thread that turns a missing rank into an
error and ``ncclCommAbort`` instead of a hang ([Note: blocking communicator] says why the
communicator itself is a blocking one).

Life cycle (every step collective over the group unless marked local)::

    comm = NcclCommunicator(cpu_group, device=dev)   # unique id over gloo, ncclCommInitRankConfig
    full = comm.alloc(S, tag="layer.3.slot")         # local ncclMemAlloc, a torch view, no copy
    comm.register_all()                              # windows, sorted by tag, same on every rank
    h = comm.all_gather_into(full, chunk, async_op=True)  # on comm.stream, never the default stream
    h.wait()                                         # current stream waits on the gather's event
    comm.close()                                     # deregister, free, finalize + destroy

Errors and teardown: any failing call raises :class:`~wsharding.comm.nccl.binding.NcclError`
(``ncclGetErrorString`` + ``ncclGetLastError``); an operation still in progress after
``timeout_s`` raises :class:`CommTimeout` after aborting the communicator. ``close()`` after an
abort only frees memory (the aborted communicator owns no windows any more).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import socket
import threading
import time
import weakref
from typing import Any

import torch

from wsharding.comm.base import CommError, Communicator, check_gather_args
from wsharding.comm.captured_launch import CapturedLaunch
from wsharding.comm.cuda_driver import CudaDriverError, driver
from wsharding.comm.issue_thread import IssueThread, IssueThreadError, IssueThreadUnavailable, driver_issue_thread
from wsharding.comm.nccl.binding import (
    CTA_POLICY_NAMES,
    NCCL_IN_PROGRESS,
    NCCL_SUCCESS,
    NCCL_UINT8,
    NcclBinding,
    NcclError,
    NcclUniqueId,
    make_config,
)
from wsharding.comm.nccl.gather import NcclPreparedGather
from wsharding.comm.nccl.group import (
    exchange_over,
    gloo_group_for,
    gloo_shard_group_for,
    group_members,
    share_unique_id,
)
from wsharding.comm.nccl.library import (
    MIN_MULTI_RANK_GPU,
    MIN_SYMMETRIC,
    NcclLibrary,
    NcclLibraryError,
    default_library,
    format_version,
)
from wsharding.comm.nccl.symmetric import WINDOW_ALIGN, SymmetricPool
from wsharding.comm.nccl.watchdog import Watchdog
from wsharding.comm.torch_backend import mode_label
from wsharding.emulation import SHARED_GPU_NOTE
from wsharding.fatal import end_process

#: "graph": each prepared gather's ncclAllGather is captured once and launched as a CUDA graph
#: (one driver call per layer); "direct": ncclAllGather is called per layer.
GATHER_LAUNCHES = ("graph", "direct")
#: The weight-sharding design refuses to run without it: policy 2 ("zero") is the copy-engine path.
CTA_POLICY_ZERO = 2


class CommTimeout(CommError):
    """An NCCL operation did not complete within the timeout; the communicator was aborted."""


def parse_cta_policy(value: str) -> int:
    """``NCCL_CTA_POLICY`` as an int (numbers, or the names default/efficiency/zero)."""
    names = {v: k for k, v in CTA_POLICY_NAMES.items()}
    v = value.strip().lower()
    if v in names:
        return names[v]
    try:
        return int(v, 0)
    except ValueError:
        raise CommError(f"NCCL_CTA_POLICY={value!r} is not a CTA policy: use 0, 1, 2 or default/efficiency/zero") from None


def check_cta_policy_env(requested: int, environ: dict[str, str] | None = None) -> None:
    """The environment variable overrides the config field inside NCCL, silently. Refuse a
    mismatch, so a run that asked for the copy engine never measures SM kernels unawares."""
    env = os.environ if environ is None else environ
    raw = env.get("NCCL_CTA_POLICY")
    if raw is None or raw == "":
        return
    got = parse_cta_policy(raw)
    if got != requested:
        raise CommError(
            f"NCCL_CTA_POLICY={raw} ({CTA_POLICY_NAMES.get(got, '?')}) is set in the environment and overrides the "
            f"CTA policy {requested} ({CTA_POLICY_NAMES.get(requested, '?')}) this communicator asks for"
            + (" -- the copy-engine AllGather needs policy 2 (zero)" if requested == CTA_POLICY_ZERO else "")
            + f"; unset NCCL_CTA_POLICY or set it to {requested}"
        )


_LIVE: weakref.WeakSet[NcclCommunicator] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for c in list(_LIVE):
        try:
            c.close()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass


# [Note: blocking communicator]
# NCCL runs every collective of a *non-blocking* communicator through a group job on a thread it
# creates for that call (group.cc: a std::thread per ncclGroupEnd, joined when the async state is
# polled). On two H200s that cost the host ~150 us per ncclAllGather -- more than the planner's whole
# per-layer budget -- while a blocking communicator launches in the calling thread. So the default is
# blocking (``blocking=True``). What non-blocking bought was a timeout on host-side collective steps
# (init, window registration); here each of them is preceded by an exchange over the gloo group, whose
# own timeout fails if a rank never arrives, and a rank that dies after it is a dead worker process,
# which the cluster (or torchrun) reports and cleans up. One host-side collective hides inside the
# first gather: NCCL sets the copy-engine path up lazily, registering a window of its own, and a
# blocking communicator would wait there for a missing peer with no timeout (seen on two H200s). So
# the communicator runs one small gather at init, while every rank is known to be present
# (``_set_up_copy_engine``); after it a gather only queues stream work. (With CTA policy 0 NCCL may
# still connect lazily when a later size picks another algorithm.) Gathers in flight stay watched by
# the watchdog thread in both modes. ``blocking=False`` keeps the old behaviour, for comparison.

class NcclGatherHandle:
    """A gather in flight on the communicator's stream (see :meth:`NcclCommunicator.all_gather_into`)."""

    def __init__(self, comm: NcclCommunicator, event: torch.cuda.Event, what: str) -> None:
        self.comm = comm
        self.event = event
        self.what = what

    def wait(self) -> None:
        """Order the caller's current stream after the gather (does not block the host)."""
        torch.cuda.current_stream(self.comm.device).wait_event(self.event)

    def is_completed(self) -> bool:
        return self.event.query()

    def synchronize(self, timeout_s: float | None = None) -> None:
        """Block the host until the gather finished; abort and raise :class:`CommTimeout` after
        ``timeout_s`` (default: the communicator's), e.g. when a rank never joined."""
        self.comm.poll_until(self.event.query, self.what, timeout_s)


class NcclCommunicator(Communicator):
    """A :class:`~wsharding.comm.base.Communicator` on libnccl with symmetric windows.

    Args:
        cpu_group: a gloo process group over the same ranks -- the whole world, or one shard group
            ([Note: shard groups] in ``group.py``; :func:`from_context` with ``group_size``) -- used to share the unique
            id and check window registration (``None``: the default group, or world size 1 when
            torch.distributed is not initialised). ``rank`` and ``world_size`` are those inside it.
        device: this rank's CUDA device (default: the current one).
        cta_policy: 2 (zero: copy engine, the default) or 0 (SM kernels, for comparison).
        timeout_s: how long any operation may stay in progress before the communicator is aborted.
        blocking: a blocking NCCL communicator (default; [Note: blocking communicator]) or a
            non-blocking one polled with the timeout.
        library: a loaded :class:`NcclLibrary` (default: discovery order of ``library.py``).
        issue_thread: issue the prepared gathers from a native thread, so that the model's thread only
            hands them over ([Note: the issue thread] in ``wsharding/comm/issue_thread.py``; off by
            default until measured on two GPUs).
    """

    #: Every buffer is its own ncclMemAlloc, rounded up to the 4096-byte window alignment: the unit
    #: in which weight sharding's byte formula counts this backend's allocations.
    alloc_granularity = WINDOW_ALIGN
    #: [Note: the issue thread]: set in __init__ when asked for.
    issuer: IssueThread | None = None

    def __init__(
        self,
        cpu_group: Any = None,
        *,
        device: torch.device | str | int | None = None,
        cta_policy: int = CTA_POLICY_ZERO,
        timeout_s: float = 60.0,
        blocking: bool = True,
        library: NcclLibrary | None = None,
        name: str = "wsharding",
        gather_launch: str = "graph",
        issue_thread: bool = False,
    ) -> None:
        self.handle: int | None = None
        if gather_launch not in GATHER_LAUNCHES:
            raise CommError(f"gather_launch must be one of {GATHER_LAUNCHES}, got {gather_launch!r}")
        #: How a prepared gather reaches NCCL per layer ([Note: a gather launched as a graph]).
        self.gather_launch = gather_launch
        #: Every graph captured on this communicator: destroyed before it (NCCL waits for them).
        self._graphs: list[CapturedLaunch] = []
        self.aborted = False
        self._abort_thread: threading.Thread | None = None
        self.closed = False
        #: Held around NCCL calls that the watchdog's abort (from its thread) must not interleave with.
        self.lock = threading.RLock()
        self.watchdog: Watchdog | None = None
        # Callbacks of the users whose tensors view our memory (weight shardings): run before we free it.
        self._on_close: list[weakref.WeakMethod] = []
        self.pool = SymmetricPool(self)
        self.timeout_s = float(timeout_s)
        if cta_policy not in CTA_POLICY_NAMES:
            raise CommError(f"cta_policy must be one of {sorted(CTA_POLICY_NAMES)}, got {cta_policy!r}")
        self.cta_policy = cta_policy
        self.blocking = bool(blocking)
        # Checks that need no GPU come first, so CPU machines get the real reason.
        self.library = library or default_library()
        self.library.require(MIN_SYMMETRIC, "symmetric windows and the copy-engine AllGather")
        self.nccl = NcclBinding(self.library)
        if self.nccl.missing:
            raise NcclLibraryError(f"{self.library.path} lacks {self.nccl.missing}: not a complete libnccl")
        check_cta_policy_env(cta_policy)
        if not torch.cuda.is_available():
            raise CommError(
                "NcclCommunicator needs CUDA and this machine has no GPU: use TorchDistComm (gloo) on CPU; "
                "the copy-engine path runs only on GPUs"
            )
        import torch.distributed as dist

        self.cpu_group = cpu_group
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(cpu_group)
            self.world_size = dist.get_world_size(cpu_group)
        else:
            if cpu_group is not None:
                raise CommError("a cpu_group was given but torch.distributed is not initialised")
            self.rank, self.world_size = 0, 1
        if device is None:
            device = torch.cuda.current_device()
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if self.device.type != "cuda":
            raise CommError(f"NcclCommunicator needs a CUDA device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(self.device)

        # Which ranks share a GPU: several on one needs NCCL >= 2.30 and the opt-in variable.
        props = torch.cuda.get_device_properties(self.device)
        me = (socket.gethostname(), str(getattr(props, "uuid", self.device.index)))
        where = self.exchange(me)
        self.ranks_per_gpu = max(where.count(w) for w in where)
        self.shared_gpu = self.ranks_per_gpu > 1
        if self.shared_gpu:
            self.library.require(MIN_MULTI_RANK_GPU, f"{self.ranks_per_gpu} ranks on one GPU")
            if os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
                raise CommError(
                    f"{self.ranks_per_gpu} ranks share one GPU: set NCCL_MULTI_RANK_GPU_ENABLE=1 in every rank's "
                    "environment (NCCL refuses duplicate GPUs otherwise)"
                )
        self.single_node = len({w[0] for w in where}) == 1
        self.mode = mode_label("nccl", self.device, self.shared_gpu, world_size=self.world_size)
        self.emulation = SHARED_GPU_NOTE if self.shared_gpu else ""
        # NCCL 2.28 copy-engine collectives fail on the legacy default stream: always our own.
        self.stream = torch.cuda.Stream(self.device)
        #: Places a rank's own chunk into its slot ahead of the in-place gather ([Note: no serial
        #: local copy] in gather.py), beside the gather stream and the compute stream.
        self.copy_stream = torch.cuda.Stream(self.device)
        self.gathers_issued = 0
        self._last_event: torch.cuda.Event | None = None
        #: [Note: the issue thread]: None unless asked for.
        self.issuer = self._start_issue_thread(name) if issue_thread else None

        #: Global ranks of this communicator's shard group, in group order ([Note: shard groups] in ``group.py``).
        self.group_ranks = group_members(cpu_group, self.world_size)
        raw = share_unique_id(self.nccl, self.rank, self.exchange)
        self._config = make_config(blocking=self.blocking, cta_policy=cta_policy, comm_name=name.encode())
        comm = ctypes.c_void_p()
        _LIVE.add(self)
        try:
            rc = self.nccl.ncclCommInitRankConfig(
                ctypes.byref(comm), self.world_size, NcclUniqueId.from_bytes(raw), self.rank, ctypes.byref(self._config)
            )
            self.handle = comm.value
            self.complete(rc, f"ncclCommInitRankConfig(rank {self.rank} of {self.world_size})")
        except BaseException:
            self._teardown(error=True)
            raise
        self.watchdog = Watchdog(self._async_error_text, self._abort_from_watchdog, timeout_s=self.timeout_s,
                                 name=f"wsharding-nccl-watchdog-r{self.rank}", lock=self.lock,
                                 on_stuck=None if self.stuck_exit_s is None else self._end_stuck_process,
                                 stuck_after_s=self.stuck_exit_s or 0.0)
        if self.world_size > 1:
            self._set_up_copy_engine()

    def _start_issue_thread(self, name: str) -> IssueThread:
        try:
            return driver_issue_thread(f"{name} issue thread of rank {self.rank}")
        except IssueThreadUnavailable as e:
            raise CommError(f"issue_thread=True on rank {self.rank}: {e}") from e

    def set_issue_thread(self, on: bool) -> None:
        """Start or stop the issue thread between steps ([Note: the issue thread]). Ranks may differ:
        the thread changes who issues the gathers, not which gathers or in what order."""
        self._check_open()
        if on and self.issuer is None:
            self.issuer = self._start_issue_thread("wsharding")
        elif not on and self.issuer is not None:
            self.drain_issued("stopping the issue thread")
            issuer, self.issuer = self.issuer, None
            if not issuer.stop(self.abort_wait_s):
                raise CommError(f"the issue thread of rank {self.rank} did not stop within {self.abort_wait_s} s")

    def drain_issued(self, what: str) -> None:
        """Before a call that reaches the gather or copy stream (or NCCL) directly: let the issue
        thread run everything pushed so far, so that the streams and NCCL see one order."""
        if self.issuer is not None:
            try:
                self.issuer.drain(poll=lambda: self.raise_if_failed(what), timeout_s=self.timeout_s, what=what)
            except IssueThreadError as e:
                self.abort()  # the peers' gathers are left unmatched: end them too
                raise CommError(f"{e}; the NCCL communicator of rank {self.rank} was aborted") from e

    def _set_up_copy_engine(self) -> None:
        """One small gather at init, with every rank present ([Note: blocking communicator]).

        NCCL sets the copy-engine path up at a communicator's first CE collective, and that set-up
        registers a window of its own -- a host-side collective. On a blocking communicator a peer
        that is missing at that moment would hold this host inside ``ncclAllGather``, out of reach of
        every timeout. Done here, right after init, the peers are known to be present (the unique id
        exchange just ran over gloo), and every later gather only queues work on a stream, which the
        watchdog times."""
        t = self.pool.alloc(WINDOW_ALIGN * self.world_size, "wsharding.copy-engine-setup")
        try:
            self.pool.register_all()
            mine = t.narrow(0, self.rank * WINDOW_ALIGN, WINDOW_ALIGN)
            self.all_gather_into(t, mine, async_op=True).synchronize()
        finally:
            if not (self.aborted or self.closed):
                self.pool.release([t])

    # ---- helpers -----------------------------------------------------------------------------
    def exchange(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` in rank order, over the CPU group (gloo)."""
        return exchange_over(self.cpu_group, self.world_size, obj)

    def async_state(self) -> int:
        """``ncclCommGetAsyncError``: 0 done, 7 in progress, anything else an error."""
        state = ctypes.c_int(0)
        self.nccl.check(self.nccl.ncclCommGetAsyncError(self.handle, ctypes.byref(state)), "ncclCommGetAsyncError",
                        self.handle)
        return state.value

    def poll_until(self, done, what: str, timeout_s: float | None = None) -> None:
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

    def _async_error_text(self) -> str | None:
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

    def _abort_from_watchdog(self, reason: str) -> None:
        with self.lock:
            self.abort()

    def _end_stuck_process(self, message: str) -> None:
        end_process(f"rank {self.rank} of {self.world_size} ({self.mode}): {message}")

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

    def fail(self, rc: int, what: str) -> None:
        """A call returned an error: abort and raise it."""
        err = NcclError(what, rc, self.nccl.error_string(rc), self.nccl.last_error(self.handle))
        self.abort()
        raise err

    def watch(self, event: torch.cuda.Event, what: str) -> None:
        """Have the watchdog time ``event`` (for example the end of a CUDA-graph replay that holds
        gathers): if it is not done within the timeout, the communicator is aborted."""
        self.watchdog.watch(event, what)

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

    def _check_open(self) -> None:
        if self.closed or self.aborted:
            raise CommError(f"NCCL communicator of rank {self.rank} is {'aborted' if self.aborted else 'closed'}")

    # ---- the Communicator protocol ----------------------------------------------------------
    def alloc(self, nbytes: int, *, tag: str = "", register: bool = False) -> torch.Tensor:
        """A uint8 tensor over fresh ncclMemAlloc memory (a view, no copy; offset 0 of its own
        allocation, so 4096-aligned). Local; call :meth:`register_all` (collective) before gathering
        into it, or pass ``register=True`` when every rank allocates in the same order."""
        self._check_open()
        t = self.pool.alloc(nbytes, tag or f"buffer.{len(self.pool.buffers)}")
        if register:
            self.register_all()
        return t

    def require_window(self, t: torch.Tensor, name: str, what: str) -> None:
        """Raise unless ``t`` lies inside a registered symmetric window (the copy engine needs it)."""
        buf = self.pool.window_of(t)
        if buf is None or buf.window is None:
            raise CommError(
                f"{what}: {name} ({t.numel()} bytes at {t.data_ptr():#x}) is not inside a registered symmetric "
                "window: allocate it with comm.alloc(...) and call comm.register_all() on every rank first"
            )

    def prepare_gather(self, full: torch.Tensor, chunk: torch.Tensor, *, what: str = "ncclAllGather") -> NcclPreparedGather:
        """A layer's gather with every argument checked and converted once (see ``gather.py``)."""
        self._check_open()
        return NcclPreparedGather(self, full, chunk, what)

    def capture(self, stream: int, record, what: str) -> CapturedLaunch:
        """Capture what ``record(stream)`` queues (NCCL calls on this communicator) into a graph that
        this communicator owns and destroys before itself ([Note: a gather launched as a graph]).
        Collective when ``record`` is: every rank captures the same calls in the same order."""
        self._check_open()
        self.drain_issued(what)
        with self.lock:
            try:
                launch = CapturedLaunch(stream, record, what)
            except CudaDriverError as e:
                raise CommError(f"{what}: capturing the gather into a CUDA graph failed on rank {self.rank}: {e}. "
                                "Pass gather_launch='direct' to the communicator to call NCCL per layer "
                                "instead") from e
        self._graphs.append(launch)
        return launch

    def drop_graph(self, launch: CapturedLaunch) -> None:
        """Destroy one captured graph (a closed weight sharding's gather)."""
        if launch in self._graphs:
            self._graphs.remove(launch)
        launch.destroy()

    def _destroy_graphs(self) -> None:
        graphs, self._graphs = self._graphs, []
        for launch in graphs:
            launch.destroy()

    def release(self, tensors: list[torch.Tensor]) -> None:
        """Collective: deregister and free the buffers behind ``tensors`` (a closed weight sharding's
        chunks and slots)."""
        if self.closed or self.aborted:
            return  # already freed with the communicator
        self.pool.release(tensors)

    def on_close(self, callback) -> None:
        """Run ``callback()`` (a bound method, held weakly) when this communicator closes, before its
        memory is freed: a weight sharding closes itself so that its model raises instead of reading
        freed memory."""
        self._on_close.append(weakref.WeakMethod(callback))

    def fork(self, event: torch.cuda.Event) -> None:
        """Order the copy and gather streams after ``event`` (recorded on the compute stream)."""
        self.drain_issued("the fork of the gather streams")
        # The driver's call, as the gathers make ([Note: the hot path] in wsharding/planner.py): torch's
        # Stream.wait_event costs several times more host per call, once per step here.
        handle = event.cuda_event
        if handle == 0:  # torch creates the CUDA event at its first record: never recorded, nothing to wait for
            return
        cu = driver()
        cu.stream_wait_event(self.copy_stream.cuda_stream, handle)
        cu.stream_wait_event(self.stream.cuda_stream, handle)

    def register_all(self) -> int:
        """Collective: register every buffer allocated since the last call, sorted by tag."""
        self._check_open()
        return self.pool.register_all()

    def all_gather_into(
        self,
        full: torch.Tensor,
        chunk: torch.Tensor,
        *,
        async_op: bool = False,
        stream: torch.cuda.Stream | None = None,
        what: str = "ncclAllGather",
    ) -> NcclGatherHandle:
        """Gather every rank's ``chunk`` into ``full`` on ``stream`` (default :attr:`stream`).

        The gather stream first waits for the caller's current stream (so ``chunk`` is ready);
        ``wait()`` on the handle makes the caller's current stream wait for the gather. Both
        buffers must lie in registered windows (that is what the copy engine needs).
        ``async_op=False`` calls ``wait()`` before returning; neither blocks the host.
        """
        self._check_open()
        check_gather_args(self, full, chunk)
        for name, t in (("full", full), ("chunk", chunk)):
            self.require_window(t, name, what)
        self.drain_issued(what)
        s = stream if stream is not None else self.stream
        if s.cuda_stream == 0:
            raise CommError(f"{what}: refusing the legacy default stream (NCCL 2.28 copy-engine collectives fail on "
                            "it); pass a created torch.cuda.Stream")
        current = torch.cuda.current_stream(self.device)
        if current.cuda_stream != s.cuda_stream:
            s.wait_stream(current)
        self.raise_if_failed(what)
        with self.lock:
            rc = self.nccl.ncclAllGather(chunk.data_ptr(), full.data_ptr(), chunk.numel(), NCCL_UINT8, self.handle,
                                         s.cuda_stream)
        if rc != NCCL_SUCCESS:
            self.complete(rc, what)
        event = torch.cuda.Event()
        event.record(s)
        self._last_event = event
        self.gathers_issued += 1
        if torch.cuda.is_current_stream_capturing():
            self.watchdog.pause_for_capture()
        else:
            self.watchdog.watch(event, what)
        handle = NcclGatherHandle(self, event, what)
        if not async_op:
            handle.wait()
        return handle

    def synchronize(self, timeout_s: float | None = None) -> None:
        """Block until everything issued on :attr:`stream` finished (abort after the timeout)."""
        self._check_open()
        self.drain_issued("synchronize")
        ev = torch.cuda.Event()
        ev.record(self.stream)
        self.poll_until(ev.query, f"work on the gather stream of rank {self.rank}", timeout_s)

    def barrier(self) -> None:
        """Our stream drained (with the timeout), then a barrier over the CPU group."""
        self.synchronize()
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier(group=self.cpu_group)

    # ---- teardown -----------------------------------------------------------------------------
    #: How long :meth:`abort` waits for ``ncclCommAbort`` before leaving it to its thread.
    abort_wait_s = 2.0
    #: After a watchdog error, how long the host has to reach a call that raises it before the
    #: process is ended ([Note: a host held behind a stuck gather] in ``wsharding/fatal.py``);
    #: None: never end it (the host may then wait forever in a CUDA synchronization).
    stuck_exit_s: float | None = 3.0

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
        if self.handle and not self.aborted:
            self.aborted = True
            self._stop_issue_thread()  # before the graphs it launches are destroyed
            for b in self.pool.buffers:
                b.window = None
            self._abort_thread = threading.Thread(target=self._abort_now, args=(self.handle,),
                                                  name=f"wsharding-nccl-abort-r{self.rank}", daemon=True)
            self._abort_thread.start()
            self._abort_thread.join(self.abort_wait_s)

    def _stop_issue_thread(self) -> None:
        # A thread held in a driver call longer than abort_wait_s is left to end on its own (stop()
        # returns False): the process is on its way out after an abort, like a stuck abort's.
        if self.issuer is not None:
            self.issuer.stop(self.abort_wait_s)

    def _abort_now(self, handle: int) -> None:
        # NCCL's abort, like its destroy, waits until no graph references the communicator.
        try:
            self._destroy_graphs()
        finally:
            self.nccl.ncclCommAbort(handle)

    @property
    def leaked(self) -> bool:
        """True when an abort did not finish (a gather stuck on the GPU): the memory stays allocated."""
        return self._abort_thread is not None and self._abort_thread.is_alive()

    def _teardown(self, error: bool) -> None:
        """Deregister windows (collective), free memory, finalize + destroy; on an error, or when a
        collective step times out, abort first and only free memory."""
        if self.watchdog is not None:
            self.watchdog.stop()
        try:
            if self.issuer is not None and not error and not self.aborted:
                try:
                    self.drain_issued("close")
                except CommError:
                    pass  # aborted by drain_issued
            self._stop_issue_thread()
            if self.handle and not self.aborted and not error:
                try:
                    self.synchronize()
                    self._destroy_graphs()  # they reference windows; NCCL's destroy waits for them
                    # Deregistration is collective, and on a blocking communicator it would wait for
                    # a peer that is gone with no timeout: agree over gloo first, whose failure (a
                    # dead peer closes its sockets) or timeout turns the close into an abort.
                    self.exchange("close")
                    self.pool.deregister_all()
                except CommError:
                    pass  # poll_until / complete aborted the communicator already
                except (RuntimeError, ValueError):  # gloo: a peer is gone, or the group was destroyed
                    error = True
            if error:
                self.abort()
            if not self.aborted:
                torch.cuda.synchronize(self.device)  # no copy may still touch the memory we free
                self._destroy_graphs()  # (when the deregistration above did not run)
            if not self.leaked:  # [Note: abort with a stuck gather]
                self.pool.free_all()
            if self.handle and not self.aborted:
                self.complete(self.nccl.ncclCommFinalize(self.handle), "ncclCommFinalize")
                if not self.aborted:
                    self.nccl.check(self.nccl.ncclCommDestroy(self.handle), "ncclCommDestroy")
        finally:
            self.handle = None
            self.closed = True
            _LIVE.discard(self)

    def close(self) -> None:
        """Close the shardings that use our memory, then deregister windows, free the memory, finalize
        and destroy (or abort) the communicator."""
        callbacks, self._on_close = self._on_close, []
        for ref in callbacks:
            fn = ref()
            if fn is not None and not (self.closed or self.aborted):
                fn()
        if not self.closed:
            self._teardown(error=self.aborted)

    def __enter__(self) -> NcclCommunicator:
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        # On an error the peers may not reach the collective deregistration: abort instead.
        if exc_type is not None and not self.closed:
            self._teardown(error=True)
        else:
            self.close()

    # ---- reporting -----------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "world_size": self.world_size, "device": str(self.device), "mode": self.mode,
            "blocking": self.blocking, "leaked": self.leaked, "emulation": self.emulation,
            "gather_launch": self.gather_launch, "captured_graphs": len(self._graphs),
            "issue_thread": self.issuer is not None,
            "ranks_per_gpu": self.ranks_per_gpu, "cta_policy": self.cta_policy,
            "group_ranks": list(self.group_ranks),
            "cta_policy_name": CTA_POLICY_NAMES[self.cta_policy], "nccl": self.library.describe(),
            "windows": sum(1 for b in self.pool.buffers if b.window is not None),
            "registered_bytes": self.pool.registered_bytes,
        }

    def __repr__(self) -> str:
        return (f"NcclCommunicator(rank={self.rank}, world_size={self.world_size}, group={list(self.group_ranks)}, "
                f"mode={self.mode!r}, "
                f"cta_policy={self.cta_policy}, nccl={format_version(self.library.version)})")


def from_context(ctx: Any, *, device: torch.device | str | None = None, group_size: int | None = None,
                 **kwargs: Any) -> NcclCommunicator:
    """An :class:`NcclCommunicator` over this rank's shard group of a :class:`~wsharding.context.RankContext`
    (``group_size`` ``None``: all ranks; else groups ``(rank // g) * g``, one communicator each).

    On gloo clusters (several ranks on one GPU) each rank takes ``cuda:(rank % gpus)``.
    """
    if device is None:
        device = ctx.device if ctx.device.type == "cuda" else torch.device("cuda", ctx.rank % max(1, torch.cuda.device_count()))
    cpu_group = gloo_group_for(ctx) if group_size is None else gloo_shard_group_for(ctx, group_size)
    return NcclCommunicator(cpu_group, device=device, **kwargs)
