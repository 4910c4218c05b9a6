"""``wsharding bench serve`` on GPUs (marker ``gpu``; skipped without CUDA): the same requests served
replicated and sharded under one budget, really run, and the sharded model's replay of the
replicated run token for token.

Needs two ranks: two GPUs, or one GPU with NCCL >= 2.30 (``WSHARDING_NCCL_LIBRARY``) and
``NCCL_MULTI_RANK_GPU_ENABLE=1`` (two ranks time-sliced on it; the report says so).
"""

from __future__ import annotations

import pytest

from tests.lab.test_gpu_kv import _two_ranks
from wsharding.lab.bench.serve import format_table, summarize
from wsharding.lab.tasks.serve import serve_rank
from wsharding.serve import BLOCK_TOKENS, Workload
from wsharding.serve.metrics import SLO

pytestmark = pytest.mark.gpu


def test_gpu_serve_sharded_serves_more_and_the_same_tokens():
    wl = Workload(requests=24, prompt=(16, 200), output=(8, 64))
    cluster, comm = _two_ranks()
    with cluster:
        results = cluster.run(serve_rank, "small", workload=wl.as_dict(), budgets=[{"kv_share": 0.05}],
                              rates=[None, 50.0], trials=2, token_budget=128, comm=comm, plain=True)
    report = summarize(results, SLO(ttft_ms=5000, tpot_ms=500), warmup=2)
    print("\n" + format_table(report))
    assert report["equal"], report["differ"]
    for r in results:
        per_token, budget = r["kv_bytes_per_token"], r["budgets"][0]
        for v in r["runs"]:  # with our NCCL >= 2.30 also "sharded_plain" beside the mapped "sharded"
            s = r["sizing"][v]
            for run in r["runs"][v].values():
                assert run["pool_blocks"] == (budget - s["resident_bytes"] - s["reserve_bytes"]) // (BLOCK_TOKENS * per_token) - 1
                assert run["peak_blocks"] <= run["pool_blocks"]
                assert sum(q["output_tokens"] for q in run["records"]) > 0
    row = report["rows_by_budget"][0]
    assert row["sharded"]["pool_tokens"] > row["replicated"]["pool_tokens"]
    if "sharded_plain" in row:  # the mapped slots keep (N-1)/N of a slot: a larger pool than plain slots
        assert row["sharded"]["pool_tokens"] > row["sharded_plain"]["pool_tokens"]
    assert report["layer_times"] and all(lt["gather_us"] > 0 and lt["compute_us"] > 0 for lt in report["layer_times"])
