"""``wsharding plan --serve`` on GPUs (marker ``gpu``; skipped without two ranks): a step-time profile
measured on the ranks, and the prediction of a bench serve run made on the same ranks, printed beside
it (the error is reported, not asserted: a timing)."""

from __future__ import annotations

import pytest

from tests.lab.test_gpu_kv import _two_ranks
from wsharding.lab.bench.serve import summarize
from wsharding.lab.tasks.predict import profile_from_ranks, profile_rank
from wsharding.lab.tasks.serve import serve_rank
from wsharding.serve import Workload
from wsharding.serve.metrics import SLO
from wsharding.serve.predict import PREDICTED, StepModel, StepProfile, format_comparison, predict_report
from wsharding.serve.step import context_buckets, token_buckets

pytestmark = pytest.mark.gpu


def test_gpu_profile_and_prediction_of_a_run():
    wl = Workload(requests=24, prompt=(16, 200), output=(8, 64))
    cluster, comm = _two_ranks()
    with cluster:
        prof = cluster.run(profile_rank, "small", token_budget=128, max_len=wl.max_len, comm=comm, repeats=3)
        results = cluster.run(serve_rank, "small", workload=wl.as_dict(), budgets=[{"kv_share": 0.05}],
                              rates=[20.0, 80.0], trials=1, token_budget=128, comm=comm, check=False)
    profile = StepProfile.from_dict(profile_from_ranks(prof))
    shapes = {f"{n}x{w}" for n in token_buckets(128) for w in context_buckets(wl.max_len)}
    assert set(profile.steps["replicated"]) == shapes == set(profile.steps["sharded"])
    assert all(t > 0 for v in profile.steps.values() for t in v.values())
    report = summarize(results, SLO(ttft_ms=5000, tpot_ms=500), warmup=2)
    for rule in ("measured", "serial"):
        pred = predict_report(profile, StepModel(profile, rule), report)
        print("\n" + format_comparison(pred["comparison"]))
        assert pred["label"] == PREDICTED
        assert [p["rate"] for p in pred["comparison"]["rows_by_budget"][0]["points"]] == [20.0, 80.0]
