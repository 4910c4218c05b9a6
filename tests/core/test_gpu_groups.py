"""Shard groups on GPUs with our NCCL communicator (marker ``gpu``; skipped without CUDA).

4 ranks in 2 groups of 2, each group its own NCCL communicator (one unique id per group, its own
symmetric windows). With fewer than 4 GPUs the ranks share a GPU, which needs NCCL >= 2.30 and
``NCCL_MULTI_RANK_GPU_ENABLE=1`` (``WSHARDING_NCCL_LIBRARY``, ../shared/GPU.md): the code path of 4
GPUs, not their bandwidth (mode ``gpu-nccl-shared``). Run: ``PYTHONPATH=. python3 -m pytest -m gpu -q
tests/core/test_gpu_groups.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

from wsharding.lab.cluster import RankCluster
from wsharding.models import PRESETS
from wsharding.models.equality import model_equality

pytestmark = pytest.mark.gpu

COUNTS = [[3, 5, 1, 7], [6, 2, 0, 1], [1, 4, 8, 2]]


def _cluster4() -> RankCluster:
    from wsharding.accel.nccl.library import MIN_MULTI_RANK_GPU, NcclLibraryError, default_library

    gpus = torch.cuda.device_count()
    try:
        lib = default_library()
    except NcclLibraryError as e:
        pytest.skip(f"no usable libnccl: {e}")
    if gpus < 4:
        if not lib.supports(MIN_MULTI_RANK_GPU):
            pytest.skip(f"4 ranks on {gpus} GPU(s) need NCCL >= 2.30; the loaded one is {lib.version_str} "
                        f"({lib.path}): set WSHARDING_NCCL_LIBRARY (../shared/GPU.md)")
        if os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
            pytest.skip("4 ranks on fewer GPUs need NCCL_MULTI_RANK_GPU_ENABLE=1")
    # gloo between the rank processes; gathers through our NCCL communicators, one per group
    return RankCluster(4, backend="gloo", task_timeout=600, collective_timeout=120,
                       env={"NCCL_MULTI_RANK_GPU_ENABLE": "1"} if gpus < 4 else {})


def test_gpu_nccl_two_groups_of_two():
    cfg = PRESETS["small"]
    n_layers = cfg.layers - 1
    with _cluster4() as c:
        results = c.run(model_equality, "small", COUNTS, group_size=2, comm="nccl")
    for r in results:
        assert r["group"] == ([0, 1] if r["rank"] < 2 else [2, 3]), r["group"]
        assert r["mode"] in ("gpu-nccl", "gpu-nccl-shared")
        assert r["equal"] == [None if COUNTS[s][r["rank"]] == 0 else True for s in range(len(COUNTS))], r
        assert r["max_abs_diff"] == 0.0
        assert r["gathers"] == [n_layers] * len(COUNTS)
        total = -(-cfg.sharded_bytes_per_layer() // 32) * 32  # a layout of group size 2
        assert r["layout_bytes"] == [total] * n_layers
        assert r["resident_bytes"] == r["formula_bytes"]  # window-rounded chunks (total / 2) + two slots
    print([(r["rank"], r["group"], r["mode"], r["resident_bytes"]) for r in results])
