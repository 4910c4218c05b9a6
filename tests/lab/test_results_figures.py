"""Notebook 07's results figures and narrow table draw exactly the saved reports, readably."""

from __future__ import annotations

import math

from wsharding.lab.bench.planner_calls import PlannerCallTimer
from wsharding.lab.bench.step import saved_path, saved_reports, short_table
from wsharding.lab.viz.bench import against_figure, log_ticks, machine_caption, results_figure

REPORT = "bench_step_h200x2_2026-12-01_llama8b-blocks_nccl"


def _report() -> dict:
    return saved_reports()[REPORT]


def test_log_ticks_are_plain_numbers_on_the_125_series():
    ticks = log_ticks(0.4, 60)
    assert ticks["tickvals"] == [0.2, 0.5, 1, 2, 5, 10, 20, 50, 100]  # a step beyond the data each way
    assert ticks["ticktext"] == ["0.2", "0.5", "1", "2", "5", "10", "20", "50", "100"]  # never a lone "5" for 0.5
    assert log_ticks(1.05, 13.4, "{:g}x")["ticktext"] == ["0.5x", "1x", "2x", "5x", "10x", "20x"]


def test_results_figure_draws_the_report_on_log_axes_with_the_machine_and_date():
    report = _report()
    fig = results_figure(report)
    names = [t.name for t in fig.data]
    assert names[:3] == ["replicated", "weight-sharded (eager)", "FSDP2 (eager)"] and names[3].startswith("link floor")
    assert list(fig.data[0].y) == [row["replicated"] for row in report["rows"]]
    assert list(fig.data[3].y) == [row["floor_ms"] for row in report["rows"]]
    assert fig.layout.xaxis.type == fig.layout.yaxis.type == "log"
    assert "NVIDIA H200" in fig.layout.title.text and report["date"] in fig.layout.title.text
    assert "2 x NVIDIA H200" in machine_caption(report)
    assert fig.layout.font.size >= 11


def test_against_figure_is_log_with_readable_labels():
    report = _report()
    fig = against_figure(report, base="floor_ms", variants=("sharded", "fsdp2", "graph_sharded"))
    assert [t.name for t in fig.data] == ["weight-sharded (eager)", "FSDP2 (eager)", "weight-sharded, CUDA graph",
                                          "1x = the link floor"]  # the goal line is in the legend
    assert fig.layout.yaxis.type == "log"
    assert all(t.textfont.size >= 11 for t in fig.data if t.type == "bar")
    sharded = fig.data[0]
    assert list(sharded.y) == [row["sharded"] / row["floor_ms"] for row in report["rows"]]
    assert 10 ** fig.layout.yaxis.range[1] > max(sharded.y)  # the largest bar and its label fit
    assert math.isclose(10 ** fig.layout.yaxis.range[0] * 1.3, min(1.0, *sharded.y))
    assert not fig.layout.annotations  # nothing written over the bars' labels


def test_against_figure_stays_linear_for_a_narrow_range():
    fig = against_figure(_report(), base="replicated", variants=("sharded", "sharded_next_step"))
    assert fig.layout.yaxis.type != "log" and fig.layout.yaxis.range[0] == 0
    assert fig.data[-1].name == "1x = replicated"


def test_emulated_reports_say_so():
    report = dict(_report(), emulation="emulated: CPU processes", device_name="cpu", mode="cpu-gloo")
    assert machine_caption(report).startswith("2 ranks, cpu-gloo") and "x cpu" not in machine_caption(report)
    title = results_figure(report).layout.title.text
    assert "emulated on CPU ranks, not GPU timings" in title.split("<br>")[0]
    assert "emulated" in short_table(report).splitlines()[0]


def test_short_table_is_narrow_and_holds_the_numbers():
    report = _report()
    text = short_table(report, ("replicated", "sharded", "fsdp2", "graph_sharded"))
    assert max(len(line) for line in text.splitlines()) <= 90  # no wrapping in a notebook cell
    assert f"{report['rows'][0]['fsdp2']:.2f}" in text and "link floor" in text
    assert text.count("\n") == len(report["rows"]) + 1


def test_saved_path_finds_one_file():
    assert saved_path(REPORT + ".json").name == REPORT + ".json"


def test_planner_call_timer_repr_says_what_was_timed():
    class Planner:  # the timer only reads the planner when it enters
        pass

    t = PlannerCallTimer(Planner())
    t.by_call["maybe_dispatch"] = 12e-6
    t.seconds, t.calls = 12e-6, 3
    text = repr(t)
    assert text.startswith("PlannerCallTimer(3 calls, 12.0 us") and "maybe_dispatch 12.0 us" in text
    assert "__dict__" not in text and "planner" not in text.lower().replace("plannercalltimer", "")


def test_spread_figure_whiskers_reach_the_fastest_and_slowest_round():
    from wsharding.lab.viz.bench import spread_figure

    report = _report()
    fig = spread_figure(report)
    on, off = fig.data
    rows = report["rows"]
    assert list(on.y) == [r["sharded"] for r in rows] and list(off.y) == [r["sharded_no_lookahead"] for r in rows]
    assert list(on.error_y.array) == [r["sharded_max"] - r["sharded"] for r in rows]
    assert list(off.error_y.arrayminus) == [r["sharded_no_lookahead"] - r["sharded_no_lookahead_min"] for r in rows]
    assert fig.layout.xaxis.type == fig.layout.yaxis.type == "log"
    assert [t.name for t in fig.data] == ["lookahead on", "lookahead off"]
    # the lesson of notebook 08 section 6: on two H200s every lookahead round beat every round without it
    assert all(r["sharded_max"] < r["sharded_no_lookahead_min"] for r in rows)
