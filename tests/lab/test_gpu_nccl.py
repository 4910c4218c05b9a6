"""GPU tests of our NCCL backend (marker ``gpu``; skipped without CUDA).

Run on the GPU machine from the project root: ``PYTHONPATH=. python3 -m pytest -m gpu -q
tests/test_gpu_nccl.py``. Several ranks on one GPU need NCCL >= 2.30: point
``WSHARDING_NCCL_LIBRARY`` at one (../shared/GPU.md) -- otherwise those cases skip and say why.
"""

from __future__ import annotations

import pytest
import torch

from wsharding.accel.nccl.library import MIN_MULTI_RANK_GPU, default_library
from wsharding.cluster import RankCluster
from wsharding.lab.tasks import nccl as tasks

pytestmark = pytest.mark.gpu
MiB = 1 << 20
SIZES = [1 * MiB, 4 * MiB + 4096 * 8, 64 * MiB]


def test_world_size_one_roundtrip_and_no_growth():
    r = tasks.gather_roundtrip(None, SIZES, steps=100, ce_probe=False)
    assert r["mode"] == "gpu-nccl-single"
    assert [s["mismatched_bytes"] for s in r["sizes"]] == [0, 0, 0]
    assert r["order"] == ["layer.0.full", "layer.1.full", "layer.2.full"]  # sorted by tag, not by alloc order
    assert r["aligned"] and r["zero_copy"] and r["after_steps_ok"] and r["closed"]
    assert r["steps"]["torch_allocated_delta"] == 0
    assert r["steps"]["device_free_delta"] == 0
    assert r["gathers_issued"] == 3 + 5 + 100


def test_graph_replay_world_size_one():
    r = tasks.graph_replay(None)
    assert r["replays_equal"] == [True, True, True]


@pytest.mark.parametrize("policy", [2, 0])
def test_graph_replay_two_ranks(policy):
    """Two ranks (on one GPU when only one is there: ../shared/GPU.md saw this hang once)."""
    with _cluster(2) as cluster:
        cluster.task_timeout = 60
        res = cluster.run(tasks.graph_replay, 8 * MiB, 3, policy)
    assert [r["replays_equal"] for r in res] == [[True, True, True]] * 2


def test_default_stream_is_refused():
    assert "legacy default stream" in tasks.default_stream_refused()


def test_unregistered_buffer_is_refused():
    assert "not inside a registered symmetric window" in tasks.unregistered_refused()


def _cluster(n: int) -> RankCluster:
    gpus = torch.cuda.device_count()
    if n > gpus and not default_library().supports(MIN_MULTI_RANK_GPU):
        pytest.skip(f"{n} ranks on {gpus} GPU(s) need NCCL >= 2.30; the loaded one is "
                    f"{default_library().version_str} ({default_library().path}): set WSHARDING_NCCL_LIBRARY")
    env = {"NCCL_MULTI_RANK_GPU_ENABLE": "1"} if n > gpus else {}
    return RankCluster(n, backend="gloo", task_timeout=300, collective_timeout=120, env=env)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("policy", [2, 0])
def test_multi_rank_roundtrip(n, policy):
    with _cluster(n) as cluster:
        res = cluster.run(tasks.gather_roundtrip, SIZES, policy, 100)
    for r in res:
        assert [s["mismatched_bytes"] for s in r["sizes"]] == [0, 0, 0], r
        assert r["after_steps_ok"] and r["closed"]
        assert r["steps"]["torch_allocated_delta"] == 0
        assert r["steps"]["device_free_delta"] == 0
        # The copy engine launches no NCCL kernel; policy 0 does.
        assert r["ce_check"]["copy_engine"] is (policy == 2), r["ce_check"]
        if n > torch.cuda.device_count():
            assert r["mode"] == "gpu-nccl-shared" and "time-slice" in r["emulation"]
    print(n, policy, res[0]["mode"], res[0]["ce_check"], res[0]["steps"])


@pytest.mark.parametrize("n,how", [(2, "leave"), (2, "skip"), (4, "skip")])
def test_missing_rank_fails_within_timeout(n, how):
    with _cluster(n) as cluster:
        cluster.task_timeout = 60  # if abort itself hung, fail here instead of holding the GPU
        res = cluster.run(tasks.missing_rank, 5.0, 2, how)
    assert res[-1]["left"]
    for r in res[:-1]:
        # Either our timeout fired or NCCL noticed the peer leave (ncclRemoteError): an error, not a hang.
        assert r["error"] and ("did not complete within 5.0 s" in r["error"] or "ncclRemoteError" in r["error"]), r
        if how == "skip":  # a live rank that never joins: only our timeout can end the wait
            assert "CommTimeout" in r["error"], r
        assert r["elapsed_s"] < 15, r
        assert r["aborted"]
    print(res)
