"""``wsharding plan --serve``: its argument errors, a prediction from a saved CPU report beside it, and the
step-time profile measured on two CPU ranks (the rank task behind ``--profile measure``)."""

from __future__ import annotations

import argparse
import json

import pytest

from wsharding.lab import plan
from wsharding.lab.cliargs import InputError
from wsharding.lab.tasks.predict import profile_from_ranks, profile_rank
from wsharding.serve.predict import StepProfile

SAVED = "docs/measurements/cpu-2026-12-04/bench_serve_tiny-deep_2ranks_gloo.json"


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
    assert out["replicated_lockstep"] is True  # a schema-2 run's engine stepped every rank in lockstep
    pt = out["comparison"]["rows_by_budget"][0]["replicated"]["points"][0]
    assert pt["goodput_error"] == (pt["goodput_predicted"] - pt["goodput_measured"]) / pt["goodput_measured"]


def test_link_h200_prices_gathers_for_n_gpus(capsys):
    rc = plan.main(args(["--serve", "--profile", SAVED, "--link", "h200", "--ranks", "4", "--no-design",
                         "--kv-share", "0.3", "--rate", "20", "--no-search", "--requests", "8"]))
    text = capsys.readouterr().out
    assert rc == 0 and "4 x H200 NVLink at 450 GB/s, datasheet" in text and "4 ranks" in text


def test_profile_measured_on_two_cpu_ranks(cluster_of):
    results = cluster_of(2).run(profile_rank, "tiny", token_budget=2, max_len=20, warmup=1, repeats=1)
    p = StepProfile.from_dict(profile_from_ranks(results))
    assert set(p.steps["replicated"]) == set(p.steps["sharded"]) == {"1x16", "1x32", "2x16", "2x32"}
    assert p.steps["sharded"]["2x32"] == max(r["steps"]["sharded"]["2x32"] for r in results)  # lockstep: slowest
    assert p.layer_ids() == [1, 2, 3] and all(g > 0 for g in p.gathers())
    assert p.sizing["resident_bytes"]["sharded"] != p.sizing["resident_bytes"]["replicated"]
    assert any("emulated" in n for n in p.notes)
