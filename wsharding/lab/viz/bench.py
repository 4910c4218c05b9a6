"""Figures of measured benchmarks (``wsharding bench``)."""

from __future__ import annotations

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


def against_figure(report: dict[str, Any], base: str = "replicated") -> go.Figure:
    """Each variant's step time divided by ``base`` (``replicated`` or ``floor_ms``), grouped by tokens
    per rank: 1.0 is the goal line; below the floor is impossible."""
    fig = go.Figure()
    rows = [r for r in report["rows"] if r.get(base)]
    for v in report["variants"]:
        if v == base:
            continue
        pts = [(str(r["tokens_per_rank"]), r[v] / r[base]) for r in rows if v in r]
        fig.add_trace(go.Bar(x=[p[0] for p in pts], y=[p[1] for p in pts], name=v, marker_color=COLORS.get(v),
                             text=[f"{p[1]:.2f}x" for p in pts], textposition="outside"))
    name = "the link floor" if base == "floor_ms" else base
    fig.add_shape(type="line", xref="paper", x0=0, x1=1, y0=1, y1=1, line={"dash": "dot", "color": "#444"})
    fig.update_layout(barmode="group", height=420, xaxis_title="tokens per rank", yaxis_title=f"step / {name}",
                      title=f"Step time against {name} ({report['mode']}, {report['world_size']} ranks, "
                            f"{report.get('model', '')}, comm {report.get('comm', '')})")
    return fig


#: The bare-loop measurements of the host-breakdown probe (the planner loop timed without compute, each
#: way of launching the gathers), in drawing order.
HOST_LOOPS = {"direct": "ncclAllGather called per layer", "graph": "gathers launched as graphs",
              "planner_only": "the planner's own Python (gathers do nothing)"}


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
    fig.update_layout(barmode="group", height=420, yaxis_title="host us per sharded layer",
                      yaxis_range=[0, top * 1.18],  # room for the labels above the bars
                      title="Host time of the planner and communicator per layer, no compute"
                            + ("<br><sub>ranks sharing one GPU: emulated, not the timings of N GPUs</sub>"
                               if emulated else ""))
    return fig


def _probe_label(probe: dict[str, Any]) -> str:
    return (f"{probe['world_size']} rank(s) on {probe['gpus']} GPU(s), NCCL {probe['nccl']['version']}, "
            f"{probe['model']}")


def forward_host_figure(probe: dict[str, Any]) -> go.Figure:
    """What each variant (left) and each single action before a block (right) adds to the replicated
    forward's host time, us per layer: medians of paired calls, whiskers to the quartiles (the report
    of the forward-host probe)."""
    fig = go.Figure()
    for group, key in (("whole forwards", "added_host_us_per_layer"), ("one action before each block",
                                                                      "actions_host_us_per_block")):
        items = probe.get(key, {})
        names = list(items)
        med = [items[n]["median"] for n in names]
        fig.add_trace(go.Bar(
            x=names, y=med, name=group, text=[f"{m:.1f}" for m in med], textposition="outside",
            error_y={"type": "data", "symmetric": False,
                     "array": [items[n]["q3"] - items[n]["median"] for n in names],
                     "arrayminus": [items[n]["median"] - items[n]["q1"] for n in names]}))
    label = (f"{probe['world_size']} rank(s) on {probe['gpus']} GPU(s), {probe['model']}, "
             f"{probe['tokens_per_rank']} tokens, {probe['pairs']} pairs")
    if probe.get("emulation"):
        label += " -- emulated, not the timings of N GPUs"
    fig.update_layout(height=460, yaxis_title="host us per layer over the replicated forward",
                      title=f"What the sharded forward adds to the host, and why<br><sub>{label}</sub>")
    return fig


def planner_calls_figure(reports: dict[str, dict[str, Any]]) -> go.Figure:
    """The planner's and the communicator's own host time inside real forwards (``bench step``'s
    ``planner_calls_*_us_per_layer``), one bar per run, variant and tokens per rank, stacked by call
    where the report split it; a diamond marks the bare planner loop of the same run and variant (no
    compute between the calls). ``reports``: saved ``bench step`` reports by label."""
    prefix, suffix = "planner_calls", "_us_per_layer"
    bars: list[tuple[str, dict[str, float], float | None]] = []  # (x label, us by call, bare loop)
    emulated = False
    for label, report in reports.items():
        emulated = emulated or bool(report.get("emulation"))
        first = report["rows"][0] if report["rows"] else {}
        for key in [k for k in first if k.startswith(prefix) and k.endswith(suffix)]:
            middle = key[len(prefix):-len(suffix)]  # "", "_mapped", "_issue_thread", ...
            bare = report.get(f"planner_host_us_per_layer{middle}")
            for row in report["rows"]:
                split = row.get(f"{key}_by_call") or {"in the forward": row[key]}
                bars.append((f"{label}<br>{middle.strip('_') or 'plain'}, {row['tokens_per_rank']} tok", split, bare))
    fig = go.Figure()
    calls = list(dict.fromkeys(call for _, split, _ in bars for call in split))
    x = [name for name, _, _ in bars]
    for call in calls:
        fig.add_trace(go.Bar(x=x, y=[split.get(call) for _, split, _ in bars], name=call))
    fig.add_trace(go.Scatter(x=[n for n, _, b in bars if b is not None], y=[b for _, _, b in bars if b is not None],
                             mode="markers", name="bare planner loop (no compute)",
                             marker={"symbol": "diamond", "size": 11, "color": "black"}))
    note = " -- ranks time-slicing one GPU: emulated, not the timings of N GPUs" if emulated else ""
    fig.update_layout(barmode="stack", height=500, yaxis_title="host us per sharded layer, on the model's thread",
                      title="The planner's and communicator's own calls, inside real forwards<br><sub>bars: timed "
                            f"inside the forwards; diamonds: the same calls with nothing between them{note}</sub>")
    return fig


def paired_rounds_figure(runs: dict[str, tuple[list[float] | None, list[float] | None, Any]],
                         names: tuple[str, str] = ("lookahead", "no lookahead")) -> go.Figure:
    """One row per run: each round's difference ``a - b`` in ms (dots) and the interval that holds
    their median (the bar). ``runs`` maps a label to the two variants' per-round times and their
    :class:`~wsharding.lab.bench.paired.PairedDifference` (``paired_difference(a, b)``); a run whose
    report kept only the comparison (``bench step`` keeps medians) passes None for both: its bar alone."""
    fig = go.Figure()
    labels = list(runs)
    lows: list[float] = []
    highs: list[float] = []
    for k, label in enumerate(labels):
        a, b, d = runs[label]
        diffs = [x - y for x, y in zip(a, b, strict=True)] if a is not None else []
        fig.add_trace(go.Scatter(x=[d.low_ms, d.high_ms], y=[label, label], mode="lines",
                                 line={"width": 10, "color": COLORS["sharded"] if d.enough_rounds else "#c7c7c7"},
                                 name=f"{d.coverage:.0%} of the median", showlegend=False,
                                 hovertemplate=f"{d.verdict}<extra></extra>"))
        if diffs:
            fig.add_trace(go.Scatter(x=diffs, y=[label] * len(diffs), mode="markers",
                                     marker={"color": COLORS["sharded_no_lookahead"], "size": 8},
                                     name="one round", showlegend=k == 0))
        said = d.verdict.split(" (")[0] if d.enough_rounds else "too few rounds"
        fig.add_annotation(x=d.high_ms, y=label, text=f"  {d.coverage:.0%}: {said}",
                           showarrow=False, xanchor="left", font={"size": 11})
        lows.append(min([d.low_ms, *diffs]))
        highs.append(max([d.high_ms, *diffs]))
    dots = any(t.mode == "markers" for t in fig.data)
    fig.add_vline(x=0, line={"color": COLORS["floor_ms"], "dash": "dash"})
    low, high = min(min(lows, default=-1.0), 0.0), max(max(highs, default=1.0), 0.0)
    span = high - low or 1.0
    fig.update_xaxes(range=[low - 0.1 * span, high + 0.1 * span])
    fig.update_layout(height=140 + 60 * len(labels), xaxis_title=f"{names[0]} - {names[1]} (ms per step, per round)",
                      margin={"l": 240, "r": 300},
                      title=f"{names[0]} against {names[1]}{', round by round' if dots else ''}<br><sub>the bar "
                            "holds the median difference; grey: too few rounds to name a side</sub>")
    return fig
