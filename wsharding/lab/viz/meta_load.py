"""The start-up peak of :func:`~wsharding.checkpoint.load_sharded`, built with weights against built on
meta (notebook 04): what :func:`wsharding.lab.bench.load.load_peak_rank` measured, per rank.

Built with its weights a rank holds every sharded weight whole before setup shrinks them -- R, the
start-up OOM the design warns about; built on meta it allocates only its own rows, R/N, before the
checkpoint's read. The bars are the bytes the bench counted (on GPUs the allocator's peak, on CPU ranks
the parameters' bytes as the read starts: exact, not the resident set)."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from wsharding.core.units import MiB

WHOLE_COLOR, META_COLOR, BOUND_COLOR, R_COLOR = "#E45756", "#4C78A8", "#54A24B", "#7F7F7F"


def meta_load_figure(results: list[dict[str, Any]]) -> go.Figure:
    """Per rank: the peak from the build through the checkpoint's read, built with weights and on meta,
    beside R (the replicated sharded weights) and the package's bound ``R/N + slots + rest + one weight``."""
    ranks = [f"rank {r['rank']}" for r in results]
    fig = go.Figure()
    fig.add_bar(x=ranks, y=[r["whole"]["load_peak"] / MiB for r in results], name="built with its weights",
                marker_color=WHOLE_COLOR)
    fig.add_bar(x=ranks, y=[r["meta"]["load_peak"] / MiB for r in results], name="built on meta",
                marker_color=META_COLOR)
    w = results[0]["whole"]
    # reference lines as traces, so the legend names each beside its style
    for y, name, color, dash in ((w["replicated"], "R: the sharded weights, replicated", R_COLOR, "dashdot"),
                                 (w["bound"], "bound: R/N + slots + rest + one weight", BOUND_COLOR, "dash")):
        fig.add_scatter(x=ranks, y=[y / MiB] * len(ranks), mode="lines", name=name,
                        line={"color": color, "dash": dash, "width": 2}, hoverinfo="name+y")
    r0 = results[0]
    what = ("torch.cuda.max_memory_allocated" if w["measured"] == "max_memory_allocated"
            else "the parameters' bytes as the read starts (exact)")
    mode = r0["mode"] + (" (emulated)" if r0["emulation"] else "")
    fig.update_layout(barmode="group", height=460, font={"size": 13}, yaxis_title="MiB per rank",
                      legend={"orientation": "v", "x": 1.02, "xanchor": "left", "y": 1, "yanchor": "top"},
                      margin={"t": 110, "r": 20},
                      title={"text": f"Start-up peak through the checkpoint's read: {len(results)} ranks, {mode}"
                                     f"<br><sup>{what}</sup>"})
    return fig
