"""Figures for the linear contract: which checkpoint rows land on which rank, and rank coordinates."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from wsharding.linear.groups import attn_coords

SHARD_COLORS = {"q": "#4C78A8", "k": "#F58518", "v": "#54A24B"}


def qkv_row_map(plan: dict[str, Any]) -> go.Figure:
    """One horizontal bar per (rank, q/k/v): the checkpoint rows it loads. Replicated K/V heads show as
    bars at the same rows on several ranks. ``plan`` comes from :func:`wsharding.linear.plan.layer_plan`."""
    cfg = plan["config"]
    hs = cfg["head_size"]
    base = {"q": 0, "k": cfg["heads"] * hs, "v": (cfg["heads"] + cfg["kv_heads"]) * hs}
    fig = go.Figure()
    for shard, color in SHARD_COLORS.items():
        rows = [r for r in plan["qkv_rows"] if r["shard"] == shard]
        fig.add_bar(
            orientation="h", name=shard, marker_color=color,
            y=[f"rank {r['rank']}" for r in rows],
            x=[r["checkpoint_rows"][1] - r["checkpoint_rows"][0] for r in rows],
            base=[base[shard] + r["checkpoint_rows"][0] for r in rows],
            customdata=[[*r["checkpoint_rows"], r["replicas"]] for r in rows],
            hovertemplate=f"{shard} rows [%{{customdata[0]}}, %{{customdata[1]}}) x%{{customdata[2]}} replicas<extra></extra>",
        )
    ranks = [f"rank {r}" for r in range(cfg["tp_size"])]
    fig.update_layout(
        barmode="overlay", height=row_map_height(cfg["tp_size"]), font={"size": 13},
        margin={"t": 90, "b": 60, "l": 80, "r": 20},
        title=(f"QKV checkpoint rows per rank<br><sup>H={cfg['heads']} query heads, K={cfg['kv_heads']} KV heads, "
               f"head {hs}, TP={cfg['tp_size']}, attn DP={cfg['attn_dp_size']} (attn TP={cfg['attn_tp_size']})</sup>"),
        xaxis_title="row of the fused [q; k; v] checkpoint weight",
        # every rank labelled (plotly would skip labels of a short axis), the legend above the plot
        yaxis={"autorange": "reversed", "tickmode": "array", "tickvals": ranks, "ticktext": ranks,
               "categoryorder": "array", "categoryarray": ranks},
        legend={"orientation": "h", "x": 1, "xanchor": "right", "y": 1.0, "yanchor": "bottom", "title": "shard"},
    )
    return fig


#: Pixels of the row map's frame (title, legend, x axis) and of one rank's row.
ROW_MAP_FRAME_PX, ROW_MAP_RANK_PX = 170, 34


def row_map_height(tp_size: int) -> int:
    """Height of :func:`qkv_row_map` for ``tp_size`` ranks: one readable row per rank."""
    return ROW_MAP_FRAME_PX + ROW_MAP_RANK_PX * max(tp_size, 2)


def quant_error_heatmap(error: Any, title: str) -> go.Figure:
    """``|dequantised - reference|`` of a weight as a heatmap: rows of the rank's parameter down,
    input columns across (notebook 05 §3)."""
    fig = go.Figure(go.Heatmap(z=error, colorscale="Viridis", colorbar={"title": "abs error"}))
    fig.update_layout(title=title, height=340, font={"size": 13}, xaxis_title="input column",
                      yaxis={"title": "row of the rank's parameter", "autorange": "reversed"})
    return fig


def rank_coords_figure(tp_size: int, attn_cp_size: int = 1, attn_dp_size: int = 1) -> go.Figure:
    """Each TP rank's (dp, cp, tp) coordinates; colour = attention-DP replica, label = attn-TP rank."""
    coords = [attn_coords(r, tp_size=tp_size, attn_cp_size=attn_cp_size, attn_dp_size=attn_dp_size) for r in range(tp_size)]
    fig = go.Figure(go.Heatmap(
        z=[[c[0] for c in coords]], x=[f"g{r}" for r in range(tp_size)], y=["rank"],
        text=[[f"dp{c[0]} cp{c[1]} tp{c[2]}" for c in coords]], texttemplate="%{text}", colorscale="Blues",
        showscale=False,
    ))
    fig.update_layout(height=200, title=f"rank = (dp x cp + cp_rank) x attn_tp + tp_rank; TP={tp_size}, "
                                        f"attn CP={attn_cp_size}, attn DP={attn_dp_size}")
    return fig


#: Pixels of a one-line table row and header, and of a title plus margins: a table figure is given
#: the height of all its rows, so none hides behind a scrollbar.
ROW_PX, HEAD_PX, FRAME_PX = 24, 30, 90


def table_height(rows: int, title: bool = True) -> int:
    """Height in pixels that shows a one-line-per-row plotly table of ``rows`` rows in full."""
    return HEAD_PX + ROW_PX * rows + (FRAME_PX if title else FRAME_PX - 40)


def shapes_table(plan: dict[str, Any]) -> go.Figure:
    """The per-rank shape table of :func:`wsharding.linear.plan.layer_plan` as a plotly table (tall
    enough for every row)."""
    rows = plan["shapes"]
    cols = ["rank", "dp", "linear", "group", "group_rank", "weight", "reduce"]
    values = [[str(r[c]) for r in rows] for c in cols]
    fig = go.Figure(go.Table(header={"values": cols, "height": HEAD_PX - 2}, cells={"values": values, "height": ROW_PX - 2}))
    fig.update_layout(height=table_height(len(rows), title=False), margin={"l": 10, "r": 10, "t": 10, "b": 10})
    return fig


def findings_table(caught: Sequence[tuple[str, str, int]],
                   title: str = "each deliberately broken layer is caught by its check") -> go.Figure:
    """One row per deliberately broken rule (notebook 05 §5): the rule, the linear the finding
    names, and how many findings :func:`wsharding.linear.contract.check_contract` returned."""
    cols = ["broken rule", "linear named", "findings"]
    values = [[str(c[i]) for c in caught] for i in range(len(cols))]
    fig = go.Figure(go.Table(header={"values": cols, "height": HEAD_PX - 2}, cells={"values": values, "height": ROW_PX - 2}))
    fig.update_layout(title=title, height=table_height(len(caught)), margin={"l": 10, "r": 10, "t": 50, "b": 10})
    return fig


def row_error_figure(errors: Mapping[str, float], tolerance: float, title: str, note: str = "") -> go.Figure:
    """Max |split - reference| of each row-parallel case on a log axis, with the fp32 reduction
    tolerance as a dotted line. ``note`` (e.g. the emulation label) goes in a subtitle.

    Zero errors are drawn at 1e-9 (a log axis has no 0). The tolerance's label is an annotation at
    log10(tolerance): ``add_hline``'s own label would be placed at 10**tolerance on a log axis, and
    stretch the axis up to it (flattening the bars).
    """
    names = list(errors)
    fig = go.Figure(go.Bar(x=names, y=[max(v, 1e-9) for v in errors.values()],
                           customdata=list(errors.values()), hovertemplate="%{x}: %{customdata:.3g}<extra></extra>"))
    fig.add_hline(y=tolerance, line_dash="dot")
    fig.add_annotation(x=1, xref="x domain", y=math.log10(tolerance), yref="y", showarrow=False, xanchor="right",
                       yanchor="bottom", text=f"fp32 reduction tolerance {tolerance:g}")
    # one label per decade: plotly's own log ticks label 2 and 5 inside each decade too, crammed
    # into a 400 px figure
    fig.update_layout(title=title + (f"<br><sup>{note}</sup>" if note else ""), height=400,
                      yaxis={"type": "log", "title": "max abs error", "dtick": 1, "exponentformat": "power",
                             "minor": {"ticks": ""}})
    return fig
