"""Figures of measured benchmarks (``wsharding bench``)."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go


def step_figure(report: dict[str, Any]) -> go.Figure:
    """Step time per variant (the report's ``variants``) across tokens per rank (log-log), labelled
    with the mode."""
    fig = go.Figure()
    xs = [r["tokens_per_rank"] for r in report["rows"]]
    for v in report["variants"]:
        fig.add_trace(go.Scatter(x=xs, y=[r[v] for r in report["rows"]], mode="lines+markers", name=v))
    label = f"{report['mode']}, {report['world_size']} ranks, preset {report['preset']}"
    if report.get("emulation"):
        label += " -- emulated, not GPU timings"
    fig.update_layout(title=f"Step time: replicated vs weight-sharded vs FSDP2 ({label})",
                      xaxis_title="tokens per rank", yaxis_title="ms per step", xaxis_type="log", yaxis_type="log")
    return fig
