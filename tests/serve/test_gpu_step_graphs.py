"""Serving steps replayed from CUDA graphs on GPUs (marker ``gpu``; skipped without CUDA): the
replicated and the sharded model serve the same requests with pools of one size, every step eager,
then decode-only steps replayed from the graphs of the shapes every rank met -- every token equal,
and graphs really replayed.

Run: ``PYTHONPATH=. python3 -m pytest -m gpu -q -s tests/serve/test_gpu_step_graphs.py``. The two-rank
case needs two GPUs with our NCCL (>= 2.28.3), or one GPU with NCCL >= 2.30 (``WSHARDING_NCCL_LIBRARY``)
and ``NCCL_MULTI_RANK_GPU_ENABLE=1``: the two ranks then time-slice it (mode ``gpu-nccl-shared``), and
the runner captures there only because the task asks it to (``shared_gpu``). Imports no teaching layer.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.serve.serve_tasks import serve_with_graphs
from wsharding.comm_by_name import ours_supported
from wsharding.lab.cluster import RankCluster

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _two_ranks() -> tuple[RankCluster, bool]:
    """Two ranks for our NCCL communicator, and whether they share one GPU."""
    if _gpus() >= 2 and ours_supported():
        return RankCluster(2, backend="nccl", task_timeout=600), False
    from wsharding.accel.nccl.library import MIN_MULTI_RANK_GPU, NcclLibraryError, default_library

    try:
        ok = default_library().supports(MIN_MULTI_RANK_GPU)
    except NcclLibraryError:
        ok = False
    if not ok or os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
        pytest.skip("2 ranks need 2 GPUs with NCCL >= 2.28.3, or 1 GPU with NCCL >= 2.30 (WSHARDING_NCCL_LIBRARY) "
                    "and NCCL_MULTI_RANK_GPU_ENABLE=1")
    return RankCluster(2, backend="gloo", task_timeout=600, env={"NCCL_MULTI_RANK_GPU_ENABLE": "1"}), True


def _check(results: list[dict]) -> None:
    for r in results:
        print(f"\nrank {r['rank']} ({r['mode']}{', ' + r['emulation'] if r['emulation'] else ''}): "
              f"{r['shapes']} shapes captured; replicated {r['replicated_graphs_counts']}, "
              f"sharded {r['sharded_graphs_counts']}")
        assert r["replicated_eager"] == r["sharded_eager"], "same pool, same steps: the same tokens"
        assert r["replicated_graphs"] == r["replicated_eager"] and r["sharded_graphs"] == r["sharded_eager"]
        assert sum(len(t) for t in r["sharded_eager"].values()) > 0
        for v in ("replicated", "sharded"):
            counts = r[f"{v}_graphs_counts"]
            assert counts["eager_reason"] is None, counts
            assert r[f"{v}_captured"] == r["shapes"] > 0
            assert counts["graphed_steps"] > 0
            assert counts["graphed_steps"] + counts["eager_steps"] == r[f"{v}_eager_counts"]["eager_steps"]


def test_gpu_serve_steps_from_graphs_one_rank():
    """World size 1 (the gathers are copies on the one GPU): every GPU runs it."""
    if _gpus() < 1:
        pytest.skip("needs a GPU")
    with RankCluster(1, backend="nccl", task_timeout=600) as c:
        _check(c.run(serve_with_graphs, "small", comm="torch"))


def test_gpu_serve_steps_from_graphs_two_ranks():
    """Two ranks, our NCCL communicator: each rank's step graphs hold its gathers; a rank replays a
    graph while the other may run its step eagerly (one gather per sharded layer, in order, either way)."""
    cluster, shared = _two_ranks()
    with cluster as c:
        _check(c.run(serve_with_graphs, "small", comm="nccl", shared_gpu=shared))
