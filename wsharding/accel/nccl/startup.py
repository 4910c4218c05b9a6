"""The steps of our NCCL communicator's constructor, in the order it takes them, as functions of
explicit arguments (the constructor calls them and keeps what they return).

The checks that need no GPU come first (the library and its version, the CTA policy variable), so
that a CPU machine gets the real reason; then where this rank sits (its group, its device, who
shares its GPU); then NCCL itself. The constructor then starts the watchdog and runs one small
gather that sets the copy-engine path up while every rank is known to be present (its
``_set_up_copy_engine``; [Note: blocking communicator] in ``communicator.py``).
"""

from __future__ import annotations

import ctypes
import socket
from collections.abc import Callable
from typing import Any

import torch

from wsharding.accel.nccl.binding import NcclBinding, NcclConfig, NcclUniqueId
from wsharding.accel.nccl.library import (
    MIN_MULTI_RANK_GPU,
    MIN_SYMMETRIC,
    NcclLibrary,
    NcclLibraryError,
    default_library,
)
from wsharding.accel.nccl.policy import check_shared_gpu_env
from wsharding.core.comm import CommError


def load_nccl(library: NcclLibrary | None) -> tuple[NcclLibrary, NcclBinding]:
    """The library (default: the discovery order of ``library.py``), new enough for symmetric
    windows, and its binding, complete."""
    library = library or default_library()
    library.require(MIN_SYMMETRIC, "symmetric windows and the copy-engine AllGather")
    nccl = NcclBinding(library)
    if nccl.missing:
        raise NcclLibraryError(f"{library.path} lacks {nccl.missing}: not a complete libnccl")
    return library, nccl


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise CommError(
            "NcclCommunicator needs CUDA and this machine has no GPU: use TorchDistComm (gloo) on CPU; "
            "the copy-engine path runs only on GPUs"
        )


def group_position(cpu_group: Any) -> tuple[int, int]:
    """(rank, world size) inside ``cpu_group``; (0, 1) when torch.distributed is not initialised."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(cpu_group), dist.get_world_size(cpu_group)
    if cpu_group is not None:
        raise CommError("a cpu_group was given but torch.distributed is not initialised")
    return 0, 1


def cuda_device(device: torch.device | str | int | None) -> torch.device:
    """``device`` as a CUDA device with an index (default: the current one), made current."""
    if device is None:
        device = torch.cuda.current_device()
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        raise CommError(f"NcclCommunicator needs a CUDA device, got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    count = torch.cuda.device_count()
    if device.index >= count:
        raise CommError(f"NcclCommunicator: device {device} does not exist: this process sees {count} GPU(s), "
                        f"cuda:0 .. cuda:{count - 1}")
    torch.cuda.set_device(device)
    return device


def gpu_placement(device: torch.device, library: NcclLibrary, exchange: Callable[[Any], list[Any]]) -> tuple[int, bool]:
    """(ranks per GPU, whether every rank is on one host), over the CPU group (``exchange``). Several
    ranks on one GPU needs NCCL >= 2.30 and the opt-in variable."""
    props = torch.cuda.get_device_properties(device)
    me = (socket.gethostname(), str(getattr(props, "uuid", device.index)))
    where = exchange(me)
    ranks_per_gpu = max(where.count(w) for w in where)
    if ranks_per_gpu > 1:
        library.require(MIN_MULTI_RANK_GPU, f"{ranks_per_gpu} ranks on one GPU")
        check_shared_gpu_env(ranks_per_gpu)
    return ranks_per_gpu, len({w[0] for w in where}) == 1


def init_comm(nccl: NcclBinding, rank: int, world_size: int, unique_id: bytes, config: NcclConfig) -> tuple[int, int | None]:
    """``ncclCommInitRankConfig`` for this rank: (its return code, the new ``ncclComm_t``). The caller
    completes it (a non-blocking communicator may still be in progress) and tears down on a failure."""
    handle = ctypes.c_void_p()
    rc = nccl.ncclCommInitRankConfig(ctypes.byref(handle), world_size, NcclUniqueId.from_bytes(unique_id), rank,
                                     ctypes.byref(config))
    return rc, handle.value
