"""``wsharding bench serve --engine transformers`` on a GPU (marker ``gpu``; skipped without CUDA, and
without transformers, which the GPU machine does not have unless it is carried there): a Llama of
Llama 3.2 1B's shapes (4 layers, bfloat16, random weights) served by transformers' continuous batching,
replicated and sharded, under one budget, in a KV-bound and a compute-bound set-up; every token equal
in the check, each pool exactly the blocks its budget leaves, the sharded pool the larger.

Needs two ranks: two GPUs, or one GPU with NCCL >= 2.30 and ``NCCL_MULTI_RANK_GPU_ENABLE=1`` (two
ranks time-sliced on it; the report says so).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

pytest.importorskip("transformers", reason="transformers is not installed here: the engine run needs the 'hf' "
                                           "extra (pip install 'wsharding[hf]', or carry it to the GPU machine)")

from tests.lab.test_gpu_kv import _two_ranks  # noqa: E402
from wsharding.lab.bench.serve_engine import format_engine_table, summarize_engine  # noqa: E402
from wsharding.lab.bench.serve_report import SLICED_NOTE  # noqa: E402
from wsharding.lab.tasks.engine_bench import engine_bench_rank  # noqa: E402
from wsharding.serve.metrics import SLO  # noqa: E402
from wsharding.serve.workload import Workload  # noqa: E402

#: Replicated KV shares: 5 % (its pool limits: KV-bound) and 60 % (room to spare: compute-bound).
SHARES = {"kv-bound": 0.05, "compute-bound": 0.6}


@pytest.mark.parametrize("regime", list(SHARES))
def test_gpu_engine_serve_pools_and_tokens(regime):
    wl = Workload(requests=16, prompt=(32, 256), output=(32, 256))
    cluster, comm = _two_ranks()
    with cluster:
        results = cluster.run(engine_bench_rank, "llama-1b", workload=wl.as_dict(),
                              budgets=[{"kv_share": SHARES[regime]}], rates=[8.0], trials=2, max_batch_tokens=256,
                              max_requests=32, comm=comm, layers=4)
    report = summarize_engine(results, SLO(ttft_ms=2000, tpot_ms=200), warmup=2)
    print(f"\n[{regime}]\n" + format_engine_table(report))
    assert report["equal"], report["differ"]
    for r in results:
        budget, block = r["budgets"][0], r["block_bytes"]
        per_sector = 1 if block % 128 == 0 else None
        assert per_sector == 1  # a bfloat16 block of 16 tokens is a multiple of 128 B
        for v in ("replicated", "sharded"):
            s = r["sizing"][v]
            assert r["pools"][v] == [(budget - s["resident_bytes"] - s["reserve_bytes"]) // block - 2]
    row = report["rows_by_budget"][0]
    assert row["sharded"]["pool_tokens"] > row["replicated"]["pool_tokens"]
    if report["ranks_per_device"] > 1:
        assert SLICED_NOTE in report["notes"]
