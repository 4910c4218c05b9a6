"""The torch.distributed backend: gloo on CPU ranks, NCCL on GPUs.

Buffers are plain tensors here (no symmetric memory); our own NCCL binding (``comm.nccl``) is the
backend that hands out registered windows and takes the copy-engine path.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from wsharding.core.comm import (
    CommError,
    Communicator,
    DoneHandle,
    GatherHandle,
    PreparedGather,
    check_gather_args,
    is_slice_of,
)
from wsharding.core.groups import shard_group_ranks

# torch 2.13 renamed all_gather_into_tensor to all_gather_single; the GPU machine has 2.11.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _WorkHandle:
    """Wraps a torch.distributed Work so that waiting on it names what was being gathered."""

    def __init__(self, work: dist.Work, what: str) -> None:
        self._work = work
        self._what = what

    def wait(self) -> None:
        try:
            self._work.wait()
        except RuntimeError as e:  # gloo/NCCL timeouts and aborts arrive here
            raise CommError(f"{self._what} did not complete: {e}") from e
        for fn in getattr(self, "_late_callbacks", ()):
            fn()

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def add_done_callback(self, fn) -> None:
        """Call ``fn()`` when the collective completes (on the backend's thread for gloo)."""
        try:
            self._work.get_future().then(lambda _fut: fn())
        except RuntimeError:  # a backend without futures: stamp when the caller waits instead
            self._late_callbacks = [*getattr(self, "_late_callbacks", []), fn]


class TorchPreparedGather(PreparedGather):
    """A layer's gather through torch.distributed, arguments checked once.

    On CUDA the collective is issued from the compute stream: ProcessGroupNCCL orders its own NCCL
    stream after the stream current at the call, i.e. after every layer already queued -- the gate
    -- and ``work.wait()`` orders the compute stream after the collective; neither waits on the host.
    The gather is out of place: NCCL's ring kernel copies this rank's own chunk inside the same
    kernel, so no separate local copy runs in front of it.
    """

    def __init__(self, comm: TorchDistComm, full: torch.Tensor, chunk: torch.Tensor, what: str) -> None:
        check_gather_args(comm, full, chunk)
        self.comm = comm
        self.full = full
        self.chunk = chunk
        self.what = what
        self._in_place = is_slice_of(chunk, full, comm.rank)
        self._work: dist.Work | None = None

    def start(self, gate: torch.cuda.Event | None = None, marks: tuple | None = None, *,
              inline: bool = False) -> None:  # always on the calling thread
        comm = self.comm
        comm.gathers_issued += 1
        if marks is not None:
            marks[0].record()
        if comm.world_size == 1:
            if not self._in_place:
                self.full.copy_(self.chunk)
            self._work = None
        else:
            try:
                # [Note: gloo's gather temporary]
                # On CPU ranks gloo's all-gather flattens its output into a temporary as large as the whole
                # layer and copies it into ``full`` when it completes, so a forward's resident set rises by
                # |T_l| per gather in flight (gloo runs one collective at a time: two at depth 1 and above).
                # Measured so on gloo ranks: one layer at depth 0, two at depths 1 and 2, whatever the tokens.
                # NCCL writes into ``full`` directly: on GPUs the forward's peak is its activations.
                self._work = all_gather_single(self.full, self.chunk, group=comm.group, async_op=True)
            except RuntimeError as e:
                raise CommError(f"{self.what} failed on rank {comm.rank}: {e}") from e
        if marks is not None:
            if self._work is not None and comm.device.type == "cuda":
                # Only for traces: a private stream waits for the collective, then stamps its end.
                with torch.cuda.stream(comm.trace_stream()):
                    self._work.wait()
                    marks[1].record()
            else:
                marks[1].record()

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        work, self._work = self._work, None
        if work is None:
            return
        try:
            work.wait()
        except RuntimeError as e:  # gloo/NCCL timeouts and aborts arrive here
            raise CommError(f"{self.what} did not complete: {e}") from e

    def add_done_callback(self, fn) -> None:
        """Call ``fn()`` when the collective in flight completes (gloo: on its thread)."""
        if self._work is None:
            fn()
            return
        try:
            self._work.get_future().then(lambda _fut: fn())
        except RuntimeError:  # a backend without futures: stamp now
            fn()


def mode_label(backend: str, device: torch.device, shared_gpu: bool = False, *, world_size: int | None = None) -> str:
    """The mode every report names, for both communicators: ``cpu-gloo``, ``gpu-nccl``,
    ``gpu-nccl-shared`` (several ranks time-slicing one GPU), or ``gpu-nccl-single`` for a group of one
    rank when ``world_size`` is given (our NCCL communicator passes it; the rank contexts and
    torch.distributed comms do not, and say ``gpu-nccl`` there)."""
    if device.type == "cpu":
        return f"cpu-{backend}"
    if world_size == 1:
        return f"gpu-{backend}-single"
    return f"gpu-{backend}" + ("-shared" if shared_gpu else "")


class TorchDistComm(Communicator):
    """A :class:`~wsharding.core.comm.Communicator` over a torch.distributed process group."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        device: torch.device | str | None = None,
        mode: str | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise CommError("torch.distributed is not initialised: start the ranks first (torchrun and "
                            "wsharding.core.context.init_from_env, or a RankCluster of wsharding.lab.cluster)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.group_ranks = list(dist.get_process_group_ranks(group)) if group is not None else list(range(self.world_size))
        self.backend = str(dist.get_backend(group))
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        self.device = torch.device(device)
        self.mode = mode or mode_label(self.backend, self.device)
        #: Number of all-gathers issued (tests count one per sharded layer per step).
        self.gathers_issued = 0
        self._trace_stream: torch.cuda.Stream | None = None
        self.timeout = timeout
        #: The gloo group of the gathers outside the steps (:meth:`prepare_outside_steps`).
        self.outside_group: dist.ProcessGroup | None = None

    def all_gather_into(
        self, full: torch.Tensor, chunk: torch.Tensor, *, async_op: bool = False,
        stream: torch.cuda.Stream | None = None, what: str = "all-gather",
    ) -> GatherHandle:
        # ``stream``: torch.distributed gathers on its own stream, ordered after the current one.
        check_gather_args(self, full, chunk)
        self.gathers_issued += 1
        if self.world_size == 1:
            if not is_slice_of(chunk, full, 0):
                full.copy_(chunk)
            return DoneHandle()
        try:
            work = all_gather_single(full, chunk, group=self.group, async_op=async_op)
        except RuntimeError as e:
            raise CommError(f"{what} failed on rank {self.rank}: {e}") from e
        if async_op:
            return _WorkHandle(work, what)
        return DoneHandle()

    def prepare_outside_steps(self) -> None:
        """A gloo group over the same ranks, made by them alone (``use_local_synchronization``: the shard
        group finalizes without the rest of the world)."""
        if self.world_size == 1 or self.outside_group is not None:
            return
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else list(range(self.world_size))
        kwargs = {"timeout": self.timeout} if self.timeout is not None else {}
        self.outside_group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True, **kwargs)

    def gather_outside_steps(self, full: torch.Tensor, chunk: torch.Tensor, *, what: str) -> None:
        """Over :attr:`outside_group`, through host memory on CUDA (a rare, warned path)."""
        if self.world_size == 1 or self.outside_group is None:
            self.all_gather_into(full, chunk, what=what)
            return
        host = full.device.type != "cpu"
        # the own chunk may be a slice of full (in place): read it before full is written
        send = chunk.to("cpu", copy=True) if host else chunk.clone()
        recv = torch.empty(full.numel(), dtype=torch.uint8) if host else full
        try:
            all_gather_single(recv, send, group=self.outside_group)
        except RuntimeError as e:
            raise CommError(f"{what} did not complete on rank {self.rank} (every rank of the shard group must make "
                            f"this call): {e}") from e
        if host:
            full.copy_(recv)

    def prepare_gather(self, full: torch.Tensor, chunk: torch.Tensor, *, what: str = "all-gather") -> TorchPreparedGather:
        return TorchPreparedGather(self, full, chunk, what)

    def fork(self, event: torch.cuda.Event) -> None:
        """Nothing to order: gathers are issued from the compute stream itself."""

    def raise_if_failed(self, what: str) -> None:
        """torch.distributed reports its errors from ``work.wait()``; what is checked here, once per
        step, is that the process group still exists: after ``destroy_process_group`` a gather would
        end in torch's "Default process group has not been initialized", which names neither the
        sharding nor the way out."""
        gone = not dist.is_initialized() or (
            self.group is not None and self.group not in dist.distributed_c10d._world.pg_map)
        if gone:
            raise CommError(
                f"{what} on rank {self.rank}: the process group of this weight sharding was destroyed "
                "(torch.distributed.destroy_process_group) while the sharded model still uses it, so no layer "
                "can be gathered. Close the sharding (ws.close()) before destroying the group; to run again, "
                "initialise a process group and shard a freshly built model")

    def trace_stream(self) -> torch.cuda.Stream:
        if self._trace_stream is None:
            self._trace_stream = torch.cuda.Stream(self.device)
        return self._trace_stream

    def alloc(self, nbytes: int, *, tag: str = "") -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def barrier(self) -> None:
        if self.world_size > 1:
            if self.backend == "nccl":
                dist.barrier(self.group, device_ids=[self.device.index])
            else:
                dist.barrier(self.group)

    def __repr__(self) -> str:
        return f"TorchDistComm(rank={self.rank}, world_size={self.world_size}, mode={self.mode!r})"


def new_shard_comms(
    group_size: int = 8,
    *,
    device: torch.device | str | None = None,
    mode: str | None = None,
    timeout: timedelta | None = None,
) -> TorchDistComm:
    """Create every shard group of the world (a collective call: all ranks, same order) and
    return a communicator over this rank's group.

    World 8 with ``group_size=4`` gives two independent groups, [0..3] and [4..7].
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = shard_group_ranks(world, group_size)
    if len(groups) == 1:
        return TorchDistComm(None, device=device, mode=mode, timeout=timeout)
    mine = None
    for ranks in groups:
        # new_group must be called by every rank for every group, in the same order.
        pg = dist.new_group(ranks, timeout=timeout) if timeout else dist.new_group(ranks)
        if rank in ranks:
            mine = pg
    return TorchDistComm(mine, device=device, mode=mode, timeout=timeout)
