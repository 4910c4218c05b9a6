"""The plan behind the notebook's tables, figures and widget."""

from __future__ import annotations

import numpy as np

from wsharding.lab.viz.linear import qkv_row_map, quant_error_heatmap, rank_coords_figure, row_map_height, shapes_table
from wsharding.lab.widgets.linear import build_linear_panel
from wsharding.linear.plan import layer_plan


def test_layer_plan_matches_the_designs_dp_attention_table():
    plan = layer_plan(8, 2, 32, 8)
    r5 = {r["linear"]: r for r in plan["shapes"] if r["rank"] == 5}
    assert r5["qkv_proj"]["weight"] == (1536, 4096) and r5["o_proj"]["weight"] == (4096, 1024)
    assert r5["gate_up_proj"]["weight"] == (3584, 4096) and r5["down_proj"]["weight"] == (4096, 1792)
    assert r5["o_proj"]["reduce"] == "4 ranks" and r5["down_proj"]["reduce"] == "8 ranks"
    k = [r["checkpoint_rows"] for r in plan["qkv_rows"] if r["shard"] == "k"]
    assert k == [(0, 256), (256, 512), (512, 768), (768, 1024)] * 2  # each DP replica holds all 8 KV heads


def test_figures_have_one_bar_per_rank_and_shard():
    plan = layer_plan(8, 1, 32, 4)
    fig = qkv_row_map(plan)
    assert [t.name for t in fig.data] == ["q", "k", "v"] and all(len(t.x) == 8 for t in fig.data)
    assert list(fig.data[1].base[:2]) == [4096, 4096]  # ranks 0 and 1 read the same K head
    assert len(rank_coords_figure(8, 2, 2).data[0].text[0]) == 8
    assert len(shapes_table(plan).data[0].cells.values[0]) == 32


def test_panel_driven_programmatically():
    panel, compute = build_linear_panel()
    assert panel.error is None and panel.plan["config"]["tp_size"] == 8
    panel.controls["kv_heads"].value = 4
    assert {r["replicas"] for r in panel.plan["qkv_rows"] if r["shard"] == "k"} == {2}
    panel.controls["heads"].value = 12  # 12 heads on 8 ranks: refused with the rule named
    assert panel.plan is None and "not divisible by 8" in panel.error
    assert compute(4, 2, 32, 8)["config"]["attn_tp_size"] == 2


def test_row_map_grows_with_the_ranks_and_labels_every_one():
    heights = [qkv_row_map(layer_plan(tp, 1, 32, 8)).layout.height for tp in (1, 2, 4, 8)]
    assert heights == sorted(heights) and len(set(heights[1:])) == 3  # (1 rank gets the 2-rank minimum)
    fig = qkv_row_map(layer_plan(4, 1, 32, 8))
    assert list(fig.layout.yaxis.tickvals) == [f"rank {r}" for r in range(4)]
    assert fig.layout.height == row_map_height(4) and fig.layout.legend.orientation == "h"


def test_quant_error_heatmap_names_its_axes():
    fig = quant_error_heatmap(np.zeros((4, 3)), "err")
    assert fig.layout.xaxis.title.text and fig.layout.yaxis.title.text


def test_panel_puts_the_figure_before_the_folded_table():
    panel, _ = build_linear_panel(tp_size=4)
    kinds = [type(c).__name__ for c in panel.children]
    assert kinds.index("Output") < kinds.index("Accordion") and panel.shapes.selected_index is None
    assert "16 rows" in panel.shapes.get_title(0)  # 4 ranks x 4 linears


def test_the_row_error_axis_labels_one_tick_per_decade():
    """05's log axis labelled 2 and 5 inside each decade too: crammed minor labels."""
    from wsharding.lab.viz.linear import row_error_figure

    fig = row_error_figure({"a": 1e-7, "b": 0.0, "c": 3e-4}, 1e-5, "t")
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis.dtick == 1 and fig.layout.yaxis.minor.ticks == ""
