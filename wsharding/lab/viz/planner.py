"""Figures of the lookahead planner (notebook 03, ``wsharding demo``): what each rank's compute and
gathers did in one step, which layer held which slot, and the weight bytes per rank.

Every figure is drawn from trace records (``StepTrace.records()``: one dict per rank, step and
layer with times in microseconds from that rank's step start) or from the demo's report; nothing
here measures or computes a number the planner did not record. Bars are ``go.Bar`` with
``orientation="h"``, ``base`` = start and ``x`` = duration, so the hover shows the trace's own
numbers. Records of several steps are reduced to the last step of each rank.
"""

from __future__ import annotations

import statistics
import textwrap
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


def exposed_span(r: Record) -> tuple[float, float] | None:
    """``(start, duration)`` of the time a layer's compute waited for its gather.

    With lookahead that is the wait segment (wait_start → wait_end). A record marked
    ``lookahead: False`` issued its gather at its own start, and a backend may run such a gather
    inline before the wait is marked (gloo does): then the whole span issue → wait_end is waiting.
    Records without the key are read as lookahead records."""
    if r.get("lookahead") is False:
        return _span(r, "issue", "wait_end")
    return _span(r, "wait_start", "wait_end")


def exposed_us(records: Iterable[Record]) -> dict[int, float]:
    """Per rank, the sum of its exposed waits (:func:`exposed_span`) in its last step: time the
    compute spent waiting."""
    out: dict[int, float] = {}
    for r in last_step(records):
        s = exposed_span(r)
        out[r["rank"]] = out.get(r["rank"], 0.0) + (max(0.0, s[1]) if s else 0.0)
    return out


def exposed_us_per_step(records: Iterable[Record]) -> dict[int, list[float]]:
    """Per rank, the sum of its wait segments in each step, in step order (µs)."""
    sums: dict[tuple[int, int], float] = {}
    for r in records:
        if "rank" not in r or "layer" not in r:
            continue
        key = (r["rank"], r.get("step", 0))
        s = exposed_span(r)
        sums[key] = sums.get(key, 0.0) + (max(0.0, s[1]) if s else 0.0)
    out: dict[int, list[float]] = {}
    for (rank, _step), v in sorted(sums.items()):
        out.setdefault(rank, []).append(v)
    return out


def median_exposed_us(records: Iterable[Record]) -> dict[int, float]:
    """Per rank, the median over steps of its exposed wait per step (µs): one slow gather in one
    step (a CPU rank descheduled) moves it little, where the last step alone can be all noise."""
    return {rank: statistics.median(v) for rank, v in exposed_us_per_step(records).items()}


class _Bars:
    """Accumulates horizontal bars of one trace (one legend entry)."""

    def __init__(self, name: str, color: str, **style: Any) -> None:
        self.name, self.color, self.style = name, color, style
        self.y: list[str] = []
        self.base: list[float] = []
        self.x: list[float] = []
        self.text: list[str] = []
        self.hover: list[str] = []
        self.offsets: list[float] = []

    def add(self, lane: str, start: float, width: float, text: str, hover: str, offset: float | None = None) -> None:
        self.y.append(lane)
        self.base.append(start)
        self.x.append(width)
        self.text.append(text)
        self.hover.append(hover)
        if offset is not None:
            self.offsets.append(offset)

    def trace(self) -> go.Bar:
        style = dict(self.style)
        if self.offsets:
            style["offset"] = self.offsets
        return go.Bar(
            name=self.name, y=self.y, base=self.base, x=self.x, orientation="h", marker_color=self.color,
            text=self.text, textposition="inside", insidetextanchor="start", hovertext=self.hover,
            hoverinfo="text", textangle=0, insidetextfont={"size": 12}, constraintext="none", **style,
        )


def _hover(what: str, r: Record, start: float, width: float) -> str:
    return (f"rank {r['rank']} step {r.get('step', '?')} layer {r['layer']} slot {r.get('slot') or '-'}<br>"
            f"{what}: {start:.1f} → {start + width:.1f} µs ({width:.1f} µs)")


#: Where bars sit inside a lane (y units, the lane's centre at 0): the main bars in the upper part, the
#: exposed-wait strip along the lane's lower edge, so that a wait never covers a layer's label.
MAIN_BAR = {"offset": -0.28, "width": 0.66}
WAIT_STRIP = {"offset": -0.45, "width": 0.14}
#: In a slot lane, successive occupants alternate between two half rows, so that two occupancies
#: of one slot that overlap in time (the race the gate prevents) are both visible.
HALF_ROWS = (0.02, -0.34)
HALF_WIDTH = 0.34
HELD_STRIP = {"offset": 0.37, "width": 0.1}


def _layout(fig: go.Figure, title: str, lanes: list[str], n_ranks: int, note: str = "") -> go.Figure:
    if note:
        title += f"<br><sup>{note}</sup>"
    lines = title.count("<br>") + 1  # the title's lines, each ~20 px, above the plot
    fig.update_layout(
        title=title, barmode="overlay", xaxis_title="µs from the step start (each rank's own clock)",
        height=150 + 20 * lines + 80 * max(1, len(lanes)), legend_title="", margin={"t": 50 + 22 * lines},
        legend={"orientation": "h", "y": -0.25 if len(lanes) > 2 else -0.5, "x": 0},
        yaxis={"categoryorder": "array", "categoryarray": list(reversed(lanes)), "title": ""},
        font={"size": 12},
    )
    if not lanes:
        fig.add_annotation(text="no trace records", showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5)
    return fig


# ---- the timeline ------------------------------------------------------------------------------
def _timeline_traces(recs: Sequence[Record]) -> tuple[list[go.Bar], list[str]]:
    """The bars of :func:`timeline_figure` for records of one step per rank, and their lanes."""
    compute = _Bars("compute", COLORS["compute"], **MAIN_BAR)
    gathers = {s: _Bars(f"gather → slot {s}", COLORS[f"gather {s}"], **MAIN_BAR) for s in ("A", "B")}
    wait = _Bars("exposed wait", COLORS["wait"], **WAIT_STRIP)
    lanes = []
    for rank in _ranks(recs):
        lanes += [f"rank {rank} · compute", f"rank {rank} · gather"]
    for r in recs:
        label = f"L{r['layer']}" + (f"·{r['slot']}" if r.get("slot") else "")
        c_lane, g_lane = f"rank {r['rank']} · compute", f"rank {r['rank']} · gather"
        if (s := _span(r, "compute_start", "compute_end")) is not None:
            compute.add(c_lane, s[0], s[1], label, _hover("compute", r, *s))
        if (s := _span(r, "gather_start", "gather_end")) is not None:
            gathers.get(r.get("slot") or "A", gathers["A"]).add(g_lane, s[0], s[1], label, _hover("gather", r, *s))
        if (s := exposed_span(r)) is not None:
            wait.add(c_lane, s[0], s[1], "", _hover("exposed wait", r, *s))
    # the wait strip first: drawn behind everything else
    return [b.trace() for b in (wait, compute, gathers["A"], gathers["B"])], lanes


#: A bar's label is drawn only where it fits inside the bar, at one size for the whole figure: labels
#: of short bars (11 layers on a narrow page) would otherwise run into each other. Hover shows them all.
LABELS_THAT_FIT = {"minsize": 10, "mode": "hide"}


def timeline_figure(records: Iterable[Record], title: str = "Gathers and compute per rank", note: str = "") -> go.Figure:
    """Two lanes per rank: **compute** (compute_start → compute_end, labelled ``L<layer>·<slot>``;
    a dense layer, traced by :func:`wsharding.lab.tasks.planner.trace_dense_layers`, has no slot)
    and **gather** (gather_start → gather_end, coloured by the slot it fills), plus the **exposed
    wait** segments (wait_start → wait_end) as a red strip along the compute lane's lower edge: the
    time the layer could not start because its gather had not arrived (a strip, so that it never
    covers a label). With lookahead they shrink to slivers; without it each covers its whole
    gather. Only the last step of each rank is shown. ``note`` is written under the title (what the
    run was, whether noise dominates it)."""
    recs = last_step(records)
    traces, lanes = _timeline_traces(recs)
    fig = go.Figure(traces)
    exposed = exposed_us(recs)
    if exposed:
        title += "<br><sup>exposed wait per rank in this step: " + ", ".join(
            f"rank {k} {v / 1e3:.2f} ms" for k, v in sorted(exposed.items())) + "</sup>"
    fig.update_layout(uniformtext=LABELS_THAT_FIT)
    return _layout(fig, title, lanes, len(_ranks(recs)), note)


#: px above a hanging title, per line of it (17 px text at plotly's line height), for a subplot's one-line
#: title below it with a gap, and the title's first-line ascent above its anchor (plotly anchors there).
TITLE_PAD, TITLE_LINE, SUBPLOT_TITLE, TITLE_ASCENT = 12, 24, 32, 16


def lookahead_pair_figure(on: Iterable[Record], off: Iterable[Record], *, title: str = "Lookahead on and off",
                          note: str = "", ranks: Sequence[int] | None = None) -> go.Figure:
    """One step with lookahead (top) and one without (bottom), on **one** time axis: the two can be
    compared by eye, the end of each step included. ``on`` / ``off``: records of one step per rank
    (:func:`wsharding.lab.widgets.planner.lookahead_view` picks the median step of each);
    ``ranks``: the ranks drawn (default all). Each panel's title gives that step's end and its
    exposed wait per rank."""
    from plotly.subplots import make_subplots

    parts = []
    for name, records in (("lookahead on", on), ("lookahead off", off)):
        recs = [r for r in last_step(records) if ranks is None or r["rank"] in ranks]
        end = max((float(v) for r in recs for k, v in r.items() if k in ("compute_end", "gather_end")), default=0.0)
        exposed = exposed_us(recs)
        parts.append((recs, f"{name}: step ends at {end / 1e3:.1f} ms; exposed wait "
                      + ", ".join(f"rank {k} {v / 1e3:.1f} ms" for k, v in sorted(exposed.items()))))
    lanes_per = max(2, 2 * max(len(_ranks(p[0])) for p in parts))
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=[p[1] for p in parts])
    for row, (recs, _t) in enumerate(parts, start=1):
        traces, lanes = _timeline_traces(recs)
        for t in traces:
            t.update(legendgroup=t.name, showlegend=row == 1)
            fig.add_trace(t, row=row, col=1)
        fig.update_yaxes(categoryorder="array", categoryarray=list(reversed(lanes)), title="", row=row, col=1)
    fig.update_xaxes(title="µs from the step start (each rank's own clock)", row=2, col=1)
    if note:  # in lines of at most 100 characters: one long line would run past the figure's edge
        lines_of_note = [ln for part in note.split("<br>") for ln in textwrap.wrap(part, 100)]
        title += "".join(f"<br><sup>{ln}</sup>" for ln in lines_of_note)
    lines = title.count("<br>") + 1
    # The title hangs from the figure's top edge and the margin holds all its lines and, below them,
    # the first subplot's title: plotly centres a title in the margin by default, and a title of
    # several lines then grows down over the subplot title.
    top, bottom = TITLE_PAD + TITLE_LINE * lines + SUBPLOT_TITLE, 110
    plot = 2 * 55 * lanes_per + 60  # px of the two subplots and the gap between them
    height = top + plot + bottom
    # plotly anchors a top-anchored title at its first line's baseline region: the line's ascent sits
    # above the anchor (about 15 px at the title's 17 px), so the anchor goes that much lower
    fig.update_layout(title={"text": title, "yref": "container", "y": 1 - (TITLE_PAD + TITLE_ASCENT) / height,
                             "yanchor": "top"},
                      barmode="overlay", uniformtext=LABELS_THAT_FIT, font={"size": 12},
                      height=height, margin={"t": top, "b": bottom},
                      # the legend under the x-axis title (about 45 px below the plot), never on it
                      legend={"orientation": "h", "x": 0, "y": -55 / plot, "yanchor": "top"})
    for a in fig.layout.annotations:  # the subplot titles: left-aligned, small
        a.update(x=0, xanchor="left", font={"size": 12})
    return fig


# ---- slot occupancy ----------------------------------------------------------------------------
def slot_figure(records: Iterable[Record], title: str = "Slot A/B occupancy and gate waits", note: str = "") -> go.Figure:
    """Two lanes per rank, **slot A** and **slot B**: a bar per layer from its gather_start to its
    compute_end (the slot is that layer's from the moment its gather may write it until the layer
    has read it). Successive occupants of a slot alternate between the lane's upper and lower half,
    so two occupancies that overlap in time both show, and the time they overlap is drawn across
    the lane, behind the bars, as **written while read** (hatched red): a gather that overwrote weights a layer was
    still reading. Thin strips: **gate waits** along the top (held → gather_start: a gather
    dispatched early and held until the layer two back, which reads the same slot, was done) and
    **exposed waits** along the bottom (wait_start → wait_end). With the gate there is no red hatch."""
    recs = last_step(records)
    ranks = _ranks(recs)
    occupancy = {s: _Bars(f"slot {s} occupied", COLORS[f"slot {s}"], width=HALF_WIDTH, opacity=0.8)
                 for s in ("A", "B")}
    gate = _Bars("gate wait (held)", COLORS["gate"], **HELD_STRIP)
    wait = _Bars("exposed wait", COLORS["wait"], **WAIT_STRIP)
    # behind the occupancy bars and taller than both half rows: it shows above, below and between
    # them, and through them, without covering a layer's label
    clash = _Bars("written while read", COLORS["wait"], offset=-0.47, width=0.94, opacity=0.8,
                  marker_pattern_shape="x", marker_line_width=0)
    lanes = []
    for rank in ranks:
        lanes += [f"rank {rank} · slot A", f"rank {rank} · slot B"]
    seen: dict[str, int] = {}
    for r in sorted(recs, key=lambda r: (r["rank"], r.get("gather_start") or 0.0, r["layer"])):
        slot = r.get("slot")
        if slot not in ("A", "B"):
            continue  # never issued: it occupied no slot
        lane = f"rank {r['rank']} · slot {slot}"
        if (s := _span(r, "gather_start", "compute_end")) is not None:
            k = seen.get(lane, 0)
            seen[lane] = k + 1
            occupancy[slot].add(lane, s[0], s[1], f"L{r['layer']}",
                                _hover(f"slot {slot} holds layer {r['layer']}", r, *s), offset=HALF_ROWS[k % 2])
        if (s := _span(r, "held", "gather_start")) is not None:
            gate.add(lane, s[0], s[1], "", _hover("held by the gate", r, *s))
        if (s := exposed_span(r)) is not None:
            wait.add(lane, s[0], s[1], "", _hover("exposed wait", r, *s))
    for rank, slot, _a, _b, start, end in _overlap_spans(recs):
        clash.add(f"rank {rank} · slot {slot}", start, end - start, "",
                  f"rank {rank} slot {slot}: layer {_b}'s gather wrote it while layer {_a} still read it<br>"
                  f"{start:.1f} → {end:.1f} µs")
    fig = go.Figure([b.trace() for b in (wait, clash, gate, occupancy["A"], occupancy["B"])])
    return _layout(fig, title, lanes, len(ranks), note)


def _overlap_spans(recs: Sequence[Record]) -> list[tuple[int, str, int, int, float, float]]:
    """``(rank, slot, earlier layer, later layer, start, end)`` of each overlap of two occupancies
    of one slot in ``recs`` (already one step per rank)."""
    out = []
    for rank in _ranks(recs):
        for slot in ("A", "B"):
            spans = sorted(
                (s[0], s[0] + s[1], r["layer"]) for r in recs
                if r["rank"] == rank and r.get("slot") == slot and (s := _span(r, "gather_start", "compute_end"))
            )
            out += [(rank, slot, a[2], b[2], b[0], min(a[1], b[1]))
                    for a, b in zip(spans, spans[1:], strict=False) if b[0] < a[1]]
    return out


def slot_overlaps(records: Iterable[Record]) -> list[tuple[int, str, int, int]]:
    """``(rank, slot, earlier layer, later layer)`` for each pair of layers whose occupancy of one
    slot overlaps in time in the last step: a gather that wrote a slot still being read. Empty when
    the gate did its job."""
    return [o[:4] for o in _overlap_spans(last_step(records))]


# ---- the opening animation ---------------------------------------------------------------------
#: The three lanes of :func:`animated_timeline`, top to bottom.
ANIMATION_LANES = ("compute", "slot A", "slot B")


def _previous_readers(recs: Sequence[Record]) -> dict[int, Record]:
    """For each layer, the record of the layer that read the same slot before it (its gate)."""
    out: dict[int, Record] = {}
    last: dict[str, Record] = {}
    for r in sorted(recs, key=lambda r: r["layer"]):
        slot = r.get("slot")
        if slot not in ("A", "B"):
            continue
        if slot in last:
            out[r["layer"]] = last[slot]
        last[slot] = r
    return out


def animated_timeline(records: Iterable[Record], *, rank: int = 0, frames: int = 30,
                      title: str = "Lookahead over two slots", note: str = "") -> go.Figure:
    """One rank's step as an animation (plotly frames, a play button and a time slider): the layers'
    **compute**, and per slot, A and B, the **gather** that fills it (hatched) followed by the layer
    **reading** it (solid). A grey tick on a slot lane marks its **gate**: the moment the slot's
    previous reader finished, before which no gather may write the slot; a gather held by it shows
    a grey strip from its dispatch. Red strips on the compute lane are exposed waits.

    Drawn from trace records (the last step of ``rank``): :func:`wsharding.lab.tasks.planner.model_schedule`
    (the planner's order with fixed durations) or a live run's trace (:func:`run_schedule`,
    :func:`traced_run`). The figure's own data is the whole step, so a static render shows it all;
    frame ``k`` of ``frames`` shows the step up to ``k/frames`` of its length."""
    if frames < 1:
        raise InvalidArgument(f"frames: must be >= 1, got {frames}")
    recs = [r for r in last_step(records) if r["rank"] == rank]
    if not recs:
        raise NotFound(f"animated_timeline: no trace records of rank {rank}")
    ms = 1e-3  # records are in µs; the opening figure reads in ms
    end = max(float(v) for r in recs for k, v in r.items() if k in ("compute_end", "gather_end") and v is not None)
    readers = _previous_readers(recs)
    # (trace name, colour, lane, [(start, end, label)], style)
    waits, computes, gate_ticks, held = [], [], [], []
    gathers: dict[str, list[tuple[float, float, str]]] = {"A": [], "B": []}
    reads: dict[str, list[tuple[float, float, str]]] = {"A": [], "B": []}
    for r in recs:
        slot = r.get("slot")
        if (s := exposed_span(r)) is not None and s[1] > 0:
            waits.append((s[0], s[0] + s[1], ""))
        if (s := _span(r, "compute_start", "compute_end")) is not None:
            computes.append((s[0], s[0] + s[1], f"L{r['layer']}" + (f"·{slot}" if slot else "")))
            if slot in reads:
                reads[slot].append((s[0], s[0] + s[1], f"L{r['layer']} reads"))
        if slot in gathers and (s := _span(r, "gather_start", "gather_end")) is not None:
            gathers[slot].append((s[0], s[0] + s[1], f"gather L{r['layer']}"))
        if slot in gathers and (s := _span(r, "held", "gather_start")) is not None and s[1] > 0:
            held.append((f"slot {slot}", s[0], s[0] + s[1]))
        prev = readers.get(r["layer"])
        if prev is not None and prev.get("compute_end") is not None:
            gate_ticks.append((f"slot {slot}", float(prev["compute_end"]), r["layer"], prev["layer"]))

    def bars(name: str, color: str, lane: str, spans: list[tuple[float, float, str]], t: float,
             **style: Any) -> go.Bar:
        base = [a * ms for a, _b, _l in spans]
        width = [max(0.0, min(b, t) - a) * ms for a, b, _l in spans]
        text = [lab if min(b, t) - a > 0 else "" for a, b, lab in spans]
        return go.Bar(name=name, y=[lane] * len(spans), base=base, x=width, orientation="h", marker_color=color,
                      text=text, textposition="inside", insidetextanchor="start", textangle=0,
                      insidetextfont={"size": 12}, constraintext="none", hoverinfo="text",
                      hovertext=[f"{name}: {a * ms:.2f} → {b * ms:.2f} ms" for a, b, _l in spans],
                      showlegend=True, **style)

    def data(t: float) -> list[Any]:
        lanes_held = [h for h in held if h[1] < t]
        ticks = [g for g in gate_ticks if g[1] <= t]
        return [
            bars("exposed wait", COLORS["wait"], "compute", waits, t, **WAIT_STRIP),
            bars("compute", COLORS["compute"], "compute", computes, t, **MAIN_BAR),
            bars("gather → slot A", COLORS["gather A"], "slot A", gathers["A"], t, marker_pattern_shape="/",
                 **MAIN_BAR),
            bars("layer reads slot A", COLORS["slot A"], "slot A", reads["A"], t, opacity=0.6, **MAIN_BAR),
            bars("gather → slot B", COLORS["slot B"], "slot B", gathers["B"], t, marker_pattern_shape="/",
                 **MAIN_BAR),
            bars("layer reads slot B", COLORS["slot B"], "slot B", reads["B"], t, opacity=0.6, **MAIN_BAR),
            go.Bar(name="held by the gate", y=[h[0] for h in lanes_held], base=[h[1] * ms for h in lanes_held],
                   x=[(min(h[2], t) - h[1]) * ms for h in lanes_held], orientation="h",
                   marker_color=COLORS["gate"], hoverinfo="skip", **HELD_STRIP),
            go.Scatter(name="gate: the slot's previous reader is done", x=[g[1] * ms for g in ticks],
                       y=[g[0] for g in ticks], mode="markers",
                       marker={"symbol": "line-ns", "size": 34, "line": {"width": 3, "color": "#333"}},
                       hovertext=[f"gate of layer {g[2]}: layer {g[3]} done at {g[1] * ms:.2f} ms" for g in ticks],
                       hoverinfo="text"),
            go.Scatter(name="now", x=[t * ms, t * ms], y=[ANIMATION_LANES[0], ANIMATION_LANES[-1]], mode="lines",
                       line={"color": "#000", "dash": "dot", "width": 1}, hoverinfo="skip", showlegend=False),
        ]

    times = [end * (k + 1) / frames for k in range(frames)]
    fig = go.Figure(data=data(end), frames=[go.Frame(data=data(t), name=str(k)) for k, t in enumerate(times)])
    play = {"frame": {"duration": 150, "redraw": True}, "transition": {"duration": 0}, "fromcurrent": False}
    fig.update_layout(
        title=title + (f"<br><sup>{note}</sup>" if note else ""), barmode="overlay", font={"size": 12},
        height=560, margin={"t": 90, "b": 230},
        xaxis={"title": "ms from the step start", "range": [0, end * ms * 1.02]},
        yaxis={"categoryorder": "array", "categoryarray": list(reversed(ANIMATION_LANES)), "title": ""},
        legend={"orientation": "h", "y": -0.62, "yanchor": "top", "x": 0},
        updatemenus=[{"type": "buttons", "direction": "left", "x": 0, "y": -0.3, "xanchor": "left",
                      "yanchor": "top", "showactive": False, "pad": {"r": 10},
                      "buttons": [{"label": "▶ play", "method": "animate", "args": [None, play]},
                                  {"label": "❚❚ pause", "method": "animate",
                                   "args": [[None], {"mode": "immediate", "frame": {"duration": 0}}]}]}],
        sliders=[{"active": frames - 1, "x": 0.3, "len": 0.7, "y": -0.26, "yanchor": "top",
                  "currentvalue": {"prefix": "t = ", "suffix": " ms"}, "pad": {"t": 0},
                  "steps": [{"label": f"{t * ms:.0f}" if (frames - 1 - k) % max(1, frames // 6) == 0 else "",
                             "method": "animate",
                             "args": [[str(k)], {"mode": "immediate", "frame": {"duration": 0, "redraw": True},
                                                 "transition": {"duration": 0}}]} for k, t in enumerate(times)]}],
    )
    return fig


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
