"""Figures of a :class:`~wsharding.core.layout.FlatLayout`: where every byte of T lives and who owns it.

* :func:`chunk_map_figure` -- one horizontal byte axis ``[0, |T|)``: a row of weights (each entry,
  each alignment hole, the tail padding) above a row of rank chunks, with the chunk borders drawn
  as lines across both. A border that cuts through a weight is labelled: that is the case where a
  chunk holds the tail of one weight and the head of the next.
* :func:`rank_pieces_figure` -- one row per rank, x = byte inside the rank's chunk: which pieces of
  which weights the rank stores, and where its chunk is padding.
* :func:`pieces_table_figure` -- the same pieces as a table with exact byte ranges.
* :func:`gather_count_figure`, :func:`view_addresses_figure`, :func:`gather_check_figure` -- the
  notebook's pictures of "one gather per layer", zero-copy views, and a verified live gather.

Figures stay light for layers of hundreds of MB: there is one bar per entry, per padding hole and
per rank (never per byte), and the byte axis is numeric.

The figures are built from small pure functions (:func:`segments`, :func:`rank_bands`,
:func:`border_cuts`, :func:`piece_rows`) that tests check byte for byte.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go
import torch
from plotly.colors import qualitative

from wsharding.core.layout import SUPPORTED_DTYPES, FlatLayout

#: Colours of the padding kinds and of the alternating rank bands.
ALIGNMENT_COLOR = "#d62728"
TAIL_COLOR = "#7f7f7f"
RANK_COLORS = ("#4c78a8", "#9ecae9")
CHUNK_PADDING_COLOR = "#c7c7c7"

#: Row labels of the chunk map (top to bottom).
ROW_WEIGHTS = "T: weights"
ROW_RANKS = "T: rank chunks"

#: At most this many border labels are drawn; more would hide the figure behind text.
MAX_BORDER_LABELS = 12
#: Levels the border labels stack on, and the plot width they are laid out for (px: the narrowest a
#: learner sees, 1280 px with the file browser open) at about 6.6 px per character of 11 px text.
LABEL_LEVELS, LABEL_PLOT_PX, LABEL_CHAR_PX = 3, 760, 6.6


def border_label_levels(cuts: list[BorderCut], total_bytes: int) -> list[tuple[BorderCut, int]]:
    """``(cut, level)`` for the border labels drawn: each on the lowest level where it keeps clear of
    the labels already there (widths estimated from the text), at most :data:`MAX_BORDER_LABELS`; a
    label with no clear level is left out (its border line stays, and the title counts every cut).
    On one level, two labels at borders a chunk apart ran together ("cuts ...weightcuts ...weight")."""
    placed: list[tuple[BorderCut, int, float, float]] = []  # cut, level, centre px, half width px
    for c in cuts:
        if len(placed) == MAX_BORDER_LABELS:
            break
        x = c.border / max(1, total_bytes) * LABEL_PLOT_PX
        half = (len(f"cuts {c.name}") * LABEL_CHAR_PX + 8) / 2
        for level in range(LABEL_LEVELS):
            if all(abs(x - px) >= half + h for _c, lv, px, h in placed if lv == level):
                placed.append((c, level, x, half))
                break
    return [(c, level) for c, level, _x, _h in placed]


def human_bytes(n: int) -> str:
    """``n`` bytes in binary units (``"1.5 KiB"``); exact below 1 KiB."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def _bytes_both(n: int) -> str:
    return f"{n} B" + (f" ({human_bytes(n)})" if n >= 1024 else "")


@dataclass(frozen=True)
class Segment:
    """A byte range ``[start, stop)`` of T: an entry, an alignment hole, or the tail padding."""

    kind: str  # "entry" | "alignment" | "tail"
    name: str  # the entry's name; "" for padding
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class BorderCut:
    """A chunk border at byte ``border`` that falls strictly inside entry ``name``: the entry's
    head lives on ``left_rank`` and its tail on ``right_rank``."""

    border: int
    name: str
    left_rank: int
    right_rank: int


def segments(layout: FlatLayout) -> list[Segment]:
    """T cut into entries and padding, in byte order; the segments tile ``[0, total_bytes)`` exactly.

    Holes between entries are ``"alignment"`` (the 16-byte offset rule); the bytes after the last
    entry are ``"tail"`` (the ``16 * N`` total rule). Entries of zero bytes take no room and are left out.
    """
    out: list[Segment] = []
    cursor = 0
    for e in layout.entries:
        if e.offset > cursor:
            out.append(Segment("alignment", "", cursor, e.offset))
        if e.nbytes:
            out.append(Segment("entry", e.name, e.offset, e.end))
        cursor = max(cursor, e.end)
    if layout.total_bytes > cursor:
        out.append(Segment("tail", "", cursor, layout.total_bytes))
    return out


def rank_bands(layout: FlatLayout) -> list[tuple[int, int, int]]:
    """``(rank, start, stop)`` of every rank's chunk in T."""
    return [(r, *layout.chunk_range(r)) for r in range(layout.group_size)]


def border_cuts(layout: FlatLayout) -> list[BorderCut]:
    """Chunk borders ``i * C`` (``0 < i < N``) that fall strictly inside an entry.

    Each one means rank ``i - 1`` stores the head of that weight and rank ``i`` its tail, so
    rank ``i``'s chunk starts with the tail of one weight (and, if it is long enough, goes on to the
    head of the next). Chunk borders depend only on ``|T|`` and ``N``, never on weight borders.
    """
    cuts = []
    for i in range(1, layout.group_size):
        b = i * layout.chunk_bytes
        for e in layout.entries:
            if e.offset < b < e.end:
                cuts.append(BorderCut(b, e.name, i - 1, i))
    return cuts


def piece_rows(layout: FlatLayout) -> list[dict[str, int | str]]:
    """Every rank's owned pieces as rows: rank, entry, byte range in the entry, in the chunk, in T."""
    rows: list[dict[str, int | str]] = []
    for r in range(layout.group_size):
        lo, _ = layout.chunk_range(r)
        for p in layout.pieces(r):
            rows.append(
                {
                    "rank": r,
                    "entry": p.name,
                    "entry_start": p.entry_start,
                    "entry_stop": p.entry_stop,
                    "chunk_start": p.chunk_start,
                    "chunk_stop": p.chunk_stop,
                    "t_start": lo + p.chunk_start,
                    "t_stop": lo + p.chunk_stop,
                    "nbytes": p.nbytes,
                }
            )
    return rows


def chunk_padding(layout: FlatLayout) -> list[tuple[int, int, int]]:
    """``(rank, chunk_start, chunk_stop)`` of every byte range of a chunk that no piece covers."""
    out = []
    for r in range(layout.group_size):
        cursor = 0
        for p in layout.pieces(r):
            if p.chunk_start > cursor:
                out.append((r, cursor, p.chunk_start))
            cursor = p.chunk_stop
        if cursor < layout.chunk_bytes:
            out.append((r, cursor, layout.chunk_bytes))
    return out


def entry_colors(layout: FlatLayout) -> dict[str, str]:
    """One colour per entry, the same in every figure of this module."""
    palette = qualitative.Plotly + qualitative.D3 + qualitative.Set2
    # Padding is red/grey: skip palette colours that would be confused with it.
    palette = [c for c in palette if c.lower() not in (ALIGNMENT_COLOR, TAIL_COLOR)]
    return {e.name: palette[i % len(palette)] for i, e in enumerate(layout.entries)}


def _entry_label(layout: FlatLayout, name: str) -> str:
    e = layout.entry(name)
    return f"{name}<br>{SUPPORTED_DTYPES[e.dtype]} {list(e.shape)}"


#: The chunk map's bars let the chunk borders behind them show through.
BAR_OPACITY = 0.8


def chunk_map_figure(layout: FlatLayout, *, title: str | None = None, height: int = 380) -> go.Figure:
    """The byte map of T: entries and padding on top, rank chunks below, chunk borders as lines.

    Traces, in order: one per non-empty entry, then one for all alignment holes (if any), one for
    the tail padding (if any), one for all rank chunks. Chunk borders are layout shapes; borders
    that cut a weight carry a label naming it (see :func:`border_cuts`).
    """
    colors = entry_colors(layout)
    segs = segments(layout)
    owners: dict[str, list[int]] = {}
    for row in piece_rows(layout):
        owners.setdefault(str(row["entry"]), []).append(int(row["rank"]))
    fig = go.Figure()
    for s in segs:
        if s.kind != "entry":
            continue
        e = layout.entry(s.name)
        fig.add_trace(
            go.Bar(
                name=s.name,
                y=[ROW_WEIGHTS],
                x=[s.nbytes],
                base=[s.start],
                orientation="h",
                marker_color=colors[s.name],
                text=[_entry_label(layout, s.name)],
                textposition="inside",
                insidetextanchor="middle",
                textangle=0,  # a label that does not fit is hidden (uniformtext), never turned sideways
                hovertext=[
                    f"<b>{s.name}</b> {SUPPORTED_DTYPES[e.dtype]} {list(e.shape)}<br>"
                    f"bytes [{s.start}, {s.stop}) = {human_bytes(s.nbytes)}<br>"
                    f"owned by rank(s) {owners.get(s.name, [])}"
                ],
                hoverinfo="text",
            )
        )
    for kind, label, color in (("alignment", "alignment padding", ALIGNMENT_COLOR), ("tail", "tail padding", TAIL_COLOR)):
        pads = [s for s in segs if s.kind == kind]
        if not pads:
            continue
        fig.add_trace(
            go.Bar(
                name=label,
                y=[ROW_WEIGHTS] * len(pads),
                x=[s.nbytes for s in pads],
                base=[s.start for s in pads],
                orientation="h",
                marker_color=color,
                marker_pattern_shape="/",
                hovertext=[f"{label}: bytes [{s.start}, {s.stop}) = {s.nbytes} B" for s in pads],
                hoverinfo="text",
            )
        )
    bands = rank_bands(layout)
    band_text, band_hover = [], []
    for r, lo, hi in bands:
        pieces = layout.pieces(r)
        names = [p.name for p in pieces]
        # two short lines, not one long one: a label wider than its chunk is hidden (uniformtext)
        band_text.append(f"rank {r}" + (f"<br>{len(names)} weights" if len(names) > 1 else ""))
        shown = "<br>".join(f"{p.name}[{p.entry_start}:{p.entry_stop}]" for p in pieces[:8])
        more = f"<br>... and {len(pieces) - 8} more" if len(pieces) > 8 else ""
        band_hover.append(
            f"<b>rank {r}</b> chunk T[{lo}:{hi}] = {human_bytes(hi - lo)}<br>{shown or 'padding only'}{more}"
        )
    fig.add_trace(
        go.Bar(
            name="rank chunks",
            y=[ROW_RANKS] * len(bands),
            x=[hi - lo for _, lo, hi in bands],
            base=[lo for _, lo, _ in bands],
            orientation="h",
            marker_color=[RANK_COLORS[r % 2] for r, _, _ in bands],
            marker_line_color="white",
            marker_line_width=1,
            text=band_text,
            textposition="inside",
            insidetextanchor="middle",
            hovertext=band_hover,
            hoverinfo="text",
        )
    )
    for i in range(1, layout.group_size):
        # behind the bars (drawn a little transparent, so the border shows through): a line drawn over
        # them crossed the weights' labels
        fig.add_vline(x=i * layout.chunk_bytes, line_width=2, line_dash="dash", line_color="black", layer="below")
    fig.update_traces(marker_opacity=BAR_OPACITY)
    cuts = border_cuts(layout)
    for c, level in border_label_levels(cuts, layout.total_bytes):
        fig.add_annotation(
            x=c.border, y=1.0, yref="paper", yanchor="bottom", showarrow=False, font_size=11,
            yshift=16 * level,  # neighbouring labels on different levels, so that they never run together
            text=f"cuts {c.name}", hovertext=f"{c.name}: head on rank {c.left_rank}, tail on rank {c.right_rank}",
        )
    n = layout.group_size
    fig.update_layout(
        title=title
        or (
            f"Flat layout over N={n}: |T| = {_bytes_both(layout.total_bytes)}, "
            f"C = {_bytes_both(layout.chunk_bytes)} per rank<br><sup>{len(cuts)} chunk border(s) cut a weight; "
            f"padding: {layout.alignment_padding_bytes} B alignment, {layout.tail_padding_bytes} B tail</sup>"
        ),
        barmode="overlay",
        height=height,
        margin=dict(t=120, l=10, r=10, b=40),
        xaxis=dict(title="byte offset in T", range=[0, layout.total_bytes], zeroline=False),
        yaxis=dict(categoryorder="array", categoryarray=[ROW_RANKS, ROW_WEIGHTS]),
        uniformtext=dict(minsize=11, mode="hide"),
    )
    return fig


def rank_pieces_figure(layout: FlatLayout, *, title: str | None = None) -> go.Figure:
    """One row per rank, x = byte inside its chunk ``[0, C)``: the pieces it stores, coloured by entry.

    Traces: one per entry that has bytes (its pieces on every rank), then one for the chunk bytes no
    piece covers (alignment holes and tail padding that fall in that chunk), if any.
    """
    colors = entry_colors(layout)
    rows = piece_rows(layout)
    fig = go.Figure()
    for e in layout.entries:
        mine = [r for r in rows if r["entry"] == e.name]
        if not mine:
            continue
        fig.add_trace(
            go.Bar(
                name=e.name,
                y=[f"rank {r['rank']}" for r in mine],
                x=[r["nbytes"] for r in mine],
                base=[r["chunk_start"] for r in mine],
                orientation="h",
                marker_color=colors[e.name],
                marker_line_color="white",
                marker_line_width=1,
                text=[f"{e.name}[{r['entry_start']}:{r['entry_stop']}]" for r in mine],
                textposition="inside",
                insidetextanchor="middle",
                textangle=0,  # a label that does not fit is hidden (uniformtext), never turned sideways
                hovertext=[
                    f"<b>{e.name}</b> bytes [{r['entry_start']}, {r['entry_stop']}) of the weight<br>"
                    f"chunk bytes [{r['chunk_start']}, {r['chunk_stop']}) of rank {r['rank']}<br>"
                    f"T bytes [{r['t_start']}, {r['t_stop']}) = {human_bytes(int(r['nbytes']))}"
                    for r in mine
                ],
                hoverinfo="text",
            )
        )
    pads = chunk_padding(layout)
    if pads:
        fig.add_trace(
            go.Bar(
                name="padding in chunk",
                y=[f"rank {r}" for r, _, _ in pads],
                x=[hi - lo for _, lo, hi in pads],
                base=[lo for _, lo, _ in pads],
                orientation="h",
                marker_color=CHUNK_PADDING_COLOR,
                marker_pattern_shape="/",
                hovertext=[f"padding: chunk bytes [{lo}, {hi}) of rank {r}" for r, lo, hi in pads],
                hoverinfo="text",
            )
        )
    n = layout.group_size
    fig.update_layout(
        title=title or f"What each rank stores: its chunk of C = {layout.chunk_bytes} B, piece by piece",
        barmode="overlay",
        height=140 + 45 * n,
        margin=dict(t=60, l=10, r=10, b=40),
        xaxis=dict(title="byte offset in the rank's chunk", range=[0, layout.chunk_bytes]),
        yaxis=dict(categoryorder="array", categoryarray=[f"rank {r}" for r in reversed(range(n))]),
        uniformtext=dict(minsize=11, mode="hide"),
    )
    return fig


def pieces_table_figure(layout: FlatLayout) -> go.Figure:
    """Each rank's pieces as a table: entry, byte range in the entry, in the chunk, in T, size."""
    rows = piece_rows(layout)
    colors = entry_colors(layout)
    cells = [
        [r["rank"] for r in rows],
        [r["entry"] for r in rows],
        [f"[{r['entry_start']}, {r['entry_stop']})" for r in rows],
        [f"[{r['chunk_start']}, {r['chunk_stop']})" for r in rows],
        [f"[{r['t_start']}, {r['t_stop']})" for r in rows],
        [r["nbytes"] for r in rows],
    ]
    fill = [["white"] * len(rows), [colors[str(r["entry"])] for r in rows]] + [["white"] * len(rows)] * 4
    fig = go.Figure(
        go.Table(
            header=dict(values=["rank", "entry", "bytes in entry", "bytes in chunk", "bytes in T", "size (B)"]),
            cells=dict(values=cells, fill_color=fill, align="left"),
        )
    )
    fig.update_layout(
        title=f"Owned pieces: N={layout.group_size}, C={layout.chunk_bytes} B",
        height=min(120 + 28 * len(rows), 700),
        margin=dict(t=50, l=10, r=10, b=10),
    )
    return fig


def gather_count_figure(layouts: Mapping[str, FlatLayout], *, max_n: int = 8) -> go.Figure:
    """Why one gather per layer: collectives per layer, and bytes each rank receives, per layer.

    Left: all-gathers per layer when every weight is gathered on its own (one per entry) versus
    the flat layout (one). Right: bytes each rank receives in the flat gather,
    ``|T| - C = (N - 1) / N * |T|`` for N = 1..``max_n`` (``|T|`` rebuilt for each N): the flat
    layout cuts the number of collectives, not the bytes, which approach ``|T|`` as N grows.
    Traces: two bar traces, then one line per layout.
    """
    from plotly.subplots import make_subplots

    names = list(layouts)
    fig = make_subplots(
        rows=1, cols=2, column_widths=[0.4, 0.6],
        subplot_titles=("all-gathers per layer", "bytes received per rank per layer (MiB)"),
    )
    fig.add_trace(go.Bar(name="one gather per weight", x=names, y=[len(layouts[k].entries) for k in names]), 1, 1)
    fig.add_trace(go.Bar(name="flat layout: one gather", x=names, y=[1] * len(names)), 1, 1)
    for k in names:
        specs = [(e.name, e.shape, e.dtype) for e in layouts[k].entries]
        ns = list(range(1, max_n + 1))
        received = []
        for n in ns:
            lay = FlatLayout(specs, n)
            received.append((lay.total_bytes - lay.chunk_bytes) / 2**20)
        fig.add_trace(go.Scatter(name=f"{k}: (N-1)/N·|T|", x=ns, y=received, mode="lines+markers"), 1, 2)
    fig.update_xaxes(title_text="N (ranks in the shard group)", row=1, col=2)
    fig.update_layout(barmode="group", height=380, margin=dict(t=60, l=10, r=10, b=40))
    return fig


def view_addresses_figure(layout: FlatLayout, buffer: torch.Tensor, views: Mapping[str, torch.Tensor]) -> go.Figure:
    """Where the views really point: byte ranges measured from ``view.data_ptr()`` next to the
    layout's planned ``[offset, offset + nbytes)``. Equal rows mean the views are windows into
    ``buffer`` -- no byte was copied. Traces: "planned" and "measured", one bar per entry each.
    """
    colors = entry_colors(layout)
    base = buffer.data_ptr()
    entries = [e for e in layout.entries if e.nbytes]
    measured = [(views[e.name].data_ptr() - base, views[e.name].numel() * views[e.name].element_size()) for e in entries]
    shared = all(views[e.name].untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr() for e in entries)
    fig = go.Figure()
    fig.add_trace(go.Bar(
        name="planned: layout offsets", y=["planned"] * len(entries), x=[e.nbytes for e in entries],
        base=[e.offset for e in entries], orientation="h", marker_color=[colors[e.name] for e in entries],
        text=[e.name for e in entries], textposition="inside", insidetextanchor="middle", textangle=0,
    ))
    fig.add_trace(go.Bar(
        name="measured: view.data_ptr() - buffer.data_ptr()", y=["measured"] * len(entries),
        x=[nb for _, nb in measured], base=[off for off, _ in measured], orientation="h",
        marker_color=[colors[e.name] for e in entries], marker_line_color="black", marker_line_width=1,
        text=[e.name for e in entries], textposition="inside", insidetextanchor="middle", textangle=0,
        hovertext=[f"{e.name}: data_ptr = buffer + {off}, {nb} B" for e, (off, nb) in zip(entries, measured, strict=True)],
        hoverinfo="text",
    ))
    fig.update_layout(
        title=f"Views are windows into one buffer of {layout.total_bytes} B "
        f"(all share its storage: {shared})",
        barmode="overlay", height=260, showlegend=False, margin=dict(t=50, l=10, r=10, b=40),
        xaxis=dict(title="byte offset in the buffer", range=[0, layout.total_bytes]),
        uniformtext=dict(minsize=11, mode="hide"),
    )
    return fig


def gather_check_figure(
    layout: FlatLayout, reports: Sequence[Mapping[str, Any]], *, mode: str, emulation: str
) -> go.Figure:
    """Per rank after a live gather: bytes it contributed (its chunk, C) and received ((N-1)·C),
    labelled with its mismatched-byte count. The title says when ranks are emulated.
    Traces: "own chunk" and "received from the others", one bar per rank each.
    """
    ranks = [f"rank {r['rank']}" for r in reports]
    c = layout.chunk_bytes
    fig = go.Figure()
    fig.add_trace(go.Bar(name="own chunk (sent)", x=ranks, y=[c] * len(reports)))
    fig.add_trace(go.Bar(
        name="received from the others", x=ranks, y=[layout.total_bytes - c] * len(reports),
        text=[f"{r['mismatched_bytes']} mismatched B, views equal: {r['views_equal']}" for r in reports],
        textposition="inside",
    ))
    note = emulation or "real GPUs"  # a subtitle: one long title line is cut at the figure's edge
    fig.update_layout(
        title=f"One all-gather of |T| = {layout.total_bytes} B on {len(reports)} ranks ({mode})<br><sup>{note}</sup>",
        barmode="stack", height=360, yaxis_title="bytes", margin=dict(t=70, l=10, r=10, b=40),
    )
    return fig
