"""``NcclCommunicator``: our own NCCL communicator over the ctypes binding.

What it adds to :class:`~wsharding.core.torch_backend.TorchDistComm`: buffers from ``ncclMemAlloc``
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

Errors and teardown: any failing call raises :class:`~wsharding.accel.nccl.binding.NcclError`
(``ncclGetErrorString`` + ``ncclGetLastError``); an operation still in progress after
``timeout_s`` raises :class:`CommTimeout` after aborting the communicator. ``close()`` after an
abort only frees memory (the aborted communicator owns no windows any more).

This file holds the protocol; each other concern has its own file, read top to bottom:
``startup.py`` (the constructor's steps, functions of explicit arguments), ``policy.py`` (arguments
and environment refused), ``failures.py`` (:class:`~wsharding.accel.nccl.failures.NcclWaits`, a base
class: waiting, and failures turned into errors), ``watchdog.py`` (the thread it owns),
``teardown.py`` (:class:`~wsharding.accel.nccl.teardown.Teardown`, an object it owns: close, abort,
the exit registry), ``graphs.py`` (:class:`~wsharding.accel.nccl.graphs.CapturedGraphs`, the CUDA
graphs it owns), ``gather.py`` (a layer's prepared gather), ``gather_now.py`` (``all_gather_into``),
and ``issuing.py`` (the opt-in issue thread, imported only when it is switched on).
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from wsharding.accel.captured_launch import CapturedLaunch
from wsharding.accel.cuda_driver import driver
from wsharding.accel.nccl import gather_now
from wsharding.accel.nccl.binding import CTA_POLICY_NAMES, NcclError, make_config
from wsharding.accel.nccl.failures import CommTimeout, NcclWaits
from wsharding.accel.nccl.gather import NcclPreparedGather
from wsharding.accel.nccl.gather_now import NcclGatherHandle
from wsharding.accel.nccl.graphs import CapturedGraphs
from wsharding.accel.nccl.group import (
    exchange_over,
    gloo_group_for,
    gloo_shard_group_for,
    group_members,
    share_unique_id,
)
from wsharding.accel.nccl.library import NcclLibrary, format_version
from wsharding.accel.nccl.policy import (
    CTA_POLICY_ZERO,
    GATHER_LAUNCHES,
    check_cta_policy,
    check_cta_policy_env,
    check_device_arg,
    check_gather_launch,
    parse_cta_policy,
)
from wsharding.accel.nccl.startup import (
    cuda_device,
    gpu_placement,
    group_position,
    init_comm,
    load_nccl,
    require_cuda,
)
from wsharding.accel.nccl.symmetric import WINDOW_ALIGN, SymmetricPool
from wsharding.accel.nccl.teardown import Teardown, close_at_exit
from wsharding.accel.nccl.watchdog import Watchdog
from wsharding.core.comm import CommError, Communicator
from wsharding.core.emulation import SHARED_GPU_NOTE
from wsharding.core.groups import check_group_size
from wsharding.core.torch_backend import mode_label

if TYPE_CHECKING:
    from wsharding.accel.nccl.issuing import Issuing

#: The policy names, the errors and the gather handle live in ``policy.py``, ``binding.py``,
#: ``failures.py`` and ``gather_now.py``; they are importable from here too, with the communicator
#: that checks, raises and returns them.
__all__ = ["CTA_POLICY_ZERO", "GATHER_LAUNCHES", "CommError", "CommTimeout", "NcclCommunicator", "NcclError",
           "NcclGatherHandle", "check_cta_policy_env", "from_context", "parse_cta_policy"]

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
# (``set_up_copy_engine`` in ``startup.py``); after it a gather only queues stream work. (With CTA
# policy 0 NCCL may still connect lazily when a later size picks another algorithm.) Gathers in
# flight stay watched by the watchdog thread in both modes. ``blocking=False`` keeps the old
# behaviour, for comparison.

class NcclCommunicator(NcclWaits, Communicator):
    """A :class:`~wsharding.core.comm.Communicator` on libnccl with symmetric windows.

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
            hands them over ([Note: the issue thread] in ``wsharding/accel/issue_thread.py``; off by
            default until measured on two GPUs).
    """

    #: Every buffer is its own ncclMemAlloc, rounded up to the 4096-byte window alignment: the unit
    #: in which weight sharding's byte formula counts this backend's allocations.
    alloc_granularity = WINDOW_ALIGN
    #: Its gathers are captured in CUDA graphs ([Note: a gather launched as a graph]): a decode step
    #: replays whole (not where several ranks share one GPU: ``shared_gpu``).
    captures_gathers = True
    offers_issue_thread = True
    #: [Note: the issue thread]: the plug-in that hands the gathers to the native thread, set when
    #: asked for (``issue_thread=True``, :meth:`set_issue_thread`); None, the default, when off.
    issuing: Issuing | None = None

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
        check_gather_launch(gather_launch)
        cta_policy = check_cta_policy(cta_policy)
        check_device_arg(device)
        #: How a prepared gather reaches NCCL per layer ([Note: a gather launched as a graph]).
        self.gather_launch = gather_launch
        self.aborted = False
        self.closed = False
        #: Held around NCCL calls that the watchdog's abort (from its thread) must not interleave with.
        self.lock = threading.RLock()
        self.watchdog: Watchdog | None = None
        #: Every graph captured on this communicator: destroyed before it (NCCL waits for them).
        self.graphs = CapturedGraphs(self.lock)
        #: How it ends: the close, the abort, and what only they need.
        self.teardown = Teardown(self)
        self.pool = SymmetricPool(self)
        self.timeout_s = float(timeout_s)
        # the base's `timeout`: a gloo group made beside this one (an engine's step agreement) waits as long
        self.timeout = timedelta(seconds=self.timeout_s)
        self.cta_policy = cta_policy
        self.blocking = bool(blocking)
        # Checks that need no GPU come first, so CPU machines get the real reason.
        self.library, self.nccl = load_nccl(library)
        check_cta_policy_env(cta_policy)
        require_cuda()

        self.cpu_group = cpu_group
        self.rank, self.world_size = group_position(cpu_group)
        self.device = cuda_device(device)
        self.ranks_per_gpu, self.single_node = gpu_placement(self.device, self.library, self.exchange)
        self.shared_gpu = self.ranks_per_gpu > 1
        self.mode = mode_label("nccl", self.device, self.shared_gpu, world_size=self.world_size)
        self.emulation = SHARED_GPU_NOTE if self.shared_gpu else ""
        # NCCL 2.28 copy-engine collectives fail on the legacy default stream: always our own.
        self.stream = torch.cuda.Stream(self.device)
        #: Places a rank's own chunk into its slot ahead of the in-place gather ([Note: no serial
        #: local copy] in gather.py), beside the gather stream and the compute stream.
        self.copy_stream = torch.cuda.Stream(self.device)
        self._cu = driver()  # the planner's event records go through it (record_event)
        self.gathers_issued = 0
        self.issuing = None  # an instance attribute, as every gather's start reads it
        if issue_thread:
            self._start_issuing(name)

        #: Global ranks of this communicator's shard group, in group order ([Note: shard groups] in ``group.py``).
        self.group_ranks = group_members(cpu_group, self.world_size)
        self._init_nccl(name)
        #: Turns a stuck gather or an async NCCL error into an abort, off the hot path (``watchdog.py``).
        self.watchdog = Watchdog(self.async_error_text, self.abort_from_watchdog, timeout_s=self.timeout_s,
                                 name=f"wsharding-nccl-watchdog-r{self.rank}", lock=self.lock,
                                 on_stuck=None if self.stuck_exit_s is None else self.end_stuck_process,
                                 stuck_after_s=self.stuck_exit_s or 0.0)
        if self.world_size > 1:
            self._set_up_copy_engine()

    def _init_nccl(self, name: str) -> None:
        """The unique id over gloo, then ``ncclCommInitRankConfig``; on a failure the communicator is
        torn down (an error close: abort, free) and the error raised."""
        unique_id = share_unique_id(self.nccl, self.rank, self.exchange)
        #: The ``ncclConfig_t`` the communicator was made with (NCCL reads it during init).
        self.config = make_config(blocking=self.blocking, cta_policy=self.cta_policy, comm_name=name.encode())
        close_at_exit(self)
        try:
            rc, self.handle = init_comm(self.nccl, self.rank, self.world_size, unique_id, self.config)
            self.complete(rc, f"ncclCommInitRankConfig(rank {self.rank} of {self.world_size})")
        except BaseException:
            self.teardown.end(error=True)
            raise

    def _set_up_copy_engine(self) -> None:
        """One small gather at init, with every rank present ([Note: blocking communicator]).

        NCCL sets the copy-engine path up at a communicator's first CE collective, and that set-up
        registers a window of its own -- a host-side collective. On a blocking communicator a peer
        that is missing at that moment would hold this host inside ``ncclAllGather``, out of reach of
        every timeout. Done here, right after init, the peers are known to be present (the unique id
        exchange just ran over gloo), and every later gather only queues work on a stream, which the
        watchdog times."""
        window = self.alloc_granularity  # one window's alignment per rank
        t = self.pool.alloc(window * self.world_size, "wsharding.copy-engine-setup")
        try:
            self.pool.register_all()
            mine = t.narrow(0, self.rank * window, window)
            self.all_gather_into(t, mine, async_op=True).synchronize()
        finally:
            if not (self.aborted or self.closed):
                self.pool.release([t])

    # ---- the ending (teardown.py) -----------------------------------------------------------------
    #: How long :meth:`abort` waits for ``ncclCommAbort`` before leaving it to its thread.
    abort_wait_s = 2.0
    #: After a watchdog error, how long the host has to reach a call that raises it before the
    #: process is ended ([Note: a host held behind a stuck gather] in ``wsharding/fatal.py``);
    #: None: never end it (the host may then wait forever in a CUDA synchronization).
    stuck_exit_s: float | None = 3.0

    def abort(self) -> None:
        """``ncclCommAbort`` on a thread of its own ([Note: abort with a stuck gather]); windows go with
        the communicator."""
        self.teardown.abort()

    def close(self) -> None:
        """Collective: close the shardings that use our memory, then deregister windows, free the
        memory, finalize and destroy (or abort) the communicator."""
        self.teardown.close()

    @property
    def leaked(self) -> bool:
        """True when an abort did not finish (a gather stuck on the GPU): the memory stays allocated."""
        return self.teardown.leaked

    def __enter__(self) -> NcclCommunicator:
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        # On an error the peers may not reach the collective deregistration: abort instead.
        if exc_type is not None and not self.closed:
            self.teardown.end(error=True)
        else:
            self.close()

    # ---- the issue thread, a plug-in ([Note: the issue thread]) -------------------------------------
    def _start_issuing(self, name: str) -> None:
        from wsharding.accel.nccl.issuing import start_issuing  # only where it is switched on

        self.issuing = start_issuing(self, name)

    def set_issue_thread(self, on: bool) -> None:
        """Start or stop the issue thread between steps ([Note: the issue thread]). Ranks may differ:
        the thread changes who issues the gathers, not which gathers or in what order."""
        self.check_open()
        if on and self.issuing is None:
            self._start_issuing("wsharding")
        elif not on and self.issuing is not None:
            self.drain_issued("stopping the issue thread")
            issuing, self.issuing = self.issuing, None
            if not issuing.stop():
                raise CommError(f"the issue thread of rank {self.rank} did not stop within {self.abort_wait_s} s")

    def drain_issued(self, what: str) -> None:
        """Before a call that reaches the gather or copy stream (or NCCL) directly: let the issue
        thread run everything pushed so far, so that the streams and NCCL see one order. The one
        place the communicator and its gathers drain it; nothing when it is off."""
        if self.issuing is not None:
            self.issuing.drain(what)

    @property
    def issuer(self) -> Any:
        """The native :class:`~wsharding.accel.issue_thread.IssueThread` when the issue thread is on,
        else None. Assigning one plugs it in as it is (tests hand it a thread whose calls fail or lag)."""
        return None if self.issuing is None else self.issuing.thread

    @issuer.setter
    def issuer(self, thread: Any) -> None:
        from wsharding.accel.nccl.issuing import Issuing  # only where it is switched on

        self.issuing = None if thread is None else Issuing(self, thread)

    # ---- helpers -----------------------------------------------------------------------------
    def exchange(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` in rank order, over the CPU group (gloo)."""
        return exchange_over(self.cpu_group, self.world_size, obj)

    def gather_outside_steps(self, full: torch.Tensor, chunk: torch.Tensor, *, what: str) -> None:
        """Over the CPU group (gloo), through host memory: a channel apart from the NCCL communicator's, so
        that a rank that makes this call alone cannot pair it with a peer's scheduled gather (a rare,
        warned path: [Note: checked at use] in ``wsharding/core/step_owner.py``)."""
        if self.world_size == 1:
            if full.data_ptr() != chunk.data_ptr():
                full.copy_(chunk)
            return
        import torch.distributed as dist

        from wsharding.core.torch_backend import all_gather_single

        send = chunk.to("cpu", copy=True)  # may be a slice of full (in place): read before full is written
        recv = torch.empty(full.numel(), dtype=torch.uint8)
        try:
            all_gather_single(recv, send, group=self.cpu_group if self.cpu_group is not None else dist.group.WORLD)
        except RuntimeError as e:
            raise CommError(f"{what} did not complete on rank {self.rank} (every rank of the shard group must make "
                            f"this call): {e}") from e
        full.copy_(recv)

    def watch(self, event: torch.cuda.Event, what: str) -> None:
        """Have the watchdog time ``event`` (for example the end of a CUDA-graph replay that holds
        gathers): if it is not done within the timeout, the communicator is aborted."""
        self.watchdog.watch(event, what)

    def alloc(self, nbytes: int, *, tag: str = "", register: bool = False) -> torch.Tensor:
        """A uint8 tensor over fresh ncclMemAlloc memory (a view, no copy; offset 0 of its own
        allocation, so 4096-aligned). Local; call :meth:`register_all` (collective) before gathering
        into it, or pass ``register=True`` when every rank allocates in the same order."""
        self.check_open()
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
        self.check_open()
        return NcclPreparedGather(self, full, chunk, what)

    def capture(self, stream: int, record, what: str) -> CapturedLaunch:
        """Capture what ``record(stream)`` queues (NCCL calls on this communicator) into a graph that
        this communicator owns and destroys before itself ([Note: a gather launched as a graph]).
        Collective when ``record`` is: every rank captures the same calls in the same order."""
        self.check_open()
        self.drain_issued(what)
        return self.graphs.capture(stream, record, what, rank=self.rank)

    def drop_graph(self, launch: CapturedLaunch) -> None:
        """Destroy one captured graph (a closed weight sharding's gather)."""
        self.graphs.drop(launch)

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
        self.teardown.on_close(callback)

    def fork(self, event: torch.cuda.Event) -> None:
        """Order the copy and gather streams after ``event`` (recorded on the compute stream)."""
        self.drain_issued("the fork of the gather streams")
        # The driver's call, as the gathers make ([Note: the hot path] in wsharding/core/comm.py): torch's
        # Stream.wait_event costs several times more host per call, once per step here.
        handle = event.cuda_event
        if handle == 0:  # torch creates the CUDA event at its first record: never recorded, nothing to wait for
            return
        cu = driver()
        cu.stream_wait_event(self.copy_stream.cuda_stream, handle)
        cu.stream_wait_event(self.stream.cuda_stream, handle)

    def record_event(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        """The planner's per-layer event records, through the driver: torch's ``Event.record`` costs
        several times more host per call ([Note: the hot path] in wsharding/core/comm.py)."""
        self._cu.event_record(event.cuda_event, stream.cuda_stream)

    def slot_policy(self, map_own_chunk: bool | str = "auto") -> Any:
        """Layer views mapped over the chunks where NCCL >= 2.30 allows and they hold no more
        ([Note: map_own_chunk="auto"] in wsharding/accel/mapped_slots.py)."""
        # imported here: mapped slots use this package's library and windows, which its __init__ loads
        from wsharding.accel.mapped_slots import MappedSlotPolicy

        return MappedSlotPolicy(self, map_own_chunk)

    def register_all(self) -> int:
        """Collective: register every buffer allocated since the last call, sorted by tag."""
        self.check_open()
        return self.pool.register_all()

    def all_gather_into(self, full: torch.Tensor, chunk: torch.Tensor, *, async_op: bool = False,
                        stream: torch.cuda.Stream | None = None, what: str = "ncclAllGather") -> NcclGatherHandle:
        """A gather issued now, not prepared (:func:`~wsharding.accel.nccl.gather_now.all_gather_into`):
        every rank's ``chunk`` into ``full``, both inside registered windows."""
        return gather_now.all_gather_into(self, full, chunk, async_op=async_op, stream=stream, what=what)

    def synchronize(self, timeout_s: float | None = None) -> None:
        """Block until everything issued on :attr:`stream` finished (abort after the timeout)."""
        self.check_open()
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

    # ---- reporting -----------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "world_size": self.world_size, "device": str(self.device), "mode": self.mode,
            "blocking": self.blocking, "leaked": self.leaked, "emulation": self.emulation,
            "gather_launch": self.gather_launch, "captured_graphs": len(self.graphs),
            "issue_thread": self.issuing is not None,
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
    """An :class:`NcclCommunicator` over this rank's shard group of a :class:`~wsharding.core.context.RankContext`
    (``group_size`` ``None``: all ranks; else groups ``(rank // g) * g``, one communicator each).

    On gloo clusters (several ranks on one GPU) each rank takes ``cuda:(rank % gpus)``.
    """
    if group_size is not None:  # refused before any group is made, never clipped to the world
        group_size = check_group_size(ctx.world_size, group_size, where=f"rank {ctx.rank}: from_context")
    if device is None:
        device = ctx.device if ctx.device.type == "cuda" else torch.device("cuda", ctx.rank % max(1, torch.cuda.device_count()))
    cpu_group = gloo_group_for(ctx) if group_size is None else gloo_shard_group_for(ctx, group_size)
    return NcclCommunicator(cpu_group, device=device, **kwargs)
