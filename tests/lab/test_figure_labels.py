"""Labels a reader can see: on a log axis plotly puts ``add_hline``/``add_vline`` labels at
10**value (far outside the figure), so the package's figures place them as annotations at log10 of
the value; tables are tall enough for all their rows; labels above bars get headroom. The browser
test (tests/lab/test_browser.py) checks the drawn result; these check the figures' numbers."""

from __future__ import annotations

import math

import pytest

from wsharding.costmodel import Deployment, estimate, get_device
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
