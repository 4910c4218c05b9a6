"""What a rank is: its :class:`RankContext`, and :func:`init_from_env` for a ``torchrun`` job.

A task function receives the context as its first argument (under :class:`~wsharding.lab.cluster.RankCluster`
or a torchrun script alike): the rank, the world, the device, the backend of the process group, the
mode and what is emulated, and ``shard_comm(g)`` -- the communicator of the rank's shard group.
:func:`init_from_env` builds it from torchrun's environment, checks that environment before any work,
learns which node each rank is on ([Note: shard groups and nodes]) and registers the teardown of the
process groups at exit ([Note: tearing down at exit]).
"""

from __future__ import annotations

import atexit
import math
import os
import socket
import sys
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from wsharding.core.emulation import CPU_EMULATION_NOTE, SHARED_GPU_NOTE, SHARED_GPU_TORCH_NOTE
from wsharding.core.errors import WshardingError, require_int
from wsharding.core.groups import check_group_size, fitting_group_size, warn_if_group_spans_nodes


class ClusterError(WshardingError, RuntimeError):
    """Base class of the errors a :class:`RankCluster` raises."""


def seconds_arg(name: str, value: object) -> float:
    """``value`` as a finite number of seconds > 0, or a ClusterError naming ``name``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok:
        raise ClusterError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


# ------------------------------------------------------------------------------------------------
# What a task sees on its rank
# ------------------------------------------------------------------------------------------------
@dataclass
class RankContext:
    """Everything a task function receives on its rank (first argument of every task)."""

    rank: int
    world_size: int
    device: torch.device
    backend: str
    mode: str
    #: ``""`` on real GPUs; otherwise the words that say what is emulated.
    emulation: str
    timeout: timedelta
    #: State a rank keeps between tasks (a notebook builds a model once and reuses it).
    store: dict[str, Any] = field(default_factory=dict)
    #: The node of every rank, in rank order (``0, 1, ...`` in order of first appearance); ``None``: not known.
    nodes: tuple[int, ...] | None = None
    _comms: dict[int, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        # a context of 2.0 ranks or of rank True would reach the groups' arithmetic as it was given
        self.world_size = require_int(self.world_size, "world_size", minimum=1, where="RankContext")
        self.rank = require_int(self.rank, "rank", maximum=self.world_size - 1, where="RankContext",
                                todo=f"ranks of a world of {self.world_size} are 0 .. {self.world_size - 1}")

    @property
    def node_group_size(self) -> int:
        """The largest shard group size whose groups ``(rank // g) * g`` each sit inside one node
        ([Note: shard groups and nodes]); the world size when the nodes are not known."""
        return self.world_size if not self.nodes else fitting_group_size(self.nodes)

    @property
    def comm(self):
        """A communicator over the whole world."""
        return self.shard_comm(self.world_size)

    def shard_comm(self, group_size: int | None = None, *, across_nodes: bool = False):
        """A communicator over this rank's shard group (``(rank // g) * g``), created once.

        ``group_size``: the ranks that share one copy of the weights; it must divide the world and is
        never clipped to it (a group of 8 in a world of 2 is refused, naming the world size and how to
        launch more ranks: :func:`~wsharding.core.groups.check_group_size`). ``None``: the largest group
        that sits inside one node (:attr:`node_group_size`; the whole world on one node).

        The first call for a group size is collective: every rank must make it. A group that spans
        nodes warns (:class:`~wsharding.core.groups.ShardGroupAcrossNodesWarning`) unless ``across_nodes=True`` says it is meant.
        """
        from wsharding.core.torch_backend import new_shard_comms

        g = self.node_group_size if group_size is None else check_group_size(
            self.world_size, group_size, where=f"rank {self.rank}: shard_comm")
        if self.device.type == "cuda" and self.backend != "nccl":
            raise ClusterError(f"rank {self.rank}: {SHARED_GPU_TORCH_NOTE}; use comm='nccl' (ours) for the gathers")
        if g not in self._comms:
            if not across_nodes:
                warn_if_group_spans_nodes(self, g, opt_in=f"pass shard_comm({g}, across_nodes=True)", stacklevel=2)
            self._comms[g] = new_shard_comms(g, device=self.device, mode=self.mode, timeout=self.timeout)
        return self._comms[g]

    def _subgroups(self) -> list[Any]:
        """The process groups made for this context besides the world (the shard groups of
        :meth:`shard_comm`, the gloo groups that ``comm.nccl.group`` keeps in :attr:`store`), oldest first."""
        import torch.distributed as dist

        found = [c.group for c in self._comms.values() if getattr(c, "group", None) is not None]
        found += [v for v in self.store.values() if isinstance(v, dist.ProcessGroup)]
        unique: list[Any] = []
        for pg in found:
            if all(pg is not u for u in unique):
                unique.append(pg)
        return unique


# [Note: shard groups and nodes]
# A shard group exists for the NVLink bandwidth inside a node: every layer, each member gathers the
# others' chunks. A group that spans nodes still computes the right thing, but each of those gathers
# crosses the inter-node network (an order of magnitude slower), so building one says so, once per rank
# whose group it is. Which node a rank is on: torchrun's GROUP_RANK (the node's index in the job) when it
# is set -- in a job of several "nodes" on one host the host names are all equal -- else the host name;
# init_from_env gathers them once. RankCluster's ranks all run on the host that started them.
_CONTEXT: RankContext | None = None


def current_context() -> RankContext:
    """The :class:`RankContext` of this process (inside a worker or a torchrun script)."""
    if _CONTEXT is None:
        raise ClusterError("this process is not a rank: start a RankCluster or call init_from_env()")
    return _CONTEXT


def make_context(rank: int, world: int, device: torch.device, backend: str, shared_gpu: bool, timeout: timedelta,
                  nodes: tuple[int, ...] | None = None) -> RankContext:
    from wsharding.core.torch_backend import mode_label

    mode = mode_label(backend, device, shared_gpu)
    emulation = CPU_EMULATION_NOTE if device.type == "cpu" else (SHARED_GPU_NOTE if shared_gpu else "")
    return RankContext(rank, world, device, backend, mode, emulation, timeout, nodes=nodes)


#: What ``init_process_group(init_method="env://")`` reads; torchrun sets them for every rank.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise ClusterError(f"environment variable {name} is not set: run the script under torchrun, or set it")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ClusterError(
            f"environment variable {name}={raw!r} is not an integer: torchrun sets it to the rank's number; "
            "set it to a whole number or unset it and run under torchrun"
        ) from None


def _read_torchrun_env(initialized: bool) -> tuple[int, int, int, int]:
    """``(rank, world, local_rank, local_world)`` of this process, checked against each other."""
    needed = TORCHRUN_VARIABLES if not initialized else ("RANK", "WORLD_SIZE")
    missing = [v for v in needed if v not in os.environ]
    if missing:
        raise ClusterError(
            f"init_from_env() joins a torchrun launch through env:// and needs {', '.join(needed)} in the "
            f"environment; missing: {', '.join(missing)}. Run the script under torchrun (torchrun "
            "--nproc-per-node N script.py), or set them yourself -- or start ranks from Python with RankCluster(N)"
        )
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if world < 1:
        raise ClusterError(f"environment variable WORLD_SIZE={world} must be >= 1")
    if not 0 <= rank < world:
        raise ClusterError(f"environment variable RANK={rank} is outside WORLD_SIZE={world}: ranks are 0 .. {world - 1}")
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    if not 1 <= local_world <= world:
        raise ClusterError(f"environment variable LOCAL_WORLD_SIZE={local_world} must be in 1 .. WORLD_SIZE={world}")
    local = _env_int("LOCAL_RANK", rank % local_world)
    if not 0 <= local < local_world:
        raise ClusterError(
            f"environment variable LOCAL_RANK={local} is outside LOCAL_WORLD_SIZE={local_world}: "
            f"local ranks are 0 .. {local_world - 1}"
        )
    _env_int("GROUP_RANK", 0)  # read later for the node map: refuse a malformed one now
    return rank, world, local, local_world


def _gather_nodes(world: int) -> tuple[int, ...]:
    """Every rank's node index ([Note: shard groups and nodes]); collective over the world."""
    import torch.distributed as dist

    group_rank = os.environ.get("GROUP_RANK")
    key = f"torchrun node {group_rank}" if group_rank is not None else f"host {socket.gethostname()}"
    keys: list[Any] = [None] * world
    dist.all_gather_object(keys, key)
    order: dict[str, int] = {}
    return tuple(order.setdefault(k, len(order)) for k in keys)


# [Note: tearing down at exit]
# A torchrun script that leaves with its process group alive exits while gloo's worker threads still
# hold finished work objects; one of them dropping the last reference during Py_FinalizeEx aborts the
# process ("terminate called without an active exception", SIGABRT) -- rarely on one node, often in
# jobs of several nodes, where the healthy node's agent then waits in the rendezvous exit barrier.
# init_from_env therefore registers an atexit teardown for the group it created:
# * first a barrier over each of this rank's sub-groups, then over the world: a rank destroys its
#   groups only once every peer has reached its exit, so no peer has work in flight with it (gloo's
#   barrier also waits for the group's own earlier work);
# * then the sub-groups, newest first, then the world -- a sub-group is never left behind a destroyed
#   world, and the order is the same on every rank;
# * all in a daemon thread joined with a time limit (the group timeout plus a margin): with a peer gone
#   or stuck, the barrier or the destroy can block, and a rank must still leave -- it says so on stderr;
# * after an uncaught exception (sys.last_value is set) there is no barrier: the peers are not coming to
#   it, and the failure must reach torchrun at once; the destroy alone gets a short limit.
_EXIT_MARGIN_S = 5.0
_EXIT_AFTER_ERROR_S = 5.0


def _barrier(pg: Any, device: torch.device) -> None:
    import torch.distributed as dist

    if dist.get_world_size(pg) == 1:
        return
    if str(dist.get_backend(pg)) == "nccl":
        dist.barrier(pg, device_ids=[device.index])
    else:
        dist.barrier(pg)


def _teardown_at_exit(ctx: RankContext, limit_s: float) -> None:
    """[Note: tearing down at exit]"""
    import torch.distributed as dist

    if not dist.is_initialized():  # the script destroyed it itself
        return
    after_error = getattr(sys, "last_value", None) is not None
    problems: list[str] = []

    def teardown() -> None:
        groups = ctx._subgroups()
        if not after_error:
            try:
                for pg in groups:
                    _barrier(pg, ctx.device)
                _barrier(None, ctx.device)
            except Exception as e:  # noqa: BLE001 - a peer that left: destroy all the same
                problems.append(f"the exit barrier failed (a peer rank may have exited): {e}")
        for pg in reversed(groups):
            try:
                dist.destroy_process_group(pg)
            except ValueError:  # already destroyed by the script
                pass
        dist.destroy_process_group()
        ctx._comms.clear()

    def run() -> None:
        try:
            teardown()
        except Exception as e:  # noqa: BLE001 - said on stderr below; the process is leaving anyway
            problems.append(f"{type(e).__name__}: {e}")

    limit = _EXIT_AFTER_ERROR_S if after_error else limit_s
    worker = threading.Thread(target=run, name="wsharding-exit-teardown", daemon=True)
    try:
        worker.start()
    except RuntimeError as e:  # an interpreter that refuses new threads while finalizing
        print(f"wsharding: rank {ctx.rank}: process group not torn down at exit ({e})", file=sys.stderr, flush=True)
        return
    worker.join(limit)
    if worker.is_alive():
        print(f"wsharding: rank {ctx.rank}: the process group was not torn down within {limit:.0f} s (a peer rank "
              "may be gone or stuck); leaving without it", file=sys.stderr, flush=True)
    for problem in problems:
        print(f"wsharding: rank {ctx.rank}: at exit: {problem}", file=sys.stderr, flush=True)


def init_from_env(backend: str = "auto", timeout_s: float = 120.0) -> RankContext:
    """Join the group of a ``torchrun`` launch (``env://``) and return this rank's context.

    ``backend="auto"`` picks NCCL when CUDA is available (device ``cuda:LOCAL_RANK``), else gloo.
    ``timeout_s``: how long a collective waits for its peers. The group created here is torn down at
    exit ([Note: tearing down at exit]). Bad input is refused before any rank connects (ClusterError).
    """
    import torch.distributed as dist

    global _CONTEXT
    if backend not in ("auto", "gloo", "nccl"):
        raise ClusterError(f"unknown backend={backend!r}: use 'auto', 'gloo' or 'nccl'")
    timeout = timedelta(seconds=seconds_arg("timeout_s", timeout_s))
    initialized = dist.is_initialized()
    rank, world, local, local_world = _read_torchrun_env(initialized)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        backend = "nccl" if gpus else "gloo"
    if backend == "nccl" and not gpus:
        raise ClusterError(
            "backend='nccl' needs a CUDA GPU, and this process sees none (torch.cuda.is_available() is False): "
            "use backend='gloo' for CPU ranks, or 'auto'"
        )
    on_gpu = backend == "nccl"
    shared = on_gpu and local_world > gpus
    if shared:
        backend = "gloo"  # NCCL's process group refuses several ranks on one GPU: gloo controls them
    device = torch.device("cuda", local % gpus) if on_gpu else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not initialized:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=timeout)
    nodes = _gather_nodes(world) if world > 1 else (0,)
    _CONTEXT = make_context(rank, world, device, backend, shared, timeout, nodes)
    if not initialized:  # a group the script made itself is the script's to tear down
        atexit.register(_teardown_at_exit, _CONTEXT, timeout_s + _EXIT_MARGIN_S)
    return _CONTEXT


def set_current_context(ctx: RankContext) -> None:
    """Make ``ctx`` this process's context (a RankCluster worker, once its process group is up)."""
    global _CONTEXT
    _CONTEXT = ctx
