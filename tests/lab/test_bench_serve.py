"""``wsharding bench serve`` on CPU ranks: the same requests, replicated and sharded, under one budget at
two rates -- the paged pool each variant sizes, the replay's tokens, the report, and the refusals."""

from __future__ import annotations

import pytest

from wsharding.cluster import RemoteError
from wsharding.lab.bench.serve import format_table, replicated_footprint, summarize
from wsharding.lab.tasks.serve import serve_rank
from wsharding.serve import BLOCK_TOKENS, Workload, blocks_for
from wsharding.serve.metrics import SLO

WORKLOAD = Workload(requests=6, prompt=(4, 12), output=(3, 6))
TOKENS = 32
RATES = [None, 400.0]  # all at once, and Poisson fast enough to keep the test short
SLO_ = SLO(ttft_ms=60_000, tpot_ms=60_000)  # met by every request on any CPU: the counts below are exact


@pytest.fixture(scope="module")
def served(cluster_of):
    # the replicated pool is 6 % of the budget: 2 blocks, a third of one rank's demand, so it is the limit
    return cluster_of(2).run(serve_rank, "tiny-deep", workload=WORKLOAD.as_dict(), budgets=[{"kv_share": 0.06}],
                             rates=RATES, trials=2, token_budget=TOKENS)


def test_the_replay_gives_every_token_and_every_request_finishes(served):
    assert [r["differ"] for r in served] == [{"0/0": [], "0/1": []}] * 2
    for r in served:
        want = {q.rid: q.output for q in WORKLOAD.with_(seed=0).for_rank(r["rank"], 192)}
        for v in ("replicated", "sharded"):
            recs = r["runs"][v]["0/0/0"]["records"]
            assert {x["rid"]: x["output_tokens"] for x in recs} == want


def test_pool_is_whole_blocks_of_budget_minus_resident_minus_reserve(served):
    for r in served:
        per_token, budget = r["kv_bytes_per_token"], r["budgets"][0]
        rep = r["sizing"]["replicated"]
        assert budget == -(-(rep["resident_bytes"] + rep["reserve_bytes"]) // 0.94)  # the pool is 6 % of it
        for v in ("replicated", "sharded"):
            s = r["sizing"][v]
            for run in r["runs"][v].values():
                assert run["pool_blocks"] == (budget - s["resident_bytes"] - s["reserve_bytes"]) // (BLOCK_TOKENS * per_token) - 1
                assert run["pool_bytes"] == (run["pool_blocks"] + 1) * BLOCK_TOKENS * per_token
                assert run["peak_blocks"] <= run["pool_blocks"]
        gained = rep["resident_bytes"] - r["sizing"]["sharded"]["resident_bytes"]
        assert gained == r["sizing"]["sharded"]["net_saving_bytes_predicted"] > 0  # the cost model's bill, exactly


def test_report_answer_and_table(served):
    report = summarize(served, SLO_, warmup=1)
    row = report["rows_by_budget"][0]
    assert report["schema"] == 2 and report["equal"] and report["variants"] == ["replicated", "sharded"]
    assert row["sharded"]["pool_tokens"] == row["predicted"]["sharded"]["pool_tokens"] > row["replicated"]["pool_tokens"]
    # whole blocks: the pool (its scratch block included) is at most the 6 % asked for
    assert row["replicated"]["kv_share"] == row["replicated"]["pool_bytes"] / row["budget_bytes"] <= 0.06
    assert row["sharded"]["kv_share"] > 0.06 and row["replicated"]["pool_blocks"] == 2
    for p in row["points"]:
        for v in ("replicated", "sharded"):
            x = p[v]
            assert x["attainment"]["mean"] == 1.0 and x["measured"]["mean"] == 10  # 5 per rank after 1 warm-up
            assert x["goodput"]["n"] == 2 and x["ttft_ms"]["p99"]["mean"] >= x["ttft_ms"]["p50"]["mean"]
    # every rate met the SLO, but 5 measured requests per rank at 400/s are a burst: most of each trial is
    # the drain after the last arrival, so the sweep stops there and claims no rate (all at once neither)
    assert all(p[v]["drain_share"]["mean"] > 0.5 for p in row["points"] for v in ("replicated", "sharded"))
    assert row["answer"]["max_rate"] == {"replicated": None, "sharded": None}
    assert row["answer"]["all_at_once_sustained"] == {"replicated": False, "sharded": False}
    assert row["answer"]["stopped"] == {v: {"rate": 400.0, "why": "not a steady state"} for v in ("replicated", "sharded")}
    # every request of every run: 2 ranks x 6 requests x 2 rates x 2 trials x 2 variants
    assert len(report["requests"]) == 96 and sum(q["measured"] for q in report["requests"]) == 80
    sizes = {lt["tokens"] for lt in report["layer_times"]}
    assert sizes and all(lt["gather_us"] > 0 and lt["compute_us"] > 0 for lt in report["layer_times"])
    assert len(report["layer_times"]) == 11 * len(sizes)
    text = format_table(report)
    assert "CPU ranks" in text and "ANSWER" in text and "every token equal" in text and "KV share 6%" in text
    assert "replicated not established (400/s not a steady state)" in text and "rate 400/s per rank: NOT A STEADY" in text
    # beside the measurement, the cost model's figure for the full-size design, labelled as a prediction
    from wsharding.costmodel import Deployment, estimate, get_device
    from wsharding.presets import load_preset

    cap = estimate(load_preset("kimi-k3-b200-fp8"), Deployment(ranks=8, device=get_device("b200"), tokens=256)).kv_capacity()
    rep, sh = cap["tokens_replicated"], cap["tokens_sharded"]
    assert (f"PREDICTED, not measured (cost model, kimi-k3-b200-fp8 on 8 x B200, a 40 GiB replicated KV pool "
            f"assumed): KV tokens per GPU replicated {rep:,} -> sharded {sh:,} ({sh / rep:.2f}x)") in text


def test_a_saved_report_gets_the_drain_its_records_give(served, tmp_path):
    """A report saved before the steady-state rule has no drain shares: read back, they come from its
    per-request records, equal to what the trials computed; its answer is computed again."""
    import json

    from wsharding.lab.bench.serve import read_serve_report

    report = summarize(served, SLO_, warmup=1)
    old = json.loads(json.dumps(report))
    for row in old["rows_by_budget"]:
        row.pop("answer")
        for p in row["points"]:
            for v in old["variants"]:
                p[v].pop("drain_share")
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    back = read_serve_report(path)
    for got, want in zip(back["rows_by_budget"][0]["points"], report["rows_by_budget"][0]["points"], strict=True):
        for v in report["variants"]:
            assert got[v]["drain_share"]["mean"] == pytest.approx(want[v]["drain_share"]["mean"], rel=1e-12)
    assert back["rows_by_budget"][0]["answer"] == report["rows_by_budget"][0]["answer"]


def test_a_file_that_is_not_a_serve_report_is_refused(tmp_path):
    from wsharding.core.errors import InvalidArgument
    from wsharding.lab.bench.serve import read_serve_report

    (tmp_path / "a.json").write_text("{not json")
    with pytest.raises(InvalidArgument, match="not JSON"):
        read_serve_report(tmp_path / "a.json")
    (tmp_path / "b.json").write_text('{"bench": "step"}')
    with pytest.raises(InvalidArgument, match="not a report of wsharding bench serve"):
        read_serve_report(tmp_path / "b.json")
    with pytest.raises(InvalidArgument):
        read_serve_report(tmp_path)  # a folder


def test_the_saved_h200_answers_are_the_readmes():
    """The measured answer the README quotes, from the saved one-H200 reports under today's rules."""
    from pathlib import Path

    from wsharding.lab.bench.serve import read_serve_report
    from wsharding.lab.bench.serve_report import answer_text
    from wsharding.lab.bench.step import MEASUREMENTS, saved_path

    root = Path(__file__).resolve().parents[2] / MEASUREMENTS
    steady = read_serve_report(saved_path("bench_serve_k3-like_2ranks_1gpu_steady_share05.json", root))
    row = steady["rows_by_budget"][0]
    assert row["answer"]["max_rate"] == {"replicated": 5.0, "sharded": 5.0} and row["answer"]["stopped"] == {
        "replicated": None, "sharded": None}
    assert [round(g, 2) for g in row["answer"]["goodput_ratio"]["sharded"]] == [0.94, 0.89]
    assert (row["replicated"]["pool_tokens"], row["sharded"]["pool_tokens"]) == (8592, 42176)
    short = read_serve_report(saved_path("bench_serve_k3-like_2ranks_1gpu_share05.json", root))
    assert "replicated at least 8/s (every rate tried); sharded 4/s (8/s not a steady state)" in answer_text(
        short["rows_by_budget"][0], short["variants"])


def test_goodput_figure_states_the_slo(served):
    from wsharding.lab.viz.serve import NOISE_NOTE, goodput_figure, serve_figure

    report = summarize(served, SLO_, warmup=1)
    fig = goodput_figure(report)
    assert {"replicated", "sharded"} <= {t.name for t in fig.data}
    assert "TTFT <= 60000 ms and TPOT <= 60000 ms" in fig.layout.title.text
    assert NOISE_NOTE.split(":")[0] in fig.layout.title.text
    assert "replicated" in {t.name for t in serve_figure(report).data}


def test_a_request_one_rank_cannot_fit_stops_every_rank(cluster_of):
    """Rank 1's longest request needs more blocks than the pool has, rank 0's fit: both ranks stop with an
    error (rank 0 would otherwise wait in its first gather for a rank that never comes)."""
    wl = Workload(requests=6, prompt=(4, 30), output=(3, 6))
    f = replicated_footprint("tiny-deep", None, TOKENS, wl)
    longest = [max(q.kv_tokens for q in wl.for_rank(rank, 192)) for rank in (0, 1)]
    small, big = sorted(longest)
    assert blocks_for(small) < blocks_for(big), "the seed must give the ranks longest requests of other block counts"
    budget = f["resident_bytes"] + f["reserve_bytes"] + (blocks_for(small) + 1) * BLOCK_TOKENS * f["kv_bytes_per_token"]
    with pytest.raises(RemoteError) as err:
        cluster_of(2).run(serve_rank, "tiny-deep", workload=wl.as_dict(), budgets=[{"bytes": budget}], rates=[None],
                          trials=1, token_budget=TOKENS)
    failing = longest.index(big)
    text = str(err.value)
    assert f"of rank {failing} needs {big} KV tokens" in text
    assert f"the whole pool holds {blocks_for(small) * BLOCK_TOKENS}" in text and "another rank refused" in text


def test_a_cluster_of_another_size_is_refused(cluster_of):
    from wsharding.core.errors import InvalidArgument
    from wsharding.lab.bench.serve import run_serve_bench

    with pytest.raises(InvalidArgument, match="ranks=3, but the cluster given has 2"):
        run_serve_bench(3, "tiny-deep", WORKLOAD, budgets=[1 << 30], token_budget=TOKENS, cluster=cluster_of(2))


def test_a_report_of_the_fixed_row_bench_is_refused_by_name():
    from pathlib import Path

    from wsharding.core.errors import InvalidArgument
    from wsharding.lab.bench.step import MEASUREMENTS, pick_report, saved_reports

    root = Path(__file__).resolve().parents[2]
    old = pick_report(saved_reports(root / MEASUREMENTS, "bench_serve_*.json"), preset="k3-like", rows=1024)
    with pytest.raises(InvalidArgument, match="was written by the earlier fixed-row benchmark"):
        format_table(old)


def test_slo_parsing():
    assert SLO.parse("ttft=500,tpot=50") == SLO(ttft_ms=500.0, tpot_ms=50.0)
    assert SLO.parse("e2e=900,attainment=0.99").attainment == 0.99
    with pytest.raises(Exception, match="KEY=VALUE"):
        SLO.parse("ttft:500")
    with pytest.raises(Exception, match="name at least one"):
        SLO.parse("attainment=0.5")


def test_from_json_prints_a_saved_report_and_refuses_what_is_not_one(tmp_path, capsys):
    from pathlib import Path

    from wsharding.lab import cli
    from wsharding.lab.bench.step import MEASUREMENTS, saved_path

    saved = saved_path("bench_serve_k3-like_2ranks_1gpu_steady_share05.json",
                       Path(__file__).resolve().parents[2] / MEASUREMENTS)
    assert cli.main(["bench", "serve", "--from-json", str(saved), "--json", ""]) == 0
    out = capsys.readouterr().out
    assert "replicated at least 5/s (every rate tried); sharded at least 5/s (every rate tried)" in out
    assert "NOTE: time-sliced" in out and list(tmp_path.iterdir()) == []
    (tmp_path / "x.json").write_text("[]")
    assert cli.main(["bench", "serve", "--from-json", str(tmp_path / "x.json")]) != 0
    assert "not a report of wsharding bench serve" in capsys.readouterr().err
