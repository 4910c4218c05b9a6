"""``wsharding bench serve`` on CPU ranks: the same requests, replicated and sharded, under one budget --
the pool each variant sizes, the tokens they generate, the report, and the refusals."""

from __future__ import annotations

import pytest

from wsharding.cluster import RemoteError
from wsharding.lab.bench.serve import format_table, replicated_footprint, summarize
from wsharding.lab.tasks.serve import serve_rank
from wsharding.serve import Workload

WORKLOAD = Workload(requests=6, prompt=(4, 12), output=(3, 6))
ROWS = 32


@pytest.fixture(scope="module")
def served(cluster_of):
    f = replicated_footprint("tiny-deep", None, ROWS, WORKLOAD)
    # the replicated pool holds about a third of one rank's requests at once: its pool is the limit
    budget = f["resident_bytes"] + f["reserve_bytes"] + f["demand_bytes"] // 3
    results = cluster_of(2).run(serve_rank, "tiny-deep", workload=WORKLOAD.as_dict(), budgets=[budget], rows=ROWS)
    return budget, results


def test_every_request_generates_the_same_tokens(served):
    _, results = served
    assert [r["differ"] for r in results] == [[[]], [[]]]
    assert all(r["runs"][v][0]["output_tokens"] == sum(q.output for q in WORKLOAD.for_rank(r["rank"], 192))
               for r in results for v in ("replicated", "sharded"))


def test_pool_is_budget_minus_measured_resident_minus_reserve(served):
    budget, results = served
    for r in results:
        per_token = r["kv_bytes_per_token"]
        for v in ("replicated", "sharded"):
            s, run = r["sizing"][v], r["runs"][v][0]
            assert run["pool_tokens"] == (budget - s["resident_bytes"] - s["reserve_bytes"]) // per_token - 1
            assert run["pool_bytes"] == (run["pool_tokens"] + 1) * per_token <= budget - s["resident_bytes"]
            assert run["peak_kv_tokens"] <= run["pool_tokens"]  # admission never over-commits the pool
        gained = r["sizing"]["replicated"]["resident_bytes"] - r["sizing"]["sharded"]["resident_bytes"]
        assert gained == r["sizing"]["sharded"]["net_saving_bytes_predicted"] > 0  # the cost model's bill, exactly
        assert r["runs"]["sharded"][0]["max_concurrency"] > r["runs"]["replicated"][0]["max_concurrency"]
        assert r["runs"]["replicated"][0]["waited_for_memory"] > r["runs"]["sharded"][0]["waited_for_memory"]


def test_report_ratios_prediction_and_table(served):
    budget, results = served
    report = summarize(results)
    row = report["rows_by_budget"][0]
    assert report["equal"] and row["budget_bytes"] == budget
    assert report["variants"] == ["replicated", "sharded"]  # torch's comm: plain slots only, no third variant
    ratio = row["ratio"]["sharded"]
    assert ratio["pool_tokens"] == row["sharded"]["pool_tokens"] / row["replicated"]["pool_tokens"] > 1
    assert row["predicted"]["sharded"]["pool_tokens"] == row["sharded"]["pool_tokens"]
    assert ratio["tokens_per_step"] > 1  # more sequences at once: more tokens per step, exactly counted
    assert len(report["layer_times"]) == 11 and all(lt["gather_us"] > 0 and lt["compute_us"] > 0
                                                      for lt in report["layer_times"])
    text = format_table(report)
    assert "emulated" in text and "every request's tokens equal" in text and "cost model: pool sharded" in text


def test_figure_draws_both_variants(served):
    from wsharding.lab.viz.serve import NOISE_NOTE, serve_figure

    fig = serve_figure(summarize(served[1]))
    names = {t.name for t in fig.data}
    assert {"replicated: most at once", "sharded: most at once", "sharded: pool / mean request (predicted)"} <= names
    assert NOISE_NOTE.split(":")[0] in fig.layout.title.text


def test_a_request_one_rank_cannot_fit_stops_every_rank(cluster_of):
    """Rank 1's longest request does not fit its pool, rank 0's do: both ranks stop with an error (rank 0 would
    otherwise wait in its first gather for a rank that never comes)."""
    f = replicated_footprint("tiny-deep", None, ROWS, WORKLOAD)
    longest = [max(q.kv_tokens for q in WORKLOAD.for_rank(rank, 192)) for rank in (0, 1)]
    small, big = sorted(longest)
    assert small < big, "the workload's seed must give the ranks different longest requests"
    budget = f["resident_bytes"] + f["reserve_bytes"] + (small + 1) * f["kv_bytes_per_token"]
    with pytest.raises(RemoteError) as err:
        cluster_of(2).run(serve_rank, "tiny-deep", workload=WORKLOAD.as_dict(), budgets=[budget], rows=ROWS)
    failing = longest.index(big)
    text = str(err.value)
    assert f"of rank {failing} needs {big} KV tokens" in text and f"the whole pool holds {small}" in text
    assert "another rank refused" in text


def test_a_cluster_of_another_size_is_refused(cluster_of):
    from wsharding.core.errors import InvalidArgument
    from wsharding.lab.bench.serve import run_serve_bench

    with pytest.raises(InvalidArgument, match="ranks=3, but the cluster given has 2"):
        run_serve_bench(3, "tiny-deep", WORKLOAD, budgets=[1 << 30], rows=ROWS, cluster=cluster_of(2))


def test_the_saved_gpu_run_is_labelled_time_sliced_not_cpu():
    from pathlib import Path

    from wsharding.lab.bench.step import MEASUREMENTS, pick_report, saved_reports
    from wsharding.lab.viz.serve import NOISE_NOTE, serve_figure

    root = Path(__file__).resolve().parents[2]
    report = pick_report(saved_reports(root / MEASUREMENTS, "bench_serve_*.json"), preset="k3-like", rows=1024)
    title = serve_figure(report).layout.title.text
    assert "time-slice" in title and NOISE_NOTE.split(":")[0] not in title
    assert "time-sliced" in format_table(report) and "CPU times" not in format_table(report)
