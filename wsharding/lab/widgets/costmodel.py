"""The cost-model panel of notebook 00: sliders for N, dtype, bandwidth and tokens per step, and a
``map_own_chunk`` box, driving the memory and overlap figures. The panel is a thin wrapper over
:func:`costmodel_view`, which tests call directly."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go
from IPython.display import display

from wsharding.costmodel import GB, Deployment, ModelSpec, Plan, estimate, get_device, plan_table
from wsharding.lab.viz.costmodel import memory_figure, overlap_figure, token_grid
from wsharding.lab.widgets import pre_html

#: The dtype menu: "as given" keeps the model's own dtypes.
DTYPE_CHOICES = ("as given", "bf16", "fp8_e4m3", "fp32")

#: Width of each slider and of its description: with ipywidgets' defaults, five controls in one row
#: leave a slider's track a few pixels wide in a 1400 px window (nothing to drag). Rows that wrap
#: keep every track a few hundred pixels long at any window width.
CONTROL_WIDTH = "420px"
#: The figures' height in the panel (px): both fit under the controls in one screen.
PANEL_FIGURE_HEIGHT = 320
DESCRIPTION_WIDTH = "110px"


#: The blocks of ``plan_table`` the panel shows, by their first line: what the controls change (the
#: deployment, the memory per GPU and the savings, the traffic). The model's header, source and
#: assumptions, the replicated bytes by group and the load peaks are the notebook's sections 1-3,
#: stated once above the panel: reprinted on every move of a slider they pushed its figures off screen.
PANEL_BLOCKS = ("  shard group N = ", "memory per GPU", "  gross saving R", "traffic and time")


def panel_text(plan: Plan) -> str:
    """The part of the plan's text report that the panel's controls change (:data:`PANEL_BLOCKS`),
    whole blocks only: a block is cut at a blank line, so no wrapped continuation of a dropped line
    is left behind."""
    lines = plan_table(plan).splitlines()
    kept: list[str] = []
    for i, line in enumerate(lines):
        if line.startswith(PANEL_BLOCKS):
            if kept:
                kept.append("")
            for follow in lines[i:]:
                if not follow.strip() or (follow is not line and follow.startswith(PANEL_BLOCKS)):
                    break
                kept.append(follow)
    return "\n".join(kept)


def costmodel_view(
    model: ModelSpec,
    ranks: int,
    dtype: str = "as given",
    bandwidth_gbps: float | None = None,
    tokens: int = 256,
    device: str = "b200",
    map_own_chunk: bool = False,
) -> tuple[Plan, go.Figure, go.Figure]:
    """The pure function behind the panel: the plan and its two figures for one set of inputs."""
    # a model stored in another dtype is named so: the figures' titles say which weights they price
    m = model if dtype == "as given" else replace(model.with_dtype(dtype), name=f"{model.name} as {dtype}")
    dep = Deployment(ranks=ranks, device=get_device(device), tokens=tokens,
                     link_bandwidth=None if bandwidth_gbps is None else bandwidth_gbps * GB, map_own_chunk=map_own_chunk)
    plan = estimate(m, dep)
    return plan, memory_figure(plan), overlap_figure(plan)


#: The panel's figure margins (px): plotly's defaults (100 above, 80 below) leave a 320 px figure a
#: plot area of 140 px, and the memory figure's legend of seven rows (three groups, three parts, its
#: title) then scrolls inside it and is cut.
PANEL_MARGIN = {"t": 70, "b": 40}


def panel_figure(fig: go.Figure) -> go.Figure:
    """A copy of ``fig`` at the panel's height, with margins that leave its legend room to show whole."""
    return go.Figure(fig).update_layout(height=PANEL_FIGURE_HEIGHT, margin=PANEL_MARGIN,
                                        legend={"font": {"size": 11}, "tracegroupgap": 0})


@dataclass
class CostModelPanel:
    """The widget, its controls by name, and the latest ``(plan, memory figure, overlap figure)``."""

    widget: widgets.Widget
    controls: dict[str, widgets.Widget]
    view: Any = costmodel_view
    state: tuple[Plan, go.Figure, go.Figure] | None = None
    renders: int = field(default=0)

    @property
    def plan(self) -> Plan:
        assert self.state is not None
        return self.state[0]


def build_costmodel_panel(model: ModelSpec, *, ranks: int | None = None, tokens: int | None = None,
                          device: str | None = None) -> CostModelPanel:
    """Sliders (N, dtype, bandwidth GB/s, tokens per step) and the ``map_own_chunk`` box -> plan text,
    memory and overlap figures.

    Changing any control recomputes through :func:`costmodel_view`; ``panel.state`` holds the result.
    """
    dev = get_device(device or model.defaults.get("device", "b200"))
    style = {"description_width": DESCRIPTION_WIDTH}

    def sized() -> widgets.Layout:
        return widgets.Layout(width=CONTROL_WIDTH)

    controls: dict[str, widgets.Widget] = {
        "ranks": widgets.IntSlider(value=ranks or int(model.defaults.get("ranks", 8)), min=1, max=16,
                                   description="N ranks", style=style, layout=sized()),
        "dtype": widgets.Dropdown(options=DTYPE_CHOICES, value="as given", description="weight dtype",
                                  style=style, layout=sized()),
        "bandwidth": widgets.FloatSlider(value=dev.link_bandwidth / GB, min=25, max=1800, step=25,
                                         description="link GB/s", style=style, layout=sized()),
        "tokens": widgets.SelectionSlider(options=token_grid(16384),
                                          value=tokens or int(model.defaults.get("tokens", 256)),
                                          description="tokens/step", style=style, layout=sized()),
        "map_own_chunk": widgets.Checkbox(value=False, description="map_own_chunk", style=style, layout=sized()),
    }
    text = widgets.HTML()  # not an Output: its <pre> would wrap inside numbers and names at 1280 px
    # the figures right under the controls, the text last: a moved slider redraws them in view
    figs = widgets.Output()
    rows = widgets.HBox(list(controls.values()), layout=widgets.Layout(flex_flow="row wrap"))
    panel = CostModelPanel(widget=widgets.VBox([rows, figs, text]), controls=controls)

    def refresh(_change: Any = None) -> None:
        panel.state = costmodel_view(model, controls["ranks"].value, controls["dtype"].value,
                                     controls["bandwidth"].value, controls["tokens"].value, dev.name,
                                     controls["map_own_chunk"].value)
        panel.renders += 1
        text.value = pre_html(panel_text(panel.state[0]), 11)
        figs.clear_output(wait=True)
        with figs:
            for fig in panel.state[1:]:
                display(panel_figure(fig))

    for c in controls.values():
        c.observe(refresh, names="value")
    refresh()
    return panel
