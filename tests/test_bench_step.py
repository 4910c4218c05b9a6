"""The step benchmark's rank task and report (structure only: timings are never asserted)."""

from __future__ import annotations

from wsharding.lab.bench.step import format_table, step_bench_rank, summarize
from wsharding.models import PRESETS


def test_step_bench_measures_every_variant(cluster_of):
    results = cluster_of(2).run(step_bench_rank, "tiny", [1, 4], steps=1, warmup=1)
    report = summarize(results, "tiny")
    assert [r["tokens_per_rank"] for r in report["rows"]] == [1, 4]
    for row in report["rows"]:
        for v in ("replicated", "sharded", "sharded_no_lookahead", "fsdp2"):
            assert row[v] > 0
        assert row["sharded_vs_replicated"] == row["sharded"] / row["replicated"]
    per_layer = PRESETS["tiny"].sharded_bytes_per_layer()  # a multiple of 32 B: no padding at N = 2
    assert report["replicated_bytes_per_rank"] == 3 * per_layer
    # with only 3 sharded layers the two slots outweigh the saving: R/2 + 2|T| > R
    assert report["sharded_resident_bytes_per_rank"] == 3 * per_layer // 2 + 2 * per_layer
    text = format_table(report)
    assert "emulated" in text and "fsdp2" in text
