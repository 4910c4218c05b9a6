"""``wsharding plan --serve``: its argument errors, a prediction from a saved CPU report (schema 3) beside
it, judged as the bench judges; an old-format report's step times only; ``bench serve --predict``'s text;
and the step-time profile measured on two CPU ranks (the rank task behind ``--profile measure``)."""

from __future__ import annotations

import argparse
import json

import pytest

from wsharding.lab import plan
from wsharding.lab.bench.serve import predicted_text
from wsharding.lab.bench.serve_report import read_serve_report
from wsharding.lab.cliargs import InputError
from wsharding.lab.tasks.predict import profile_from_ranks, profile_rank
from wsharding.serve.predict import ProfileRefused, StepProfile

SAVED = "docs/measurements/cpu-2026-12-05/bench_serve_tiny-deep_2ranks_gloo_sweep.json"  # schema 3
OLD = "docs/measurements/cpu-2026-12-04/bench_serve_tiny-deep_2ranks_gloo.json"  # schema 2


def args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    plan.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("argv, words", [
    (["--serve"], "--serve needs --profile"),
    (["--kv-share", "0.1"], "--kv-share: options of wsharding plan --serve"),
    (["--serve", "--profile", SAVED, "--ranks", "4"], "--ranks 4 needs --link h200 or b200"),
    (["--serve", "--profile", "measure", "--compare", SAVED], "--compare predicts a saved bench serve run"),
    (["--serve", "--profile", "pyproject.toml"], "not JSON"),
    (["--serve", "--profile", SAVED, "--preset", "kimi-k3-b200-fp8"], "--preset: options of the bill"),
    (["--serve", "--profile", SAVED, "--compare", SAVED, "--rate", "4"], "--rate: --compare takes them"),
    (["--serve", "--profile", SAVED, "--compare", SAVED, "--link", "h200", "--ranks", "4"], "the run had 2 ranks"),
])
def test_argument_errors(argv, words):
    with pytest.raises(InputError, match=words):
        plan.main(args(argv))


def test_compare_with_a_saved_cpu_report_is_labelled(capsys):
    rc = plan.main(args(["--serve", "--profile", SAVED, "--compare", SAVED, "--no-design", "--json"]))
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["label"] == "PREDICTED" and out["comparison"]["label"] == "PREDICTED"
    report = read_serve_report(SAVED)
    for prow, mrow, crow in zip(out["rows_by_budget"], report["rows_by_budget"], out["comparison"]["rows_by_budget"],
                                strict=True):
        # the run's own pools and rates; the measured side is the report's answer, computed again
        assert prow["pool_blocks"] == {v: mrow[v]["pool_blocks"] for v in ("replicated", "sharded")}
        assert [p["rate"] for p in prow["points"]] == report["rates"]
        for v in ("replicated", "sharded"):
            assert crow[v]["measured"] == mrow["answer"]["brackets"][v]
    pt = out["comparison"]["rows_by_budget"][0]["points"][1]["replicated"]
    assert pt["goodput_error"] == (pt["goodput_predicted"] - pt["goodput_measured"]) / pt["goodput_measured"]


def test_compare_refuses_an_old_format_report():
    with pytest.raises(ValueError, match="old-format serve report .schema 2.*not judged as a pair"):
        plan.main(args(["--serve", "--profile", SAVED, "--compare", OLD, "--no-design"]))


def test_old_format_report_gives_step_times_only(capsys, tmp_path):
    rc = plan.main(args(["--serve", "--profile", OLD, "--link", "h200", "--ranks", "4", "--no-design",
                         "--kv-share", "0.3", "--rate", "20", "--no-search", "--requests", "8"]))
    text = capsys.readouterr().out
    assert rc == 0 and "4 x H200 NVLink at 450 GB/s, datasheet" in text and "4 ranks" in text
    assert "steps of an old-format report (schema 2)" in text
    raw = json.load(open(OLD))
    raw["kv_bytes_per_token"] = -3
    bad = tmp_path / "old.json"
    bad.write_text(json.dumps(raw))
    with pytest.raises(ProfileRefused, match="field kv_bytes_per_token is -3"):
        plan.main(args(["--serve", "--profile", str(bad), "--no-design", "--no-search", "--requests", "8"]))


def test_bench_serve_predict_prints_the_run_predicted_beside_it():
    text = predicted_text(read_serve_report(SAVED))
    assert text.startswith("PREDICTED from this run's own measured steps")
    assert "replicated PREDICTED sustains 2/s, fails at 4/s; measured sustains 2/s, fails at 4/s; sustained rate " \
           "error +0%" in text


def test_profile_measured_on_two_cpu_ranks(cluster_of):
    results = cluster_of(2).run(profile_rank, "tiny", token_budget=2, max_len=20, warmup=1, repeats=1)
    p = StepProfile.from_dict(profile_from_ranks(results))
    assert set(p.steps["replicated"]) == set(p.steps["sharded"]) == {"1x16", "1x32", "2x16", "2x32"}
    assert p.steps["sharded"]["2x32"] == max(r["steps"]["sharded"]["2x32"] for r in results)  # lockstep: slowest
    assert p.layer_ids() == [1, 2, 3] and all(g > 0 for g in p.gathers())
    assert p.sizing["resident_bytes"]["sharded"] != p.sizing["resident_bytes"]["replicated"]
    assert any("emulated" in n for n in p.notes)


def test_predict_report_refuses_what_it_cannot_replay():
    from wsharding.serve.predict import StepModel, predict_report

    report = read_serve_report(SAVED)
    profile = StepProfile.from_serve_report(report, "own steps")
    model = StepModel(profile, "measured")
    trace = {**report, "workload": {**report["workload"], "source": "ShareGPT V3"}}
    with pytest.raises(ValueError, match="lengths came from ShareGPT V3, whose pairs the report does not keep"):
        predict_report(profile, model, trace)  # without it: other requests than the run's, compared as its own
    with pytest.raises(ValueError, match="without an SLO"):
        predict_report(profile, model, {**report, "slo": None})
    with pytest.raises(ValueError, match="attended over 96 tokens"):
        predict_report(profile, model, {**report, "max_context": 96})


def test_bench_serve_predict_says_why_it_made_none():
    # said in the text, not raised: a run without an SLO is still printed and saved
    assert predicted_text({**read_serve_report(SAVED), "slo": None}).startswith(
        "PREDICTED: not made -- predict a bench serve run: it was run without an SLO")


def test_bench_serve_from_json_predict_prints_it_under_the_report(capsys):
    from wsharding.lab.bench import serve as bench_serve

    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    assert bench_serve.main(parser.parse_args(["--from-json", SAVED, "--predict", "--json", ""])) == 0
    out = capsys.readouterr().out
    assert out.index("ANSWER") < out.index("PREDICTED from this run's own measured steps")
