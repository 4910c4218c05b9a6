"""Figures of the flat layout: exact byte extents of every segment, band and piece, checked on a
layout computed by hand, plus trace counts that keep the figures light for big layers."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from wsharding.core.layout import FlatLayout, LayoutEntry
from wsharding.lab.layout_presets import preset_specs
from wsharding.lab.tasks.layout import reference_tensors
from wsharding.lab.viz import layout as vl

# Hand-computed, N = 2:
#   a: bf16 (3, 5)  = 30 B at 0    -> hole [30, 32)
#   b: fp32 (10,)   = 40 B at 32   -> ends 72, hole [72, 80)
#   c: int8 (7,)    =  7 B at 80   -> ends 87; total align_up(87, 16*2) = 96 -> tail [87, 96)
#   C = 48: rank 0 owns [0, 48) = a + head of b; rank 1 owns [48, 96) = tail of b + c.
SPECS = [("a", (3, 5), torch.bfloat16), ("b", (10,), torch.float32), ("c", (7,), torch.int8)]


@pytest.fixture
def lay() -> FlatLayout:
    return FlatLayout(SPECS, 2)


def test_segments_are_exact(lay):
    assert [(s.kind, s.name, s.start, s.stop) for s in vl.segments(lay)] == [
        ("entry", "a", 0, 30),
        ("alignment", "", 30, 32),
        ("entry", "b", 32, 72),
        ("alignment", "", 72, 80),
        ("entry", "c", 80, 87),
        ("tail", "", 87, 96),
    ]


def test_rank_bands_cuts_pieces_and_chunk_padding(lay):
    assert vl.rank_bands(lay) == [(0, 0, 48), (1, 48, 96)]
    assert [(c.border, c.name, c.left_rank, c.right_rank) for c in vl.border_cuts(lay)] == [(48, "b", 0, 1)]
    rows = [(r["rank"], r["entry"], r["entry_start"], r["entry_stop"], r["chunk_start"], r["chunk_stop"],
             r["t_start"], r["t_stop"]) for r in vl.piece_rows(lay)]
    assert rows == [
        (0, "a", 0, 30, 0, 30, 0, 30),
        (0, "b", 0, 16, 32, 48, 32, 48),   # the head of b ...
        (1, "b", 16, 40, 0, 24, 48, 72),   # ... and its tail, on the next rank
        (1, "c", 0, 7, 32, 39, 80, 87),
    ]
    assert vl.chunk_padding(lay) == [(0, 30, 32), (1, 24, 32), (1, 39, 48)]


def test_border_on_a_weight_border_is_not_a_cut():
    # N = 3: C = 32, the border at 32 is exactly where b starts (not a cut); 64 falls inside b.
    lay = FlatLayout(SPECS, 3)
    assert lay.chunk_bytes == 32
    assert [(c.border, c.name) for c in vl.border_cuts(lay)] == [(64, "b")]


def test_chunk_map_traces_and_extents(lay):
    fig = vl.chunk_map_figure(lay)
    # 3 entries + 1 alignment trace + 1 tail trace + 1 rank trace
    assert [t.name for t in fig.data] == ["a", "b", "c", "alignment padding", "tail padding", "rank chunks"]
    by_name = {t.name: t for t in fig.data}
    for name, (base, width) in {"a": (0, 30), "b": (32, 40), "c": (80, 7)}.items():
        assert (tuple(by_name[name].base), tuple(by_name[name].x)) == ((base,), (width,))
        assert set(by_name[name].y) == {vl.ROW_WEIGHTS}
    assert (tuple(by_name["alignment padding"].base), tuple(by_name["alignment padding"].x)) == ((30, 72), (2, 8))
    assert (tuple(by_name["tail padding"].base), tuple(by_name["tail padding"].x)) == ((87,), (9,))
    ranks = by_name["rank chunks"]
    assert (tuple(ranks.base), tuple(ranks.x), set(ranks.y)) == ((0, 48), (48, 48), {vl.ROW_RANKS})
    assert ranks.text[1] == "rank 1<br>2 weights"
    # the chunk border is a line at byte 48, and it is labelled as cutting b
    assert [(s.type, s.x0, s.x1) for s in fig.layout.shapes] == [("line", 48, 48)]
    assert [(a.text, a.hovertext) for a in fig.layout.annotations] == [("cuts b", "b: head on rank 0, tail on rank 1")]
    assert tuple(fig.layout.xaxis.range) == (0, 96)


def test_chunk_map_without_padding_has_no_padding_traces():
    lay = FlatLayout([("w", (8, 8), torch.float32)], 4)  # 256 B: aligned, divisible by 64
    assert lay.alignment_padding_bytes == lay.tail_padding_bytes == 0
    fig = vl.chunk_map_figure(lay)
    assert [t.name for t in fig.data] == ["w", "rank chunks"]
    assert len(fig.layout.shapes) == 3 and len(fig.layout.annotations) == 3


def test_rank_pieces_figure(lay):
    fig = vl.rank_pieces_figure(lay)
    assert [t.name for t in fig.data] == ["a", "b", "c", "padding in chunk"]
    b = fig.data[1]
    assert (tuple(b.y), tuple(b.base), tuple(b.x)) == (("rank 0", "rank 1"), (32, 0), (16, 24))
    pad = fig.data[3]
    assert (tuple(pad.y), tuple(pad.base), tuple(pad.x)) == (("rank 0", "rank 1", "rank 1"), (30, 24, 39), (2, 8, 9))
    # colours agree between the figures
    assert fig.data[0].marker.color == vl.chunk_map_figure(lay).data[0].marker.color


def test_pieces_table(lay):
    cells = vl.pieces_table_figure(lay).data[0].cells.values
    assert list(cells[0]) == [0, 0, 1, 1]
    assert list(cells[1]) == ["a", "b", "b", "c"]
    assert list(cells[2]) == ["[0, 30)", "[0, 16)", "[16, 40)", "[0, 7)"]
    assert list(cells[3]) == ["[0, 30)", "[32, 48)", "[0, 24)", "[32, 39)"]
    assert list(cells[5]) == [30, 16, 24, 7]


def test_big_layout_figure_stays_light():
    # 416 MiB over 8 ranks: one bar per entry and per rank, never per byte.
    lay = FlatLayout(preset_specs("llama31_8b"), 8)
    fig = vl.chunk_map_figure(lay)
    assert len(fig.data) == 7 + 1
    assert sum(len(t.x) for t in fig.data) == 7 + 8
    assert len(json.dumps(fig.to_plotly_json(), default=str)) < 40_000
    assert sum(len(t.x) for t in vl.rank_pieces_figure(lay).data) == len(vl.piece_rows(lay))


def test_border_labels_are_capped():
    # One 2000-byte weight over 16 ranks: all 15 borders cut it, but only 12 labels are drawn
    # (the lines are all there); without the cap a wide group would bury the map under text.
    lay = FlatLayout([("w", (1000,), torch.bfloat16)], 16)
    assert len(vl.border_cuts(lay)) == 15
    fig = vl.chunk_map_figure(lay)
    assert 0 < len(fig.layout.annotations) <= vl.MAX_BORDER_LABELS == 12
    assert len(fig.layout.shapes) == 15


def test_border_labels_never_run_together():
    """01's chunk map: two labels a chunk apart on one level read "cuts ...weightcuts ...weight"."""
    lay = FlatLayout([("mlp.experts.0.down_proj.weight", (4000,), torch.bfloat16)], 8)
    placed = vl.border_label_levels(vl.border_cuts(lay), lay.total_bytes)
    assert len({lv for _c, lv in placed}) > 1  # more than one level used
    for level in range(vl.LABEL_LEVELS):
        xs = sorted(c.border / lay.total_bytes * vl.LABEL_PLOT_PX for c, lv in placed if lv == level)
        width = len("cuts mlp.experts.0.down_proj.weight") * vl.LABEL_CHAR_PX
        assert all(b - a >= width for a, b in zip(xs, xs[1:], strict=False))


def test_segments_tile_a_gappy_layout_from_entries():
    # from_entries may leave gaps wider than the alignment: they are shown, not hidden.
    entries = [LayoutEntry("x", (4,), torch.float32, 0, 16), LayoutEntry("y", (2,), torch.float32, 64, 8)]
    lay = FlatLayout.from_entries(entries, 2)
    assert [(s.kind, s.start, s.stop) for s in vl.segments(lay)] == [
        ("entry", 0, 16), ("alignment", 16, 64), ("entry", 64, 72), ("tail", 72, 96)]


@given(
    sizes=st.lists(st.tuples(st.integers(0, 70), st.sampled_from(["bf16", "fp32", "fp8", "int8"])), min_size=1, max_size=6),
    n=st.integers(1, 8),
)
def test_segments_and_pieces_cover_every_byte(sizes, n):
    lay = FlatLayout([(f"w{i}", (k,), dt) for i, (k, dt) in enumerate(sizes)], n)
    segs = vl.segments(lay)
    assert segs[0].start == 0 and segs[-1].stop == lay.total_bytes
    assert all(a.stop == b.start for a, b in zip(segs, segs[1:], strict=False))
    assert sum(s.nbytes for s in segs if s.kind == "alignment") == lay.alignment_padding_bytes
    assert sum(s.nbytes for s in segs if s.kind == "tail") == lay.tail_padding_bytes
    # each chunk = its pieces + its padding, exactly
    for r in range(n):
        owned = sum(p.nbytes for p in lay.pieces(r))
        pad = sum(hi - lo for rr, lo, hi in vl.chunk_padding(lay) if rr == r)
        assert owned + pad == lay.chunk_bytes


def test_view_addresses_figure_measures_real_pointers(lay):
    buf = lay.pack({e.name: torch.zeros(e.shape, dtype=e.dtype) for e in lay.entries})
    views = lay.views(buf)
    fig = vl.view_addresses_figure(lay, buf, views)
    planned, measured = fig.data
    assert tuple(measured.base) == tuple(planned.base) == (0, 32, 80)
    assert tuple(measured.x) == (30, 40, 7)
    assert "share its storage: True" in fig.layout.title.text
    # copies instead of views: the measured addresses leave the buffer and the title says so
    copies = {k: v.clone() for k, v in views.items()}
    fig2 = vl.view_addresses_figure(lay, buf, copies)
    assert tuple(fig2.data[1].base) != (0, 32, 80)
    assert "share its storage: False" in fig2.layout.title.text


def test_gather_count_figure_exact_bytes():
    lay = FlatLayout(SPECS, 2)
    fig = vl.gather_count_figure({"toy": lay}, max_n=4)
    per_weight, flat, line = fig.data
    assert (list(per_weight.y), list(flat.y)) == ([3], [1])
    # |T| for N = 1..4: 96, 96, 96, 128 -> received (N-1)/N |T| = 0, 48, 64, 96 bytes
    assert [round(y * 2**20) for y in line.y] == [0, 48, 64, 96]


def test_gather_check_figure_names_emulation(lay):
    reports = [{"rank": r, "mismatched_bytes": 0, "views_equal": True} for r in range(2)]
    fig = vl.gather_check_figure(lay, reports, mode="cpu-gloo", emulation="emulated: CPU processes")
    own, received = fig.data
    assert (list(own.y), list(received.y)) == ([48, 48], [48, 48])
    assert "emulated: CPU processes" in fig.layout.title.text
    assert "real GPUs" in vl.gather_check_figure(lay, reports, mode="gpu-nccl", emulation="").layout.title.text


def test_human_bytes():
    assert [vl.human_bytes(n) for n in (0, 1023, 1024, 436207616)] == ["0 B", "1023 B", "1.0 KiB", "416.0 MiB"]


def test_bar_labels_are_readable(lay):
    """Labels that fit are drawn at 11 px or more; plotly hides the ones that would need smaller."""
    buf = lay.pack(reference_tensors(lay, seed=0))
    figs = [vl.chunk_map_figure(lay), vl.rank_pieces_figure(lay), vl.view_addresses_figure(lay, buf, lay.views(buf))]
    for fig in figs:
        assert fig.layout.uniformtext.minsize >= 11 and fig.layout.uniformtext.mode == "hide"
        assert all((a.font.size or 12) >= 11 for a in fig.layout.annotations)


def test_chunk_borders_pass_behind_the_labels_and_band_labels_fit():
    """Notebook 01's chunk map drew its dashed borders over the weights' labels, and hid a rank's label
    ("rank 1 (3 weights)") that was wider than its chunk."""
    import torch

    from wsharding import FlatLayout
    from wsharding.lab.layout_presets import preset_specs
    from wsharding.lab.viz.layout import chunk_map_figure

    fig = chunk_map_figure(FlatLayout(preset_specs("k3_moe_fp8"), 8))
    borders = [s for s in fig.layout.shapes if s.type == "line"]
    assert len(borders) == 7 and all(s.layer == "below" for s in borders)
    assert all(t.marker.opacity < 1 for t in fig.data)  # the borders show through the bars
    bands = fig.data[-1]
    assert bands.name == "rank chunks" and max(len(line) for t in bands.text for line in t.split("<br>")) <= 9
    small = chunk_map_figure(FlatLayout([("a", (50,), torch.bfloat16), ("b", (30,), torch.uint8)], 4))
    assert all(s.layer == "below" for s in small.layout.shapes if s.type == "line")
