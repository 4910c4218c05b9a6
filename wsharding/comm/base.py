"""The small communication protocol every backend speaks.

Weight sharding needs only four things from a communication library: who am I, how many are we,
gather my chunk into a full buffer (blocking or not), and a barrier. Backends also allocate the
buffers that gathers read and write, so that a backend with symmetric memory (our NCCL binding) can
hand out registered windows while the torch.distributed backend hands out plain tensors.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


class CommError(RuntimeError):
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


@runtime_checkable
class Communicator(Protocol):
    """What the slots, the planner and the loaders need from a group of ranks."""

    #: This rank's index inside the group.
    rank: int
    #: Number of ranks in the group.
    world_size: int
    #: Device that gathered buffers live on.
    device: torch.device
    #: Short label of the backend and mode, e.g. ``"cpu-gloo"`` or ``"gpu-nccl"``.
    mode: str

    def all_gather_into(
        self, full: torch.Tensor, chunk: torch.Tensor, *, async_op: bool = False
    ) -> GatherHandle:
        """Gather every rank's ``chunk`` into ``full`` (rank order). In place when ``chunk`` is
        this rank's slice of ``full``. On CUDA the gather is ordered after the current stream."""
        ...

    def alloc(self, nbytes: int, *, tag: str = "") -> torch.Tensor:
        """A 1-D uint8 buffer of ``nbytes`` on :attr:`device` that gathers may use."""
        ...

    def barrier(self) -> None: ...


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
