"""The benchmark panel of notebook 08: run ``wsharding bench step`` on the notebook's ranks for the
tokens per rank you choose, and show the table and the step-time figure.

A thin wrapper over :func:`bench_view`, which tests call directly; the work on the ranks is
:func:`wsharding.lab.bench.step.step_bench_rank`, the figure
:func:`wsharding.lab.viz.bench.results_figure`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go
from IPython.display import HTML, display

from wsharding.core.errors import InvalidArgument
from wsharding.lab.bench.step import short_table, step_bench_rank, summarize
from wsharding.lab.cluster import RankCluster
from wsharding.lab.viz.bench import machine_caption, results_figure
from wsharding.lab.widgets import pre_html, run_into

#: The variants the panel times and draws.
PANEL_VARIANTS = ("replicated", "sharded", "fsdp2")


@dataclass
class BenchView:
    """One run of the step benchmark on every rank: its summary and figure."""

    report: dict[str, Any]
    figure: go.Figure

    def text(self) -> str:
        lines = [f"mode: {machine_caption(self.report)}", short_table(self.report, PANEL_VARIANTS)]
        if str(self.report.get("mode", "")).startswith("cpu"):
            lines += side_lines(self.report)
        return "\n".join(lines)


def side_lines(report: dict[str, Any], a: str = "sharded", b: str = "replicated") -> list[str]:
    """Per token count, whether the rounds name a faster side: only where every round of one variant
    beat every round of the other (no overlap of their fastest-to-slowest spans); else noise decides.
    On CPU ranks the table's medians alone read as a result that the next click may turn around."""
    out = []
    for row in report["rows"]:
        if f"{a}_min" not in row or f"{b}_min" not in row:
            continue
        if row[f"{a}_max"] < row[f"{b}_min"]:
            say = f"every round of {a} beat every round of {b}"
        elif row[f"{b}_max"] < row[f"{a}_min"]:
            say = f"every round of {b} beat every round of {a}"
        else:
            say = f"the rounds of {a} and {b} overlap: noise decides which is faster (more timed steps may tell)"
        out.append(f"{row['tokens_per_rank']} tokens/rank: {say}")
    return out


def bench_view(cluster: RankCluster, model: str, tokens: list[int], *, steps: int = 3, repeats: int = 1) -> BenchView:
    """``steps`` timed steps of every variant at each of ``tokens`` per rank, on every rank."""
    if not tokens or min(tokens) < 1:
        raise InvalidArgument(f"tokens: give at least one count >= 1, got {tokens}")
    results = cluster.run(step_bench_rank, model, sorted(set(tokens)), steps=steps, warmup=1, repeats=repeats)
    report = summarize(results, model, "auto")
    return BenchView(report, results_figure(report, variants=PANEL_VARIANTS))


@dataclass
class BenchPanel:
    widget: widgets.Widget
    tokens: widgets.SelectMultiple
    steps: widgets.IntSlider
    run_button: widgets.Button
    view: BenchView | None = None
    error: str = ""
    runs: int = field(default=0)


def build_bench_panel(cluster: RankCluster, model: str, *, tokens: tuple[int, ...] = (1, 16, 256),
                      repeats: int = 1) -> BenchPanel:
    """Tokens per rank (pick several), steps, and a **run benchmark** button."""
    size = {"style": {"description_width": "110px"}}
    pick = widgets.SelectMultiple(options=tokens, value=tokens[:2], description="tokens/rank", rows=len(tokens),
                                  layout=widgets.Layout(width="260px"), **size)
    steps = widgets.IntSlider(value=3, min=1, max=10, description="timed steps", layout=widgets.Layout(width="340px"),
                              **size)
    button = widgets.Button(description="run benchmark", button_style="primary")
    out = widgets.Output()
    panel = BenchPanel(widgets.VBox([widgets.HBox([pick, steps, button], layout=widgets.Layout(flex_flow="row wrap")),
                                     out]), pick, steps, button)

    def show(view: BenchView) -> None:
        display(HTML(pre_html(view.text(), 11)))
        display(view.figure)

    def run(_b: Any = None) -> None:
        run_into(panel, out, lambda: bench_view(cluster, model, list(pick.value), steps=steps.value,
                                                repeats=repeats), show)

    button.on_click(run)
    return panel
