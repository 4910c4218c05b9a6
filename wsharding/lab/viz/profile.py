"""The per-stream timeline of one profiled step (notebook 08, ``wsharding bench profile``).

Drawn only from a report of :func:`wsharding.lab.bench.profile.summarize`: nothing here measures.
One lane per rank and stream (per rank and thread on CPU ranks, where there are no streams), plus
the host's lanes (the layers and the planner's calls); bars coloured by class, the interval's name
on hover.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from wsharding.lab.viz.planner import COLORS as PLANNER_COLORS

#: One colour per interval class: the gathers and compute in the planner figures' colours.
COLORS = {"gather": PLANNER_COLORS["gather A"], "compute": PLANNER_COLORS["compute"], "copy": "#54a24b",
          "layer": "#bab0ac", "planner": "#9d755d"}
#: What a legend entry says each class is: short, so that the legend stays on one row at 1280 px
#: (what each class holds is in :mod:`wsharding.lab.bench.profile` and on each bar's hover).
LABELS = {"gather": "gather", "compute": "compute", "copy": "copy", "layer": "host: a layer",
          "planner": "host: a planner call"}
#: Said beside a run on CPU ranks, in the words the other benches use for their lanes.
THREADS_NOTE = "emulation: CPU processes, lanes are threads, not streams"
#: Pixels per lane: a bar and its label stay readable at 1280 px.
LANE_PX = 34
#: Pixels above the lanes: the title, a caption of up to three lines, and the legend (two rows at 1280 px).
TOP_PX = 190


def _caption(report: dict[str, Any]) -> str:
    words = [report.get("device_name", "?"), report.get("mode", "?"), report.get("date", "")]
    head = f"{report.get('preset', '?')}, {report.get('world_size', '?')} ranks, {report.get('tokens', '?')} tokens/rank"
    lines = [f"{head} -- {' · '.join(w for w in words if w)}"]
    if report.get("emulation"):
        lines.append(report["emulation"])
    if report.get("kind") == "threads":
        lines.append(THREADS_NOTE)
    return "<br>".join(lines)


def stream_timeline_figure(report: dict[str, Any], title: str | None = None) -> go.Figure:
    """One lane per (rank, stream) -- (rank, thread) on CPU ranks -- and the host's lanes; bars from
    each interval's start to end in ms from the step's start, coloured by class, hover with the
    kernel's or operator's name; the machine, mode and date in the caption."""
    lanes: list[str] = []
    series: dict[str, dict[str, list[Any]]] = {c: {"y": [], "base": [], "x": [], "text": []} for c in COLORS}
    for r in report["ranks"]:
        names = r["names"]
        for lane in r["lanes"]:
            label = f"rank {r['rank']} · {lane['lane']}"
            lanes.append(label)
            for start, end, cls, name in lane["intervals"]:
                s = series.setdefault(cls, {"y": [], "base": [], "x": [], "text": []})
                s["y"].append(label)
                s["base"].append(start / 1e3)
                s["x"].append(max(end - start, 0.0) / 1e3)
                s["text"].append(f"{names[name]} ({cls})<br>{label}<br>{start / 1e3:.3f}-{end / 1e3:.3f} ms "
                                 f"({(end - start):.1f} us)")
    fig = go.Figure()
    for cls, s in series.items():
        if not s["y"]:
            continue
        fig.add_trace(go.Bar(y=s["y"], x=s["x"], base=s["base"], orientation="h", name=LABELS.get(cls, cls),
                             marker={"color": COLORS.get(cls, "#7f7f7f"), "line": {"width": 0}},
                             hovertext=s["text"], hoverinfo="text", width=0.7))
    step_ms = max((r["step_us"] for r in report["ranks"]), default=0.0) / 1e3
    fig.update_layout(
        title={"text": (title or "One decoder step, per stream, from a real profile")
               + f"<br><sub>{_caption(report)}</sub>", "x": 0.01, "xanchor": "left", "y": 0.985,
               "yref": "container", "yanchor": "top", "pad": {"t": 30}},
        barmode="overlay", height=TOP_PX + LANE_PX * len(lanes) + 70, font={"size": 13},
        margin={"t": TOP_PX, "l": 10, "r": 20, "b": 60},
        legend={"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 0, "font": {"size": 12}},
        xaxis={"title": "time from the step's start (ms)", "range": [0, step_ms * 1.01], "showgrid": True},
        yaxis={"categoryorder": "array", "categoryarray": lanes[::-1], "automargin": True,
               "tickfont": {"size": 12}},
    )
    return fig
