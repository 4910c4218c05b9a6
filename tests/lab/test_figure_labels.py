"""Labels a reader can see: on a log axis plotly puts ``add_hline``/``add_vline`` labels at
10**value (far outside the figure), so the package's figures place them as annotations at log10 of
the value; tables are tall enough for all their rows; labels above bars get headroom. The browser
test (tests/lab/test_browser.py) checks the drawn result; these check the figures' numbers."""

from __future__ import annotations

import math

import pytest

from wsharding.costmodel import Deployment, estimate, get_device
from wsharding.lab.quiz import check
from wsharding.lab.viz import comm as vc
from wsharding.lab.viz import linear as vlin
from wsharding.lab.viz import planner as vp
from wsharding.lab.viz.costmodel import overlap_figure
from wsharding.presets import load_preset


def annotation(fig, text: str):
    hits = [a for a in fig.layout.annotations if text in a.text]
    assert len(hits) == 1, [a.text for a in fig.layout.annotations]
    return hits[0]


def test_breakeven_label_sits_at_log10_of_the_breakeven():
    plan = estimate(load_preset("kimi-k3-b200-fp8"), Deployment(ranks=8, device=get_device("b200"), tokens=256))
    fig = overlap_figure(plan)
    assert fig.layout.xaxis.type == "log"
    a = annotation(fig, f"break-even {plan.breakeven_tokens} tokens")
    assert (a.xref, a.x) == ("x", math.log10(plan.breakeven_tokens))  # not 3457 (= 10**3457 on this axis)
    assert fig.layout.shapes[0].x0 == plan.breakeven_tokens  # the line itself takes data coordinates


def test_copy_ceiling_label_sits_at_log10():
    result = {"machine": "m", "date": "2026-11-30", "mode": "gpu-nccl", "world_size": 2, "copy_ceiling_GBps": 800.0,
              "rows": [{"impl": "nccl-ce (policy 2)", "size_bytes": 1 << 20, "busbw_GBps": 100.0}]}
    fig = vc.allgather_bandwidth_figure(result)
    a = annotation(fig, "copy ceiling / 2 = 400 GB/s")
    assert fig.layout.yaxis.type == "log" and (a.yref, a.y) == ("y", math.log10(400.0))
    assert fig.layout.shapes[0].y0 == 400.0


def test_row_error_figure_tolerance_label_and_axis():
    errors = {"plain": 0.0, "bias once": 2e-7, "skip reduce": 3e-8}
    fig = vlin.row_error_figure(errors, 1e-5, title="row-parallel cases", note="emulated")
    a = annotation(fig, "fp32 reduction tolerance 1e-05")
    assert (a.yref, a.y) == ("y", -5.0)
    assert list(fig.data[0].y) == [1e-9, 2e-7, 3e-8]  # zero drawn at 1e-9: a log axis has no 0
    assert "<sup>emulated</sup>" in fig.layout.title.text


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_tables_are_tall_enough_for_every_row(rows):
    caught = [(f"rule{i}", f"linear{i}", i) for i in range(rows)]
    fig = vlin.findings_table(caught)
    assert fig.layout.height >= vlin.HEAD_PX + vlin.ROW_PX * rows + fig.layout.margin.t + fig.layout.margin.b
    plan = {"shapes": [{"rank": r, "dp": 0, "linear": "q", "group": "tp", "group_rank": "0/8", "weight": [8, 8],
                        "reduce": "-"} for r in range(rows)]}
    t = vlin.shapes_table(plan)
    assert t.layout.height >= vlin.HEAD_PX + vlin.ROW_PX * rows + t.layout.margin.t + t.layout.margin.b
    assert len(t.data[0].cells.values[0]) == rows


def test_memory_figure_keeps_room_above_the_tallest_bar():
    report = {"replicated_bytes_per_rank": 1000, "formula_bytes_per_rank": 1400, "slot_bytes": 500, "world_size": 2,
              "sharded_resident_bytes_all": [1400, 1400]}
    fig = vp.memory_figure(report)
    top = fig.layout.yaxis.range[1]
    assert top >= 1.15 * 1400 / 1024  # KiB: the "= formula" text above the 1400 B bar stays inside
    step = vp.step_time_figure({"replicated": 2.0, "sharded": 3.0})
    assert step.layout.yaxis.range[1] >= 1.15 * 3.0


def test_check_yourself():
    assert check("bytes", 48, 48)
    assert check("tokens", 3300, 3457, rel=0.1)
    with pytest.raises(AssertionError, match="you predicted 64, the package says 48. padding"):
        check("bytes", 64, 48, why="padding")
    with pytest.raises(AssertionError, match=r"within 10%"):
        check("tokens", 3000, 3457, rel=0.1)


def test_host_breakdown_figure_draws_the_saved_probes_and_says_what_is_emulated():
    import json
    from pathlib import Path

    from wsharding.lab.viz.bench import host_breakdown_figure

    folder = Path(__file__).resolve().parents[2] / "docs" / "measurements"
    probes = {p.stem: json.loads(p.read_text()) for p in sorted(folder.rglob("host_breakdown_*.json"), key=lambda p: p.name)}
    assert len(probes) >= 2
    fig = host_breakdown_figure(probes)
    graph = next(t for t in fig.data if t.name == "gathers launched as graphs")
    assert list(graph.y) == [p["bare_loop_us_per_layer"]["graph"] for p in probes.values()]
    assert "emulated" in fig.layout.title.text  # the 2-rank probe shares one GPU
    assert fig.layout.yaxis.range[1] > max(max(t.y) for t in fig.data)


def test_forward_host_figure_draws_medians_with_quartiles():
    import json
    from pathlib import Path

    from wsharding.lab.viz.bench import forward_host_figure

    folder = Path(__file__).resolve().parents[2] / "docs" / "measurements" / "h200-2026-12-01"
    probe = json.loads((folder / "forward_host_h200_1gpu_2026-12-01.json").read_text())
    fig = forward_host_figure(probe)
    whole, actions = fig.data
    added = probe["added_host_us_per_layer"]
    assert list(whole.x) == list(added) and list(whole.y) == [v["median"] for v in added.values()]
    # the whiskers reach the quartiles
    assert [m + up for m, up in zip(whole.y, whole.error_y.array, strict=True)] == pytest.approx(
        [v["q3"] for v in added.values()])
    assert "side graph copy + compute waits it" in list(actions.x)
    assert f"{probe['pairs']} pairs" in fig.layout.title.text


def test_paired_rounds_figure_draws_every_round_and_the_interval():
    from wsharding.lab.bench.paired import paired_difference
    from wsharding.lab.viz.bench import paired_rounds_figure

    times = {"seven rounds": ([5.0, 5.1, 5.2, 5.0, 5.3, 5.1, 5.2], [6.0] * 7), "three rounds": ([7.0, 5.0, 6.5], [6.0] * 3)}
    runs = {label: (a, b, paired_difference(a, b, ("lookahead", "no lookahead"))) for label, (a, b) in times.items()}
    fig = paired_rounds_figure(runs)
    bars = [t for t in fig.data if t.mode == "lines"]
    dots = [t for t in fig.data if t.mode == "markers"]
    assert [len(t.x) for t in dots] == [7, 3]  # every round drawn, not only the summary
    for bar, (label, (_a, _b, d)) in zip(bars, runs.items(), strict=True):
        assert tuple(bar.x) == (d.low_ms, d.high_ms) and bar.y[0] == label
    # the three-round run names no side: its bar is grey, its label says so
    assert bars[1].line.color == "#c7c7c7" and "too few rounds" in annotation(fig, "75%").text
    assert "faster" in annotation(fig, "98%").text


def test_paired_rounds_figure_draws_a_saved_comparison_without_its_rounds():
    """``bench step`` reports keep each comparison, not the rounds behind it: the bar alone."""
    from wsharding.lab.bench.paired import PairedDifference, paired_difference
    from wsharding.lab.viz.bench import paired_rounds_figure

    d = paired_difference([5.0, 5.1, 5.2, 5.0, 5.3, 5.1, 5.2], [6.0] * 7, ("issue thread", "issued inline"))
    saved = PairedDifference(**d.as_dict())
    fig = paired_rounds_figure({"1 token": (None, None, saved)}, names=("issue thread", "issued inline"))
    assert [t.mode for t in fig.data] == ["lines"]
    assert tuple(fig.data[0].x) == (d.low_ms, d.high_ms)
    assert "round by round" not in fig.layout.title.text and "issue thread against issued inline" in fig.layout.title.text
    assert "faster" in annotation(fig, "98%").text


def test_planner_calls_figure_stacks_the_split_and_marks_the_bare_loop():
    import json
    from pathlib import Path

    from wsharding.lab.viz.bench import planner_calls_figure

    folder = Path(__file__).resolve().parents[2] / "docs" / "measurements" / "h200-2026-12-01"
    split = json.loads((folder / "bench_step_h200_2ranks-1gpu_2026-12-01_llama8b-blocks_planner-calls-split.json").read_text())
    whole = json.loads((folder / "bench_step_h200_1gpu_2026-12-01_llama8b-blocks_planner-calls.json").read_text())
    fig = planner_calls_figure({"one": whole, "two": split})
    bars = {t.name: list(t.y) for t in fig.data if t.type == "bar"}
    row = split["rows"][0]
    n_one = 4 * len(whole["rows"])  # plain, mapped, issue thread, mapped + thread, per tokens value
    # a report without the split is one bar per variant; the split one stacks to its total
    assert bars["in the forward"][:n_one] == [r[k] for k in ("planner_calls_us_per_layer", "planner_calls_mapped_us_per_layer",
                                                             "planner_calls_issue_thread_us_per_layer",
                                                             "planner_calls_mapped_issue_thread_us_per_layer")
                                              for r in whole["rows"]]
    stacked = sum(bars[call][n_one] for call in row["planner_calls_us_per_layer_by_call"])
    assert stacked == pytest.approx(row["planner_calls_us_per_layer"])
    bare = next(t for t in fig.data if t.name == "bare planner loop (no compute)")
    assert split["planner_host_us_per_layer"] in list(bare.y)
    assert "emulated" in fig.layout.title.text
