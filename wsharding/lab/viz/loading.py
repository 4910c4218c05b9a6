"""Figures of loading: which checkpoint rows each rank reads, the finalize redistribution and its
peak, and the quant variants side by side (notebook 04). They draw only what
:func:`wsharding.lab.tasks.loading.load_variant` returned.

Two kinds of byte counts appear, and every figure says which one it draws:

* **held (allocated)**: the bytes of the storages that hold sharded weights (row shards or full
  weights, chunks, slots), read from the tensors themselves -- exact, the same on every run;
* **measured**: what the device reports -- the CUDA allocator on GPUs, the process's resident set on
  CPU ranks. A resident set counts only pages that were written, and also the process's own
  allocations, so on CPU ranks it can sit below the held bytes (a slot not yet filled) or above
  them (small models, where the process's noise dominates).
"""

from __future__ import annotations

import math
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from wsharding.core.units import KiB, MiB
from wsharding.lab.tasks.loading import held_peak_bytes

RANK_COLORS = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2", "#FF9DA6"]
PART_COLORS = {"weights": "#9D755D", "chunks": "#4C78A8", "slots": "#BAB0AC"}
BOUND_COLOR, R_COLOR = "#E45756", "#7F7F7F"
FONT = {"size": 13}


def _label(results: list[dict[str, Any]]) -> str:
    r = results[0]
    return f"{r['world_size']} ranks, {r['mode']}" + (" (emulated)" if r["emulation"] else "")


def measured_note(result: dict[str, Any]) -> str:
    """What the measured number is on this run's device, for a figure's subtitle (broken in two
    lines where one would run past a notebook's output width)."""
    if result["load_peak"]["device_is_host"]:
        return ("measured = the rank process's resident set: only written pages count,<br>"
                "and the process's own allocations too (noise for small models)")
    return "measured = bytes allocated on the GPU (torch's allocator plus NCCL's windows)"


def _scale_top(held_mib: list[float], measured_mib: list[float]) -> tuple[float, bool]:
    """The y axis' top for held bytes and measured ones: a measured value more than twice the held
    scale is process noise (small models on CPU ranks), and is left off the scale rather than
    squashing the bars. Returns ``(top, measured_off_scale)``."""
    held_top = max(held_mib)
    off = max(measured_mib) > 2 * held_top
    return 1.15 * (held_top if off else max(held_top, *measured_mib)), off


def row_reads_figure(results: list[dict[str, Any]], layer: int | None = None) -> go.Figure:
    """One bar per (weight, rank): the rows of the checkpoint tensor that rank read. Row-shard
    loading gives each rank its own 1/N; requant-then-shard has every rank read every row."""
    layer = results[0]["reads"][0]["layer"] if layer is None else layer
    fig = go.Figure()
    for r in results:
        reads = [x for x in r["reads"] if x["layer"] == layer]
        for x in reads:
            lo, hi = x["window"]
            fig.add_bar(orientation="h", y=[x["entry"]], x=[hi - lo], base=[lo], offsetgroup=r["rank"],
                        name=f"rank {r['rank']}", legendgroup=f"rank {r['rank']}", showlegend=x is reads[0],
                        marker_color=RANK_COLORS[r["rank"] % len(RANK_COLORS)],
                        hovertemplate=(f"rank {r['rank']}: rows [{lo}, {hi}) of {x['rows']}, "
                                       f"{x['loaded_rows'] * x['row_bytes']} B read<extra></extra>"))
    v = results[0]
    entries = len({x["entry"] for x in v["reads"] if x["layer"] == layer})
    fig.update_layout(barmode="group", height=180 + 16 * entries * len(results), font=FONT,
                      title=f"Checkpoint rows each rank reads: layer {layer}, {v['variant']} "
                            f"({', '.join(v['shard_modes'])})<br><sup>{_label(results)}</sup>",
                      xaxis_title="row of the checkpoint weight", yaxis={"autorange": "reversed", "title": "weight"},
                      legend={"traceorder": "normal"})
    return fig


def finalize_figure(result: dict[str, Any]) -> go.Figure:
    """The redistribution step by step on one rank: bytes held in row shards (or full weights),
    chunks and slots (stacked, from the storages), the measured bytes, and two reference lines in
    the legend: the bound on the peak and R, what a replicated rank holds."""
    steps = result["finalize_steps"]
    x = [s["stage"] if s["layer"] is None else f"L{s['layer']} {s['stage']}" for s in steps]
    fig = go.Figure()
    names = {"weights": "held: row shards / full weights", "chunks": "held: chunks", "slots": "held: slots"}
    for part, color in PART_COLORS.items():
        fig.add_bar(x=x, y=[s[part] / MiB for s in steps], name=names[part], marker_color=color)
    fig.add_scatter(x=x, y=[s["measured"] / MiB for s in steps], name="measured now", mode="lines+markers",
                    line={"color": "black"})
    fig.add_scatter(x=x, y=[s.get("peak_so_far", s["measured"]) / MiB for s in steps], name="measured peak so far",
                    mode="lines", line={"color": "black", "dash": "dot"})
    # reference lines as traces (not shapes) so that the legend names each one beside its own style
    bound = (result["formula_bytes"] + result["largest_weight_bytes"]) / MiB
    fig.add_scatter(x=x, y=[bound] * len(x), mode="lines", line={"color": BOUND_COLOR, "dash": "dash", "width": 2},
                    name="bound: R/N + padding/N<br>+ 2 slots + one weight", hoverinfo="name+y")
    fig.add_scatter(x=x, y=[result["replicated_bytes"] / MiB] * len(x), mode="lines",
                    line={"color": R_COLOR, "dash": "dashdot", "width": 2}, name="R: a replicated rank's weights",
                    hoverinfo="name+y")
    top, off = _scale_top([bound, result["replicated_bytes"] / MiB] + [sum(s[k] for k in PART_COLORS) / MiB
                                                                       for s in steps],
                          [s.get("peak_so_far", s["measured"]) / MiB for s in steps])
    fig.update_yaxes(range=[0, top])
    # Said in the subtitle, not inside the plot: there it would sit on the lines it speaks of, and
    # run wider than the plot at 1280 px (the legend beside takes ~280 px).
    note = measured_note(result) + ("<br>the measured lines run off the scale: at these sizes process noise "
                                    "dominates them" if off else "")
    # the legend beside the plot: below it, it would collide with the rotated step names, and above
    # it, with the title's lines
    fig.update_layout(barmode="stack", height=600 + (20 if off else 0), font=FONT, yaxis_title="MiB on this rank",
                      xaxis_title="step of load + finalize (L = layer)",
                      legend={"orientation": "v", "x": 1.02, "xanchor": "left", "y": 1, "yanchor": "top"},
                      margin={"t": 130 + (20 if off else 0), "r": 20},
                      title={"text": f"Finalize on rank {result['rank']}: {result['variant']} "
                                     f"({', '.join(result['shard_modes'])}), {_label([result])}"
                                     f"<br><sup>{note}</sup>"})
    return fig


def _byte_ticks(lo: float, hi: float) -> tuple[list[float], list[str]]:
    """Tick values and plain labels ("32 B", "1 KiB", "32 MiB") for a log axis in bytes."""
    vals, text = [], []
    for unit, name in ((1, "B"), (KiB, "KiB"), (MiB, "MiB"), (1024 * MiB, "GiB")):
        for m in (1, 32):
            v = unit * m
            if lo / 32 <= v <= hi * 32:
                vals.append(v)
                text.append(f"{m} {name}")
    return vals, text


def variants_figure(per_variant: dict[str, list[dict[str, Any]]]) -> go.Figure:
    """The variants side by side (rank 0). Left: bytes per rank in the layout (the weights' 1/N) and
    the replicated scales, on a log axis (scales are bytes to KiB, weights MiB), each bar labelled.
    Right, like with like (all held = allocated bytes, from the storages): the peak held during
    load + finalize, the resident bytes after finalize, and R; the measured peak as a marker."""
    names = list(per_variant)
    r0 = [per_variant[v][0] for v in names]
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                        subplot_titles=("per rank: weights in the layout vs replicated scales",
                                        "peak while loading vs resident after (held bytes)"))
    weights = [r["layout_payload_bytes"] / r["world_size"] for r in r0]
    scales = [r["replicated_scale_bytes"] for r in r0]
    fig.add_bar(x=names, y=weights, name="weights / N (in the layout)", marker_color="#4C78A8", row=1, col=1,
                text=[f"{w / MiB:.1f} MiB" if w >= MiB else f"{w / KiB:.0f} KiB" for w in weights],
                textposition="outside", textfont={"size": 12}, cliponaxis=False, constraintext="none", legendgroup="left")
    fig.add_bar(x=names, y=[s if s else None for s in scales], name="scales (replicated, outside the layout)",
                marker_color="#F58518", row=1, col=1, legendgroup="left",
                text=[(f"{s / KiB:.1f} KiB" if s >= KiB else f"{s} B") for s in scales], textposition="outside",
                textfont={"size": 12}, cliponaxis=False, constraintext="none")
    positive = [v for v in weights + scales if v]
    for i, s in enumerate(scales):
        if not s:
            fig.add_annotation(x=names[i], y=math.log10(min(positive)) - 0.45, xref="x", yref="y", text="no scales",
                               showarrow=False, xshift=18, yanchor="bottom", textangle=-90, font={"size": 11})
    # room left of the first bars: their labels ("20.6 MiB"), wider than a bar, sat on the tick labels
    fig.update_xaxes(range=[-0.9, len(names) - 0.4], row=1, col=1)
    vals, text = _byte_ticks(min(positive), max(positive))
    fig.update_yaxes(type="log", tickvals=vals, ticktext=text, title_text="bytes per rank (log)",
                     range=[math.log10(min(positive)) - 0.5, math.log10(max(positive)) + 0.8], row=1, col=1)
    peaks = [held_peak_bytes(r) / MiB for r in r0]
    fig.add_bar(x=names, y=peaks, name="peak held during load + finalize", marker_color="#E45756", row=1, col=2)
    fig.add_bar(x=names, y=[r["resident_bytes"] / MiB for r in r0], name="resident after finalize (chunks + slots)",
                marker_color="#54A24B", row=1, col=2)
    fig.add_bar(x=names, y=[r["replicated_bytes"] / MiB for r in r0], name="R (a replicated rank's weights)",
                marker_color="#BAB0AC", row=1, col=2)
    fig.add_scatter(x=names, y=[r["load_peak"]["device_peak_bytes"] / MiB for r in r0], mode="markers",
                    marker={"symbol": "diamond", "size": 11, "color": "black"}, name="measured peak", row=1, col=2)
    measured = [r["load_peak"]["device_peak_bytes"] / MiB for r in r0]
    top, off = _scale_top(peaks + [r["replicated_bytes"] / MiB for r in r0], measured)
    fig.update_yaxes(title_text="MiB per rank", range=[0, top], row=1, col=2)
    # the off-scale note in the subtitle: inside the right plot it sat on its top tick and ran wider
    # than the plot at 1280 px
    note = measured_note(r0[0]) + ("<br>the measured peaks (diamonds) run off the right scale: process noise "
                                   "at these sizes" if off else "")
    fig.update_layout(barmode="group", height=540 + (20 if off else 0), font=FONT,
                      legend={"orientation": "h", "y": -0.15, "yanchor": "top", "x": 0},
                      margin={"b": 150, "t": 150 + (20 if off else 0)},
                      title=f"Quant variants side by side: rank 0, {_label(r0)}<br><sup>{note}</sup>")
    return fig
