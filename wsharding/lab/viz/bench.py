"""Figures of measured benchmarks (``wsharding bench``)."""

from __future__ import annotations

import math
from typing import Any

import plotly.graph_objects as go

#: One color per variant, the same in every figure.
COLORS = {"replicated": "#1f77b4", "sharded": "#2ca02c", "sharded_no_lookahead": "#ff7f0e",
          "sharded_next_step": "#8c564b", "sharded_mapped": "#bcbd22",
          "sharded_mapped_next_step": "#393b79", "fsdp2": "#d62728",
          "sharded_issue_thread": "#98df8a", "sharded_mapped_issue_thread": "#dbdb8d",
          "graph_replicated": "#17becf", "graph_sharded": "#9467bd", "graph_sharded_mapped": "#e377c2",
          "floor_ms": "#7f7f7f"}


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


#: What each variant is called in a figure's legend.
NAMES = {"replicated": "replicated", "sharded": "weight-sharded (eager)", "fsdp2": "FSDP2 (eager)",
         "sharded_no_lookahead": "weight-sharded, lookahead off", "sharded_mapped_next_step":
         "weight-sharded, mapped slots + next-step prefetch", "graph_replicated": "replicated, CUDA graph",
         "graph_sharded": "weight-sharded, CUDA graph", "graph_sharded_mapped": "weight-sharded mapped, CUDA graph",
         "sharded_mapped": "weight-sharded, mapped slots", "floor_ms": "link floor"}
#: The variants the results figure draws when the caller names none.
RESULT_VARIANTS = ("replicated", "sharded", "fsdp2")
#: Font size of labels written on a figure (px): readable at 1280 px wide windows.
LABEL_PX = 13


def log_ticks(low: float, high: float, fmt: str = "{:g}") -> dict[str, list[Any]]:
    """Tick values and texts for a log axis from ``low`` to ``high`` on the 1-2-5 series, written as
    plain numbers (``fmt``): plotly's own log ticks print a lone "5" for 0.5 or 50."""
    vals: list[float] = []
    decade = 10.0 ** math.floor(math.log10(low / 2.5))
    while decade <= high * 10:
        vals += [m * decade for m in (1, 2, 5) if low / 2.5 <= m * decade <= high * 2.5]
        decade *= 10
    return {"tickvals": vals, "ticktext": [fmt.format(v) for v in vals]}


def machine_caption(report: dict[str, Any]) -> str:
    """Where and when a report was measured: the GPUs, the date the report carries, the model and the communicator (emulated runs say so)."""
    world = report.get("world_size", 1)
    emulated = bool(report.get("emulation"))
    where = (f"{world} x {report['device_name']}" if report.get("device_name") and not emulated
             else f"{world} ranks, {report['mode']}")
    when = f", {report['date']}" if report.get("date") else ""
    text = f"{where}{when}, {report.get('model', report.get('preset', ''))}, comm {report.get('comm', '')}"
    return text + (" -- emulated, not GPU timings" if emulated else "")


def results_figure(report: dict[str, Any], variants: tuple[str, ...] = RESULT_VARIANTS) -> go.Figure:
    """Step time against tokens per rank for ``variants`` and the link floor of the same run, both
    axes logarithmic (decode's 1-16 tokens and prefill's 8192 in one picture), ticks in plain
    numbers, the machine and date in the caption; an emulated run says so in the title too."""
    rows = report["rows"]
    fig = go.Figure()
    ys: list[float] = []
    for v in variants:
        pts = [(r["tokens_per_rank"], r[v]) for r in rows if r.get(v)]
        ys += [p[1] for p in pts]
        fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers",
                                 name=NAMES.get(v, v), line={"color": COLORS.get(v), "width": 3},
                                 marker={"size": 9}))
    floors = [(r["tokens_per_rank"], r["floor_ms"]) for r in rows if r.get("floor_ms")]
    if floors:
        ys += [f for _, f in floors]
        fig.add_trace(go.Scatter(x=[t for t, _ in floors], y=[f for _, f in floors], mode="lines",
                                 name="link floor: (N-1)/N of every layer over the measured bus bandwidth",
                                 line={"color": COLORS["floor_ms"], "dash": "dash", "width": 2}))
    xs = [r["tokens_per_rank"] for r in rows]
    fig.update_xaxes(type="log", title="tokens per rank per step", tickvals=xs, ticktext=[f"{x:,}" for x in xs])
    fig.update_yaxes(type="log", title="ms per step", **log_ticks(min(ys), max(ys)))
    fig.update_layout(height=480, font={"size": LABEL_PX},
                      title=("Step time against tokens per rank" + (" -- emulated on CPU ranks, not GPU timings"
                                                                     if report.get("emulation") else "")
                             + f"<br><sub>measured on {machine_caption(report)}</sub>"),
                      legend={"orientation": "h", "y": -0.22, "x": 0}, margin={"t": 80, "b": 130})
    return fig


#: The spread figure's default pair, by what differs between them.
LOOKAHEAD_NAMES = {"sharded": "lookahead on", "sharded_no_lookahead": "lookahead off"}


def spread_figure(report: dict[str, Any], variants: tuple[str, ...] = ("sharded", "sharded_no_lookahead"),
                  names: dict[str, str] | None = None) -> go.Figure:
    """Each variant's step time per tokens per rank as the median of its rounds, the whiskers reaching
    the fastest and the slowest round (``<v>_min``, ``<v>_max``): where two variants' whiskers do not
    overlap, every round of one was faster than every round of the other. Log axes. ``names``: legend
    names by variant (default: lookahead on / off, else the figures' usual names)."""
    names = names or LOOKAHEAD_NAMES
    rows = report["rows"]
    fig = go.Figure()
    ys: list[float] = []
    for k, v in enumerate(variants):
        pts = [r for r in rows if r.get(v)]
        ys += [r[f"{v}_min"] for r in pts] + [r[f"{v}_max"] for r in pts]
        shift = 1 + 0.06 * (k - (len(variants) - 1) / 2)  # side by side on the log axis
        fig.add_trace(go.Scatter(
            x=[r["tokens_per_rank"] * shift for r in pts], y=[r[v] for r in pts], mode="markers", name=names.get(v, NAMES.get(v, v)),
            marker={"color": COLORS.get(v), "size": 10},
            customdata=[[r["tokens_per_rank"], r[f"{v}_min"], r[f"{v}_max"]] for r in pts],
            hovertemplate="%{customdata[0]} tokens: %{y:.2f} ms (rounds %{customdata[1]:.2f} .. %{customdata[2]:.2f})",
            error_y={"type": "data", "symmetric": False, "thickness": 2, "width": 6,
                     "array": [r[f"{v}_max"] - r[v] for r in pts], "arrayminus": [r[v] - r[f"{v}_min"] for r in pts]}))
    xs = [r["tokens_per_rank"] for r in rows]
    fig.update_xaxes(type="log", title="tokens per rank per step", tickvals=xs, ticktext=[f"{x:,}" for x in xs])
    fig.update_yaxes(type="log", title="ms per step",
                     **log_ticks(min(ys), max(ys)))
    fig.update_layout(height=460, font={"size": LABEL_PX}, legend={"orientation": "h", "y": -0.22, "x": 0},
                      margin={"t": 80, "b": 120},
                      title=f"{' against '.join(names.get(v, NAMES.get(v, v)) for v in variants)}, every round"
                            f"<br><sub>dots: the median round; whiskers: the fastest to the slowest round. "
                            f"Measured on {machine_caption(report)}</sub>")
    return fig


def against_figure(report: dict[str, Any], base: str = "replicated",
                   variants: tuple[str, ...] | None = None) -> go.Figure:
    """Each variant's step time divided by ``base`` (``replicated`` or ``floor_ms``), grouped by tokens
    per rank; on a log axis where the ratios span more than 4x (decode's 1.1x and prefill's 13x both
    readable): 1 is the goal line; below the floor is impossible. ``variants``: which to draw (default: all of the report's but ``base``)."""
    fig = go.Figure()
    rows = [r for r in report["rows"] if r.get(base)]
    ratios: list[float] = [1.0]
    for v in variants or report["variants"]:
        if v == base:
            continue
        pts = [(f"{r['tokens_per_rank']:,}", r[v] / r[base]) for r in rows if r.get(v)]
        ratios += [p[1] for p in pts]
        fig.add_trace(go.Bar(x=[p[0] for p in pts], y=[p[1] for p in pts], name=NAMES.get(v, v),
                             marker_color=COLORS.get(v), text=[f"{p[1]:.2f}x" for p in pts],
                             textposition="outside", textfont={"size": LABEL_PX}, cliponaxis=False))
    name = "the link floor" if base == "floor_ms" else base
    # the goal line, named in the legend (a label on the plot would sit on the shortest bars' labels)
    fig.add_hline(y=1, line={"dash": "dot", "color": "#444"})
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", name=f"1x = {name}",
                             line={"dash": "dot", "color": "#444"}))
    if max(ratios) / min(ratios) > 4:  # decode's 1.1x beside prefill's 13x: a log axis keeps both readable
        fig.update_yaxes(type="log", title=f"step time / {name} (log)", **log_ticks(min(ratios), max(ratios), "{:g}x"),
                         range=[math.log10(min(min(ratios), 1.0) / 1.3), math.log10(max(ratios) * 1.6)])
    else:
        fig.update_yaxes(title=f"step time / {name}", range=[0, max(ratios) * 1.15], ticksuffix="x")
    fig.update_layout(barmode="group", height=480, xaxis_title="tokens per rank per step", font={"size": LABEL_PX},
                      title=f"Step time against {name}<br><sub>measured on {machine_caption(report)}</sub>",
                      legend={"orientation": "h", "y": -0.22, "x": 0}, margin={"t": 80, "b": 130})
    return fig


#: The bare-loop measurements of the host-breakdown probe (the planner loop timed without compute, each
#: way of launching the gathers), in drawing order.
HOST_LOOPS = {"direct": "ncclAllGather called per layer", "graph": "gathers launched as graphs",
              "planner_only": "the planner's own Python (gathers do nothing)"}


def _probe_label(probe: dict[str, Any]) -> str:
    """A host probe's machine in a few words (the NCCL version is in the report, not on the axis)."""
    return f"{probe['world_size']} rank(s) on {probe['gpus']} GPU(s), {probe['model']}"


def host_breakdown_figure(probes: dict[str, dict[str, Any]]) -> go.Figure:
    """Host microseconds per sharded layer of the planner loop without compute, one group of bars per
    saved probe (``host_breakdown.py``, by name), one bar per way of launching the gathers."""
    fig = go.Figure()
    names = list(probes)
    for key, words in HOST_LOOPS.items():
        ys = [probes[n]["bare_loop_us_per_layer"].get(key) for n in names]
        fig.add_trace(go.Bar(x=[_probe_label(probes[n]) for n in names], y=ys, name=words,
                             text=[f"{y:.1f}" if y is not None else "" for y in ys], textposition="outside"))
    emulated = any(p.get("emulation") for p in probes.values())
    top = max((v for p in probes.values() for v in p["bare_loop_us_per_layer"].values()), default=1.0)
    fig.update_layout(barmode="group", height=420, yaxis_title="host µs per sharded layer", font={"size": LABEL_PX},
                      legend={"orientation": "h", "y": -0.2, "x": 0}, margin={"b": 110},
                      yaxis_range=[0, top * 1.18],  # room for the labels above the bars
                      title="Host time of the planner and communicator per layer, no compute"
                            + ("<br><sub>ranks sharing one GPU: emulated, not the timings of N GPUs</sub>"
                               if emulated else ""))
    return fig
