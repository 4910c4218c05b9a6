"""Figures of the lookahead planner (notebook 03, ``wsharding demo``): what each rank's compute and
gathers did in one step, which layer held which slot, and the weight bytes per rank.

Every figure is drawn from trace records (``StepTrace.records()``: one dict per rank, step and
layer with times in microseconds from that rank's step start) or from the demo's report; nothing
here measures or computes a number the planner did not record. Bars are ``go.Bar`` with
``orientation="h"``, ``base`` = start and ``x`` = duration, so the hover shows the trace's own
numbers. Records of several steps are reduced to the last step of each rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from wsharding.core.errors import InvalidArgument, NotFound

#: Colours kept constant across the planner's figures.
COLORS = {
    "compute": "#4c78a8",
    "gather A": "#f58518",
    "gather B": "#e8b04a",
    "slot A": "#f58518",
    "slot B": "#54a24b",
    "wait": "#d62728",
    "gate": "#7f7f7f",
}

Record = Mapping[str, Any]


# ---- selecting records -------------------------------------------------------------------------
def last_step(records: Iterable[Record]) -> list[Record]:
    """The records of the last step of each rank, sorted by rank then layer.

    A figure shows one step: with several steps in a list (a traced run, or a report that kept
    them), the latest one of each rank is the one after warm-up.
    """
    recs = [r for r in records if "rank" in r and "layer" in r]
    last: dict[int, int] = {}
    for r in recs:
        last[r["rank"]] = max(last.get(r["rank"], r.get("step", 0)), r.get("step", 0))
    return sorted((r for r in recs if r.get("step", 0) == last[r["rank"]]), key=lambda r: (r["rank"], r["layer"]))


def _span(r: Record, start: str, end: str) -> tuple[float, float] | None:
    """``(start, duration)`` when both marks are there, else None (a mark may be missing: a held
    gather never released, a step that failed, a record from an older trace)."""
    a, b = r.get(start), r.get(end)
    if a is None or b is None:
        return None
    return float(a), float(b) - float(a)


def _ranks(recs: Sequence[Record]) -> list[int]:
    return sorted({r["rank"] for r in recs})


def exposed_us(records: Iterable[Record]) -> dict[int, float]:
    """Per rank, the sum of its wait segments in its last step: time the compute spent waiting."""
    out: dict[int, float] = {}
    for r in last_step(records):
        s = _span(r, "wait_start", "wait_end")
        out[r["rank"]] = out.get(r["rank"], 0.0) + (max(0.0, s[1]) if s else 0.0)
    return out


class _Bars:
    """Accumulates horizontal bars of one trace (one legend entry)."""

    def __init__(self, name: str, color: str, **style: Any) -> None:
        self.name, self.color, self.style = name, color, style
        self.y: list[str] = []
        self.base: list[float] = []
        self.x: list[float] = []
        self.text: list[str] = []
        self.hover: list[str] = []

    def add(self, lane: str, start: float, width: float, text: str, hover: str) -> None:
        self.y.append(lane)
        self.base.append(start)
        self.x.append(width)
        self.text.append(text)
        self.hover.append(hover)

    def trace(self) -> go.Bar:
        return go.Bar(
            name=self.name, y=self.y, base=self.base, x=self.x, orientation="h", marker_color=self.color,
            text=self.text, textposition="inside", insidetextanchor="middle", hovertext=self.hover,
            hoverinfo="text", textangle=0, **self.style,
        )


def _hover(what: str, r: Record, start: float, width: float) -> str:
    return (f"rank {r['rank']} step {r.get('step', '?')} layer {r['layer']} slot {r.get('slot') or '-'}<br>"
            f"{what}: {start:.1f} → {start + width:.1f} µs ({width:.1f} µs)")


def _layout(fig: go.Figure, title: str, lanes: list[str], n_ranks: int) -> go.Figure:
    fig.update_layout(
        title=title, barmode="overlay", xaxis_title="µs from the step start (each rank's own clock)",
        height=140 + 70 * max(1, len(lanes)), legend_title="", bargap=0.25,
        yaxis={"categoryorder": "array", "categoryarray": list(reversed(lanes)), "title": ""},
    )
    if not lanes:
        fig.add_annotation(text="no trace records", showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5)
    return fig


# ---- the timeline ------------------------------------------------------------------------------
def timeline_figure(records: Iterable[Record], title: str = "Gathers and compute per rank") -> go.Figure:
    """Two lanes per rank: **compute** (compute_start → compute_end, labelled ``L<layer>·<slot>``)
    and **gather** (gather_start → gather_end, coloured by the slot it fills), plus the **exposed
    wait** segments (wait_start → wait_end) drawn in red on the compute lane: the time the layer
    could not start because its gather had not arrived. With lookahead they shrink to slivers; without
    it each covers its whole gather. Only the last step of each rank is shown."""
    recs = last_step(records)
    ranks = _ranks(recs)
    compute = _Bars("compute", COLORS["compute"])
    gathers = {s: _Bars(f"gather → slot {s}", COLORS[f"gather {s}"]) for s in ("A", "B")}
    wait = _Bars("exposed wait", COLORS["wait"], marker_line_color=COLORS["wait"], marker_line_width=1)
    lanes = []
    for rank in ranks:
        lanes += [f"rank {rank} · compute", f"rank {rank} · gather"]
    for r in recs:
        label = f"L{r['layer']}" + (f"·{r['slot']}" if r.get("slot") else "")
        c_lane, g_lane = f"rank {r['rank']} · compute", f"rank {r['rank']} · gather"
        if (s := _span(r, "compute_start", "compute_end")) is not None:
            compute.add(c_lane, s[0], s[1], label, _hover("compute", r, *s))
        if (s := _span(r, "gather_start", "gather_end")) is not None:
            gathers.get(r.get("slot") or "A", gathers["A"]).add(g_lane, s[0], s[1], label, _hover("gather", r, *s))
        if (s := _span(r, "wait_start", "wait_end")) is not None:
            wait.add(c_lane, s[0], s[1], "", _hover("exposed wait", r, *s))
    fig = go.Figure([b.trace() for b in (compute, gathers["A"], gathers["B"], wait)])
    exposed = exposed_us(recs)
    if exposed:
        title += "<br><sup>exposed wait per rank: " + ", ".join(
            f"rank {k} {v / 1e3:.2f} ms" for k, v in sorted(exposed.items())) + "</sup>"
    return _layout(fig, title, lanes, len(ranks))


# ---- slot occupancy ----------------------------------------------------------------------------
def slot_figure(records: Iterable[Record], title: str = "Slot A/B occupancy and gate waits") -> go.Figure:
    """Two lanes per rank, **slot A** and **slot B**: a bar per layer from its gather_start to its
    compute_end (the slot is that layer's from the moment its gather may write it until the layer
    has read it), **gate waits** in grey (held → gather_start: a gather dispatched early and held
    until the layer two back, which reads the same slot, was done) and **waits** in red
    (wait_start → wait_end). Two bars of one slot lane never overlap when the gate works."""
    recs = last_step(records)
    ranks = _ranks(recs)
    occupancy = {s: _Bars(f"slot {s} occupied", COLORS[f"slot {s}"]) for s in ("A", "B")}
    gate = _Bars("gate wait (held)", COLORS["gate"], marker_pattern_shape="/", width=0.5)
    wait = _Bars("exposed wait", COLORS["wait"], width=0.3)
    lanes = []
    for rank in ranks:
        lanes += [f"rank {rank} · slot A", f"rank {rank} · slot B"]
    for r in recs:
        slot = r.get("slot")
        if slot not in ("A", "B"):
            continue  # never issued: it occupied no slot
        lane = f"rank {r['rank']} · slot {slot}"
        if (s := _span(r, "gather_start", "compute_end")) is not None:
            occupancy[slot].add(lane, s[0], s[1], f"L{r['layer']}", _hover(f"slot {slot} holds layer {r['layer']}", r, *s))
        if (s := _span(r, "held", "gather_start")) is not None:
            gate.add(lane, s[0], s[1], "gate", _hover("held by the gate", r, *s))
        if (s := _span(r, "wait_start", "wait_end")) is not None:
            wait.add(lane, s[0], s[1], "", _hover("exposed wait", r, *s))
    fig = go.Figure([b.trace() for b in (occupancy["A"], occupancy["B"], gate, wait)])
    return _layout(fig, title, lanes, len(ranks))


def slot_overlaps(records: Iterable[Record]) -> list[tuple[int, str, int, int]]:
    """``(rank, slot, earlier layer, later layer)`` for each pair of layers whose occupancy of one
    slot overlaps in time in the last step: a gather that wrote a slot still being read. Empty when
    the gate did its job."""
    out = []
    recs = last_step(records)
    for rank in _ranks(recs):
        for slot in ("A", "B"):
            spans = sorted(
                (s[0], s[0] + s[1], r["layer"]) for r in recs
                if r["rank"] == rank and r.get("slot") == slot and (s := _span(r, "gather_start", "compute_end"))
            )
            out += [(rank, slot, a[2], b[2]) for a, b in zip(spans, spans[1:], strict=False) if b[0] < a[1]]
    return out


# ---- memory ------------------------------------------------------------------------------------
def _unit(nbytes: float) -> tuple[float, str]:
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if nbytes >= scale:
            return scale, name
    return 1, "B"


def memory_figure(report: Mapping[str, Any], title: str = "Weight bytes per rank") -> go.Figure:
    """Bytes of the sharded weights per rank: replicated ``R`` versus sharded, where sharded is the
    resident chunks (formula − 2·slot_bytes) plus the two slots (2·slot_bytes), with the measured
    resident bytes (from the storages) as a marker on each rank's sharded bar.

    ``report`` is the demo's report (``replicated_bytes_per_rank``, ``sharded_resident_bytes_per_rank``,
    ``formula_bytes_per_rank``, ``slot_bytes``, ``world_size``); an optional
    ``sharded_resident_bytes_all`` (one measured value per rank) puts each rank's own measurement on
    its bar, otherwise every rank shows the single measured value of the report. A report with
    ``map_own_chunk`` true keeps only the peers' pages of its slots (``slot_resident_bytes``).
    """
    for key in ("replicated_bytes_per_rank", "formula_bytes_per_rank", "slot_bytes"):
        if key not in report:
            raise NotFound(f"memory_figure: the report has no {key!r} (a report of wsharding.lab.demo.summarize has it)")
    world = int(report.get("world_size", 1))
    rep, formula, slot = (int(report[k]) for k in ("replicated_bytes_per_rank", "formula_bytes_per_rank", "slot_bytes"))
    measured = report.get("sharded_resident_bytes_all")
    if measured is None:
        one = report.get("sharded_resident_bytes_per_rank")
        measured = None if one is None else [one] * world
    if measured is not None and len(measured) != world:
        raise InvalidArgument(f"memory_figure: sharded_resident_bytes_all has {len(measured)} values for {world} ranks")
    scale, unit = _unit(max(rep, formula))
    ranks = [f"rank {r}" for r in range(world)]
    mapped = bool(report.get("map_own_chunk"))
    slots = int(report["slot_resident_bytes"]) if mapped else 2 * slot
    slots_name = "the peers' slot pages 2·(N-1)/N·slot_bytes" if mapped else "two slots 2·slot_bytes"
    chunks = formula - slots
    fig = go.Figure()

    def bar(name: str, offsetgroup: str, values: list[int], color: str) -> None:
        fig.add_bar(x=ranks, y=[v / scale for v in values], name=name, offsetgroup=offsetgroup, marker_color=color,
                    customdata=values, hovertemplate="%{x}: %{customdata} B<extra>" + name + "</extra>")

    bar("replicated R", "replicated", [rep] * world, "#9d9d9d")
    bar("resident chunks (formula − slots)", "sharded", [chunks] * world, "#4c78a8")
    fig.add_bar(x=ranks, y=[slots / scale] * world, base=[chunks / scale] * world, name=slots_name,
                offsetgroup="sharded", marker_color=COLORS["slot A"], customdata=[slots] * world,
                hovertemplate="%{x}: %{customdata} B<extra>" + slots_name + "</extra>")
    if measured is not None:
        fig.add_scatter(x=ranks, y=[m / scale for m in measured], mode="markers+text", name="measured resident",
                        offsetgroup="sharded",
                        marker={"symbol": "diamond", "size": 12, "color": "black"}, customdata=list(measured),
                        text=["= formula" if m == formula else f"≠ formula ({m - formula:+d} B)" for m in measured],
                        textposition="top center", cliponaxis=False,
                        hovertemplate="%{x}: measured %{customdata} B<extra></extra>")
    saved = rep - formula
    # headroom above the tallest bar, so that the "= formula" labels above it stay inside the plot
    top = max([rep, formula, *(measured or [])]) / scale * 1.18
    fig.update_layout(
        barmode="group", scattermode="group", height=420, yaxis_title=f"{unit} per rank", legend_title="",
        yaxis_range=[0, top],
        title=f"{title}<br><sup>R = {rep} B → formula {formula} B (chunks {chunks} B + "
        + (f"{slots} B of the peers' slot pages, map_own_chunk" if mapped else f"2 × {slot} B slots") + "); "
        f"{'saves' if saved >= 0 else 'costs'} {abs(saved)} B per rank</sup>",
    )
    return fig


# ---- small helpers for the notebooks -----------------------------------------------------------
def step_time_figure(step_ms: Mapping[str, float], title: str = "Step time", note: str = "") -> go.Figure:
    """Mean step time of each variant (``{"replicated": ms, "sharded": ms, ...}``) as bars."""
    names = list(step_ms)
    fig = go.Figure(go.Bar(x=names, y=[step_ms[k] for k in names], text=[f"{step_ms[k]:.2f} ms" for k in names],
                           textposition="outside", cliponaxis=False,
                           marker_color=["#9d9d9d", "#4c78a8", "#d62728"][: len(names)]))
    top = max(step_ms.values(), default=0) * 1.18 or 1  # room for the labels above the bars
    fig.update_layout(title=title + (f"<br><sup>{note}</sup>" if note else ""), yaxis_title="ms per step", height=360,
                      yaxis_range=[0, top])
    return fig


def tokens_figure(counts: Sequence[Sequence[int]], equal: Sequence[Sequence[bool | None]] | None = None,
                  title: str = "Tokens per rank and step") -> go.Figure:
    """Heatmap of ``counts[step][rank]``; with ``equal[rank][step]`` each cell also says whether the
    sharded output equalled the replicated one bit for bit (``idle`` for a dummy step)."""
    steps, world = len(counts), len(counts[0]) if counts else 0
    text = []
    for s in range(steps):
        row = []
        for r in range(world):
            tag = ""
            if equal is not None:
                e = equal[r][s]
                tag = " idle (dummy step)" if e is None else (" equal" if e else " DIFFERENT")
            row.append(f"{counts[s][r]}{tag}")
        text.append(row)
    fig = go.Figure(go.Heatmap(z=[list(c) for c in counts], x=[f"rank {r}" for r in range(world)],
                               y=[f"step {s}" for s in range(steps)], text=text, texttemplate="%{text}",
                               colorscale="Blues", colorbar_title="tokens"))
    fig.update_layout(title=title, height=120 + 50 * steps, yaxis_autorange="reversed")
    return fig
