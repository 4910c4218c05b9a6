"""The planner's figures drawn from a hand-made trace: every bar's base and width are the trace's own
numbers, lanes get exactly their bars, several steps reduce to the last one per rank, and missing
marks are skipped rather than drawn wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wsharding.lab.viz.planner import (
    exposed_us,
    last_step,
    memory_figure,
    slot_figure,
    slot_overlaps,
    step_time_figure,
    timeline_figure,
    tokens_figure,
)


def rec(rank, step, layer, slot, **marks):
    return {"step": step, "rank": rank, "layer": layer, "slot": slot, **marks}


#: Rank 0, step 1: three sharded layers with lookahead; layer 3's gather was held by the gate.
STEP = [
    rec(0, 1, 1, "A", issue=1.0, gather_start=2.0, gather_end=50.0, wait_start=55.0, wait_end=60.0,
        compute_start=60.0, compute_end=100.0),
    rec(0, 1, 2, "B", issue=61.0, gather_start=62.0, gather_end=90.0, wait_start=101.0, wait_end=101.5,
        compute_start=101.5, compute_end=150.0),
    rec(0, 1, 3, "A", issue=102.0, held=102.0, gather_start=110.0, gather_end=140.0, wait_start=151.0,
        wait_end=170.0, compute_start=170.0, compute_end=200.0),
]
#: An earlier step of rank 0 (must be ignored) and rank 1's last step with one layer missing marks.
OLDER = [rec(0, 0, 1, "A", gather_start=0.0, gather_end=999.0, compute_start=1000.0, compute_end=2000.0)]
RANK1 = [
    rec(1, 4, 1, "A", gather_start=5.0, gather_end=25.0, wait_start=30.0, wait_end=31.0, compute_start=31.0,
        compute_end=80.0),
    rec(1, 4, 2, None, issue=81.0, held=81.0),  # held and never released: no slot, no gather
]


def bars(fig, name):
    (t,) = [t for t in fig.data if t.name == name]
    return list(zip(t.y, t.base, t.x, strict=True))


def test_last_step_per_rank():
    picked = last_step(OLDER + STEP + RANK1)
    assert [(r["rank"], r["step"], r["layer"]) for r in picked] == [(0, 1, 1), (0, 1, 2), (0, 1, 3), (1, 4, 1), (1, 4, 2)]
    assert last_step([]) == []


def test_timeline_bars_equal_the_trace():
    fig = timeline_figure(OLDER + STEP + RANK1, title="t")
    assert bars(fig, "compute") == [
        ("rank 0 · compute", 60.0, 40.0), ("rank 0 · compute", 101.5, 48.5), ("rank 0 · compute", 170.0, 30.0),
        ("rank 1 · compute", 31.0, 49.0),
    ]
    assert bars(fig, "gather → slot A") == [
        ("rank 0 · gather", 2.0, 48.0), ("rank 0 · gather", 110.0, 30.0), ("rank 1 · gather", 5.0, 20.0),
    ]
    assert bars(fig, "gather → slot B") == [("rank 0 · gather", 62.0, 28.0)]
    assert bars(fig, "exposed wait") == [
        ("rank 0 · compute", 55.0, 5.0), ("rank 0 · compute", 101.0, 0.5), ("rank 0 · compute", 151.0, 19.0),
        ("rank 1 · compute", 30.0, 1.0),
    ]
    (compute,) = [t for t in fig.data if t.name == "compute"]
    assert list(compute.text) == ["L1·A", "L2·B", "L3·A", "L1·A"]
    assert all(t.orientation == "h" for t in fig.data)
    # two lanes per rank, rank 0 on top
    assert list(fig.layout.yaxis.categoryarray) == [
        "rank 1 · gather", "rank 1 · compute", "rank 0 · gather", "rank 0 · compute"]
    assert "rank 0 0.02 ms, rank 1 0.00 ms" in fig.layout.title.text


def test_exposed_us_sums_the_waits_of_the_last_step():
    assert exposed_us(OLDER + STEP + RANK1) == {0: 5.0 + 0.5 + 19.0, 1: 1.0}


def test_slot_figure_occupancy_gate_and_waits():
    fig = slot_figure(STEP + RANK1, title="s")
    assert bars(fig, "slot A occupied") == [
        ("rank 0 · slot A", 2.0, 98.0), ("rank 0 · slot A", 110.0, 90.0), ("rank 1 · slot A", 5.0, 75.0)]
    assert bars(fig, "slot B occupied") == [("rank 0 · slot B", 62.0, 88.0)]
    assert bars(fig, "gate wait (held)") == [("rank 0 · slot A", 102.0, 8.0)]  # held -> gather_start
    assert [b[0] for b in bars(fig, "exposed wait")] == [
        "rank 0 · slot A", "rank 0 · slot B", "rank 0 · slot A", "rank 1 · slot A"]
    assert slot_overlaps(STEP + RANK1) == []


def test_slot_overlaps_finds_a_gather_into_a_slot_still_read():
    racy = [dict(r) for r in STEP]
    racy[2]["gather_start"] = 90.0  # layer 3 writes slot A while layer 1 (until 100) still reads it
    assert slot_overlaps(racy) == [(0, "A", 1, 3)]


def test_empty_and_markless_records():
    for fig in (timeline_figure([]), slot_figure([])):
        assert all(len(t.y or ()) == 0 for t in fig.data)
        assert fig.layout.annotations[0].text == "no trace records"
    fig = timeline_figure([rec(0, 0, 1, None)])  # a record with no marks at all: a lane, no bars
    assert sum(len(t.y or ()) for t in fig.data) == 0


ROOT = Path(__file__).resolve().parents[2]

REPORT = {
    "world_size": 2, "replicated_bytes_per_rank": 304128, "sharded_resident_bytes_per_rank": 278784,
    "formula_bytes_per_rank": 278784, "slot_bytes": 101376,
}


def test_memory_figure_exact_bytes():
    fig = memory_figure(REPORT, title="m")
    by = {t.name: t for t in fig.data}
    assert list(by["replicated R"].customdata) == [304128, 304128]
    assert list(by["resident chunks (formula − slots)"].customdata) == [278784 - 2 * 101376] * 2
    assert list(by["two slots 2·slot_bytes"].customdata) == [2 * 101376] * 2
    assert list(by["measured resident"].customdata) == [278784, 278784]
    assert list(by["measured resident"].text) == ["= formula", "= formula"]
    assert fig.layout.yaxis.title.text == "KiB per rank"
    assert by["replicated R"].y[0] == 304128 / 1024
    per_rank = memory_figure({**REPORT, "sharded_resident_bytes_all": [278784, 278800]})
    assert list(next(t for t in per_rank.data if t.name == "measured resident").text) == ["= formula", "≠ formula (+16 B)"]
    with pytest.raises(KeyError, match="slot_bytes"):
        memory_figure({k: v for k, v in REPORT.items() if k != "slot_bytes"})


def test_memory_figure_of_a_mapped_report_counts_the_peers_pages_not_two_slots():
    # The two-GPU demo with --map-own-chunk (docs/measurements/h200x2-2026-12-01/demo_k3-like_..._graph-mapped.json):
    # after finalize each slot keeps only the peer's page: 356 MiB in all, against 2 x 356 MiB of whole slots.
    report = json.loads((ROOT / "docs" / "measurements" / "h200x2-2026-12-01" / "demo_k3-like_h200x2_2026-12-01_graph-mapped.json").read_text())
    assert report["map_own_chunk"] and report["slot_resident_bytes"] < 2 * report["slot_bytes"]
    by = {t.name: t for t in memory_figure(report).data}
    pages = by["the peers' slot pages 2·(N-1)/N·slot_bytes"]
    assert list(pages.customdata) == [report["slot_resident_bytes"]] * 2
    chunks = report["formula_bytes_per_rank"] - report["slot_resident_bytes"]
    assert list(by["resident chunks (formula − slots)"].customdata) == [chunks] * 2
    assert list(by["measured resident"].text) == ["= formula", "= formula"]


def test_small_figures():
    fig = step_time_figure({"replicated": 1.0, "sharded": 2.5}, note="emulated")
    assert list(fig.data[0].y) == [1.0, 2.5] and "emulated" in fig.layout.title.text
    fig = tokens_figure([[3, 0], [1, 2]], equal=[[True, True], [None, False]])
    assert [list(r) for r in fig.data[0].text] == [["3 equal", "0 idle (dummy step)"], ["1 equal", "2 DIFFERENT"]]


def test_the_lookahead_pair_title_hangs_above_its_subplot_titles():
    """A title of six lines (notebooks 03 and 06 section 4) was centred in the top margin and grew down
    over the first subplot's title: it hangs from the top, in a margin that holds every line of it and
    the subplot title below."""
    from wsharding.lab.tasks.planner import model_schedule
    from wsharding.lab.viz.planner import SUBPLOT_TITLE, TITLE_ASCENT, TITLE_LINE, TITLE_PAD, lookahead_pair_figure

    on, off = model_schedule(6), model_schedule(6, lookahead=False)
    note = "<br>".join(["a line of the note that says what the run was " * 3] * 3)
    fig = lookahead_pair_figure(on, off, title="Lookahead on and off", note=note)
    lines = fig.layout.title.text.count("<br>") + 1
    assert lines >= 6
    assert (fig.layout.title.yref, fig.layout.title.yanchor) == ("container", "top")
    assert round((1 - fig.layout.title.y) * fig.layout.height) == TITLE_PAD + TITLE_ASCENT  # below the top edge
    assert fig.layout.margin.t >= TITLE_PAD + TITLE_LINE * lines + SUBPLOT_TITLE and SUBPLOT_TITLE >= 30
