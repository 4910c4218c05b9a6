"""Figures of the draft model's first-layer prefetch (notebook 03 section 7, ``wsharding bench draft``).

Drawn only from a report of :func:`wsharding.lab.bench.draft.summarize` (or a rank result of
:func:`wsharding.lab.tasks.draft.draft_exposed`): nothing here measures anything.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

#: One colour per way of gathering the draft's first layer.
COLORS = {"dedicated": "#2ca02c", "shared": "#ff7f0e", "inline": "#d62728"}

#: Said beside the figure of an emulated (CPU) run: its exposed times are a few hundred µs that a
#: descheduled rank process can change by milliseconds.
NOISE_NOTE = ("emulated, not GPU timings: noise-bound -- a rank descheduled for a moment moves a bar by milliseconds; "
              "compare runs, not single values")


def draft_exposed_figure(report: dict[str, Any], title: str | None = None) -> go.Figure:
    """Exposed time of the draft's first-layer gather per mode (bars: slowest rank's median; dots: each
    rank), the step time in the bar's label, the mode and region in the subtitle; an emulated run
    says beside it that its times are noise-bound (:data:`NOISE_NOTE`)."""
    rows = report["rows"]
    modes = [r["mode"] for r in rows]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=modes, y=[r["exposed_us"] for r in rows], name="slowest rank (median)",
                         marker_color=[COLORS.get(m, "#7f7f7f") for m in modes],
                         text=[f"step {r['step_ms']:.2f} ms" for r in rows], textposition="outside"))
    xs, ys = [], []
    for r in rows:
        for v in r.get("exposed_us_per_rank", []):
            xs.append(r["mode"])
            ys.append(v)
    if xs:
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", name="each rank (median)",
                                 marker={"color": "#333", "size": 7, "symbol": "diamond"}))
    label = f"{report['mode']}, {report['world_size']} ranks, first layer {report['first_layer_bytes'] / 2**20:.2f} MiB"
    if report.get("emulation"):
        label += "<br>" + NOISE_NOTE
    fig.update_layout(
        title=(title or "Draft model, layer 0: exposed gather time") + f"<br><sub>{label}<br>{report['region']}</sub>",
        xaxis_title="how the draft's first layer is gathered", yaxis_title="exposed us (compute waits)",
        height=520, margin={"t": 150}, legend={"orientation": "h", "y": -0.2})
    return fig
