"""Figures of the cost model (notebook 00): memory per GPU, per-layer buffer sizes, and when the
AllGather of layer l+1 hides behind the compute of layer l. Every figure is built from a
:class:`~wsharding.costmodel.Plan`; nothing here computes a number the cost model does not."""

from __future__ import annotations

import math
from collections.abc import Sequence

import plotly.graph_objects as go

from wsharding.core.layout import SUPPORTED_DTYPES
from wsharding.costmodel import Deployment, GiB, ModelSpec, Plan, breakeven, estimate
from wsharding.lab.viz.comm import plain_log_axis

#: Colours kept constant across figures so a reader learns them once.
COLORS = {"shards": "#4c78a8", "slots": "#f58518", "freed": "#54a24b", "gather": "#e45756", "compute": "#4c78a8"}


def memory_figure(plan: Plan) -> go.Figure:
    """Weight bytes per GPU: replicated (stacked by group) versus sharded (resident shards, two
    slots, and what is freed: the net saving). Heights in GiB (2**30 B)."""
    b = plan.bill
    fig = go.Figure()
    for name, dtype, nbytes in plan.groups:
        fig.add_bar(x=["replicated"], y=[nbytes / GiB], name=f"{name} ({SUPPORTED_DTYPES[dtype]})",
                    hovertemplate="%{y:.2f} GiB<extra>" + name + "</extra>")
    parts = [
        ("resident shards sum|T|/N", b.resident_shard_bytes, COLORS["shards"]),
        ("mapped slots 2(N-1)/N·max|T|" if b.map_own_chunk else "two slots 2·max|T|", b.slot_bytes, COLORS["slots"]),
        ("freed (net saving)", max(0, b.net_saving_bytes), COLORS["freed"]),
    ]
    for label, nbytes, color in parts:
        fig.add_bar(x=["sharded"], y=[nbytes / GiB], name=label, marker_color=color,
                    hovertemplate="%{y:.2f} GiB<extra>" + label + "</extra>")
    title = (f"{plan.model.name}, N = {b.ranks}: weights per GPU {b.replicated_bytes / GiB:.2f} -> "
             f"{b.sharded_resident_bytes / GiB:.2f} GiB<br><sup>net saving {b.net_saving_bytes / GiB:.2f} GiB "
             f"(gross R {b.gross_saving_bytes / GiB:.2f} GiB)</sup>")
    if b.net_saving_bytes < 0:
        fig.add_annotation(x="sharded", y=b.sharded_resident_bytes / GiB, yshift=12, showarrow=False,
                           text=f"costs {-b.net_saving_bytes / GiB:.2f} GiB more than replicated")
    fig.update_layout(barmode="stack", title=title, yaxis_title="GiB per GPU", legend_title="bytes",
                      height=420)
    return fig


def layer_bytes_figure(plan: Plan) -> go.Figure:
    """Each sharded layer's flat buffer |T_l| (MiB): the two slots are sized by the largest one."""
    xs = [c.index for c in plan.layers]
    fig = go.Figure()
    fig.add_bar(x=xs, y=[c.layout_bytes / 2**20 for c in plan.layers], name="|T_l|",
                marker_color=COLORS["shards"], customdata=[c.kind for c in plan.layers],
                hovertemplate="layer %{x} (%{customdata}): %{y:.1f} MiB<extra></extra>")
    largest = plan.bill.largest_layer_bytes / 2**20
    fig.add_hline(y=largest, line_dash="dash", line_color=COLORS["slots"],
                  annotation_text=f"slot size = max|T| = {largest:.1f} MiB")
    fig.update_layout(title=f"{plan.model.name}: flat buffer per sharded layer (N = {plan.bill.ranks})",
                      xaxis_title="layer", yaxis_title="MiB per layer", height=360, showlegend=False)
    return fig


def token_grid(max_tokens: int = 16384) -> list[int]:
    """Powers of two from 1 to ``max_tokens``: the x axis of :func:`overlap_figure`."""
    out, t = [], 1
    while t <= max_tokens:
        out.append(t)
        t *= 2
    return out


def overlap_figure(plan: Plan, tokens: Sequence[int] | None = None) -> go.Figure:
    """AllGather time of the hardest layer to hide versus the compute time of the layer before it,
    across tokens per step (log axes), with the break-even point and the plan's own batch marked."""
    pair = plan.worst_pair
    fig = go.Figure()
    if pair is None:
        fig.update_layout(title="one sharded layer: no previous layer to hide its gather behind")
        return fig
    prev = plan.layers[plan.layers.index(pair) - 1]
    grid = list(tokens) if tokens is not None else token_grid(max(16384, 2 * (plan.breakeven_tokens or 1)))
    fig.add_scatter(x=grid, y=[pair.gather_seconds * 1e6] * len(grid), mode="lines", name=f"AllGather layer {pair.index}",
                    line_color=COLORS["gather"])
    fig.add_scatter(x=grid, y=[prev.compute_seconds_per_token * t * 1e6 for t in grid], mode="lines",
                    name=f"compute layer {prev.index} (sharded GEMMs)", line_color=COLORS["compute"])
    be = breakeven(pair.gather_seconds, prev.compute_seconds_per_token)
    if be > 0:
        fig.add_vline(x=be, line_dash="dash", line_color="gray")
        # Not add_vline's annotation_text: plotly places it at x = be in axis units, and on a log axis
        # that is 10**be -- far outside the figure. An annotation on a log axis takes log10(x).
        fig.add_annotation(x=math.log10(be), xref="x", y=1, yref="y domain", text=f"break-even {be} tokens",
                           showarrow=False, xanchor="right", yanchor="top", xshift=-4)
    d = plan.deployment
    if d.tokens > 0:
        fig.add_scatter(x=[d.tokens], y=[prev.compute_seconds * 1e6], mode="markers", marker_size=10,
                        name=f"this plan: {d.tokens} tokens", marker_color=COLORS["compute"])
    fig.update_layout(
        title=f"{plan.model.name}, N = {plan.bill.ranks}, {d.bandwidth / 1e9:.0f} GB/s: gather hides from {be} tokens per step",
        xaxis_title="tokens per step", yaxis_title="microseconds", xaxis_type="log", yaxis_type="log", height=420,
    )
    plain_log_axis(fig, "x", grid)
    plain_log_axis(fig, "y", [y for t in fig.data for y in t.y])
    return fig


def dtype_vs_sharding_figure(model: ModelSpec, deployment: Deployment, dtypes: Sequence[str] = ("bf16", "fp8_e4m3")) -> go.Figure:
    """Weight bytes per GPU for each dtype, replicated versus sharded: quantisation halves the
    replicated copy, sharding divides it by N, and the two compose."""
    fig = go.Figure()
    for label, sharded in (("replicated", False), (f"sharded N = {deployment.ranks}", True)):
        ys = []
        for dt in dtypes:
            b = estimate(model.with_dtype(dt), deployment).bill
            ys.append((b.sharded_resident_bytes if sharded else b.replicated_bytes) / GiB)
        fig.add_bar(x=list(dtypes), y=ys, name=label, text=[f"{y:.1f}" for y in ys], textposition="outside")
    fig.update_layout(barmode="group", title=f"{model.name}: quantisation halves, sharding divides by N",
                      xaxis_title="weight dtype", yaxis_title="GiB per GPU", height=380)
    return fig
