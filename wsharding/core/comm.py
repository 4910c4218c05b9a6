"""The small communication protocol every backend speaks.

Weight sharding needs only four things from a communication library: who am I, how many are we,
gather my chunk into a full buffer (blocking or not), and a barrier. Backends also allocate the
buffers that gathers read and write, so that a backend with symmetric memory (our NCCL binding) can
hand out registered windows while the torch.distributed backend hands out plain tensors.

:class:`Communicator` is a base class rather than a structural protocol: what only some backends
need (registering windows, releasing them, closing shardings first, a copy stream) has a default
there, so that the library calls and reads every part plainly instead of probing for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from wsharding.core.errors import Unsupported, WshardingError


class CommError(WshardingError, RuntimeError):
    """A collective could not be issued or did not complete."""


@runtime_checkable
class GatherHandle(Protocol):
    """An all-gather in flight. ``wait()`` returns once the full buffer is valid for the caller
    (on CUDA: once the caller's current stream is ordered after the gather)."""

    def wait(self) -> None: ...

    def is_completed(self) -> bool: ...


class DoneHandle:
    """Handle of a gather that already finished (blocking backends, world size 1)."""

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class PreparedGather:
    """One layer's gather with every argument worked out once: pointers, sizes, windows, streams and
    events. The per-layer hot path only calls :meth:`start` and :meth:`wait`, which cost the host O(1)
    and never wait for the GPU ([Note: the hot path]). Each backend derives its own; the two
    optional methods have defaults here.

    [Note: the hot path]
    At decode sizes a layer computes for a fraction of a millisecond, so the host time the planner spends
    per layer *is* the step time unless it is a few microseconds. Everything that can be decided is
    decided at init: each layer's gather is a :class:`~wsharding.core.comm.PreparedGather` (pointers,
    sizes, windows, events and streams converted once), its slot, its gate layer and the events. Per
    layer the planner then does dict lookups and the few stream/event calls the data path needs; the
    compute stream is looked up once per step; nothing waits for the GPU; errors the GPU side finds are
    raised at the next call by the communicator (its watchdog), not polled for here.
    """

    #: What is gathered, for error messages ("layer 3: gather of 1024 B into slot B").
    what: str = ""

    def start(self, gate: torch.cuda.Event | None = None, marks: tuple | None = None, *,
              inline: bool = False) -> None:
        """Issue the gather. On CUDA it is ordered after ``gate`` (an event on the compute stream:
        the end of the layer that last read this slot) and never blocks the host; on CPU it runs on
        the backend's thread. ``marks``: (start, end) trace events to record around it (CUDA).
        ``inline``: the caller waits on it at once, so a backend that hands its launches to another
        thread ([Note: the issue thread]) issues this one on the calling thread; others ignore it."""
        raise Unsupported(f"{type(self).__name__} implements no start")

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """CUDA: order ``stream`` (the compute stream) after the gather, without a host wait.
        CPU: block until the gather completed."""
        raise Unsupported(f"{type(self).__name__} implements no wait")

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` when the gather completes (CPU traces mark its end with it). A backend that
        cannot tell calls it at once."""
        fn()

    def close(self) -> None:
        """Free what the gather holds beyond its buffers (our NCCL gather's captured graph); the
        planner calls it as the weight sharding closes, before the windows go."""


class Communicator:
    """What the slots, the planner and the loaders need from a group of ranks: the base class every
    backend derives from.

    The required part -- who am I, how many are we, gather, allocate, barrier -- each backend
    implements (the methods here only raise). The optional part has defaults here that are what a
    backend of plain tensors (the torch.distributed one) needs, so that callers use every attribute
    and method as it is, with no probing for what a backend may lack; a backend with symmetric
    memory (our NCCL binding) overrides them.
    """

    #: This rank's index inside the group.
    rank: int
    #: Number of ranks in the group.
    world_size: int
    #: Device that gathered buffers live on.
    device: torch.device
    #: Short label of the backend and mode, e.g. ``"cpu-gloo"`` or ``"gpu-nccl"``.
    mode: str

    # ---- optional: the defaults are what the torch backend (plain tensors) needs --------------------
    #: Unit the byte formula rounds every buffer up to: a paged backend overrides it (our NCCL binding: 4096-B windows).
    alloc_granularity: int = 1
    #: Stream a backend with its own gather streams copies the own chunk on, ahead of an in-place gather; None: no such.
    copy_stream: torch.cuda.Stream | None = None
    #: Pool of symmetric windows that mapped slots take their pages from (our NCCL binding); None: plain tensors.
    pool: Any = None
    #: The libnccl a backend loaded, whose version gates mapped layer views (our NCCL binding); None: it loads none.
    library: Any = None
    #: What a backend only emulates (several ranks time-slicing one GPU), for reports to label timings; "": nothing.
    emulation: str = ""
    #: The torch.distributed process group of the shard group (the torch backend's); None: the standard
    #: group of ``world_size`` consecutive ranks (the whole world where it is one group).
    group: Any = None
    #: How long a collective of this group may wait before it fails (the torch backend's); None: torch's default.
    timeout: Any = None
    #: Global ranks of the shard group, in group order; empty where the backend knows of no process group.
    group_ranks: tuple[int, ...] | list[int] = ()
    #: Whether several ranks of the group time-slice one GPU (our NCCL binding, NCCL >= 2.30).
    shared_gpu: bool = False
    #: Whether a CUDA graph may capture this backend's gathers (a decode step replayed whole); the
    #: torch backend's gathers are not captured.
    captures_gathers: bool = False
    #: The stream the gathers run on, apart from the compute stream (our NCCL binding's); None: a
    #: backend that gathers from the caller's current stream.
    stream: torch.cuda.Stream | None = None
    #: How a prepared gather reaches the library per layer, where a backend has a choice ("graph" or
    #: "direct", our NCCL binding's); None: one call per gather.
    gather_launch: str | None = None
    #: Whether the backend's library runs blocking (our NCCL binding's choice); None: no such choice.
    blocking: bool | None = None
    #: Whether the gathers can be handed to a native issue thread ([Note: the issue thread];
    #: :meth:`set_issue_thread`), and the thread when one runs (None: the caller's thread issues them).
    offers_issue_thread: bool = False
    issuer: Any = None

    def slot_policy(self, map_own_chunk: bool | str = "auto") -> Any:
        """How a sharding on this communicator lays out its slots: None, plain slots (the sharding's
        own :class:`~wsharding.core.slots.SlotPolicy`: plain tensors cannot be mapped over the chunks).
        A backend that can map them (our NCCL binding) returns its own policy for ``map_own_chunk``."""
        return None

    def record_event(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        """Record ``event`` on ``stream`` (CUDA): the planner's per-layer gate marks. A backend with a
        cheaper call than torch's (our binding of the CUDA driver) overrides it."""
        event.record(stream)

    def register_all(self) -> int:
        """A symmetric-memory backend registers new buffers as windows (collective); the torch backend has none: 0."""
        return 0

    def release(self, buffers: list[torch.Tensor]) -> None:
        """A backend of registered windows deregisters and frees them (collective); tensors are freed when dropped."""

    def on_close(self, callback: Callable[[], None]) -> None:
        """A backend that frees memory a sharding views calls ``callback`` before it closes; torch's frees none."""

    def prepare_outside_steps(self) -> None:
        """Collective (every rank of the group, at finalize): make the channel that
        :meth:`gather_outside_steps` uses. The default has none of its own."""

    def gather_outside_steps(self, full: torch.Tensor, chunk: torch.Tensor, *, what: str) -> None:
        """Gather a layer outside the step's schedule, synchronously ([Note: checked at use] in
        ``wsharding/core/step_owner.py``): on CUDA ordered after the current stream, which is ordered after
        it on return. A backend gives it a channel of its own, so that a rank that makes this call alone
        waits there (and times out) instead of pairing it with a peer's next scheduled gather; this
        default uses the same channel as the steps."""
        self.all_gather_into(full, chunk, what=what)

    # ---- required: every backend implements these ----------------------------------------------------
    def all_gather_into(
        self, full: torch.Tensor, chunk: torch.Tensor, *, async_op: bool = False,
        stream: torch.cuda.Stream | None = None, what: str = "all-gather",
    ) -> GatherHandle:
        """Gather every rank's ``chunk`` into ``full`` (rank order). In place when ``chunk`` is
        this rank's slice of ``full``. On CUDA the gather is ordered after the current stream, and
        runs on ``stream`` where the backend gathers on a stream it is given (our NCCL binding;
        torch.distributed uses its own, ordered after the current one). ``what`` names it in errors."""
        raise Unsupported(f"{type(self).__name__} implements no all_gather_into")

    def prepare_gather(self, full: torch.Tensor, chunk: torch.Tensor, *, what: str = "") -> PreparedGather:
        """Check the arguments once and return the gather as a :class:`PreparedGather`."""
        raise Unsupported(f"{type(self).__name__} implements no prepare_gather")

    def fork(self, event: torch.cuda.Event) -> None:
        """CUDA: order every stream the backend gathers on after ``event`` (recorded on the compute
        stream at the start of a step, or of a CUDA-graph capture). CPU: nothing."""
        raise Unsupported(f"{type(self).__name__} implements no fork")

    def alloc(self, nbytes: int, *, tag: str = "") -> torch.Tensor:
        """A 1-D uint8 buffer of ``nbytes`` on :attr:`device` that gathers may use."""
        raise Unsupported(f"{type(self).__name__} implements no alloc")

    def set_issue_thread(self, on: bool) -> None:
        """Hand the gathers to a native issue thread, or take them back ([Note: the issue thread]). Only a
        backend that :attr:`offers_issue_thread` has one; switching it off where none runs does nothing."""
        if on:
            raise Unsupported(f"{type(self).__name__} has no issue thread: it needs our NCCL communicator (--comm nccl)")

    def raise_if_failed(self, what: str) -> None:
        """Raise :class:`CommError` when an error was found off the hot path (a watchdog), naming
        ``what`` was being done; nothing otherwise."""
        raise Unsupported(f"{type(self).__name__} implements no raise_if_failed")

    def barrier(self) -> None:
        """Return once every rank of the group has called it."""
        raise Unsupported(f"{type(self).__name__} implements no barrier")


def check_gather_args(comm: Communicator, full: torch.Tensor, chunk: torch.Tensor) -> None:
    """The argument rules shared by every backend, with errors that say what to fix."""
    for name, t in (("full", full), ("chunk", chunk)):
        if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
            raise CommError(
                f"all_gather_into: {name} must be a contiguous 1-D uint8 tensor, "
                f"got {t.dtype} {tuple(t.shape)}"
            )
        if t.device != comm.device:
            raise CommError(f"all_gather_into: {name} is on {t.device}, this rank's device is {comm.device}")
    if full.numel() != chunk.numel() * comm.world_size:
        raise CommError(
            f"all_gather_into: full has {full.numel()} bytes, expected chunk ({chunk.numel()}) x "
            f"world size ({comm.world_size}) = {chunk.numel() * comm.world_size}"
        )


def is_slice_of(chunk: torch.Tensor, full: torch.Tensor, rank: int) -> bool:
    """True when ``chunk`` is exactly ``rank``'s slice of ``full`` (the in-place case)."""
    if chunk.untyped_storage().data_ptr() != full.untyped_storage().data_ptr():
        return False
    return chunk.data_ptr() == full.data_ptr() + rank * chunk.numel()
