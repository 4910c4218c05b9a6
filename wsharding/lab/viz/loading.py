"""Figures of loading: which checkpoint rows each rank reads, the finalize redistribution and its
peak, and the quant variants side by side (notebook 04). They draw only what
:func:`wsharding.lab.tasks.loading.load_variant` returned."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from wsharding.core.units import MiB

RANK_COLORS = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2", "#FF9DA6"]
PART_COLORS = {"weights": "#9D755D", "chunks": "#4C78A8", "slots": "#BAB0AC"}


def _label(results: list[dict[str, Any]]) -> str:
    r = results[0]
    return f"{r['world_size']} ranks, {r['mode']}" + (" (emulated)" if r["emulation"] else "")


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
    fig.update_layout(barmode="group", height=160 + 24 * entries * len(results),
                      title=f"Checkpoint rows each rank reads -- layer {layer}, {v['variant']} "
                            f"({', '.join(v['shard_modes'])}), {_label(results)}",
                      xaxis_title="row of the weight", yaxis={"autorange": "reversed"})
    return fig


def finalize_figure(result: dict[str, Any]) -> go.Figure:
    """The redistribution step by step on one rank: bytes held in row shards (or full weights),
    chunks and slots (stacked, from the storages), the measured bytes, and the peak so far."""
    steps = result["finalize_steps"]
    x = [s["stage"] if s["layer"] is None else f"L{s['layer']} {s['stage']}" for s in steps]
    fig = go.Figure()
    names = {"weights": "row shards / full weights", "chunks": "chunks", "slots": "slots (allocated)"}
    for part, color in PART_COLORS.items():
        fig.add_bar(x=x, y=[s[part] / MiB for s in steps], name=names[part], marker_color=color)
    what = "resident set" if result["load_peak"]["device_is_host"] else "allocated"
    fig.add_scatter(x=x, y=[s["measured"] / MiB for s in steps], name=f"measured ({what})", mode="lines+markers",
                    line={"color": "black"})
    fig.add_scatter(x=x, y=[s.get("peak_so_far", s["measured"]) / MiB for s in steps], name="measured peak so far",
                    mode="lines", line={"color": "black", "dash": "dot"})
    bound = (result["formula_bytes"] + result["largest_weight_bytes"]) / MiB
    fig.add_hline(y=bound, line_dash="dash", line_color="#E45756",
                  annotation_text="R/N + padding + 2 slots + one weight")
    fig.add_hline(y=result["replicated_bytes"] / MiB, line_dash="dot", line_color="#9D755D",
                  annotation_text="R (replicated)", annotation_position="bottom right")
    fig.update_layout(barmode="stack", height=420, yaxis_title="MiB",
                      title=f"Finalize on rank {result['rank']}: {result['variant']} "
                            f"({', '.join(result['shard_modes'])}) -- {result['mode']}"
                            + (" (emulated)" if result["emulation"] else ""))
    return fig


def variants_figure(per_variant: dict[str, list[dict[str, Any]]]) -> go.Figure:
    """The variants side by side (rank 0): bytes in the layout vs replicated scales, and the load
    peak vs the resident bytes after finalize."""
    names = list(per_variant)
    r0 = [per_variant[v][0] for v in names]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("bytes per rank: weights in the layout, scales replicated",
                                                        "load peak vs resident after finalize"))
    fig.add_bar(x=names, y=[r["layout_payload_bytes"] / r["world_size"] / MiB for r in r0], name="weights / N (layout)",
                marker_color="#4C78A8", row=1, col=1)
    fig.add_bar(x=names, y=[r["replicated_scale_bytes"] / MiB for r in r0], name="scales (replicated)",
                marker_color="#F58518", row=1, col=1)
    fig.add_bar(x=names, y=[r["load_peak"]["device_peak_bytes"] / MiB for r in r0], name="load peak (measured)",
                marker_color="#E45756", row=1, col=2)
    fig.add_bar(x=names, y=[r["resident_bytes"] / MiB for r in r0], name="resident (chunks + slots)",
                marker_color="#54A24B", row=1, col=2)
    fig.add_bar(x=names, y=[r["replicated_bytes"] / MiB for r in r0], name="R (replicated weights)",
                marker_color="#BAB0AC", row=1, col=2)
    fig.update_layout(barmode="group", height=420, yaxis_title="MiB",
                      title=f"Quant variants side by side -- {_label(r0)}")
    return fig
