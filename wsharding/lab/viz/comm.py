"""Figures of the communication layer (notebook 02): what a weight AllGather moves against an
activation AllReduce, our NCCL binding, and the AllGather benchmark (``wsharding bench allgather``)
drawn from its JSON -- a live run, or a saved run of real GPUs found among the repository's
measurements (:func:`saved_allgather_reports`).

Every benchmark figure's title carries the machine, the date and the mode of the run it shows
(``gpu-nccl-shared`` means several ranks time-sliced one GPU: no NVLink, no real overlap), so a
figure kept in ``figures/`` can never pass for something it is not.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import plotly.graph_objects as go

from wsharding.core.errors import InvalidArgument, NotFound
from wsharding.core.units import MiB
from wsharding.io_checks import read_saved_report

#: Bytes in a megabyte (10**6): the design gives its layer sizes in MB ("367 MB").
MB = 10**6

#: Said beside a benchmark figure drawn from CPU processes: what its numbers are not.
CPU_NOISE_NOTE = ("noise-bound: CPU ranks over gloo share this machine's cores<br>"
                  "dots: median of the repeats, bars: their min-max; read no trend from them")


def plain_log_ticks(lo: float, hi: float) -> tuple[list[float], list[str]]:
    """Tick values 1, 2, 5 per decade spanning ``[lo, hi]`` and their plain labels ("0.5", "2",
    "1,000"): plotly labels a log axis's in-between ticks with their first digit only, so 0.5
    would read "5"."""
    if lo <= 0 or hi <= 0:
        raise InvalidArgument(f"a log axis needs positive bounds, got {lo}, {hi}")
    vals: list[float] = []
    for e in range(math.floor(math.log10(lo)), math.floor(math.log10(hi)) + 1):
        for m in (1, 2, 5):
            v = m * 10.0**e
            if lo / 2.5 <= v <= hi * 2.5:  # one tick past each end; plotly hides those off the axis
                vals.append(v)
    if len(vals) > 12:  # many decades: powers of ten only
        vals = [v for v in vals if f"{v:.0e}".startswith("1")]
    return vals, [f"{v:,.0f}" if v >= 1 else f"{v:g}" for v in vals]


def plain_log_axis(fig: go.Figure, axis: str, values: Sequence[float], *, at_values: bool = False) -> None:
    """Label a log axis of ``fig`` (``"x"`` or ``"y"``) with plain numbers spanning ``values``;
    ``at_values``: tick the values themselves (a few benchmark sizes, 0.25 and 4 included)."""
    positive = sorted({v for v in values if v > 0})
    if not positive:
        return
    if at_values and len(positive) <= 10:
        ticks, text = positive, [f"{v:,.0f}" if v >= 1 and float(v).is_integer() else f"{v:g}" for v in positive]
    else:
        ticks, text = plain_log_ticks(positive[0], positive[-1])
    fig.update_layout({f"{axis}axis": {"tickmode": "array", "tickvals": ticks, "ticktext": text}})


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
    ys: list[float] = []
    for impl, rows in _by_impl(result["rows"]).items():
        y = [r["busbw_GBps"] for r in rows]
        error_y = None
        if all("time_min_ms" in r for r in rows):  # repeats: the spread in bandwidth, fastest to slowest
            high = [r["busbw_GBps"] * r["time_ms"] / r["time_min_ms"] for r in rows]
            low = [r["busbw_GBps"] * r["time_ms"] / r["time_max_ms"] for r in rows]
            error_y = {"type": "data", "symmetric": False, "array": [h - m for h, m in zip(high, y, strict=True)],
                       "arrayminus": [m - lo for m, lo in zip(y, low, strict=True)]}
            ys += high + low
        ys += y
        fig.add_trace(go.Scatter(
            x=[r["size_bytes"] / MiB for r in rows], y=y, mode="lines+markers", error_y=error_y,
            name=impl, line={"color": IMPL_COLORS.get(impl)},
            hovertemplate="%{x} MiB: %{y:.2f} GB/s<extra>" + impl + "</extra>",
        ))
    if result.get("copy_ceiling_GBps"):
        half = result["copy_ceiling_GBps"] / 2
        fig.add_hline(y=half, line_dash="dash", line_color="black")
        # The label as its own annotation at log10(y): add_hline's would sit at 10**half on this log axis.
        fig.add_annotation(x=1, xref="x domain", y=math.log10(half), yref="y", showarrow=False, xanchor="right",
                           yanchor="bottom", text=f"copy ceiling / 2 = {half:.0f} GB/s (measured)")
        ys.append(half)
    # On CPU ranks the figure says, beside itself, that its numbers are noise (the title's last line).
    noisy = result.get("mode", "").startswith("cpu")
    note = "<br>" + CPU_NOISE_NOTE if noisy else ""
    fig.update_layout(
        title=f"AllGather bus bandwidth<br><sup>{run_label(result)}{note}</sup>", xaxis_title="per-layer size S (MiB)",
        yaxis_title="bus bandwidth (GB/s)", xaxis_type="log", yaxis_type="log", height=520 if noisy else 460,
        legend={"orientation": "h", "y": -0.2}, showlegend=True, margin={"t": 150 if noisy else 80},
    )
    plain_log_axis(fig, "x", [r["size_bytes"] / MiB for r in result["rows"]], at_values=True)
    plain_log_axis(fig, "y", ys)
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
                      xaxis_title="per-layer size S (MiB)", yaxis_title="ms per gather", xaxis_type="log",
                      yaxis_type="log", height=440, legend={"orientation": "h", "y": -0.2})
    plain_log_axis(fig, "x", [r["size_bytes"] / MiB for r in result["rows"]], at_values=True)
    plain_log_axis(fig, "y", [r["time_ms"] for r in result["rows"]])
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


def overlap_exposed_figure(result: dict[str, Any]) -> go.Figure:
    """What a gather adds to a GEMM running beside it, per implementation and size: the exposed
    time (both together minus the GEMM alone), with the GEMM's own time as the scale. The copy
    engine's gather takes no SMs, so the GEMM barely notices it; an SM gather takes SMs from it.
    The caption names the machine, the date, the NCCL and the mode of the run."""
    rows = result.get("overlap") or []
    if not rows:
        raise InvalidArgument("this report has no overlap rows: run the benchmark with --overlap")
    sizes = sorted({o["size_bytes"] for o in rows})
    fig = go.Figure()
    for impl in dict.fromkeys(o["impl"] for o in rows):
        mine = {o["size_bytes"]: o for o in rows if o["impl"] == impl}
        ys = [mine[s]["exposed_ms"] if s in mine else None for s in sizes]
        fig.add_bar(
            x=[f"{s / MiB:,.0f} MiB" for s in sizes], y=ys, name=impl, marker_color=IMPL_COLORS.get(impl),
            text=[f"{y:.2f} ms" if y is not None else "" for y in ys], textposition="outside",
            customdata=[[mine[s]["gather_ms"], mine[s]["gemm_ms"], mine[s]["both_ms"]] if s in mine else [None] * 3
                        for s in sizes],
            hovertemplate=("gather alone %{customdata[0]:.3f} ms, GEMM alone %{customdata[1]:.3f} ms, "
                           "both %{customdata[2]:.3f} ms<extra>" + impl + "</extra>"),
        )
    gemm = statistics.median(o["gemm_ms"] for o in rows)
    top = max(o["exposed_ms"] for o in rows)
    nccl = f", NCCL {result['nccl']['version']}" if result.get("nccl") else ""
    fig.update_layout(
        barmode="group", height=460, yaxis_title="ms added to the GEMM",
        xaxis_title="gather size per layer S", yaxis_range=[0, 1.25 * top], legend={"orientation": "h", "y": -0.22},
        title=(f"What a gather adds to a {gemm:.2f} ms bf16 GEMM beside it (both together - GEMM alone)"
               f"<br><sup>{run_label(result)}{nccl}</sup>"),
        margin={"t": 90},
    )
    return fig


def repository_measurements() -> Path:
    """The folder of the repository's saved GPU runs (one folder per machine and day), found from
    the package's own place in a source checkout, else under the working directory."""
    beside = Path(__file__).resolve().parents[3] / "docs" / "measurements"
    return beside if beside.is_dir() else Path("docs") / "measurements"


def saved_allgather_reports(folder: str | Path | None = None) -> dict[str, dict[str, Any]]:
    """The saved ``bench allgather`` reports under ``folder`` (default: :func:`repository_measurements`),
    in any of its per-machine-and-day folders, by file stem."""
    paths = sorted(Path(folder or repository_measurements()).rglob("bench_allgather_*.json"), key=lambda p: p.name)
    return {p.stem: read_saved_report(p) for p in paths}


def multi_gpu_allgather(reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The newest saved report of real GPUs, one rank per GPU (no time-slicing), with overlap rows."""
    real = [r for r in reports.values() if r.get("mode") == "gpu-nccl" and r.get("ranks_per_gpu") == 1
            and r.get("world_size", 0) >= 2 and r.get("overlap") and not r.get("emulation")]
    if not real:
        raise NotFound(f"no saved bench allgather report of two or more GPUs among {sorted(reports)}")
    return max(real, key=lambda r: r["date"])


def collective_bytes(layer_bytes: int, tokens: int, hidden: int, n: int, act_bytes: int = 2) -> dict[str, float]:
    """Bytes one rank receives per layer: weight AllGather ((N-1)/N * S, no token term) vs a
    ring AllReduce of the layer's activations (2 (N-1)/N * tokens * hidden * act_bytes)."""
    return {"allgather_weights": (n - 1) / n * layer_bytes,
            "allreduce_activations": 2 * (n - 1) / n * tokens * hidden * act_bytes}


def crossover_tokens(layer_bytes: int, hidden: int, n: int, act_bytes: int = 2) -> int:
    """The fewest tokens in a step for which the activation AllReduce of :func:`collective_bytes`
    moves more than the weight AllGather: ``2 (N-1)/N t h a > (N-1)/N S``, so ``t > S / (2 h a)``
    (exact integer arithmetic; ``N`` cancels)."""
    if n < 2:
        raise InvalidArgument(f"a shard group of {n} rank moves nothing; use N >= 2")
    return layer_bytes // (2 * hidden * act_bytes) + 1


def gather_vs_allreduce_figure(layer_bytes: int, hidden: int, n: int, tokens: Sequence[int]) -> go.Figure:
    """Per-rank bytes per layer against tokens in the step: the weight gather is flat; the
    crossover of :func:`crossover_tokens` is marked. Bytes in MB (10**6 B), as the layer is given."""
    ag = [collective_bytes(layer_bytes, t, hidden, n)["allgather_weights"] / MB for t in tokens]
    ar = [collective_bytes(layer_bytes, t, hidden, n)["allreduce_activations"] / MB for t in tokens]
    fig = go.Figure([
        go.Scatter(x=list(tokens), y=ag, name="AllGather of the layer's weights (weight sharding)", mode="lines+markers"),
        go.Scatter(x=list(tokens), y=ar, name="AllReduce of activations (tensor parallel)", mode="lines+markers"),
    ])
    cross = crossover_tokens(layer_bytes, hidden, n)
    if min(tokens) <= cross <= max(tokens):
        fig.add_vline(x=cross, line_dash="dash", line_color="gray")
        # An annotation at log10(x): add_vline's own label would sit at 10**x on this log axis.
        fig.add_annotation(x=math.log10(cross), xref="x", y=1, yref="y domain", xanchor="right", yanchor="top",
                           xshift=-4, showarrow=False, text=f"AllReduce moves more from {cross:,} tokens")
    fig.update_layout(title=f"Bytes each rank receives per layer: N = {n}, S = {layer_bytes / MB:,.0f} MB, hidden {hidden}",
                      xaxis_title="tokens in the step", yaxis_title="MB per rank per layer", xaxis_type="log",
                      yaxis_type="log", height=440, legend={"orientation": "h", "y": -0.25})
    plain_log_axis(fig, "x", list(tokens))
    plain_log_axis(fig, "y", ag + ar)
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
    """A saved ``bench allgather`` result (see :func:`read_saved_report`)."""
    return read_saved_report(path)


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
