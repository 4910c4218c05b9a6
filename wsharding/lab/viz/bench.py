"""Figures of measured benchmarks (``wsharding bench``)."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

#: One color per variant, the same in every figure.
COLORS = {"replicated": "#1f77b4", "sharded": "#2ca02c", "sharded_no_lookahead": "#ff7f0e", "fsdp2": "#d62728",
          "graph_replicated": "#17becf", "graph_sharded": "#9467bd", "floor_ms": "#7f7f7f"}


def step_figure(report: dict[str, Any]) -> go.Figure:
    """Step time per variant (the report's ``variants``) across tokens per rank, the link floor of the
    same run dashed, log-log, labelled with the mode."""
    fig = go.Figure()
    rows = report["rows"]
    xs = [r["tokens_per_rank"] for r in rows]
    for v in report["variants"]:
        pts = [(r["tokens_per_rank"], r[v]) for r in rows if v in r]
        fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers", name=v,
                                 line={"color": COLORS.get(v)}))
    if any(r.get("floor_ms") for r in rows):
        fig.add_trace(go.Scatter(x=xs, y=[r["floor_ms"] for r in rows], mode="lines", name="link floor",
                                 line={"color": COLORS["floor_ms"], "dash": "dash"}))
    label = f"{report['mode']}, {report['world_size']} ranks, {report.get('model', report.get('preset'))}"
    if report.get("emulation"):
        label += " -- emulated, not GPU timings"
    fig.update_layout(title=f"Step time: replicated vs weight-sharded vs FSDP2<br><sub>{label}</sub>",
                      xaxis_title="tokens per rank", yaxis_title="ms per step", xaxis_type="log", yaxis_type="log",
                      height=460)
    return fig
