"""``wsharding bench schedule`` on CPU ranks: every depth exact, resident bytes equal to the formula
R/N + (k+1) max|T_l| byte for byte, the table names what it measured. Timings are never asserted."""

from __future__ import annotations

from wsharding.lab.bench.schedule import format_table, schedule_bench_rank, summarize


def test_depths_side_by_side(cluster_of):
    results = cluster_of(2).run(schedule_bench_rank, "tiny-blocks", [1, 16], [1, 2, 3], steps=1, repeats=1,
                                comm="torch")
    report = summarize(results, "tiny-blocks")
    assert [row["tokens"] for row in report["rows"]] == [1, 16]
    assert all(row["equal"] and row["misses"] == 0 for row in report["rows"])
    mem = report["memory"]
    assert [mem[k]["slots"] for k in (1, 2, 3)] == [2, 3, 4]
    assert all(mem[k]["resident_bytes"] == mem[k]["formula_bytes"] for k in (1, 2, 3))
    # one more slot per depth: exactly the largest layer's flat buffer more each time
    assert mem[2]["formula_bytes"] - mem[1]["formula_bytes"] == mem[3]["formula_bytes"] - mem[2]["formula_bytes"] > 0
    assert all(row["vs_first"]["depth 1"] == 1.0 for row in report["rows"])
    text = format_table(report)
    assert "NOTE: emulated: CPU processes" in text and "depth 3 (4 slots)" in text and "(equal)" in text
    assert "check at use, host per call: " in text
