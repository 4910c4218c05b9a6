"""GPU tests of our NCCL backend (marker ``gpu``; skipped without CUDA): a gather captured in a CUDA
graph, the gathers it refuses, and a rank that goes missing. The rank tasks are in ``nccl_tasks.py``.

Run on the GPU machine from the project root: ``PYTHONPATH=. python3 -m pytest -m gpu -q
tests/accel/test_gpu_nccl.py``. Several ranks on one GPU need NCCL >= 2.30: point
``WSHARDING_NCCL_LIBRARY`` at one (../shared/GPU.md) -- otherwise those cases skip and say why.
"""

from __future__ import annotations

import pytest

from tests.accel import nccl_tasks as tasks
from tests.accel.nccl_tasks import nccl_cluster
from wsharding.core.units import MiB

pytestmark = pytest.mark.gpu


def test_graph_replay_world_size_one():
    r = tasks.graph_replay(None)
    assert r["replays_equal"] == [True, True, True]


@pytest.mark.parametrize("policy", [2, 0])
def test_graph_replay_two_ranks(policy):
    """Two ranks (on one GPU when only one is there: ../shared/GPU.md saw this hang once)."""
    with nccl_cluster(2) as cluster:
        cluster.task_timeout = 60
        res = cluster.run(tasks.graph_replay, 8 * MiB, 3, policy)
    assert [r["replays_equal"] for r in res] == [[True, True, True]] * 2


def test_default_stream_is_refused():
    assert "legacy default stream" in tasks.default_stream_refused()


def test_unregistered_buffer_is_refused():
    assert "not inside a registered symmetric window" in tasks.unregistered_refused()


@pytest.mark.parametrize("n,how", [(2, "leave"), (2, "skip"), (4, "skip")])
def test_missing_rank_fails_within_timeout(n, how):
    with nccl_cluster(n) as cluster:
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
