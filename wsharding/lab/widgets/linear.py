"""A panel to explore the linear contract: TP size, attention-DP size, heads, KV heads -> each rank's
shapes and which checkpoint rows it loads. A thin wrapper over :func:`wsharding.linear.plan.layer_plan`."""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as widgets

from wsharding.lab.viz.linear import qkv_row_map
from wsharding.linear.groups import GroupError
from wsharding.linear.plan import layer_plan


def plan_html(plan: dict[str, Any]) -> str:
    """The per-rank shape table as HTML (one row per rank and linear)."""
    cols = ["rank", "dp", "linear", "group", "group_rank", "weight", "reduce"]
    head = "".join(f"<th>{c}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(r[c]))}</td>" for c in cols) + "</tr>" for r in plan["shapes"])
    return f"<table style='font-size:13px'><tr>{head}</tr>{body}</table>"


def build_linear_panel(tp_size: int = 8, attn_dp_size: int = 1, heads: int = 32, kv_heads: int = 8,
                       head_size: int = 128) -> tuple[widgets.VBox, Any]:
    """``(panel, compute)``: ``compute(tp, dp, heads, kv_heads)`` is the pure function the panel calls.

    The row map comes first; the per-rank shape table (one row per rank and linear, 32 at TP = 8)
    sits folded in ``panel.shapes`` below it, so it never pushes the figure down.

    After a change, ``panel.plan`` holds the latest plan (or ``None``), ``panel.error`` the message of a
    configuration the contract refuses (e.g. heads not divisible), and ``panel.figure`` the row map.
    """
    size = {"layout": widgets.Layout(width="170px"), "style": {"description_width": "70px"}}
    tp = widgets.Dropdown(options=[1, 2, 4, 8, 16], value=tp_size, description="TP size", **size)
    dp = widgets.Dropdown(options=[1, 2, 4, 8], value=attn_dp_size, description="attn DP", **size)
    h = widgets.BoundedIntText(value=heads, min=1, max=256, description="heads", **size)
    kv = widgets.BoundedIntText(value=kv_heads, min=1, max=256, description="KV heads", **size)
    # the figure first; the per-rank table (4 rows per rank) folded away below it
    message, table, out = widgets.HTML(), widgets.HTML(), widgets.Output()
    shapes = widgets.Accordion(children=[table], selected_index=None)
    panel = widgets.VBox([widgets.HBox([tp, dp, h, kv], layout=widgets.Layout(flex_flow="row wrap")),
                          message, out, shapes])

    def compute(tp_v: int, dp_v: int, heads_v: int, kv_v: int) -> dict[str, Any]:
        return layer_plan(tp_v, dp_v, heads_v, kv_v, head_size=head_size, hidden=512, intermediate=1024)

    def refresh(_: object = None) -> None:
        out.clear_output()
        try:
            panel.plan, panel.error = compute(tp.value, dp.value, h.value, kv.value), None
        except GroupError as e:
            panel.plan, panel.error, panel.figure = None, str(e), None
            message.value = f"<b>refused by the contract:</b> {html.escape(str(e))}"
            table.value = ""
            return
        message.value = ""
        panel.figure = qkv_row_map(panel.plan)
        table.value = plan_html(panel.plan)
        shapes.set_title(0, f"shapes of every rank's linears ({len(panel.plan['shapes'])} rows)")
        with out:
            panel.figure.show()

    for w in (tp, dp, h, kv):
        w.observe(refresh, names="value")
    panel.shapes = shapes
    panel.controls = {"tp_size": tp, "attn_dp_size": dp, "heads": h, "kv_heads": kv}
    refresh()
    return panel, compute
