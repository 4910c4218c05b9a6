"""Weight sharding on GPUs (run on the GPU machine: python3 -m pytest -m gpu). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from wsharding.cluster import RankCluster
from wsharding.model_tasks import graph_replay, memory_over_steps, model_equality

pytestmark = pytest.mark.gpu

COUNTS = [[3, 5], [6, 2], [0, 3], [1, 8]]


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(scope="module", params=[1, 2], ids=["1gpu", "2gpu"])
def gpu_cluster(request):
    n = request.param
    if _gpus() < n:
        pytest.skip(f"needs {n} GPUs, this machine has {_gpus()}")
    with RankCluster(n, backend="nccl", task_timeout=600) as c:
        yield c


@pytest.mark.parametrize("lookahead", [True, False])
@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_gpu_sharded_equals_replicated(gpu_cluster, preset, lookahead):
    counts = [row[: gpu_cluster.world_size] for row in COUNTS]
    for r in gpu_cluster.run(model_equality, preset, counts, lookahead=lookahead):
        assert r["mode"].startswith("gpu-nccl")
        assert r["max_abs_diff"] == 0.0
        assert all(e in (True, None) for e in r["equal"]) and any(r["equal"])
        assert r["resident_bytes"] == r["formula_bytes"]
        assert r["gathers"] == [len(r["sharded_layers"])] * len(counts)


def test_gpu_cuda_graph_replay_equals_eager(gpu_cluster):
    for r in gpu_cluster.run(graph_replay, "small", 16):
        assert r["replays"] == [(True, True)] * 3


def test_gpu_no_memory_growth_over_100_steps(gpu_cluster):
    for r in gpu_cluster.run(memory_over_steps, "small", 100):
        assert r["after"] == r["before"]
