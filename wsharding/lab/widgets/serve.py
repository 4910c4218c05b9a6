"""The serving panel of notebook 07: pick a memory budget per rank and the number of ranks, serve the
workload replicated and sharded, and watch concurrency and tokens per second grow into a sweep.

A thin wrapper over :func:`wsharding.lab.bench.serve.run_serve_bench` (which tests call directly);
each run adds one budget to the figure of its rank count, so a few clicks draw the curve.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ipywidgets as widgets
from IPython.display import HTML, display

from wsharding.lab.bench.ranks import bench_cluster
from wsharding.lab.bench.serve import format_table, kv_room, replicated_footprint, run_serve_bench
from wsharding.lab.cluster import RankCluster
from wsharding.lab.viz.serve import serve_figure
from wsharding.lab.widgets import pre_html
from wsharding.serve import Workload


def merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report holding every budget of ``reports`` (runs of the same set-up), sorted by budget; a
    later run of the same budget replaces the earlier one."""
    by_budget = {}
    for r in reports:
        for row in r["rows_by_budget"]:
            by_budget[row["budget_bytes"]] = row
    merged = dict(reports[-1])
    merged["rows_by_budget"] = [by_budget[b] for b in sorted(by_budget)]
    merged["differ"] = [d for r in reports for d in r["differ"]]
    merged["equal"] = not merged["differ"]
    return merged


@dataclass
class ServePanel:
    """The widget, its controls, the reports per rank count, and the last error."""

    widget: widgets.Widget
    ranks: widgets.Dropdown
    budget_mib: widgets.FloatSlider
    run_button: widgets.Button
    reports: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    error: str = ""
    runs: int = 0
    started: list[RankCluster] = field(default_factory=list)

    def close(self) -> None:
        """Stop the rank processes the panel started (not the ones it was given)."""
        for c in self.started:
            c.close()
        self.started.clear()


def build_serve_panel(clusters: dict[int, RankCluster], preset: str, workload: Workload, *,
                      token_budget: int | None = None, rows: int | None = None, rank_choices: tuple[int, ...] = (2, 4),
                      initial: dict[str, Any] | None = None,
                      start_cluster: Callable[[int], RankCluster] | None = None) -> ServePanel:
    """Controls: ranks (N) and the budget per rank in MiB, from the replicated model's resident bytes and
    reserve plus a quarter of one rank's KV demand (at least the longest request) up to one and a half of it; a **serve** button.
    ``clusters``: running clusters by size (the notebook's); others are started on first use with
    ``start_cluster`` (default :func:`~wsharding.lab.bench.ranks.bench_cluster`: GPUs where there are,
    else CPU ranks with gloo) and closed by :meth:`ServePanel.close`.
    ``initial``: a report to show before the first run (its rank count's first sweep). ``token_budget``:
    tokens per step (default 32; ``rows`` is its old name). Each run serves the workload at its own rate."""
    token_budget = token_budget or rows or 32
    f = replicated_footprint(preset, None, token_budget, workload)
    base = (f["resident_bytes"] + f["reserve_bytes"]) / 2**20
    low, high = (kv_room(f, share, workload) / 2**20 for share in (0.25, 1.5))
    size = {"layout": widgets.Layout(width="380px"), "style": {"description_width": "150px"}}
    ranks = widgets.Dropdown(options=list(rank_choices), value=max(rank_choices), description="ranks (N)", **size)
    budget = widgets.FloatSlider(value=round(base + (low + high) / 2, 2), min=round(base + low, 2) + 0.01,
                                 max=round(base + high, 2), step=0.01, readout_format=".2f",
                                 description="budget MiB per rank", **size)
    button = widgets.Button(description="serve", button_style="primary")
    out = widgets.Output()
    panel = ServePanel(widget=widgets.VBox([widgets.HBox([ranks, budget, button],
                                                         layout=widgets.Layout(flex_flow="row wrap")), out]),
                       ranks=ranks, budget_mib=budget, run_button=button)
    clusters = dict(clusters)
    if initial is not None:
        panel.reports[initial["world_size"]] = [initial]

    def cluster_for(n: int) -> RankCluster:
        if n not in clusters:
            clusters[n] = (start_cluster or bench_cluster)(n).start()
            panel.started.append(clusters[n])
        return clusters[n]

    def show(report: dict[str, Any] | None) -> None:
        out.clear_output(wait=True)
        with out:
            if panel.error:
                display(HTML(pre_html(panel.error)))
            if report is not None:
                display(HTML(pre_html(format_table(report), 11)))
                sweep = merge_reports(panel.reports[report["world_size"]])
                display(serve_figure(sweep, title=f"What the saving buys, N = {report['world_size']}: "
                                                  f"{_count(len(sweep['rows_by_budget']), 'budget')} so far"))

    def run(_button: Any = None) -> None:
        panel.error = ""
        report = None
        try:
            n = ranks.value
            report = run_serve_bench(n, preset, workload, budgets=[int(budget.value * 2**20)],
                                     token_budget=token_budget, cluster=cluster_for(n))
            panel.reports.setdefault(n, []).append(report)
        except Exception as e:  # noqa: BLE001 -- shown in the panel, kept in panel.error for callers
            panel.error = f"{type(e).__name__}: {e}"
        panel.runs += 1
        show(report)

    button.on_click(run)
    if initial is not None:
        show(initial)
    return panel


def _count(n: int, noun: str) -> str:
    """``1 budget``, ``3 budgets``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
