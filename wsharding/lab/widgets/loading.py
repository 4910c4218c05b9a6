"""The loading panel of notebook 04: load one variant's checkpoint on the notebook's ranks (row
shards, then finalize) and show what the chosen rank held at each stage.

A thin wrapper over :func:`loading_view`, which tests call directly; the work on the ranks is
:func:`wsharding.lab.tasks.loading.load_variant`, the figure
:func:`wsharding.lab.viz.loading.finalize_figure`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go
from IPython.display import HTML, display

from wsharding.core.errors import InvalidArgument
from wsharding.lab.cluster import RankCluster
from wsharding.lab.tasks.loading import held_peak_bytes, load_variant
from wsharding.lab.viz.loading import finalize_figure
from wsharding.lab.widgets import pre_html, run_into
from wsharding.models.decoder import VARIANTS as DECODER_VARIANTS

#: The checkpoint formats a rank can load (notebook 04 section 3): the decoder's variants.
VARIANTS = tuple(DECODER_VARIANTS)


@dataclass
class LoadingView:
    """One load of one variant on every rank, and the finalize figure of one rank."""

    variant: str
    rank: int
    results: list[dict[str, Any]]
    figure: go.Figure

    def text(self) -> str:
        r = self.results[self.rank]
        mib = 2**20
        held, R = held_peak_bytes(r), r["replicated_bytes"]
        return (f"{self.variant} on {len(self.results)} ranks, rank {self.rank}: peak held {held / mib:.2f} MiB "
                f"({held / R:.0%} of R = {R / mib:.2f} MiB), resident after finalize "
                f"{r['resident_bytes'] / mib:.2f} MiB; outputs equal per step {r['equal']}")


def loading_view(cluster: RankCluster, preset: str, variant: str, folder: str | Path, counts: list[list[int]], *,
                 layers: int | None = None, rank: int = 0) -> LoadingView:
    """Write ``variant``'s checkpoint under ``folder``, load it on every rank of ``cluster`` and
    finalize; the figure is ``rank``'s stages."""
    if variant not in VARIANTS:
        raise InvalidArgument(f"variant: {variant!r} is not one of {', '.join(VARIANTS)}")
    if not 0 <= rank < cluster.world_size:
        raise InvalidArgument(f"rank: {rank} is not a rank of the {cluster.world_size} ranks")
    results = cluster.run(load_variant, preset, variant, str(Path(folder) / f"panel_{variant}.safetensors"), counts,
                          layers=layers)
    return LoadingView(variant, rank, results, finalize_figure(results[rank]))


@dataclass
class LoadingPanel:
    widget: widgets.Widget
    variant: widgets.Dropdown
    rank: widgets.IntSlider
    run_button: widgets.Button
    view: LoadingView | None = None
    error: str = ""
    runs: int = field(default=0)


def build_loading_panel(cluster: RankCluster, preset: str, folder: str | Path, counts: list[list[int]], *,
                        layers: int | None = None) -> LoadingPanel:
    """A variant, a rank and a **load on ranks** button: each run writes the checkpoint, loads it and
    shows the rank's bytes held at every stage of finalize."""
    size = {"layout": widgets.Layout(width="300px"), "style": {"description_width": "80px"}}
    variant = widgets.Dropdown(options=VARIANTS, value="int8", description="variant", **size)
    rank = widgets.IntSlider(value=1, min=0, max=cluster.world_size - 1, description="rank", **size)
    button = widgets.Button(description="load on ranks", button_style="primary")
    out = widgets.Output()
    panel = LoadingPanel(widgets.VBox([widgets.HBox([variant, rank, button], layout=widgets.Layout(flex_flow="row wrap")),
                                       out]), variant, rank, button)

    def show(view: LoadingView) -> None:
        display(HTML(pre_html(view.text())))
        display(view.figure)

    def run(_b: Any = None) -> None:
        run_into(panel, out, lambda: loading_view(cluster, preset, variant.value, folder, counts, layers=layers,
                                                  rank=rank.value), show)

    button.on_click(run)
    return panel
