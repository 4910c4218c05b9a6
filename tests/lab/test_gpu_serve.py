"""``wsharding bench serve`` on GPUs (marker ``gpu``; skipped without CUDA): the same requests served
replicated and sharded under one budget, really run.

Needs two ranks: two GPUs, or one GPU with NCCL >= 2.30 (``WSHARDING_NCCL_LIBRARY``) and
``NCCL_MULTI_RANK_GPU_ENABLE=1`` (two ranks time-sliced on it; the report says so).
"""

from __future__ import annotations

import pytest

from tests.lab.test_gpu_kv import _two_ranks
from wsharding.lab.bench.serve import format_table, replicated_footprint, summarize
from wsharding.lab.tasks.serve import serve_rank
from wsharding.serve import Workload

pytestmark = pytest.mark.gpu


def test_gpu_serve_sharded_serves_more_and_the_same_tokens():
    wl = Workload(requests=12, prompt=(16, 64), output=(8, 32))
    f = replicated_footprint("small", None, 128, wl)
    budget = f["resident_bytes"] + f["reserve_bytes"] + f["demand_bytes"] // 4
    cluster, comm = _two_ranks()
    with cluster:
        results = cluster.run(serve_rank, "small", workload=wl.as_dict(), budgets=[budget], rows=128, comm=comm)
    report = summarize(results)
    print("\n" + format_table(report))
    assert report["equal"], report["differ"]
    for r in results:
        per_token = r["kv_bytes_per_token"]
        for v in r["runs"]:  # with our NCCL >= 2.30 also "sharded_plain" beside the mapped "sharded"
            s, run = r["sizing"][v], r["runs"][v][0]
            assert run["pool_tokens"] == (budget - s["resident_bytes"] - s["reserve_bytes"]) // per_token - 1
            assert run["peak_kv_tokens"] <= run["pool_tokens"]
        assert r["runs"]["sharded"][0]["pool_tokens"] > r["runs"]["replicated"][0]["pool_tokens"]
    row = report["rows_by_budget"][0]
    assert row["sharded"]["max_concurrency"] > row["replicated"]["max_concurrency"]
    if "sharded_plain" in row:  # the mapped slots keep (N-1)/N of a slot: a larger pool than plain slots
        assert row["sharded"]["pool_tokens"] > row["sharded_plain"]["pool_tokens"]
    assert all(lt["gather_us"] > 0 and lt["compute_us"] > 0 for lt in report["layer_times"])
