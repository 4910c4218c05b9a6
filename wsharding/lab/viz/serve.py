"""The figure of ``wsharding bench serve`` (notebook 06's last section): what the saving buys.

Drawn only from a report of :func:`wsharding.lab.bench.serve.summarize`: nothing here measures anything.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

COLORS = {"replicated": "#1f77b4", "sharded": "#2ca02c", "sharded_plain": "#98df8a"}

#: Said beside an emulated (CPU) run's throughput: its rank processes share two cores.
NOISE_NOTE = ("CPU ranks, emulated budgets: tokens/s are noise-bound CPU times;<br>"
              "concurrency and tokens per step are exact counts")


def serve_figure(report: dict[str, Any], title: str | None = None) -> go.Figure:
    """Left: concurrent sequences (most at once, solid; mean, dotted) against the budget per rank, both
    variants, with the cost model's prediction (open diamonds): the requests of mean length its pool
    holds, at most the requests there are. Right: output tokens per second per rank against the budget (and tokens per step in the
    hover). The subtitle gives the set-up; a CPU run says its throughput is noise-bound, a time-sliced
    GPU run says so."""
    rows = report["rows_by_budget"]
    unit, scale = ("GiB", 2**30) if rows[-1]["budget_bytes"] >= 2**30 else ("MiB", 2**20)
    x = [r["budget_bytes"] / scale for r in rows]
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                        subplot_titles=("concurrent sequences per rank", "output tokens per second per rank"))
    variants = report.get("variants", ["replicated", "sharded"])
    for v in variants:
        c = COLORS.get(v, "#7f7f7f")
        fig.add_trace(go.Scatter(x=x, y=[r[v]["max_concurrency"] for r in rows], mode="lines+markers",
                                 name=f"{v}: most at once", line={"color": c, "width": 3}, legendgroup=v,
                                 customdata=[[r[v]["pool_tokens"], r[v]["waited_for_memory"]] for r in rows],
                                 hovertemplate="%{y} sequences<br>KV pool %{customdata[0]:,} tokens<br>"
                                               "%{customdata[1]} requests waited for memory<extra></extra>"),
                      row=1, col=1)
        fig.add_trace(go.Scatter(x=x, y=[r[v]["mean_concurrency"] for r in rows], mode="lines",
                                 name=f"{v}: mean", line={"color": c, "dash": "dot"}, legendgroup=v), row=1, col=1)
        fig.add_trace(go.Scatter(x=x, y=[r[v]["tokens_per_s"] for r in rows], mode="lines+markers",
                                 name=f"{v}: tokens/s", line={"color": c, "width": 3}, legendgroup=v, showlegend=False,
                                 customdata=[r[v]["tokens_per_step"] for r in rows],
                                 hovertemplate="%{y:.1f} tokens/s<br>%{customdata:.2f} tokens per step<extra></extra>"),
                      row=1, col=2)
    for v in variants:
        fig.add_trace(go.Scatter(x=x, y=[r["predicted"][v]["concurrency"] for r in rows], mode="markers",
                                 name=f"{v}: pool / mean request (predicted)",
                                 marker={"symbol": "diamond-open", "size": 13, "color": COLORS.get(v, "#7f7f7f"),
                                                                               "line": {"width": 2}}),
                      row=1, col=1)
    setup = (f"{report['mode']}, {report['world_size']} ranks, {report['preset']}, "
             f"{report['workload']['requests']} requests per rank")
    if report.get("device") == "cpu":
        setup += "<br>" + NOISE_NOTE
    elif report.get("emulation"):  # GPU ranks that time-slice one GPU: their times take turns
        setup += f"<br>{report['emulation']}: the ranks' steps take turns, a gather is a copy inside the GPU"
    fig.update_xaxes(title_text=f"memory budget per rank ({unit})")
    fig.update_yaxes(title_text="sequences", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="tokens/s", rangemode="tozero", row=1, col=2)
    fig.update_layout(title={"text": (title or "What the saving buys: the same requests under the same budget")
                             + f"<br><sub>{setup}</sub>", "y": 0.97, "yanchor": "top"},
                      height=540, margin={"t": 140, "b": 150},
                      legend={"orientation": "h", "y": -0.25}, font={"size": 13})
    return fig
