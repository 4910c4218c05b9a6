"""The AllGather benchmark panel: pick ranks and sizes, run, see bandwidth per implementation.

A thin ipywidgets wrapper over :func:`run_allgather_panel`, which tests call directly. With CUDA it
runs the real GPU benchmark (our NCCL communicator, CTA policy 2 and 0, torch.distributed); without
it, the gloo variant on CPU processes, and the figure says that it is emulated.
"""

from __future__ import annotations

import argparse
from typing import Any

import ipywidgets as W
import plotly.graph_objects as go
import torch

from wsharding.core.errors import InvalidArgument
from wsharding.core.units import ceil_div
from wsharding.lab.args.bench_allgather import SIZES
from wsharding.lab.bench.allgather import format_table, run_cpu, run_gpu
from wsharding.lab.cluster import RankCluster
from wsharding.lab.viz.comm import allgather_bandwidth_figure
from wsharding.lab.widgets import pre_html


def parse_sizes(text: str) -> list[float]:
    """``"1, 4, 16"`` -> [1.0, 4.0, 16.0] (MiB); raises ValueError naming the bad entry. The same
    rules and messages as ``bench allgather --sizes``."""
    try:
        return SIZES(text)
    except argparse.ArgumentTypeError as e:
        raise InvalidArgument(str(e)) from None


def run_allgather_panel(ranks: int, sizes_mib: list[float], cluster: RankCluster | None = None,
                        iters: int = 5) -> tuple[dict[str, Any], go.Figure]:
    """Run the benchmark (GPU when CUDA is there, else the CPU gloo variant) and draw it.

    ``cluster``: a running CPU cluster of ``ranks`` ranks to reuse (the CPU variant only).
    """
    if torch.cuda.is_available():
        result = run_gpu(ranks, ceil_div(ranks, torch.cuda.device_count()), sizes_mib, [2, 0], iters=iters, reps=3)
    else:
        use = cluster if cluster is not None and cluster.world_size == ranks else None
        result = run_cpu(ranks, sizes_mib, iters=iters, cluster=use)
    return result, allgather_bandwidth_figure(result)


def build_allgather_panel(cluster: RankCluster | None = None) -> W.VBox:
    """The panel widget. ``panel.run_button.click()`` runs; ``panel.result`` / ``panel.figure``
    hold the last run, ``panel.text`` its table as plain text (``panel.status`` shows it as HTML)."""
    style = {"description_width": "80px"}
    ranks = W.IntSlider(value=cluster.world_size if cluster else 2, min=2, max=8, description="ranks",
                        style=style, layout=W.Layout(width="320px"))
    sizes = W.Text(value="0.25, 1, 4" if not torch.cuda.is_available() else "1, 16, 64, 256",
                   description="sizes MiB", style=style, layout=W.Layout(width="320px"))
    button = W.Button(description="run AllGather benchmark", button_style="primary",
                      layout=W.Layout(width="auto"))  # the default width cuts the label
    status = W.HTML()
    out = W.Output()
    panel = W.VBox([W.HBox([ranks, sizes, button], layout=W.Layout(flex_flow="row wrap")), status, out])
    panel.ranks, panel.sizes, panel.run_button, panel.status = ranks, sizes, button, status
    panel.result, panel.figure, panel.text = None, None, ""

    def on_click(_b: Any) -> None:
        try:
            result, fig = run_allgather_panel(ranks.value, parse_sizes(sizes.value), cluster)
        except ValueError as e:
            status.value = f"<b style='color:#c00'>{e}</b>"
            return
        panel.result, panel.figure, panel.text = result, fig, format_table(result)
        status.value = pre_html(panel.text)
        out.clear_output()
        with out:
            fig.show()

    button.on_click(on_click)
    return panel
