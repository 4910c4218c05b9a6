"""The serving prediction: the Scheduler replayed on a virtual clock (exact times by hand), sharded
ranks aligned and replicated ranks free as the engine runs them, a point judged as a pair as the bench
judges it, the step-time profile's refusals and rules, and every figure labelled PREDICTED."""

from __future__ import annotations

import json
import math

import pytest

from wsharding.serve.metrics import SLO, bracket, pair_metrics, pair_steady, request_metrics, trial_metrics
from wsharding.serve.predict import (
    PREDICTED,
    ProfileMissing,
    ProfileRefused,
    Setting,
    StepModel,
    StepProfile,
    counted_pool,
    design_prediction,
    design_text,
    format_prediction,
    predict_pair,
    predict_serve,
    replay,
)
from wsharding.serve.workload import Request, Workload


def test_replay_constant_step_reproduces_hand_computed_latencies():
    # budget 4 tokens a step, each step 1 s. t=0: r0 (3-token prompt) prefills whole, its first token at
    # 1 s. t=1: r0 decodes and r1 (arrived 0.25) prefills: tokens at 2 s (r0 done). t=2: r1 decodes: 3 s.
    r0, r1 = Request(0, 0, 0.0, (1, 2, 3), 2), Request(1, 0, 0.25, (4, 5), 2)
    rp = replay([[r0, r1]], 8, lambda n, c: 1.0, aligned=False, token_budget=4, max_context=32)
    assert [r["token_s"] for r in rp.records] == [[1.0, 2.0], [2.0, 3.0]]
    assert [request_metrics(r)["ttft_ms"] for r in rp.records] == [1000.0, 1750.0]
    assert [request_metrics(r)["tpot_ms"] for r in rp.records] == [1000.0, 1000.0]
    assert set(rp.records[0]) == {"rid", "rank", "arrival_s", "sent_s", "token_s", "prompt_tokens", "output_tokens",
                                  "preempted"}
    m = trial_metrics(rp.records, 1, 0, SLO(ttft_ms=1500))
    assert m["attainment"] == 0.5 and m["duration_s"] == 3.0 and rp.steps == 3


def test_aligned_step_lasts_the_slowest_ranks():
    # a step costs 0.25 s per bucket token: rank 0 prefills 4 tokens (1 s), rank 1 one token (0.25 s)
    a, b = Request(0, 0, 0.0, (1, 2, 3, 4), 2), Request(0, 1, 0.0, (5,), 2)
    lock = replay([[a], [b]], 8, lambda n, c: 0.25 * n, aligned=True, token_budget=4, max_context=32)
    free = replay([[a], [b]], 8, lambda n, c: 0.25 * n, aligned=False, token_budget=4, max_context=32)
    assert [r["token_s"] for r in lock.records] == [[1.0, 1.25], [1.0, 1.25]]
    assert [r["token_s"] for r in free.records] == [[1.0, 1.25], [0.25, 0.5]]


def test_aligned_ranks_with_nothing_to_compute_wait_for_the_earliest_arrival():
    # no rank has work before 0.6: none steps (no padding steps), the step starts at the arrival, as free.
    # Two ranks, arrivals at 0.6 and 2.0: rank 1 pads the step at 0.6 (rank 0 works), then both wait to 2.0.
    r = Request(0, 0, 0.6, (1,), 1)
    rp = replay([[r]], 4, lambda n, c: 0.25, aligned=True, token_budget=4, max_context=16)
    assert rp.idle_steps == 0 and rp.steps == 1 and rp.records[0]["token_s"] == [0.85]
    free = replay([[r]], 4, lambda n, c: 0.25, aligned=False, token_budget=4, max_context=16)
    assert free.idle_steps == 0 and free.records[0]["token_s"] == [0.85]
    late = Request(0, 1, 2.0, (2,), 1)
    two = replay([[r], [late]], 4, lambda n, c: 0.25, aligned=True, token_budget=4, max_context=16)
    assert two.steps == 2 and two.idle_steps == 2 and two.clock_s == 2.25
    assert [rec["token_s"] for rec in two.records] == [[0.85], [2.25]]


def test_aligned_rank_with_nothing_scheduled_counts_an_idle_step():
    # t=0: rank 0 prefills 4 tokens (1 s); rank 1's request arrives at 0.6, so its rank runs an idle step.
    # t=1: rank 0 decodes, rank 1 prefills its one token: 0.25 s. Free, rank 1 would start at 0.6.
    a, b = Request(0, 0, 0.0, (1, 2, 3, 4), 2), Request(0, 1, 0.6, (5,), 1)
    al = replay([[a], [b]], 8, lambda n, c: 0.25 * n, aligned=True, token_budget=4, max_context=32)
    free = replay([[a], [b]], 8, lambda n, c: 0.25 * n, aligned=False, token_budget=4, max_context=32)
    assert al.idle_steps == 1 and [r["token_s"] for r in al.records] == [[1.0, 1.25], [1.25]]
    assert free.idle_steps == 0 and [r["token_s"] for r in free.records] == [[1.0, 1.25], [0.85]]


def profile(**over) -> StepProfile:
    d = dict(source="hand-made", device="cpu", ranks=2, preset="tiny", vocab=192, token_budget=4, max_context=32,
             steps={"replicated": {f"{n}x{c}": 0.001 * n for n in (1, 2, 4) for c in (16, 32)},
                    "sharded": {f"{n}x{c}": 0.002 * n for n in (1, 2, 4) for c in (16, 32)}},
             sizing={"resident_bytes": {"replicated": 1_000_000, "sharded": 600_000}, "reserve_bytes": 100_000,
                     "kv_bytes_per_token": 1024},
             layers=[{"layer": 1, "tokens": 1, "width": 32, "payload_bytes": 400_000, "layout_bytes": 400_000,
                      "gather_s": 0.003, "compute_s": 0.001},
                     {"layer": 1, "tokens": 4, "width": 32, "payload_bytes": 400_000, "layout_bytes": 400_000,
                      "gather_s": 0.003, "compute_s": 0.004}])
    d.update(over)
    return StepProfile(**d)


def test_profile_refuses_a_shape_it_does_not_hold():
    p = profile()
    assert p.step_seconds("replicated", 2, 32) == 0.002
    with pytest.raises(ProfileMissing, match="no replicated step of 8 tokens x 32 context.*token bucket 8"):
        p.step_seconds("replicated", 8, 32)
    with pytest.raises(ProfileMissing, match="64 context"):
        p.step_seconds("sharded", 4, 64)


def test_rules_serial_and_overlap():
    p = profile()
    assert StepModel(p, "measured").seconds("sharded", 4, 16) == 0.008
    assert StepModel(p, "serial").seconds("sharded", 4, 16) == 0.004 + 0.003
    # compute at 2 tokens lies between the probes at 1 and 4: 0.002; the gather outlasts it by 0.001
    assert StepModel(p, "overlap").seconds("sharded", 2, 16) == pytest.approx(0.002 + 0.001, abs=1e-15)
    assert StepModel(p, "overlap").seconds("sharded", 4, 16) == 0.004  # hidden behind 4 ms of compute
    assert StepModel(p, "serial", compute_scale=0.5).seconds("sharded", 4, 16) == 0.002 + 0.003
    with pytest.raises(ValueError, match="rule"):
        StepModel(p, "guess")
    with pytest.raises(ValueError, match="compute scale"):
        StepModel(p, "measured", compute_scale=0.5)


def test_prediction_labelled_in_text_and_json():
    p = profile()
    wl = Workload(requests=6, prompt=(2, 6), output=(2, 4))
    s = Setting(ranks=2, workload=wl, token_budget=4, slo=SLO(ttft_ms=50, tpot_ms=20), vocab=192, warmup=1)
    pred = predict_serve(p, StepModel(p, "measured"), s, [0.5], [10.0], refine=1)
    row = pred["rows_by_budget"][0]
    assert pred["label"] == PREDICTED and row["label"] == PREDICTED
    assert all(pt["label"] == PREDICTED and pt[v]["label"] == PREDICTED for v in ("replicated", "sharded")
               for pt in row["points"])
    assert row["pool_blocks"]["sharded"] > row["pool_blocks"]["replicated"]
    text = format_prediction(pred)
    assert text.startswith(PREDICTED)
    assert all(PREDICTED in line for line in text.splitlines() if "sustain" in line or "KV pool" in line)
    json.dumps(pred)  # JSON-ready
    rates = [pt["rate"] for pt in row["points"]]
    steady = [pt["steady"] for pt in row["points"]]
    for v in ("replicated", "sharded"):  # the bench's bracket over every pair replayed, steadiness the pair's
        want = bracket(rates, [pt[v]["attainment"] for pt in row["points"]], 0.9, steady)
        got = row["brackets"][v]
        assert (got["sustained"], got["fails_at"], got["kind"]) == (want["sustained"], want["fails_at"], want["kind"])


def test_design_line_k3_on_8_b200():
    tiny = Workload(requests=3, prompt=(16, 32), output=(2, 4))
    d = design_prediction(SLO(ttft_ms=2000, tpot_ms=200), workload=tiny, rates=(1.0,), refine=0, widen=1)
    line = design_text(d)
    assert PREDICTED in line and "kimi-k3-b200-fp8 on 8 x B200" in line
    assert d["label"] == PREDICTED and d["ranks"] == 8 and math.isclose(d["pool_ratio"], 3_303_776 / 1_620_960,
                                                                         rel_tol=1e-4)


def test_profile_from_dict_and_pool_refusals():
    p = profile()
    assert StepProfile.from_dict(p.as_dict()) == p
    with pytest.raises(ValueError, match="not a step profile"):
        StepProfile.from_dict({"kind": "plan"})
    with pytest.raises(ValueError, match="step profile: .*'steps'"):
        StepProfile.from_dict({k: v for k, v in p.as_dict().items() if k != "steps"})
    with pytest.raises(ValueError, match="at least one block"):
        counted_pool(0)


def test_all_at_once_is_a_burst_not_a_rate():
    p = profile()
    wl = Workload(requests=4, prompt=(2, 6), output=(2, 3))
    s = Setting(ranks=2, workload=wl, token_budget=4, slo=SLO(ttft_ms=1e6), vocab=192)
    pred = predict_serve(p, StepModel(p, "measured"), s, [0.5], [math.inf], search=False)
    row = pred["rows_by_budget"][0]
    b = row["brackets"]["sharded"]
    assert row["points"][0]["rate"] is None and b["all_at_once"] and b["sustained"] is None
    assert "all at once (a burst" in format_prediction(pred)
    json.loads(json.dumps(pred, allow_nan=False))  # no Infinity in the JSON


def test_a_point_is_judged_as_a_pair_on_the_same_arrivals():
    # the same rescaled arrivals for both variants, judged together: goodput over their common
    # arrival window (not each variant's own drain), steadiness of the pair
    p = profile()
    wl = Workload(requests=8, prompt=(2, 6), output=(2, 4))
    s = Setting(ranks=2, workload=wl, token_budget=4, slo=SLO(ttft_ms=30, tpot_ms=20), vocab=192, warmup=1)
    blocks = {"replicated": 2, "sharded": 6}
    secs = {v: (lambda n, c, v=v: StepModel(p, "measured").seconds(v, n, c)) for v in ("replicated", "sharded")}
    got = predict_pair(s, blocks, secs, 40.0)
    reqs = [wl.with_(rate=40.0, seed=0).for_rank(r, 192) for r in range(2)]
    assert reqs[0][-1].arrival_s == 8 / 40.0  # rescaled: the realised rate is the label
    runs = {v: replay(reqs, blocks[v], secs[v], aligned=v == "sharded", token_budget=4, max_context=32)
            for v in blocks}
    want = pair_metrics({v: r.records for v, r in runs.items()}, 2, 1, s.slo)
    for v in blocks:
        assert got[v]["goodput"] == want[v]["goodput"] and got[v]["attainment"] == want[v]["attainment"]
        assert got[v]["goodput_own_window"] == want[v]["goodput_own_window"]
        assert got[v]["idle_steps"] == runs[v].idle_steps
    assert runs["replicated"].idle_steps == 0 and runs["sharded"].idle_steps > 0  # free vs aligned
    assert got["replicated"]["goodput"] != got["replicated"]["goodput_own_window"]  # the window matters here
    assert got["steady"] == pair_steady(40.0, {v: got[v]["drain_share"] for v in blocks},
                                        {v: got[v]["attainment"] for v in blocks}, 0.9)


OLD = "docs/measurements/cpu-2026-12-04/bench_serve_tiny-deep_2ranks_gloo.json"


def test_old_format_report_gives_its_steps_only_checked_and_labelled():
    raw = json.load(open(OLD))
    p = StepProfile.from_old_report_steps(raw, OLD)
    assert p.source.startswith("steps of an old-format report (schema 2)") and p.notes == [p.source.rsplit(": ", 1)[0]]
    assert set(p.steps) == {"replicated", "sharded"} and all(x > 0 for t in p.steps.values() for x in t.values())
    pt = raw["rows_by_budget"][0]["points"][0]["sharded"]["step_ms_by_bucket"]
    k = next(iter(pt))
    for bad, words in ((-1.0, "a finite number > 0"), ("x", "a number is needed"), (None, "a number is needed")):
        pt[k]["mean_ms"] = bad
        with pytest.raises(ProfileRefused, match=f"field rows_by_budget\\[0\\].points\\[0\\].sharded.step_ms_by_bucket.{k}.mean_ms .*{words}"):
            StepProfile.from_old_report_steps(raw, OLD)
    del raw["sizing"]["sharded"]["resident_bytes"]
    with pytest.raises(ProfileRefused, match="field sizing.sharded.resident_bytes is missing"):
        StepProfile.from_old_report_steps(raw, OLD)


def test_rate_ratio_only_of_two_brackets():
    from wsharding.serve.predict import rate_ratio

    def b(kind, sustained):
        return {"kind": kind, "sustained": sustained}

    assert rate_ratio({"replicated": b("bracketed", 2.0), "sharded": b("bracketed", 8.0)}) == 4.0
    # "at least 5/s" on both sides is no ratio of 1.00x: the sweep did not reach either limit
    assert rate_ratio({"replicated": b("at least", 5.0), "sharded": b("at least", 5.0)}) is None
    assert rate_ratio({"replicated": b("bracketed", 2.0), "sharded": b("not established", 4.0)}) is None
