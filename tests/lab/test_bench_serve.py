"""``wsharding bench serve`` on CPU ranks: the same requests, replicated and sharded, under one budget at
two rates -- the paged pool each variant sizes, the same arrivals for both, interleaved, replicated ranks
free and sharded ones aligned, the replay's tokens, the report judged as a pair, and the refusals (of a
rank's requests, and of saved reports that are not one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from wsharding.core.errors import InvalidArgument
from wsharding.lab.bench.serve import format_table, replicated_footprint, summarize
from wsharding.lab.cluster import RemoteError
from wsharding.lab.tasks.serve import serve_rank
from wsharding.serve import BLOCK_TOKENS, Workload, blocks_for
from wsharding.serve.metrics import SLO

WORKLOAD = Workload(requests=6, prompt=(4, 12), output=(3, 6))
TOKENS = 32
RATES = [None, 400.0]  # all at once, and Poisson fast enough to keep the test short
SLO_ = SLO(ttft_ms=60_000, tpot_ms=60_000)  # met by every request on any CPU: the counts below are exact
#: The saved run of the default CPU benchmark (docs/measurements).
SAVED = Path(__file__).resolve().parents[2] / "docs" / "measurements" / "cpu-2026-12-05" / "bench_serve_tiny-deep_2ranks_gloo.json"
SWEEP = SAVED.with_name("bench_serve_tiny-deep_2ranks_gloo_sweep.json")


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


def test_the_variants_serve_the_same_arrivals_interleaved_replicated_free_sharded_aligned(served):
    for r in served:
        for key, run in r["runs"]["replicated"].items():
            other = r["runs"]["sharded"][key]
            assert [q["arrival_s"] for q in run["records"]] == [q["arrival_s"] for q in other["records"]]
            assert run["idle_steps"] == 0  # free: a replicated rank runs no padding step
            trial = int(key.split("/")[2])
            assert (run["first"], other["first"]) == ((True, False) if trial % 2 == 0 else (False, True))
            if key.split("/")[1] == "1":  # 400/s, rescaled: exactly
                assert abs(run["realised_rate"] - 400.0) <= 1e-9
            assert run["kv_blocks"]["blocks"] and max(run["kv_blocks"]["blocks"]) == run["peak_blocks"]
    # aligned: every sharded run has as many steps on each rank
    for key in served[0]["runs"]["sharded"]:
        assert len({r["runs"]["sharded"][key]["steps"] for r in served}) == 1


def test_kv_trace_keeps_the_peak():
    from wsharding.lab.tasks.serve import kv_trace

    assert kv_trace([0.0, 0.1, 0.2], [1, 3, 2]) == {"t": [0.0, 0.1, 0.2], "blocks": [1, 3, 2]}
    t = kv_trace([i / 10 for i in range(10)], [0, 1, 9, 2, 3, 3, 1, 0, 4, 0], samples=3)
    assert t == {"t": [0.0, 0.3, 0.6], "blocks": [9, 3, 4]}


def test_report_answer_and_table(served):
    report = summarize(served, SLO_, warmup=1)
    row = report["rows_by_budget"][0]
    assert report["schema"] == 3 and report["equal"] and report["variants"] == ["replicated", "sharded"]
    assert row["sharded"]["pool_tokens"] == row["predicted"]["sharded"]["pool_tokens"] > row["replicated"]["pool_tokens"]
    # whole blocks: the pool (its scratch block included) is at most the 6 % asked for
    assert row["replicated"]["kv_share"] == row["replicated"]["pool_bytes"] / row["budget_bytes"] <= 0.06
    assert row["sharded"]["kv_share"] > 0.06 and row["replicated"]["pool_blocks"] == 2
    for p in row["points"]:
        for v in ("replicated", "sharded"):
            x = p[v]
            assert x["attainment"]["mean"] == 1.0 and x["measured"]["mean"] == 10  # 5 per rank after 1 warm-up
            assert x["goodput"]["n"] == 2 and x["ttft_ms"]["p99"]["mean"] >= x["ttft_ms"]["p50"]["mean"]
            for k in ("peak_blocks", "waited_for_memory", "preemptions", "recomputed_tokens", "peak_in_flight",
                      "idle_steps"):
                assert x[k]["n"] == 2 and "std" in x[k]
        # both met the SLO for every request: over the common window their goodput is the same
        assert p["sharded"]["goodput"]["mean"] == p["replicated"]["goodput"]["mean"]
    assert row["points"][1]["realised_rate"]["mean"] == pytest.approx(400.0, rel=1e-12)
    assert row["points"][0]["replicated"]["idle_steps"]["mean"] == 0
    # the replicated pool (2 blocks, a third of a rank's demand) ran out: pool-limited
    assert row["answer"]["regime"] == ["pool-limited", "pool-limited"]
    # 5 measured requests per rank at 400/s are a burst: the sweep stops there and claims no rate
    assert row["answer"]["steady"] == [True, False]
    for v in ("replicated", "sharded"):
        b = row["answer"]["brackets"][v]
        # all at once sorts above every rate: the sweep stopped at 400/s before it
        assert (b["sustained"], b["kind"], b["all_at_once"]) == (None, "not established", False)
        assert b["stopped"] == {"rate": 400.0, "why": "not a steady state"}
    assert row["answer"]["goodput_ratio"]["sharded"] == [1.0, 1.0]
    # every request of every run: 2 ranks x 6 requests x 2 rates x 2 trials x 2 variants, each with its ITLs
    assert len(report["requests"]) == 96 and sum(q["measured"] for q in report["requests"]) == 80
    assert all(len(q["itl_ms"]) == q["output_tokens"] - 1 for q in report["requests"])
    sizes = {lt["tokens"] for lt in report["layer_times"]}
    assert sizes and all(lt["gather_us"] > 0 and lt["compute_us"] > 0 for lt in report["layer_times"])
    assert len(report["layer_times"]) == 11 * len(sizes)
    c = report["crossover"][0]
    assert c["pool_ratio"] == row["sharded"]["pool_tokens"] / row["replicated"]["pool_tokens"] and c["ratio"] is None
    text = format_table(report)
    assert "CPU ranks" in text and "ANSWER" in text and "every token equal" in text and "KV share 6%" in text
    assert "(realised 400.000/s): pool-limited; NOT A STEADY STATE" in text and "CROSSOVER" in text
    assert "replicated not established: 400/s not a steady state (more requests)" in text
    # beside the measurement, the cost model's figure for the full-size design, labelled as a prediction
    from wsharding.costmodel import Deployment, estimate, get_device
    from wsharding.presets import load_preset

    cap = estimate(load_preset("kimi-k3-b200-fp8"), Deployment(ranks=8, device=get_device("b200"), tokens=256)).kv_capacity()
    rep, sh = cap["tokens_replicated"], cap["tokens_sharded"]
    assert (f"PREDICTED, not measured (cost model, kimi-k3-b200-fp8 on 8 x B200, a 40 GiB replicated KV pool "
            f"assumed): KV tokens per GPU replicated {rep:,} -> sharded {sh:,} ({sh / rep:.2f}x)") in text


def test_a_saved_report_reads_back_with_its_answers_computed_again(served, tmp_path):
    import json

    from wsharding.lab.bench.serve import read_serve_report

    report = summarize(served, SLO_, warmup=1)
    saved = json.loads(json.dumps(report))
    saved["rows_by_budget"][0]["answer"] = {"brackets": "anything"}  # never read
    path = tmp_path / "r.json"
    path.write_text(json.dumps(saved))
    back = read_serve_report(path)
    assert back["rows_by_budget"][0]["answer"] == report["rows_by_budget"][0]["answer"]
    assert format_table(back) == format_table(report)


def test_a_file_that_is_not_a_serve_report_is_refused(tmp_path):
    from wsharding.lab.bench.serve import read_serve_report

    (tmp_path / "a.json").write_text("{not json")
    with pytest.raises(InvalidArgument, match="not JSON"):
        read_serve_report(tmp_path / "a.json")
    (tmp_path / "b.json").write_text('{"bench": "step"}')
    with pytest.raises(InvalidArgument, match="not a report of wsharding bench serve"):
        read_serve_report(tmp_path / "b.json")
    with pytest.raises(InvalidArgument):
        read_serve_report(tmp_path)  # a folder


def test_the_old_h200_reports_are_refused_as_old_format():
    """The one-H200 runs the README used to quote were judged per variant, goodput over each one's own
    drain: read back, they are refused by name, never printed as an answer."""
    from wsharding.lab.bench.serve import read_serve_report
    from wsharding.lab.bench.step import MEASUREMENTS, saved_path

    root = Path(__file__).resolve().parents[2] / MEASUREMENTS
    for name in ("bench_serve_k3-like_2ranks_1gpu_steady_share05.json", "bench_serve_k3-like_2ranks_1gpu_share05.json"):
        with pytest.raises(InvalidArgument, match=r"an old-format serve report \(schema 2\).*not judged as a pair"):
            read_serve_report(saved_path(name, root))


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
    from wsharding.lab.bench.serve import run_serve_bench

    with pytest.raises(InvalidArgument, match="ranks=3, but the cluster given has 2"):
        run_serve_bench(3, "tiny-deep", WORKLOAD, budgets=[1 << 30], token_budget=TOKENS, cluster=cluster_of(2))


def test_a_report_of_the_fixed_row_bench_is_refused_by_name(tmp_path):
    import json

    from wsharding.lab.bench.serve import read_serve_report
    from wsharding.lab.bench.step import MEASUREMENTS, pick_report, saved_reports

    root = Path(__file__).resolve().parents[2]
    old = pick_report(saved_reports(root / MEASUREMENTS, "bench_serve_*.json"), preset="k3-like", rows=1024)
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(InvalidArgument, match="old-format serve report"):
        read_serve_report(tmp_path / "old.json")


def test_slo_parsing():
    assert SLO.parse("ttft=500,tpot=50") == SLO(ttft_ms=500.0, tpot_ms=50.0)
    assert SLO.parse("e2e=900,attainment=0.99").attainment == 0.99
    with pytest.raises(Exception, match="KEY=VALUE"):
        SLO.parse("ttft:500")
    with pytest.raises(Exception, match="name at least one"):
        SLO.parse("attainment=0.5")


def test_from_json_prints_a_saved_report_and_refuses_what_is_not_one(tmp_path, capsys):
    from wsharding.lab import cli

    assert cli.main(["bench", "serve", "--from-json", str(SAVED), "--json", ""]) == 0
    out = capsys.readouterr().out
    assert "ANSWER: per rank, replicated" in out and "NOTE: CPU ranks" in out and list(tmp_path.iterdir()) == []
    (tmp_path / "x.json").write_text("[]")
    assert cli.main(["bench", "serve", "--from-json", str(tmp_path / "x.json")]) != 0
    assert "not a report of wsharding bench serve" in capsys.readouterr().err
    (tmp_path / "engine.json").write_text('{"bench": "serve-engine", "rows_by_budget": []}')
    assert cli.main(["bench", "serve", "--from-json", str(tmp_path / "engine.json")]) != 0
    assert "a report of wsharding bench serve --engine transformers" in capsys.readouterr().err


def _crafted(tmp_path, change) -> str:
    """The saved CPU report with ``change`` applied to its JSON (a dict), written back."""
    import json

    report = json.loads(SAVED.read_text())
    change(report)
    path = tmp_path / "crafted.json"
    path.write_text(json.dumps(report))
    return path


def _point(r):
    return r["rows_by_budget"][0]["points"][0]


CRAFTED = {
    "attainment NaN": (lambda r: _point(r)["sharded"]["attainment"].update(mean=float("nan")),
                       "holds NaN, which is no figure"),
    "attainment 7.5": (lambda r: _point(r)["sharded"]["attainment"].update(mean=7.5),
                       r"field rows_by_budget\[0\]\.points\[0\]\.sharded\.attainment\.mean is 7\.5, it must be <= 1"),
    "attainment -0.1": (lambda r: _point(r)["replicated"]["attainment"].update(mean=-0.1), "must be >= 0"),
    "rate -20": (lambda r: (r.update(rates=[-20.0, *r["rates"][1:]]), _point(r).update(rate=-20.0)),
                 r"field rates\[0\] is -20, it must be > 0"),
    "rate 0": (lambda r: r["rates"].__setitem__(0, 0), r"field rates\[0\] is 0, it must be > 0"),
    "goodput -0.68": (lambda r: _point(r)["sharded"]["goodput"].update(mean=-0.68), r"goodput\.mean is -0\.68"),
    "equal beside differing tokens": (
        lambda r: r.update(equal=True, differ=[{"rank": 0, "budget_bytes": r["budgets"][0], "rate": r["rates"][0],
                                                "requests": [3]}]),
        "field equal says every token was equal, but the field differ lists 1 runs"),
    "missing field": (lambda r: _point(r)["sharded"].pop("ttft_ms"), r"points\[0\]\.sharded\.ttft_ms is missing"),
    "string for a number": (lambda r: _point(r)["sharded"]["ttft_ms"]["p99"].update(mean="fast"),
                            r"ttft_ms\.p99\.mean is str 'fast', a number is needed"),
    "list for an object": (lambda r: r["rows_by_budget"][0].update(points=[[1, 2]] * len(r["rates"])),
                           r"points\[0\] is not an object"),
    "a float too large": (lambda r: r.update(world_size=1e400), "too large for a float"),
    "true for a number": (lambda r: r.update(trials=True), "field trials is bool"),
    "an integer too large": (lambda r: r.update(layers=10**400), "field layers is a whole number of 401 digits"),
    "points fewer than rates": (lambda r: r["rows_by_budget"][0]["points"].pop(), "points for 2 rates"),
    "schema 99": (lambda r: r.update(schema=99), "field schema is 99, this version reads schema 3"),
    "schema 2": (lambda r: r.update(schema=2), r"old-format serve report \(schema 2\)"),
    "slo of nonsense": (lambda r: r.update(slo={"ttft_ms": -1}), "field slo is not an SLO"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_report_is_refused_naming_the_field(tmp_path, case):
    """Each of these was read as an answer (NaN attainment counted as met, "at least -20/s", "-0.68x",
    "every token equal" beside differing tokens) or ended in a raw KeyError / TypeError."""
    import json

    from wsharding.lab.bench.serve import read_serve_report

    change, message = CRAFTED[case]
    if case == "attainment NaN":  # json.dumps writes NaN as the literal NaN, which Python's json reads
        path = _crafted(tmp_path, change)
        assert "NaN" in path.read_text()
    elif case == "a float too large":
        path = _crafted(tmp_path, lambda r: None)
        text = json.loads(path.read_text())
        text["world_size"] = 1
        path.write_text(json.dumps(text).replace('"world_size": 1', '"world_size": 1e400'))
    else:
        path = _crafted(tmp_path, change)
    with pytest.raises(InvalidArgument, match=message) as err:
        read_serve_report(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_deep_nesting_is_refused_not_a_recursion_error(tmp_path):
    from wsharding.lab.bench.serve import read_serve_report

    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(InvalidArgument, match="not a report's JSON"):
        read_serve_report(tmp_path / "deep.json")
    (tmp_path / "d.json").write_text('{"bench": "serve", "schema": 3, "x": ' + "[" * 40 + "]" * 40 + "}")
    with pytest.raises(InvalidArgument, match="nested deeper than a serve report"):
        read_serve_report(tmp_path / "d.json")


def test_the_saved_cpu_run_reads_back():
    from wsharding.lab.bench.serve import read_serve_report
    from wsharding.lab.viz.serve import crossover_figure, goodput_figure, kv_figure

    report = read_serve_report(SAVED)
    assert report["device"] == "cpu" and report["equal"] and len(report["rows_by_budget"]) == 2
    assert [c["regime"] for c in report["crossover"]] == ["pool-limited", "compute-limited"]
    assert {t.name for t in goodput_figure(report).data} >= {"replicated", "sharded"}
    assert any(t.name.startswith("cost model, pool-limited") for t in crossover_figure(report).data)
    kv = kv_figure(report)
    tight = report["rows_by_budget"][0]
    trace = next(k for k in tight["points"][-1]["replicated"]["kv_blocks"] if k["trial"] == 0 and k["rank"] == 0)
    assert list(kv.data[0].y) == [b / tight["replicated"]["pool_blocks"] for b in trace["blocks"]]
    assert max(kv.data[0].y) == 1.0  # the replicated pool ran full: the pool-limited regime


def test_the_crossover_ratio_says_what_kind_of_number_it_is():
    from wsharding.lab.bench.serve_report import _rate_ratio
    from wsharding.serve.metrics import bracket

    rates = [2.0, 4.0, 8.0, 16.0]

    def b(*met):
        return bracket(rates, list(met), 0.9)

    assert _rate_ratio(b(1, 1, 1, 0), b(1, 1, 0, 0)) == (2.0, "exact")  # 8/s against 4/s
    assert _rate_ratio(b(1, 1, 1, 1), b(1, 1, 0, 0)) == (4.0, "lower")  # sharded passed every rate
    assert _rate_ratio(b(1, 1, 0, 0), b(0, 0, 0, 0)) == (2.0, "lower")  # replicated below the lowest
    assert _rate_ratio(b(1, 0, 0, 0), b(1, 1, 1, 1)) == (0.125, "upper")
    assert _rate_ratio(b(1, 1, 1, 1), b(1, 1, 1, 1)) == (None, None)  # the sweep reached neither limit
    assert _rate_ratio(b(0, 0, 0, 0), b(0, 0, 0, 0)) == (None, None)


def test_reports_of_one_set_up_at_other_budgets_merge_into_one_crossover(tmp_path, capsys):
    """One call per budget (a call's time is limited on a lent GPU), merged by --from-json: the budgets
    side by side in the order of their replicated share, the crossover of all; another set-up is refused."""
    import json

    from wsharding.lab import cli

    full = json.loads(SWEEP.read_text())
    for name, rows in (("low", [0]), ("high", [1])):
        part = json.loads(SWEEP.read_text())
        part["rows_by_budget"] = [full["rows_by_budget"][i] for i in rows]
        part["budgets"] = [full["budgets"][i] for i in rows]
        (tmp_path / f"{name}.json").write_text(json.dumps(part))
    assert cli.main(["bench", "serve", "--from-json", str(tmp_path / "high.json"), str(tmp_path / "low.json"),
                     "--json", str(tmp_path / "merged")]) == 0
    merged = json.loads((tmp_path / "merged.json").read_text())
    from wsharding.lab.bench.serve import read_serve_report

    whole = json.loads(json.dumps(read_serve_report(SWEEP)))
    assert merged["crossover"] == whole["crossover"] and merged["budgets"] == full["budgets"]
    assert "at least 8.00x" in capsys.readouterr().out
    other = json.loads((tmp_path / "low.json").read_text())
    other["trials"] = 3
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert cli.main(["bench", "serve", "--from-json", str(tmp_path / "high.json"), str(tmp_path / "other.json"),
                     "--json", ""]) == 2
    assert "its trials differs from" in capsys.readouterr().err


#: The GPU runs the README and notebook 07 quote (one H100, two ranks time-slicing it): one budget per call.
GPU_RUNS = [SAVED.parents[1] / "h100-2026-12-06" / f"bench_serve_k3-like_2ranks-1gpu_h100_2026-12-06_{w}-steady.json"
            for w in ("kv", "compute")]


def test_the_saved_gpu_runs_say_what_the_readme_says():
    from wsharding.lab.bench.serve import read_serve_report
    from wsharding.lab.bench.serve_report import answer_text, merge_saved

    report = merge_saved([read_serve_report(p) for p in GPU_RUNS], GPU_RUNS)
    tight, roomy = report["rows_by_budget"]
    assert (tight["replicated"]["pool_tokens"], tight["sharded"]["pool_tokens"]) == (16_432, 50_032)
    assert (roomy["replicated"]["pool_tokens"], roomy["sharded"]["pool_tokens"]) == (49_200, 82_800)
    assert answer_text(tight, report["variants"]) == (
        "per rank, replicated sustains 4/s, fails at 6/s; sharded at least 6/s (nothing failed); "
        "goodput sharded/replicated 4/s 1.00x (pool-limited), 6/s 2.81x (pool-limited)")
    assert answer_text(roomy, report["variants"]) == (
        "per rank, replicated at least 6/s (nothing failed); sharded at least 6/s (nothing failed); "
        "goodput sharded/replicated 4/s 1.00x (compute-limited), 6/s 1.00x (compute-limited)")
    readme = (SAVED.parents[3] / "README.md").read_text()
    assert "sustains 4/s and fails at 6/s" in readme and "2.81x at 6/s" in readme and "16,432" in readme
    assert "49,200 against 82,800" in readme
