"""The figures of shard groups, KV capacity and the draft prefetch draw exactly what they are given."""

from __future__ import annotations

from wsharding.lab.viz.capacity import (
    groups_figure,
    kv_capacity_figure,
    kv_rows_from_plans,
    kv_rows_from_ranks,
    relative,
)
from wsharding.lab.viz.draft import draft_exposed_figure


def test_groups_figure_bars_are_the_measured_bytes():
    res = {g: [{"rank": r, "group": [r // g * g + i for i in range(g)], "resident_bytes": 1024 * (10 + g + r),
                "replicated_bytes": 4096} for r in range(4)] for g in (2, 4)}
    fig = groups_figure(res)
    assert [t.name for t in fig.data] == ["groups of 2", "groups of 4"]
    assert list(fig.data[0].y) == [12, 13, 14, 15] and list(fig.data[1].customdata) == ["[0, 1, 2, 3]"] * 4


def test_kv_capacity_rows_and_figure():
    ranks = [{"rank": 1, "replicated": {"tokens": 5}, "sharded": {"tokens": 9}},
             {"rank": 0, "replicated": {"tokens": 4}, "sharded": {"tokens": 3}}]
    rows = kv_rows_from_ranks(ranks)
    assert rows == [{"label": "rank 0", "replicated": 4, "sharded": 3}, {"label": "rank 1", "replicated": 5, "sharded": 9}]
    fig = kv_capacity_figure(rows, note="emulated")
    assert [t.name for t in fig.data] == ["replicated", "sharded", "change"]
    assert list(fig.data[2].y) == [-1, 4]  # the difference has its own bar, labelled in relative terms too
    assert list(fig.data[2].text) == ["-1<br>(-25.0%)", "+4<br>(+80.0%)"] and "emulated" in fig.layout.title.text
    plans = {"a": {"tokens_replicated": 1, "tokens_sharded": 2}, "b": None}
    assert kv_rows_from_plans(plans) == [{"label": "a", "replicated": 1, "sharded": 2}]


def test_draft_figure_labels_the_mode():
    report = {"mode": "cpu-gloo", "world_size": 2, "first_layer_bytes": 2**20, "emulation": "emulated: CPU",
              "region": "stand-in for the weight-sharding design's commit step",
              "rows": [{"mode": "dedicated", "exposed_us": 40.0, "step_ms": 20.0, "exposed_us_per_rank": [40.0, 30.0]},
                       {"mode": "inline", "exposed_us": 900.0, "step_ms": 21.0, "exposed_us_per_rank": [900.0, 800.0]}]}
    fig = draft_exposed_figure(report)
    assert list(fig.data[0].y) == [40.0, 900.0] and list(fig.data[1].y) == [40.0, 30.0, 900.0, 800.0]
    assert "emulated, not GPU timings" in fig.layout.title.text and "commit step" in fig.layout.title.text


def test_relative_change_keeps_small_gains_visible():
    assert relative(0.671) == "+67.1%" and relative(-0.25) == "-25.0%"
    assert relative(275 / 2_349_102) == "+0.012%"  # a KV gain on CPU ranks: never "+0.0%"
    assert relative(0.0) == "+0.0%"
