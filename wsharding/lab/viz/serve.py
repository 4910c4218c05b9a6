"""The figures of ``wsharding bench serve``: what the saving buys, as goodput under SLOs.

Drawn only from a report of :func:`wsharding.lab.bench.serve_report.summarize`: nothing here
measures anything. Every figure states the SLO and, for CPU ranks or a time-sliced GPU, says so.
"""

from __future__ import annotations

import math
import textwrap
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

COLORS = {"replicated": "#1f77b4", "sharded": "#2ca02c", "sharded_plain": "#98df8a"}

#: Said beside a run on CPU ranks (the first words are the test's handle).
NOISE_NOTE = "CPU ranks, emulated budgets: times are CPU times on shared cores; token and block counts are exact"


def rate_label(rate: float | None) -> str:
    return "all at once" if rate is None else f"{rate:g}/s"


#: Characters per subtitle line: a GPU run's set-up is one long sentence, cut at the figure's edge in
#: a notebook's output area if it is not broken (``tests/lab/test_browser.py`` checks every label).
SUBTITLE_WIDTH = 95


def _setup(report: dict[str, Any]) -> str:
    text = (f"{report['mode']}, {report['world_size']} ranks, {report['preset']}, {report['workload_text']}, "
            f"{report['trials']} trial(s) per point (95 % intervals)")
    lines = [text, NOISE_NOTE] if report["device"] == "cpu" else [text, *report["notes"]]
    return "<br>".join(part for line in lines for part in textwrap.wrap(line, SUBTITLE_WIDTH))


def _budget_title(report: dict[str, Any], row: dict[str, Any]) -> str:
    unit, scale = ("GiB", 2**30) if row["budget_bytes"] >= 2**30 else ("MiB", 2**20)
    return (f"budget {row['budget_bytes'] / scale:,.2f} {unit}/rank: KV pool "
            f"{row['replicated']['kv_share']:.0%} replicated, {row['sharded']['kv_share']:.0%} sharded")


def goodput_figure(report: dict[str, Any], title: str | None = None) -> go.Figure:
    """Goodput (requests per second per rank that met every SLO) against the request rate, both
    variants, one panel per budget, with 95 % intervals over trials; goodput is counted over the
    arrival window common to both, so two variants that met the SLO for every request coincide. A
    dotted line marks the highest rate each variant sustains (SLO attainment at least the target at it
    and every lower rate); an open marker is a point that proves no rate (judged for the pair: a
    variant met the SLO there while most of its time measured was the drain). The SLO is stated in the
    title. A rate of "all at once" is drawn right of the others."""
    rows = report["rows_by_budget"]
    rates = report["rates"]
    finite = [r for r in rates if r is not None]
    at_once = (max(finite) * 2 if finite else 1.0)
    xs = [at_once if r is None else r for r in rates]
    fig = make_subplots(rows=1, cols=len(rows), subplot_titles=[_budget_title(report, r) for r in rows],
                        horizontal_spacing=0.08)
    for col, row in enumerate(rows, start=1):
        for v in report["variants"]:
            c = COLORS.get(v, "#7f7f7f")
            pts = row["points"]
            y = [p[v]["goodput"]["mean"] if "goodput" in p[v] else None for p in pts]
            err = [(p[v]["goodput"]["half"] or 0.0) if "goodput" in p[v] else 0.0 for p in pts]
            met = [p[v]["attainment"]["mean"] if "attainment" in p[v] else None for p in pts]
            ok = row["answer"]["steady"]  # judged for the pair: the same for both variants
            fig.add_trace(go.Scatter(x=xs, y=y, mode="lines+markers", name=v, legendgroup=v, showlegend=col == 1,
                                     line={"color": c, "width": 3}, error_y={"type": "data", "array": err, "visible": True},
                                     marker={"size": 10, "symbol": ["circle" if k else "circle-open" for k in ok]},
                                     customdata=[[rate_label(r), m if m is not None else math.nan,
                                                  "" if k else "<br>NOT a steady state (mostly the drain): proves no rate"
                                                  ]
                                                 for r, m, k in zip(rates, met, ok, strict=True)],
                                     hovertemplate=v + " at %{customdata[0]}: goodput %{y:.2f}/s<br>"
                                                   "SLO met by %{customdata[1]:.0%}%{customdata[2]}<extra></extra>"),
                          row=1, col=col)
            best = ((row["answer"]["brackets"] or {}).get(v) or {}).get("sustained")
            if best is not None:
                fig.add_vline(x=best, line={"color": c, "dash": "dot"}, row=1, col=col)
        fig.add_trace(go.Scatter(x=xs, y=xs, mode="lines", name="goodput = rate (every request met the SLO)",
                                 line={"color": "#bbbbbb", "dash": "dash"}, showlegend=col == 1), row=1, col=col)
    fig.update_xaxes(title_text="request rate per rank (req/s)", type="log",
                     tickvals=xs, ticktext=[rate_label(r) for r in rates])
    fig.update_yaxes(title_text="goodput per rank (req/s)", rangemode="tozero", col=1)
    slo = report.get("slo_text") or "no SLO given"
    setup = _setup(report)
    # the subtitle's lines (workload, then each note) sit above the panel titles: the top margin grows with them
    top = 110 + 22 * (setup.count("<br>") + 1)
    fig.update_layout(title={"text": (title or f"Goodput within the SLO: {slo}") + f"<br><sub>{setup}</sub>",
                             "y": 0.97, "yanchor": "top"},
                      height=410 + top, margin={"t": top, "b": 150}, font={"size": 13},
                      # below the x-axis title, not over it (its title sits about 0.15 of the plot below the axis)
                      legend={"orientation": "h", "y": -0.3, "yanchor": "top"})
    return fig


def serve_figure(report: dict[str, Any], title: str | None = None) -> go.Figure:
    """Per budget: left, the most requests served at once (both variants); right, output tokens per
    second per rank at the sweep's highest rate. The serving panel's figure, a sweep of budgets."""
    rows = report["rows_by_budget"]
    unit, scale = ("GiB", 2**30) if rows[-1]["budget_bytes"] >= 2**30 else ("MiB", 2**20)
    x = [r["budget_bytes"] / scale for r in rows]
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                        subplot_titles=("requests running at once, most", "output tokens/s per rank, highest rate"))
    for v in report["variants"]:
        c = COLORS.get(v, "#7f7f7f")
        fig.add_trace(go.Scatter(x=x, y=[r[v]["max_concurrency"] for r in rows], mode="lines+markers", name=v,
                                 line={"color": c, "width": 3}, legendgroup=v,
                                 customdata=[[r[v]["pool_tokens"], r[v]["kv_share"], r[v]["preemptions"]] for r in rows],
                                 hovertemplate="%{y} requests<br>KV pool %{customdata[0]:,} tokens "
                                               "(%{customdata[1]:.0%} of the budget)<br>%{customdata[2]} preemptions"
                                               "<extra></extra>"), row=1, col=1)
        fig.add_trace(go.Scatter(x=x, y=[r["points"][-1][v]["output_throughput"]["mean"] for r in rows],
                                 mode="lines+markers", name=f"{v}: tokens/s", line={"color": c, "width": 3},
                                 legendgroup=v, showlegend=False), row=1, col=2)
    fig.update_xaxes(title_text=f"memory budget per rank ({unit})")
    fig.update_yaxes(rangemode="tozero")
    fig.update_layout(title={"text": (title or "What the saving buys: the same requests under the same budget")
                             + f"<br><sub>{_setup(report)}</sub>", "y": 0.97, "yanchor": "top"},
                      height=560, margin={"t": 150, "b": 160}, font={"size": 13},
                      legend={"orientation": "h", "y": -0.3, "yanchor": "top"})
    return fig


def crossover_figure(report: dict[str, Any], title: str | None = None) -> go.Figure:
    """The crossover: the ratio of sustained rates (sharded / replicated) against the pool ratio
    (sharded pool tokens / replicated), one marker per budget of the sweep (a triangle up: a lower
    bound, the sharded variant passed every rate; down: an upper bound), beside the cost model's
    lines -- pool ratio / step-time ratio where the replicated pool limits, 1 / step-time ratio where
    compute does -- the step-time ratio measured in the same run. Hover says each point's regime."""
    items = [c for c in report["crossover"] if c["variant"] == "sharded"]
    fig = go.Figure()
    pools = [c["pool_ratio"] for c in items]
    steps = [c["step_time_ratio"] for c in items if c["step_time_ratio"]]
    step = sum(steps) / len(steps) if steps else None
    if step:
        xs = sorted({1.0, *pools, max(pools) * 1.1})
        fig.add_trace(go.Scatter(x=xs, y=[x / step for x in xs], mode="lines",
                                 name=f"cost model, pool-limited: pool ratio / step-time ratio ({step:.2f})",
                                 line={"color": "#d62728", "dash": "dash"}))
        fig.add_trace(go.Scatter(x=xs, y=[1 / step] * len(xs), mode="lines",
                                 name="cost model, compute-limited: 1 / step-time ratio",
                                 line={"color": "#7f7f7f", "dash": "dot"}))
    told = [c for c in items if c["ratio"] is not None]
    symbol = {"exact": "circle", "lower": "triangle-up", "upper": "triangle-down"}
    fig.add_trace(go.Scatter(
        x=[c["pool_ratio"] for c in told], y=[c["ratio"] for c in told], mode="markers",
        name="measured: sustained rate sharded / replicated", marker={"size": 14, "color": COLORS["sharded"],
                                                                     "symbol": [symbol[c["bound"]] for c in told]},
        customdata=[[f"{c['kv_share']:.0%}", c["regime"], c["bound"]] for c in told],
        hovertemplate="replicated KV share %{customdata[0]}: pool ratio %{x:.2f}, rate ratio %{y:.2f} "
                      "(%{customdata[2]})<br>%{customdata[1]}<extra></extra>"))
    untold = [c for c in items if c["ratio"] is None]
    if untold:
        fig.add_trace(go.Scatter(x=[c["pool_ratio"] for c in untold], y=[1.0] * len(untold), mode="markers",
                                 name="not told (a variant's rate not bracketed by the sweep)",
                                 marker={"size": 12, "symbol": "x-open", "color": "#7f7f7f"}))
    fig.add_hline(y=1.0, line={"color": "#bbbbbb"})
    fig.update_xaxes(title_text="pool ratio: sharded KV pool tokens / replicated", type="log")
    fig.update_yaxes(title_text="sustained rate, sharded / replicated", rangemode="tozero")
    fig.update_layout(title={"text": (title or "Where sharding starts to win: the crossover")
                             + f"<br><sub>{_setup(report)}</sub>", "y": 0.97, "yanchor": "top"},
                      height=560, margin={"t": 150, "b": 160}, font={"size": 13},
                      legend={"orientation": "h", "y": -0.3, "yanchor": "top"})
    return fig


def kv_figure(report: dict[str, Any], point: int = -1, title: str | None = None) -> go.Figure:
    """KV blocks in use over time, as a share of each variant's pool: one panel per budget, at the
    sweep's ``point`` (default its highest rate), rank 0's first trial, both variants -- a pool that sits
    at 100 % is the limit (the report's regime says so by its waits and preemptions)."""
    rows = report["rows_by_budget"]
    fig = make_subplots(rows=1, cols=len(rows), subplot_titles=[_budget_title(report, r) for r in rows],
                        horizontal_spacing=0.08)
    for col, row in enumerate(rows, start=1):
        p = row["points"][point]
        for v in report["variants"]:
            trace = next((k for k in p[v]["kv_blocks"] if k["trial"] == 0 and k["rank"] == 0), None)
            if trace is None:
                continue
            pool = row[v]["pool_blocks"]
            fig.add_trace(go.Scatter(x=trace["t"], y=[b / pool for b in trace["blocks"]], mode="lines", name=v,
                                     legendgroup=v, showlegend=col == 1, line={"color": COLORS.get(v, "#7f7f7f"),
                                                                               "width": 2, "shape": "hv"},
                                     hovertemplate=v + ": %{y:.0%} of " + f"{pool} blocks at " + "%{x:.2f} s"
                                                   "<extra></extra>"), row=1, col=col)
    fig.update_xaxes(title_text="seconds since the run's start")
    fig.update_yaxes(title_text="KV blocks in use (share of the pool)", tickformat=".0%", range=[0, 1.05], col=1)
    rate = rate_label(rows[0]["points"][point]["rate"])
    fig.update_layout(title={"text": (title or f"KV blocks in use at {rate} per rank (rank 0, first trial)")
                             + f"<br><sub>{_setup(report)}</sub>", "y": 0.97, "yanchor": "top"},
                      height=560, margin={"t": 170, "b": 150}, font={"size": 13},
                      legend={"orientation": "h", "y": -0.3, "yanchor": "top"})
    return fig
