"""Where a benchmark's ranks run: one rule for every benchmark that starts its own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from wsharding.comm_by_name import resolve_comm
from wsharding.core.errors import InvalidArgument
from wsharding.core.units import ceil_div
from wsharding.lab.cluster import RankCluster
from wsharding.runtime import gpu_count


def bench_cluster(ranks: int, task_timeout: float = 1800) -> RankCluster:
    """Rank processes (not started): one per GPU with NCCL; several on a GPU with gloo between the
    processes (our NCCL communicator gathers); CPU processes with gloo where there is no GPU."""
    gpus = gpu_count()
    ranks_per_gpu = ceil_div(ranks, gpus) if gpus else 1
    backend = "nccl" if gpus and ranks_per_gpu == 1 else "gloo"
    return RankCluster(ranks, backend=backend, ranks_per_gpu=ranks_per_gpu, task_timeout=task_timeout)


def auto_comm(comm: str) -> str:
    """The communicator ``comm`` names, ``"auto"`` resolved for this machine's ranks (on its GPUs where
    it has any: :func:`bench_cluster`)."""
    return resolve_comm(comm, on_gpus=gpu_count() > 0)


def run_on_ranks(caller: str, ranks: int, cluster: RankCluster | None, task: Callable[..., Any], *args: Any,
                 started: Callable[[], None] | None = None, finished: Callable[[], None] | None = None,
                 **kwargs: Any) -> list[Any]:
    """``task`` on every rank: of ``cluster`` when one is given (a started cluster of ``ranks`` ranks, as a
    notebook keeps one; another size is refused, naming ``caller``), else of a :func:`bench_cluster` started
    for this call and stopped after it. ``started`` / ``finished`` run around the task once the ranks are
    up (a progress line: a refused rank count stays a one-line error)."""
    if cluster is not None:
        if cluster.world_size != ranks:
            raise InvalidArgument(f"{caller}: ranks={ranks}, but the cluster given has {cluster.world_size}")
        return cluster.run(task, *args, **kwargs)
    with bench_cluster(ranks, task_timeout=3600) as c:
        if started:
            started()
        results = c.run(task, *args, **kwargs)
        if finished:
            finished()
        return results
