"""The serve figures keep their legends below the x-axis title (at y -0.2 the legend sat on it at
1280 px), and the panel counts its budgets in words that agree with the number."""

from __future__ import annotations

from pathlib import Path

from wsharding.lab.bench.serve import read_serve_report
from wsharding.lab.viz.serve import goodput_figure, serve_figure
from wsharding.lab.widgets.serve import _count

SAVED = Path(__file__).parents[2] / "docs" / "measurements" / "cpu-2026-12-05" / "bench_serve_tiny-deep_2ranks_gloo.json"


def test_legends_sit_below_the_x_axis_title():
    report = read_serve_report(SAVED)
    for fig in (goodput_figure(report), serve_figure(report, title="t")):
        legend = fig.layout.legend
        assert legend.y <= -0.3 and legend.yanchor == "top" and fig.layout.margin.b >= 150


def test_the_panel_counts_budgets_in_agreeing_words():
    assert (_count(1, "budget"), _count(3, "budget")) == ("1 budget", "3 budgets")
