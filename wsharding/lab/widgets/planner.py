"""The planner panel of notebook 03: run the lookahead planner on the notebook's ranks for chosen
layers, tokens per rank, a fixed compute per layer and lookahead on/off, and show the timeline
(compute and gather lanes, exposed waits), slot reuse and gate waits.

[Note: noise on CPU ranks] Two CPU ranks share two cores with the notebook: a toy layer computes
for about as long as its gather takes, and a rank descheduled for a few milliseconds decides the
waits. So the panel adds a fixed compute per layer (``compute_ms``, a sleep that stands in for a
GPU layer and is longer than a gather here) and reports the median exposed wait over the steps:
then lookahead hides the gathers in every run. With ``compute_ms=0`` the figure says that noise
dominates.

The panel is a thin wrapper over :func:`planner_view`, which tests call directly; the work on the
ranks is :func:`wsharding.lab.tasks.planner.traced_run`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go
from IPython.display import HTML, display

from wsharding.core.errors import InvalidArgument
from wsharding.lab.bench.paired import PairedDifference, paired_difference
from wsharding.lab.cluster import RankCluster
from wsharding.lab.emulation import title_note
from wsharding.lab.memory import check_fits, sharded_need_per_rank
from wsharding.lab.tasks.planner import traced_run
from wsharding.lab.viz.planner import lookahead_pair_figure, median_exposed_us, slot_figure, timeline_figure
from wsharding.lab.widgets import pre_html, run_into
from wsharding.models import PRESETS

#: Presets a CPU-emulated rank can run in a few seconds (k3-like is for GPUs: 370 MB per layer).
CPU_PRESETS = ("tiny", "small")
#: The panel's default fixed compute per layer, ms: longer than a gather of ``tiny`` on CPU ranks.
DEFAULT_COMPUTE_MS = 10.0


def run_note(compute_ms: float, steps: int) -> str:
    """The line beside the planner's figures: what the compute was, and whether noise dominates
    (see [Note: noise on CPU ranks])."""
    if compute_ms > 0:
        return (f"each layer also computes a fixed {compute_ms:g} ms (a sleep standing in for a GPU layer); "
                f"exposed wait: median over {steps} step{'s' if steps > 1 else ''}")
    return ("no added compute: on CPU ranks a layer computes about as long as its gather, so noise decides "
            "the waits -- compare several runs, not one")


@dataclass
class PlannerView:
    """What one run of the planner produced on every rank, and its two figures."""

    results: list[dict[str, Any]]
    timeline: go.Figure
    slots: go.Figure

    @property
    def records(self) -> list[dict[str, Any]]:
        return [rec for r in self.results for rec in r["records"]]

    @property
    def exposed_ms(self) -> dict[int, float]:
        """Exposed wait per rank, ms: the median over the run's steps of each step's total."""
        return {k: v / 1e3 for k, v in median_exposed_us(self.records).items()}

    def text(self) -> str:
        r0 = self.results[0]
        lines = [
            f"{len(self.results)} ranks, {r0['mode']}, lookahead {'on' if r0['lookahead'] else 'off'}; "
            f"sharded layers {r0['sharded_layers']}",
            run_note(r0.get("compute_ms", 0.0), len(r0["step_ms"])),
        ]
        if r0["emulation"]:
            lines.append(f"NOTE: {r0['emulation']}")
        for r in self.results:
            lines.append(f"  rank {r['rank']}: {r['tokens']} tokens, gathers per step {r['gathers']}, "
                         f"exposed wait {self.exposed_ms.get(r['rank'], 0.0):.2f} ms, "
                         f"step {r['step_ms'][-1]:.2f} ms")
        return "\n".join(lines)


def planner_view(cluster: RankCluster, preset: str = "tiny", *, layers: int | None = None,
                 sharded: tuple[int, int] | None = None, tokens: int | list[int] = 8, lookahead: bool = True,
                 steps: int = 4, compute_ms: float = DEFAULT_COMPUTE_MS) -> PlannerView:
    """The pure function behind the panel: ``steps`` traced steps on every rank of ``cluster``,
    with layers ``sharded = (first, last)`` (inclusive) sharded and a fixed ``compute_ms`` added to
    every layer ([Note: noise on CPU ranks]), and the figures of the last step."""
    if preset not in PRESETS:
        raise InvalidArgument(f"preset: unknown decoder preset {preset!r}; known: {sorted(PRESETS)}")
    n_layers = layers or PRESETS[preset].layers
    sharded_layers = None
    if sharded is not None:
        first, last = sharded
        if not 0 <= first <= last < n_layers:
            raise InvalidArgument(f"sharded: layers ({first}, {last}) must satisfy 0 <= first <= last < {n_layers}")
        sharded_layers = list(range(first, last + 1))
    need = sharded_need_per_rank(preset, cluster.world_size, layers=n_layers, sharded_layers=sharded_layers)
    check_fits(need, cluster.world_size, what=f"the sharded {preset} ({n_layers} layers) on {cluster.world_size} ranks",
               instead="Pick a smaller preset or fewer layers.", device_indices=cluster.device_indices)
    results = cluster.run(traced_run, preset, tokens, lookahead, steps, layers=n_layers, sharded_layers=sharded_layers,
                          compute_ms=compute_ms)
    records = [rec for r in results for rec in r["records"]]
    note = title_note(results[0]["emulation"])
    mode = f"lookahead {'on' if lookahead else 'off'}"
    median = median_exposed_us(records)
    line = run_note(compute_ms, steps) + "<br>exposed wait per rank (median): " + ", ".join(
        f"rank {k} {v / 1e3:.2f} ms" for k, v in sorted(median.items()))
    return PlannerView(
        results=results,
        timeline=timeline_figure(records, title=f"{preset}, {mode}: compute and gathers, last step{note}", note=line),
        slots=slot_figure(records, title=f"{preset}, {mode}: slot A/B occupancy and gate waits{note}"),
    )


@dataclass
class LookaheadPair:
    """Lookahead on and off, run in paired rounds on the same ranks: per mode every step's wall time
    (the slowest rank's), the median exposed wait per rank, and the figure of each mode's median step
    on one time axis (:func:`wsharding.lab.viz.planner.lookahead_pair_figure`)."""

    step_ms: dict[bool, list[float]]
    exposed_ms: dict[bool, dict[int, float]]
    median_steps: dict[bool, list[dict[str, Any]]]
    #: on minus off, step by step of the paired rounds, and whether the run can name a side
    difference: PairedDifference
    #: per mode, the gathers and the waits the planner counted, one (gathers, waits) per rank and step
    counts: dict[bool, set[tuple[int, int]]]
    sharded_layers: list[int]
    figure: go.Figure
    note: str

    def median_step_ms(self, lookahead: bool) -> float:
        return statistics.median(self.step_ms[lookahead])

    def text(self) -> str:
        lines = [self.note.replace("<br>", "; ")]
        for la in (True, False):
            lines.append(f"lookahead {'on ' if la else 'off'}: step {self.median_step_ms(la):.1f} ms (median of "
                         f"{len(self.step_ms[la])}), exposed wait (median) "
                         + ", ".join(f"rank {k} {v:.2f} ms" for k, v in sorted(self.exposed_ms[la].items())))
        lines.append(f"step time, {self.difference.line()}")
        return "\n".join(lines)


def step_verdict(d: PairedDifference) -> str:
    """The line beside a paired figure on what the step times say: a side only where the run names
    one, else that noise decides the step's end (the exposed waits are what lookahead changes)."""
    if d.verdict.startswith("cannot tell"):
        return (f"step ends: lookahead minus off {d.median_ms:+.1f} ms, inside this run's noise ({d.verdict}); "
                "the red waits are what lookahead changes")
    return f"step ends: lookahead minus off {d.median_ms:+.1f} ms over {d.rounds} paired steps: {d.verdict}"


def lookahead_view(cluster: RankCluster, preset: str = "tiny", tokens: int | list[int] = 8, *, rounds: int = 3,
                   steps: int = 3, compute_ms: float = DEFAULT_COMPUTE_MS, layers: int | None = None,
                   ranks: tuple[int, ...] | None = None, title: str = "") -> LookaheadPair:
    """Lookahead on against off, as the planner panel compares them ([Note: noise on CPU ranks]): a
    fixed ``compute_ms`` added to every layer, ``rounds`` paired rounds -- each round runs ``steps``
    traced steps of both modes, in alternating order, so that a slow moment of the machine falls on
    both -- and the medians. The figure draws, per mode, the step whose wall time is the median of
    that mode's, on one time axis (notebooks 03 section 4 and 06 section 4)."""
    if rounds < 1 or steps < 1:
        raise InvalidArgument(f"rounds and steps must be >= 1, got {rounds}, {steps}")
    step_ms: dict[bool, list[float]] = {True: [], False: []}
    by_step: dict[bool, list[list[dict[str, Any]]]] = {True: [], False: []}
    records: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    counts: dict[bool, set[tuple[int, int]]] = {True: set(), False: set()}
    for r in range(rounds):
        for la in ((True, False) if r % 2 == 0 else (False, True)):
            results = cluster.run(traced_run, preset, tokens, la, steps, layers=layers, compute_ms=compute_ms)
            for k in range(steps):
                step_ms[la].append(max(res["step_ms"][k] for res in results))
                one = []
                for res in results:
                    ids = sorted({rec["step"] for rec in res["records"]})
                    one += [rec for rec in res["records"] if rec["step"] == ids[k]]
                by_step[la].append(one)
            records[la] += [rec for res in results for rec in res["records"]]
            counts[la] |= {gw for res in results for gw in zip(res["gathers"], res["waits"], strict=True)}
    median_steps = {}
    for la in (True, False):
        mid = statistics.median_low(step_ms[la])
        median_steps[la] = by_step[la][step_ms[la].index(mid)]
    exposed = {la: {k: v / 1e3 for k, v in median_exposed_us(records[la]).items()} for la in (True, False)}
    emulation = cluster.emulation
    difference = paired_difference(step_ms[True], step_ms[False], ("lookahead", "no lookahead"))
    note = (run_note(compute_ms, rounds * steps) + f"; {rounds} paired rounds, each mode's median step drawn"
            + f"<br>{step_verdict(difference)}" + (f"<br>{emulation}" if emulation else ""))
    figure = lookahead_pair_figure(median_steps[True], median_steps[False], ranks=ranks, note=note,
                                   title=title or f"{preset}: one step with lookahead and one without{title_note(emulation)}")
    return LookaheadPair(step_ms=step_ms, exposed_ms=exposed, median_steps=median_steps, difference=difference,
                         counts=counts, sharded_layers=results[0]["sharded_layers"], figure=figure, note=note)


@dataclass
class PlannerPanel:
    """The widget, its controls, and the latest :class:`PlannerView` (or the error it raised)."""

    widget: widgets.Widget
    preset: widgets.Dropdown
    layers: widgets.IntSlider
    sharded: widgets.IntRangeSlider
    tokens: widgets.IntSlider
    lookahead: widgets.Checkbox
    steps: widgets.IntSlider
    compute_ms: widgets.FloatSlider
    run_button: widgets.Button
    view: PlannerView | None = None
    error: str = ""
    runs: int = field(default=0)


def build_planner_panel(cluster: RankCluster) -> PlannerPanel:
    """Controls (preset, layers, sharded range, tokens per rank, compute per layer, steps,
    lookahead) and a **run on ranks** button; a run shows a summary, the timeline and the slot
    figure of the last step."""
    # Each control gets a fixed width and its label room, so that a slider's track stays draggable
    # in a narrow window (the row wraps instead of squeezing the tracks).
    size = {"layout": widgets.Layout(width="360px"), "style": {"description_width": "130px"}}
    preset = widgets.Dropdown(options=CPU_PRESETS, value="tiny", description="preset", **size)
    layers = widgets.IntSlider(value=PRESETS["tiny"].layers, min=2, max=8, description="layers", **size)
    sharded = widgets.IntRangeSlider(value=(1, layers.value - 1), min=0, max=layers.value - 1,
                                     description="sharded layers", **size)
    tokens = widgets.IntSlider(value=8, min=0, max=256, description="tokens/rank", **size)
    compute_ms = widgets.FloatSlider(value=DEFAULT_COMPUTE_MS, min=0.0, max=20.0, step=1.0,
                                     description="compute ms/layer", readout_format=".0f", **size)
    steps = widgets.IntSlider(value=4, min=1, max=8, description="steps", **size)
    lookahead = widgets.Checkbox(value=True, description="lookahead", indent=False)
    button = widgets.Button(description="run on ranks", button_style="primary")
    out = widgets.Output()
    wrap = widgets.Layout(flex_flow="row wrap")
    panel = PlannerPanel(
        widget=widgets.VBox([widgets.HBox([preset, layers, sharded], layout=wrap),
                             widgets.HBox([tokens, compute_ms, steps], layout=wrap),
                             widgets.HBox([lookahead, button]), out]),
        preset=preset, layers=layers, sharded=sharded, tokens=tokens, lookahead=lookahead, steps=steps,
        compute_ms=compute_ms, run_button=button,
    )

    def on_layers(change: Any) -> None:
        # keep the sharded range inside the model; the dense layer 0 stays out by default
        top = change["new"] - 1
        lo, hi = sharded.value
        sharded.max = top
        sharded.value = (min(lo, top), min(max(hi, lo), top))

    def show(view: PlannerView) -> None:
        display(HTML(pre_html(view.text())))
        display(view.timeline)
        display(view.slots)

    def run(_button: Any = None) -> None:
        run_into(panel, out, lambda: planner_view(cluster, preset.value, layers=layers.value, sharded=sharded.value,
                                                  tokens=tokens.value, lookahead=lookahead.value, steps=steps.value,
                                                  compute_ms=compute_ms.value), show)

    layers.observe(on_layers, names="value")
    button.on_click(run)
    return panel
