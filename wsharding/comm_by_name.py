"""The communicators a rank can gather with, by name: one registry, :data:`COMMS`.

Each entry (:class:`CommKind`) says what the communicator is, the devices its gathers run on, whether
this machine runs it, and how to make one over a rank's shard group. What the package asks *by name*
is read from it: the commands' ``--comm`` choices (:data:`COMM_CHOICES`) and the ``"auto"`` rule,
written once in :func:`resolve_comm` -- the first communicator, in the registry's order, that runs
here on the ranks' devices. What a communicator *can do* once made (have its gathers captured in a
CUDA graph, several ranks on one GPU, its group's global ranks, an issue thread) it answers itself,
as attributes of :class:`~wsharding.core.comm.Communicator` with defaults there; nothing asks which
class it is.

A new communicator is one file (a :class:`~wsharding.core.comm.Communicator` subclass and its
factory) and one line in :data:`COMMS`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from wsharding.core.comm import Communicator
from wsharding.core.context import RankContext
from wsharding.core.errors import InvalidArgument
from wsharding.core.groups import check_group_size


def ours_supported() -> bool:
    """True when this machine can run our NCCL communicator: CUDA, and a libnccl with symmetric
    windows and the copy engine (>= 2.28.3)."""
    if not torch.cuda.is_available():
        return False
    from wsharding.accel.nccl.library import NcclLibraryError, default_library

    try:
        return bool(default_library().describe().get("copy_engine_allgather"))
    except NcclLibraryError:
        return False


def multi_rank_per_gpu_supported() -> bool:
    """True when several ranks may share this machine's GPU with our NCCL communicator: a GPU, a
    libnccl >= 2.30 and ``NCCL_MULTI_RANK_GPU_ENABLE=1`` (NCCL's multi-rank-per-GPU mode)."""
    if not torch.cuda.is_available() or os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
        return False
    from wsharding.accel.nccl.library import NcclLibraryError, default_library

    try:
        return bool(default_library().describe().get("multi_rank_per_gpu"))
    except NcclLibraryError:
        return False


def _torch_comm(ctx: RankContext, group_size: int) -> Communicator:
    return ctx.shard_comm(group_size)


def _nccl_comm(ctx: RankContext, group_size: int) -> Communicator:
    # creating it is collective and slow: once per rank and group size, kept in the rank's store
    whole = group_size == ctx.world_size
    key = "_wsharding_nccl_comm" if whole else f"_wsharding_nccl_comm.g{group_size}"
    if key not in ctx.store:
        from wsharding.accel.nccl import from_context

        ctx.store[key] = from_context(ctx, group_size=None if whole else group_size)
    return ctx.store[key]


@dataclass(frozen=True)
class CommKind:
    """One communicator of the registry.

    ``make(ctx, group_size)`` returns it over this rank's shard group (groups ``(rank // g) * g``);
    ``devices``: the device types its gathers run on; ``runs_here()``: whether this machine can run
    it (a library found, new enough), and ``needs``: what it takes, for the error where it cannot."""

    name: str
    what: str
    devices: tuple[str, ...]
    make: Callable[[RankContext, int], Communicator]
    runs_here: Callable[[], bool] = lambda: True
    needs: str = ""


#: Every communicator, in the order ``"auto"`` prefers them.
COMMS: dict[str, CommKind] = {k.name: k for k in (
    CommKind("nccl", "our NCCL binding: symmetric windows, copy engine", ("cuda",), _nccl_comm, ours_supported,
             "libnccl >= 2.28.3 (symmetric windows, copy engine); 'wsharding info' shows the library found"),
    CommKind("torch", "torch.distributed over the rank's shard group (gloo on CPU ranks, NCCL on GPUs)",
             ("cpu", "cuda"), _torch_comm),
)}
#: The name that picks the first communicator of :data:`COMMS` that runs here (:func:`resolve_comm`).
AUTO = "auto"
#: What a command's ``--comm`` accepts.
COMM_CHOICES: tuple[str, ...] = (AUTO, *COMMS)


def resolve_comm(name: str, *, on_gpus: bool) -> str:
    """The communicator ``name`` stands for: itself, or for ``"auto"`` the first of :data:`COMMS` that
    runs on this machine and on the ranks' devices (GPUs where ``on_gpus``, else CPU). Unknown names
    are refused."""
    if name == AUTO:
        device = "cuda" if on_gpus else "cpu"
        return next(k.name for k in COMMS.values() if device in k.devices and k.runs_here())
    if name not in COMMS:
        raise InvalidArgument(f"unknown communicator {name!r}: use one of {', '.join(map(repr, COMM_CHOICES))}")
    return name


def shard_comm_for(ctx: RankContext, comm: str = "torch", group_size: int | None = None) -> Communicator:
    """The communicator the sharded layers gather with, over this rank's shard group.

    ``comm``: a name of :data:`COMMS`, or ``"auto"`` (:func:`resolve_comm`: the gathers run on GPUs
    wherever this machine has one, several ranks sharing it included). ``group_size`` (default:
    the whole world) cuts the world into groups ``(rank // g) * g``, as the intra-node groups of 8 of
    SGLang's weight sharding for Kimi K3; each group shards one copy of the weights between its members.
    """
    kind = COMMS[resolve_comm(comm, on_gpus=torch.cuda.is_available())]
    # never clipped to the world: a group the world cannot hold is refused, naming the world size
    g = ctx.world_size if group_size is None else check_group_size(ctx.world_size, group_size,
                                                                   where=f"rank {ctx.rank}: shard_comm_for")
    return kind.make(ctx, g)


def graph_unsupported(comm: Any) -> str | None:
    """Why a step over ``comm`` cannot be captured in a CUDA graph here, or None when it can (the
    rule of ``bench step --graph`` and ``demo --graph``)."""
    if comm.device.type != "cuda":
        return "CUDA graphs need GPUs (these are CPU ranks)"
    if comm.world_size == 1:
        return None
    if not comm.captures_gathers:
        return "capturing gathers needs our NCCL communicator (--comm nccl)"
    if comm.shared_gpu:
        return "several ranks share one GPU: capturing their gathers hung when tried there"
    return None
