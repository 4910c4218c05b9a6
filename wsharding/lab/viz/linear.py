"""Figures for the linear contract: which checkpoint rows land on which rank, and rank coordinates."""

from __future__ import annotations

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
    fig.update_layout(
        barmode="overlay", height=120 + 28 * cfg["tp_size"],
        title=(f"QKV checkpoint rows per rank: H={cfg['heads']}, K={cfg['kv_heads']}, head {hs}, "
               f"TP={cfg['tp_size']}, attn DP={cfg['attn_dp_size']} (attn TP={cfg['attn_tp_size']})"),
        xaxis_title="row of the fused [q; k; v] checkpoint", yaxis={"autorange": "reversed"},
    )
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


def shapes_table(plan: dict[str, Any]) -> go.Figure:
    """The per-rank shape table of :func:`wsharding.linear.plan.layer_plan` as a plotly table."""
    rows = plan["shapes"]
    cols = ["rank", "dp", "linear", "group", "group_rank", "weight", "reduce"]
    values = [[str(r[c]) for r in rows] for c in cols]
    return go.Figure(go.Table(header={"values": cols}, cells={"values": values}))
