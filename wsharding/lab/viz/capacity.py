"""Figures of shard groups and of what the saving buys (notebook 06 sections 5 and 6, notebook 07 section 1).

Drawn only from what rank tasks returned (:func:`wsharding.models.equality.model_equality`,
:func:`wsharding.lab.tasks.kv.kv_capacity_now`) or from the cost model's
:meth:`~wsharding.costmodel.Plan.kv_capacity`: nothing here measures or computes a new number.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

COLORS = {"replicated": "#1f77b4", "sharded": "#2ca02c"}
#: The color of a loss (sharding holds more than the replicated model).
LOSS_COLOR = "#d62728"
GROUP_COLORS = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2"]


def groups_figure(by_group_size: Mapping[int, Sequence[Mapping[str, Any]]], title: str = "") -> go.Figure:
    """Resident bytes of the sharded weights per rank, one bar group per shard-group size
    (``by_group_size[g]``: every rank's ``model_equality`` result, which carries ``group`` and
    ``resident_bytes``), the replicated bytes R dashed. The hover names each rank's group."""
    fig = go.Figure()
    replicated = None
    for k, (g, results) in enumerate(sorted(by_group_size.items())):
        rs = sorted(results, key=lambda r: r["rank"])
        fig.add_trace(go.Bar(
            x=[f"rank {r['rank']}" for r in rs], y=[r["resident_bytes"] / 2**10 for r in rs],
            name=f"groups of {g}", marker_color=GROUP_COLORS[k % len(GROUP_COLORS)],
            customdata=[str(r["group"]) for r in rs],
            hovertemplate="%{x}, group %{customdata}: %{y:.1f} KiB<extra>groups of " + str(g) + "</extra>"))
        replicated = rs[0]["replicated_bytes"] if "replicated_bytes" in rs[0] else replicated
    if replicated is not None:
        fig.add_hline(y=replicated / 2**10, line_dash="dash", line_color="#7f7f7f",
                      annotation_text="replicated R per rank", annotation_position="top left")
    fig.update_layout(barmode="group", title=title or "Sharded weight bytes per rank, by shard-group size",
                      yaxis_title="KiB per rank (chunks + two slots)", height=420, font={"size": 13})
    return fig


def kv_rows_from_ranks(results: Sequence[Mapping[str, Any]], what: str = "tokens") -> list[dict[str, Any]]:
    """``kv_capacity_now`` results as figure rows: one per rank, replicated vs sharded ``what``."""
    return [{"label": f"rank {r['rank']}", "replicated": r["replicated"][what], "sharded": r["sharded"][what]}
            for r in sorted(results, key=lambda r: r["rank"])]


def kv_rows_from_plans(capacities: Mapping[str, Mapping[str, Any] | None], what: str = "tokens") -> list[dict[str, Any]]:
    """Cost-model predictions (``{name: plan.kv_capacity()}``) as figure rows."""
    return [{"label": name, "replicated": cap[f"{what}_replicated"], "sharded": cap[f"{what}_sharded"]}
            for name, cap in capacities.items() if cap is not None]


def relative(change: float) -> str:
    """A relative change with the digits that show it: ``+67.1%``, but ``+0.012%`` rather than ``+0.0%``."""
    return f"{change:+.1%}" if abs(change) >= 0.01 or change == 0 else f"{change * 100:+.2g}%"


def kv_capacity_figure(rows: Sequence[Mapping[str, Any]], what: str = "KV-cache tokens", title: str = "",
                       note: str = "") -> go.Figure:
    """Two panels per row (a rank, or a cost-model preset): left, replicated vs sharded bars; right,
    what sharding changes, ``sharded - replicated``, as its own bar labelled with the count and the
    relative change -- a gain of a few hundred tokens on bars of millions is invisible on the left."""
    labels = [r["label"] for r in rows]
    gains = [r["sharded"] - r["replicated"] for r in rows]
    fig = make_subplots(rows=1, cols=2, column_widths=[0.6, 0.4], horizontal_spacing=0.14,
                        subplot_titles=(what, "what sharding adds"))
    for key in ("replicated", "sharded"):
        fig.add_trace(go.Bar(x=labels, y=[r[key] for r in rows], name=key, marker_color=COLORS[key]), row=1, col=1)
    rel = [f"{g:+,}<br>({relative(g / r['replicated'])})" if r["replicated"] else f"{g:+,}"
           for g, r in zip(gains, rows, strict=True)]
    fig.add_trace(go.Bar(x=labels, y=gains, name="change", text=rel, textposition="outside", cliponaxis=False,
                         textfont={"size": 13}, showlegend=False,
                         marker_color=[COLORS["sharded"] if g >= 0 else LOSS_COLOR for g in gains]), row=1, col=2)
    low, high = min(0, *gains), max(0, *gains)
    pad = 0.35 * ((high - low) or 1)
    fig.update_yaxes(title_text=what, row=1, col=1)
    fig.update_yaxes(title_text="sharded - replicated", row=1, col=2,
                     range=[low - (pad if low < 0 else 0), high + pad], zeroline=True, zerolinecolor="#444")
    sub = f"<br><sub>{note}</sub>" if note else ""
    fig.update_layout(barmode="group", title=(title or f"{what}: replicated vs sharded") + sub, font={"size": 13},
                      height=460, margin={"t": 110}, legend={"orientation": "h", "y": -0.15, "x": 0})
    return fig
