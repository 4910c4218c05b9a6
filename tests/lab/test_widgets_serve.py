"""Notebook 06's serving panel: a thin wrapper over ``run_serve_bench``; each run adds a budget."""

from __future__ import annotations

from wsharding.lab.widgets.serve import build_serve_panel, merge_reports
from wsharding.serve import Workload

WL = Workload(requests=4, prompt=(4, 8), output=(2, 4))


def test_each_run_adds_its_budget_and_the_figure_holds_the_sweep(cluster_of):
    panel = build_serve_panel({2: cluster_of(2)}, "tiny-deep", WL, token_budget=16, rank_choices=(2,))
    for value in (panel.budget_mib.min, panel.budget_mib.max):
        panel.budget_mib.value = value
        panel.run_button.click()
        assert panel.error == ""
    reports = panel.reports[2]
    assert len(reports) == panel.runs == 2 and all(r["equal"] for r in reports)
    sweep = merge_reports(reports)
    budgets = [row["budget_bytes"] for row in sweep["rows_by_budget"]]
    assert budgets == sorted(budgets) and len(budgets) == 2
    low, high = sweep["rows_by_budget"]
    assert low["replicated"]["pool_tokens"] < high["replicated"]["pool_tokens"]
    panel.close()


def test_an_error_is_shown_not_raised(cluster_of):
    panel = build_serve_panel({2: cluster_of(2)}, "tiny-deep", WL, token_budget=16, rank_choices=(2,))
    panel.budget_mib.min = 0.01
    panel.budget_mib.value = 0.01  # below the model itself
    panel.run_button.click()
    assert "leaves no KV pool" in panel.error and panel.reports == {}


def test_merge_keeps_the_latest_run_of_a_budget():
    a = {"rows_by_budget": [{"budget_bytes": 2, "v": "a"}, {"budget_bytes": 1, "v": "a"}], "differ": []}
    b = {"rows_by_budget": [{"budget_bytes": 2, "v": "b"}], "differ": [], "world_size": 2}
    m = merge_reports([a, b])
    assert [(r["budget_bytes"], r["v"]) for r in m["rows_by_budget"]] == [(1, "a"), (2, "b")]
    assert m["equal"] and m["world_size"] == 2
