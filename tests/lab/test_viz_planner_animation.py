"""The opening animation and the modelled schedule it is drawn from: frames, the gate (no gather
into a slot starts before the slot's previous reader ended), and the planner's order; and the
display rules of the slot and timeline figures (an overlap of one slot shows, waits never cover a
label)."""

from __future__ import annotations

import pytest

from wsharding.lab.tasks.planner import model_schedule
from wsharding.lab.viz.planner import (
    HALF_ROWS,
    MAIN_BAR,
    WAIT_STRIP,
    animated_timeline,
    exposed_us,
    median_exposed_us,
    slot_figure,
    slot_overlaps,
    timeline_figure,
)


def spans(fig_or_frame, name):
    (t,) = [t for t in fig_or_frame.data if t.name == name]
    return [(y, b, b + w) for y, b, w in zip(t.y, t.base, t.x, strict=True)]


def assert_gated(fig):
    """Every gather into a slot starts at or after the end of the previous read of that slot."""
    for slot in ("A", "B"):
        reads = sorted(spans(fig, f"layer reads slot {slot}"), key=lambda s: s[1])
        gathers = sorted(spans(fig, f"gather → slot {slot}"), key=lambda s: s[1])
        assert reads and gathers
        for _lane, g_start, _g_end in gathers:
            before = [r for r in reads if r[1] < g_start]
            if before:
                assert g_start >= before[-1][2], (slot, g_start, before[-1])
        # and every read after a gather starts only when the gather has ended
        for _lane, r_start, _r_end in reads:
            assert any(g_end <= r_start for _l, _s, g_end in gathers)


@pytest.mark.parametrize("gather_ms", [4.0, 6.0, 15.0])
def test_model_schedule_keeps_the_planners_order(gather_ms):
    recs = model_schedule(6, gather_ms=gather_ms, compute_ms=10.0)
    # the dense layer 0 too (compute only): a figure of "six layers" draws six
    assert [(r["layer"], r["slot"]) for r in recs] == [(0, None), (1, "A"), (2, "B"), (3, "A"), (4, "B"), (5, "A")]
    assert recs[0]["compute_start"] == 0.0 and recs[0]["compute_end"] == 10_000.0 and "gather_start" not in recs[0]
    recs = recs[1:]
    by = {r["layer"]: r for r in recs}
    for r in recs:
        assert r["issue"] <= r["gather_start"] < r["gather_end"] <= r["wait_end"] == r["compute_start"]
        assert r["compute_end"] - r["compute_start"] == 10_000.0
        if r["layer"] - 2 in by:  # the gate
            assert r["gather_start"] >= by[r["layer"] - 2]["compute_end"]
    assert slot_overlaps(recs) == []
    hidden = sum(r["wait_end"] - r["wait_start"] for r in recs)
    exposed_off = sum(r["wait_end"] - r["wait_start"] for r in model_schedule(6, gather_ms, 10.0, lookahead=False)[1:])
    assert exposed_off == 5 * gather_ms * 1e3 and hidden < exposed_off
    if gather_ms < 10.0:
        assert hidden == 0.0  # the compute hides every gather


def test_model_schedule_rejects_nonsense():
    with pytest.raises(ValueError, match="durations"):
        model_schedule(gather_ms=0)
    with pytest.raises(ValueError, match="first_sharded"):
        model_schedule(2, first_sharded=2)


def test_animated_timeline_frames_and_gate():
    fig = animated_timeline(model_schedule(6, 6.0, 10.0), frames=12, title="t", note="modelled")
    assert len(fig.frames) == 12 and len(fig.layout.sliders[0].steps) == 12
    assert "modelled" in fig.layout.title.text
    assert_gated(fig)  # the static figure: the whole step
    assert [g.x for g in fig.data if g.name.startswith("gate")][0] == (20.0, 30.0, 40.0)  # ms: L1, L2, L3 done
    # frames grow: the drawn length never shrinks, and the last frame is the whole step
    drawn = [sum(sum(t.x) for t in f.data if t.type == "bar") for f in fig.frames]
    assert drawn == sorted(drawn) and drawn[-1] == pytest.approx(sum(sum(t.x) for t in fig.data if t.type == "bar"))
    assert sum(sum(t.x) for t in fig.frames[0].data if t.type == "bar") < drawn[-1] / 4
    for f in fig.frames:
        for t in f.data:
            if t.type == "bar":
                assert all(w >= 0 for w in t.x)


def test_animated_timeline_of_a_gather_bound_schedule_shows_waits_and_stays_gated():
    fig = animated_timeline(model_schedule(6, 15.0, 10.0), frames=5)
    assert_gated(fig)
    assert sum(spans(fig, "exposed wait")[i][2] - spans(fig, "exposed wait")[i][1]
               for i in range(len(spans(fig, "exposed wait")))) > 0


def test_animated_timeline_of_a_live_trace_picks_the_rank_and_last_step():
    recs = [dict(r, step=1) for r in model_schedule(5)] + [dict(r, rank=1, step=1) for r in model_schedule(5, 2.0)]
    recs += [dict(r, step=0, compute_end=r["compute_end"] + 1e6) for r in model_schedule(5)]  # older step: ignored
    fig = animated_timeline(recs, rank=0, frames=3)
    assert max(b for _l, _s, b in spans(fig, "compute")) == 50.0
    with pytest.raises(KeyError, match="rank 7"):
        animated_timeline(recs, rank=7)
    with pytest.raises(ValueError, match="frames"):
        animated_timeline(recs, frames=0)


def rec(layer, slot, g0, c1, **marks):
    return {"rank": 0, "step": 0, "layer": layer, "slot": slot, "gather_start": g0, "gather_end": g0 + 5,
            "compute_start": c1 - 10, "compute_end": c1, **marks}


def test_slot_figure_shows_an_overlap_of_one_slot():
    # layer 3's gather writes slot A at 15 while layer 1 reads it until 30: the race the gate prevents
    racy = [rec(1, "A", 0, 30), rec(2, "B", 10, 45), rec(3, "A", 15, 60)]
    fig = slot_figure(racy)
    (occ_a,) = [t for t in fig.data if t.name == "slot A occupied"]
    assert list(occ_a.offset) == [HALF_ROWS[0], HALF_ROWS[1]]  # successive occupants on different half rows
    assert 0 < occ_a.opacity < 1
    (clash,) = [t for t in fig.data if t.name == "written while read"]
    assert list(zip(clash.y, clash.base, clash.x, strict=True)) == [("rank 0 · slot A", 15, 15)]
    assert not [t for t in slot_figure(racy[:2]).data if t.name == "written while read" and len(t.x)]


def test_wait_strip_sits_below_the_labelled_bars():
    recs = [rec(1, "A", 0, 30, wait_start=10, wait_end=20)]
    for fig in (timeline_figure(recs), slot_figure(recs)):
        (wait,) = [t for t in fig.data if t.name == "exposed wait"]
        assert fig.data[0].name == "exposed wait"  # drawn first: behind the rest
        assert wait.offset + wait.width <= -0.3  # the lane's lower edge
    (compute,) = [t for t in timeline_figure(recs).data if t.name == "compute"]
    assert compute.offset == MAIN_BAR["offset"] and compute.offset >= WAIT_STRIP["offset"] + WAIT_STRIP["width"]
    assert "noise" in timeline_figure(recs, note="noise dominates").layout.title.text


def test_exposed_wait_of_a_layer_that_gathered_inline_starts_at_its_issue():
    # Without lookahead gloo runs the gather inside the issue call, before the wait is marked: the
    # whole span issue -> wait_end kept the compute waiting. Records without the flag keep the wait only.
    r = rec(1, "A", 10, 40, issue=10, wait_start=15, wait_end=16)
    assert exposed_us([dict(r, lookahead=False)]) == {0: 6.0}
    assert exposed_us([r]) == exposed_us([dict(r, lookahead=True)]) == {0: 1.0}
    assert median_exposed_us([dict(r, lookahead=False), dict(r, step=1, lookahead=False, wait_end=30)]) == {0: 13.0}


def test_the_opening_figure_draws_all_six_layers():
    """00 says "six layers": its animation draws L0 (dense) to L5, not L1-L5."""
    fig = animated_timeline(model_schedule(6, 6.0, 10.0))
    compute = next(t for t in fig.data if t.name == "compute")
    assert list(compute.text) == ["L0", "L1·A", "L2·B", "L3·A", "L4·B", "L5·A"]
    assert min(compute.base) == 0.0
