"""The KV-cache pool on GPUs (marker ``gpu``; skipped without CUDA): decode equality, and the larger
batch the saving buys, really run.

Run: ``PYTHONPATH=. python3 -m pytest -m gpu -q -s tests/models/test_gpu_kv.py``. The fill test needs two ranks:
two GPUs, or one GPU with NCCL >= 2.30 (``WSHARDING_NCCL_LIBRARY``) and ``NCCL_MULTI_RANK_GPU_ENABLE=1``
(mode ``gpu-nccl-shared``). It emulates a GPU whose memory leaves 2 GiB of KV cache to the replicated
``k3-like`` model, with a per-process memory cap; every result says so.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.models.kv_tasks import kv_fill
from wsharding.lab.cluster import RankCluster
from wsharding.lab.tasks.kv import kv_decode_equality

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _two_ranks() -> tuple[RankCluster, str]:
    if _gpus() >= 2:
        return RankCluster(2, backend="nccl", task_timeout=900), "torch"
    from wsharding.accel.nccl.library import MIN_MULTI_RANK_GPU, NcclLibraryError, default_library

    try:
        ok = default_library().supports(MIN_MULTI_RANK_GPU)
    except NcclLibraryError:
        ok = False
    if not ok or os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
        pytest.skip("2 ranks on 1 GPU need NCCL >= 2.30 (WSHARDING_NCCL_LIBRARY) and NCCL_MULTI_RANK_GPU_ENABLE=1")
    env = {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    return RankCluster(2, backend="gloo", task_timeout=900, env=env), "nccl"


def test_gpu_decode_with_kv_cache_equals_replicated():
    cluster, comm = _two_ranks()
    with cluster:
        for r in cluster.run(kv_decode_equality, "small", sequences=4, prompt=16, decode=8, comm=comm):
            assert r["equal"] == [True] * 9
            assert r["gathers"] == [5] * 9
            assert r["lengths"] == [24] * 4


def test_gpu_fill_the_pool_the_larger_batch_runs():
    cluster, comm = _two_ranks()
    with cluster:
        res = cluster.run(kv_fill, "k3-like", context=4096, kv_gib_replicated=2.0, reserve_gib=1.0, comm=comm)
    for r in res:
        print(f"\nrank {r['rank']} ({r['mode']}{', ' + r['emulation'] if r['emulation'] else ''}): {r['cap']}\n"
              f"  KV per token {r['kv_bytes_per_token']} B, context {r['context']}: sequences replicated "
              f"{r['sequences_replicated']} -> sharded {r['sequences_sharded']}\n"
              f"  sharded batch ran: {r['sharded_run']}\n  replicated, same batch: {r['replicated_error']!r}")
        assert r["sequences_sharded"] > r["sequences_replicated"] >= 1
        run = r["sharded_run"]
        assert run["tokens_in_pool"] == r["sequences_sharded"] * 4096  # every slot filled to its context
        assert run["decode_logits"][:2] == [r["sequences_sharded"], 1]  # the whole batch decoded in one step
        assert "out of memory" in r["replicated_error"].lower()  # the same batch does not fit replicated
