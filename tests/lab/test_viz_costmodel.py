"""The cost model's figures and its widget panel: what they draw adds up to the bill."""

from __future__ import annotations

import pytest

from tests.costmodel.test_costmodel import dep, toy_model
from wsharding.costmodel import GiB, estimate, model_from_dict
from wsharding.presets import load_preset


def test_memory_figure_stacks_add_up():
    from wsharding.lab.viz.costmodel import memory_figure

    plan = estimate(load_preset("kimi-k3-b200-fp8"), dep(8))
    fig = memory_figure(plan)
    rep = sum(t.y[0] for t in fig.data if t.x[0] == "replicated")
    sh = {t.name: t.y[0] for t in fig.data if t.x[0] == "sharded"}
    assert rep == pytest.approx(plan.bill.replicated_bytes / GiB, rel=1e-12)
    # resident shards + two slots + freed == what the replicated copy took.
    assert sum(sh.values()) == pytest.approx(plan.bill.replicated_bytes / GiB, rel=1e-12)
    assert sh["two slots 2·max|T|"] == plan.bill.slot_bytes / GiB


def test_memory_figure_with_a_loss_says_so():
    from wsharding.lab.viz.costmodel import memory_figure

    fig = memory_figure(estimate(model_from_dict(toy_model([1000, 3000])), dep(1)))
    assert any("costs" in a.text for a in fig.layout.annotations)


def test_overlap_figure_marks_breakeven():
    from wsharding.lab.viz.costmodel import layer_bytes_figure, overlap_figure

    plan = estimate(model_from_dict(toy_model([10_000, 30_000])), dep(4, tokens=1000))
    fig = overlap_figure(plan)
    assert fig.layout.shapes[0].x0 == 2252
    gather, compute, here = fig.data
    assert set(gather.y) == {plan.layers[1].gather_seconds * 1e6}
    assert here.x == (1000,)
    assert max(layer_bytes_figure(plan).data[0].y) == 30_016 / 2**20


def test_dtype_vs_sharding_figure():
    from wsharding.lab.viz.costmodel import dtype_vs_sharding_figure

    m = load_preset("kimi-k3-b200-moe-bf16")
    fig = dtype_vs_sharding_figure(m, dep(8))
    rep, sh = fig.data
    assert rep.y[0] == pytest.approx(2 * rep.y[1]) and rep.y[0] == m.replicated_bytes / GiB
    assert sh.y[0] == estimate(m, dep(8)).bill.sharded_resident_bytes / GiB


def test_costmodel_panel_follows_its_controls():
    from wsharding.lab.widgets.costmodel import build_costmodel_panel, costmodel_view

    m = load_preset("kimi-k3-b200-moe-bf16")
    panel = build_costmodel_panel(m)
    assert panel.plan.bill.ranks == 8 and panel.renders == 1
    panel.controls["ranks"].value = 4
    panel.controls["dtype"].value = "fp8_e4m3"
    panel.controls["bandwidth"].value = 450
    panel.controls["tokens"].value = 1024
    plan = panel.plan
    assert (plan.bill.ranks, plan.deployment.tokens, plan.deployment.bandwidth) == (4, 1024, 450e9)
    assert plan.bill.replicated_bytes == m.replicated_bytes // 2
    assert panel.renders == 5
    same, _, _ = costmodel_view(m, 4, "fp8_e4m3", 450, 1024, "b200")
    assert same.to_dict() == plan.to_dict()
    panel.controls["map_own_chunk"].value = True
    assert panel.plan.bill.map_own_chunk and panel.renders == 6
    mapped, memory, _ = costmodel_view(m, 4, "fp8_e4m3", 450, 1024, "b200", map_own_chunk=True)
    assert mapped.to_dict() == panel.plan.to_dict()
    slots = next(t for t in memory.data if t.name == "mapped slots 2(N-1)/N·max|T|")
    assert slots.y[0] == mapped.bill.slot_bytes / GiB


def test_figures_label_their_axes_plainly():
    from wsharding.lab.viz.costmodel import dtype_vs_sharding_figure, memory_figure, overlap_figure

    plan = estimate(load_preset("kimi-k3-b200-fp8"), dep(8))
    assert memory_figure(plan).layout.yaxis.title.text == "GiB per GPU"
    assert dtype_vs_sharding_figure(load_preset("kimi-k3-b200-fp8"), dep(8)).layout.yaxis.title.text == "GiB per GPU"
    fig = overlap_figure(plan)
    assert list(fig.layout.xaxis.ticktext) == ["1", "10", "100", "1,000", "10,000"]
    for axis in (fig.layout.xaxis, fig.layout.yaxis):  # every label reads as the value it marks
        assert [float(t.replace(",", "")) for t in axis.ticktext] == pytest.approx(list(axis.tickvals))


def test_costmodel_panel_controls_have_room_and_the_text_skips_the_assumptions():
    from wsharding.lab.widgets.costmodel import CONTROL_WIDTH, build_costmodel_panel, panel_text

    m = load_preset("kimi-k3-b200-fp8")
    panel = build_costmodel_panel(m)
    for name in ("ranks", "bandwidth", "tokens"):
        c = panel.controls[name]
        assert c.layout.width == CONTROL_WIDTH and c.style.description_width
    assert panel.widget.children[0].layout.flex_flow == "row wrap"  # narrow windows wrap, never squeeze
    text = panel_text(panel.plan)
    assert m.assumptions and not any(a in text for a in m.assumptions)
    assert "net saving" in text


def test_costmodel_panel_is_short_and_its_text_has_no_orphaned_fragments():
    """The panel reprinted sections 1-3 (1,670 px tall, figures off screen after a slider moved) and
    kept wrapped tails of the lines it dropped ("them out of the layout)", "--context)")."""
    from wsharding.lab.widgets.costmodel import PANEL_FIGURE_HEIGHT, build_costmodel_panel, panel_text

    m = load_preset("kimi-k3-b200-fp8")
    panel = build_costmodel_panel(m)
    text = panel_text(panel.plan)
    lines = text.splitlines()
    assert len(lines) <= 20 and "replicated weights per GPU, by group" not in text and "load peaks" not in text
    # every line kept belongs to a kept block: none starts with a continuation of a dropped line
    assert not any(line.startswith("    ") and line.strip().endswith(")") and "GiB" not in line for line in lines)
    assert "them out of the layout)" not in text and "--context)" not in text
    # the figures come right under the controls, the text after them
    import ipywidgets as w

    rows, figs, html = panel.widget.children
    assert rows.layout.flex_flow == "row wrap" and isinstance(figs, w.Output) and html.value.startswith("<pre")
    assert 3 * 40 + 2 * PANEL_FIGURE_HEIGHT + 16 * len(lines) < 1100  # controls, figures, text: not 1,670 px


def test_the_panel_names_the_dtype_it_prices_and_its_legend_fits():
    """Choosing bf16 in notebook 00's panel kept the title "kimi-k3-b200-fp8"; its memory legend (seven
    rows) scrolled inside a 140 px plot area and was cut."""
    from wsharding.lab.widgets.costmodel import PANEL_FIGURE_HEIGHT, costmodel_view, panel_figure

    k3 = load_preset("kimi-k3-b200-fp8")
    _, mem, over = costmodel_view(k3, 8, "bf16")
    assert mem.layout.title.text.startswith("kimi-k3-b200-fp8 as bf16, N = 8"), mem.layout.title.text
    assert costmodel_view(k3, 8)[1].layout.title.text.startswith("kimi-k3-b200-fp8, N = 8")
    fig = panel_figure(mem)
    rows = 1 + sum(1 for t in fig.data if t.showlegend is not False)  # the legend's title and its entries
    plot_area = PANEL_FIGURE_HEIGHT - fig.layout.margin.t - fig.layout.margin.b
    assert fig.layout.height == PANEL_FIGURE_HEIGHT and plot_area >= 22 * rows, (plot_area, rows)
