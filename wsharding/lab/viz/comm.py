"""Figures of the communication layer: what a weight AllGather moves, our NCCL binding, and the
AllGather benchmark (``wsharding bench allgather``) drawn from its JSON.

Every benchmark figure's title carries the machine, the date and the mode of the run it shows
(``gpu-nccl-shared`` means several ranks time-sliced one GPU: no NVLink, no real overlap), so a
figure kept in ``figures/`` can never pass for something it is not.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from wsharding.core.units import MiB

IMPL_COLORS = {
    "nccl-ce (policy 2)": "#2ca02c",
    "nccl-sm (policy 0)": "#d62728",
    "torch.distributed": "#1f77b4",
    "torch.distributed gloo (CPU)": "#7f7f7f",
}


def run_label(result: dict[str, Any]) -> str:
    """``machine, date, mode, world size`` (+ the emulation note, shortened)."""
    label = f"{result['machine']}, {result['date'][:10]}, mode {result['mode']}, {result['world_size']} ranks"
    if result.get("emulation"):
        label += " -- " + result["emulation"].split(":")[0].split("--")[0].strip()
    return label


def _by_impl(rows: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r["impl"], []).append(r)
    return {k: sorted(v, key=lambda r: r["size_bytes"]) for k, v in out.items()}


def allgather_bandwidth_figure(result: dict[str, Any]) -> go.Figure:
    """Bus bandwidth ((N-1)/N * S / t) against per-layer size, one line per implementation, with
    the device-to-device copy ceiling of the same machine (halved: a copy's number counts each
    byte read and written, a gather's bus bandwidth counts it once)."""
    fig = go.Figure()
    for impl, rows in _by_impl(result["rows"]).items():
        fig.add_trace(go.Scatter(
            x=[r["size_bytes"] / MiB for r in rows], y=[r["busbw_GBps"] for r in rows], mode="lines+markers",
            name=impl, line={"color": IMPL_COLORS.get(impl)},
            hovertemplate="%{x} MiB: %{y:.1f} GB/s<extra>" + impl + "</extra>",
        ))
    if result.get("copy_ceiling_GBps"):
        half = result["copy_ceiling_GBps"] / 2
        fig.add_hline(y=half, line_dash="dash", line_color="black")
        # The label as its own annotation at log10(y): add_hline's would sit at 10**half on this log axis.
        fig.add_annotation(x=1, xref="x domain", y=math.log10(half), yref="y", showarrow=False, xanchor="right",
                           yanchor="bottom", text=f"copy ceiling / 2 = {half:.0f} GB/s (measured)")
    fig.update_layout(
        title=f"AllGather bus bandwidth<br><sup>{run_label(result)}</sup>", xaxis_title="per-layer size S (MiB)",
        yaxis_title="bus bandwidth (GB/s)", xaxis_type="log", yaxis_type="log", height=460,
        legend={"orientation": "h", "y": -0.2},
    )
    return fig


def allgather_time_figure(result: dict[str, Any]) -> go.Figure:
    """Time per gather against per-layer size (the slowest rank's median)."""
    fig = go.Figure()
    for impl, rows in _by_impl(result["rows"]).items():
        fig.add_trace(go.Scatter(
            x=[r["size_bytes"] / MiB for r in rows], y=[r["time_ms"] for r in rows], mode="lines+markers",
            name=impl, line={"color": IMPL_COLORS.get(impl)},
        ))
    fig.update_layout(title=f"AllGather time per call<br><sup>{run_label(result)}</sup>",
                      xaxis_title="per-layer size S (MiB)", yaxis_title="ms", xaxis_type="log", yaxis_type="log",
                      height=440, legend={"orientation": "h", "y": -0.2})
    return fig


def allgather_overlap_figure(result: dict[str, Any]) -> go.Figure:
    """Gather alone, GEMM alone, both together (gather on its own stream beside the GEMM)."""
    fig = go.Figure()
    rows = result.get("overlap") or []
    labels = [f"{o['impl']}<br>{o['size_bytes'] / MiB:.0f} MiB" for o in rows]
    for key, name, color in (("gather_ms", "gather alone", "#9467bd"), ("gemm_ms", "GEMM alone", "#8c564b"),
                             ("both_ms", "both together", "#17becf")):
        fig.add_trace(go.Bar(x=labels, y=[o[key] for o in rows], name=name, marker_color=color))
    note = " (ranks share one GPU: compute time-slices, this is not N-GPU overlap)" if result.get("emulation") else ""
    fig.update_layout(barmode="group", title=f"Gather beside an 8192^3 bf16 GEMM{note}<br><sup>{run_label(result)}</sup>",
                      yaxis_title="ms", height=440)
    return fig


def collective_bytes(layer_bytes: int, tokens: int, hidden: int, n: int, act_bytes: int = 2) -> dict[str, float]:
    """Bytes one rank receives per layer: weight AllGather ((N-1)/N * S, no token term) vs a
    ring AllReduce of the layer's activations (2 (N-1)/N * tokens * hidden * act_bytes)."""
    return {"allgather_weights": (n - 1) / n * layer_bytes,
            "allreduce_activations": 2 * (n - 1) / n * tokens * hidden * act_bytes}


def gather_vs_allreduce_figure(layer_bytes: int, hidden: int, n: int, tokens: Sequence[int]) -> go.Figure:
    """Per-rank bytes per layer against tokens in the step: the weight gather is flat."""
    ag = [collective_bytes(layer_bytes, t, hidden, n)["allgather_weights"] / MiB for t in tokens]
    ar = [collective_bytes(layer_bytes, t, hidden, n)["allreduce_activations"] / MiB for t in tokens]
    fig = go.Figure([
        go.Scatter(x=list(tokens), y=ag, name="AllGather of the layer's weights (weight sharding)", mode="lines+markers"),
        go.Scatter(x=list(tokens), y=ar, name="AllReduce of activations (tensor parallel)", mode="lines+markers"),
    ])
    fig.update_layout(title=f"Bytes each rank receives per layer, N = {n}, S = {layer_bytes / MiB:.0f} MiB, hidden {hidden}",
                      xaxis_title="tokens in the step", yaxis_title="MiB per rank per layer", xaxis_type="log",
                      yaxis_type="log", height=420, legend={"orientation": "h", "y": -0.25})
    return fig


def binding_table_figure(rows: Sequence[dict[str, str]]) -> go.Figure:
    """The ctypes binding table (``wsharding.accel.nccl.binding.binding_table()``)."""
    cols = ["function", "returns", "arguments", "since", "why"]
    fig = go.Figure(go.Table(
        columnwidth=[2.2, 1.2, 3.6, 0.6, 3.4],
        header={"values": cols, "align": "left", "fill_color": "#dde"},
        cells={"values": [[r[c] for r in rows] for c in cols], "align": "left"},
    ))
    fig.update_layout(title="libnccl functions bound by wsharding.accel.nccl (declarative ctypes table)",
                      height=120 + 28 * len(rows), margin={"l": 10, "r": 10, "t": 50, "b": 10})
    return fig


def load_result(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def save_allgather_figures(json_path: str, out_dir: str = "figures") -> list[str]:
    """Write the benchmark's figures next to its JSON with :func:`wsharding.lab.viz.export.save_figure`
    (HTML that opens offline, sharing one plotly.js in the folder; PNG too when possible).
    Returns the paths written."""
    from wsharding.lab.viz.export import save_figure

    result = load_result(json_path)
    stem = os.path.splitext(os.path.basename(json_path))[0]
    written = []
    for name, fn in (("bandwidth", allgather_bandwidth_figure), ("time", allgather_time_figure),
                     ("overlap", allgather_overlap_figure)):
        if name == "overlap" and not result.get("overlap"):
            continue
        written += save_figure(fn(result), os.path.join(out_dir, f"{stem}_{name}"))
    return written


if __name__ == "__main__":  # python -m wsharding.lab.viz.comm figures/allgather_*.json
    import sys

    for p in sys.argv[1:]:
        print("\n".join(save_allgather_figures(p, os.path.dirname(p) or ".")))
