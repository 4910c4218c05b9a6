"""The flat-layout panel: pick a layer's weights and N, see the layout, gather it on real ranks.

The panel is a thin ipywidgets wrapper over three pure functions that tests call directly:

* :func:`parse_custom_specs` -- ``"name shape dtype"`` lines into weight specs;
* :func:`build_layout` -- a preset key (or ``"custom"`` plus text) and N into a :class:`FlatLayout`;
* :func:`run_gather` -- :func:`wsharding.lab.tasks.layout.gather_layout` on a :class:`RankCluster` of N
  ranks, summarised per rank (mismatched bytes, views equal, pieces as planned).

Which cluster runs the gather: a gather over N ranks needs a cluster of exactly N rank processes.
The panel keeps one cluster per size. The cluster you pass in serves its own size; for any other N
the panel starts a cluster of that size on the first click (a few seconds per rank on CPU) and keeps
it. :meth:`LayoutPanel.close` stops the clusters the panel started -- the one you passed in stays
yours to close.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ipywidgets as W
import plotly.graph_objects as go

from wsharding.core.errors import InvalidArgument
from wsharding.core.layout import FlatLayout, LayoutError, parse_dtype
from wsharding.lab.cluster import RankCluster, choose_backend
from wsharding.lab.layout_presets import LAYOUT_PRESETS, Spec, preset_specs
from wsharding.lab.tasks.layout import gather_layout
from wsharding.lab.viz.layout import chunk_map_figure, human_bytes
from wsharding.lab.widgets import pre_html

#: The choice that reads weights from the text box instead of a preset.
CUSTOM = "custom"

#: Largest layout gathered live on CPU-emulated ranks. Every rank holds the full buffer, a reference
#: copy of every weight and a packed expected buffer (about 4 |T| each), and 2 cores share N ranks.
MAX_CPU_GATHER_BYTES = 64 * 2**20
#: Largest layout gathered live on GPU ranks (the reference check runs on the host).
MAX_GPU_GATHER_BYTES = 2 * 2**30

MAX_GROUP_SIZE = 8

DEFAULT_CUSTOM_TEXT = """\
# one weight per line: name  shape  dtype   (shape as 96x64 or [96, 64]; dtypes: bf16 fp16 fp32 fp8 int8 ...)
q_proj      96x64   bf16
q_scale     3       fp32
kv_proj     40x64   fp8
o_proj      64x96   bf16
"""


def parse_custom_specs(text: str) -> list[Spec]:
    """Parse ``name shape dtype`` lines (``#`` starts a comment, blank lines are skipped).

    ``shape`` is dimensions joined by ``x`` (``96x64``), or a bracketed list (``[96, 64]``,
    ``(96, 64)``); ``()`` is a scalar. Errors name the line and what to write instead.

    >>> parse_custom_specs("w 2x3 bf16")
    [('w', (2, 3), torch.bfloat16)]
    """
    specs: list[Spec] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        tokens = line.split()
        if len(tokens) < 3:
            raise LayoutError(
                f"custom line {lineno} {raw.strip()!r}: expected 'name shape dtype', e.g. 'o_proj 64x96 bf16'"
            )
        name, dtype_text = tokens[0], tokens[-1]
        shape_text = "".join(tokens[1:-1]).strip("()[]").rstrip(",")  # "(3,)" is a 1-D shape
        dims = shape_text.replace("×", "x").replace("X", "x").replace(",", "x").split("x") if shape_text else []
        try:
            shape = tuple(int(d) for d in dims)  # "3x" or "3xx4" fail here: an empty dimension
        except ValueError:
            raise LayoutError(
                f"custom line {lineno} ({name!r}): shape {' '.join(tokens[1:-1])!r} is not a list of "
                "integers; write it as 96x64 or [96, 64]"
            ) from None
        if any(d < 0 for d in shape):
            raise LayoutError(f"custom line {lineno} ({name!r}): negative dimension in shape {shape}")
        specs.append((name, shape, parse_dtype(dtype_text, what=f"custom line {lineno} ({name!r})")))
    if not specs:
        raise LayoutError("custom weights: no 'name shape dtype' line found; write at least one weight")
    return specs


def build_layout(choice: str, group_size: int, custom_text: str = "") -> FlatLayout:
    """The layout for a preset key from :data:`~wsharding.lab.layout_presets.LAYOUT_PRESETS` (or
    :data:`CUSTOM`, reading ``custom_text``) over ``group_size`` ranks."""
    if not isinstance(group_size, int) or not 1 <= group_size <= MAX_GROUP_SIZE:
        raise LayoutError(f"N (group size) must be an integer from 1 to {MAX_GROUP_SIZE}, got {group_size!r}")
    specs = parse_custom_specs(custom_text) if choice == CUSTOM else preset_specs(choice)
    return FlatLayout(specs, group_size)


def live_gather_limit(cluster: RankCluster) -> int:
    """Largest ``|T|`` :func:`run_gather` accepts on ``cluster`` (CPU-emulated ranks get less)."""
    return backend_gather_limit(cluster.backend)


def backend_gather_limit(backend: str) -> int:
    """Largest ``|T|`` gathered live on ranks of ``backend`` (``"gloo"``: CPU-emulated ranks)."""
    return MAX_CPU_GATHER_BYTES if backend == "gloo" else MAX_GPU_GATHER_BYTES


def over_limit_message(layout: FlatLayout, backend: str) -> str | None:
    """A short plain sentence when ``layout`` is too large to gather live on ranks of ``backend``
    (``None`` when it fits). The panel shows it instead of an error: a layer too large to gather
    is still a valid layer, drawn exactly."""
    limit = backend_gather_limit(backend)
    if layout.total_bytes <= limit:
        return None
    where = "CPU-emulated ranks" if backend == "gloo" else "GPU ranks"
    return (f"{human_bytes(layout.total_bytes)} is drawn above, but it is over the {human_bytes(limit)} "
            f"live-gather limit on {where}: pick a smaller layer (e.g. the 1/32-scale K3-like one) to gather it.")


@dataclass
class GatherSummary:
    """The verified result of one live gather: one report per rank plus the verdict."""

    group_size: int
    total_bytes: int
    mode: str
    #: ``""`` on real GPUs; otherwise the words that say what is emulated.
    emulation: str
    reports: list[dict[str, Any]] = field(default_factory=list)
    #: Per rank: do the pieces the rank filled match ``layout.pieces(rank)`` computed here?
    pieces_match: list[bool] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every rank: zero mismatched bytes, every view equal to its reference, pieces as planned."""
        return bool(self.reports) and all(
            r["mismatched_bytes"] == 0 and r["views_equal"] and m for r, m in zip(self.reports, self.pieces_match, strict=True)
        )

    def rows(self) -> list[dict[str, Any]]:
        """One row per rank: rank, pieces, bytes gathered, mismatched bytes, views equal, milliseconds."""
        return [
            {
                "rank": r["rank"],
                "pieces": len(r["pieces"]),
                "pieces_as_planned": m,
                "bytes": r["bytes"],
                "mismatched_bytes": r["mismatched_bytes"],
                "views_equal": r["views_equal"],
                "ms": r["seconds"] * 1e3,
            }
            for r, m in zip(self.reports, self.pieces_match, strict=True)
        ]

    def text(self) -> str:
        """A plain-text report; CPU-emulated runs say so on the first line."""
        head = f"live gather on {self.group_size} rank(s), mode {self.mode}"
        head += f" ({self.emulation})" if self.emulation else " (real GPUs)"
        size = f"{self.total_bytes} B" + (f" ({human_bytes(self.total_bytes)})" if self.total_bytes >= 1024 else "")
        lines = [head, f"|T| = {size} gathered on every rank, in one all-gather"]
        for row in self.rows():
            lines.append(
                f"  rank {row['rank']}: {row['pieces']} piece(s) as planned: {row['pieces_as_planned']}, "
                f"mismatched bytes {row['mismatched_bytes']}, views equal {row['views_equal']}, "
                f"{row['ms']:.2f} ms"
            )
        lines.append("byte-exact on every rank: " + ("yes" if self.ok else "NO"))
        return "\n".join(lines)


def run_gather(cluster: RankCluster, layout: FlatLayout, *, seed: int = 0) -> GatherSummary:
    """Gather ``layout`` on every rank of ``cluster`` (one all-gather) and verify it byte for byte.

    Each rank fills its chunk from deterministic reference weights, gathers in place, and compares
    the full buffer and every view against the reference (see :func:`~wsharding.lab.tasks.layout.gather_layout`).
    """
    if cluster.world_size != layout.group_size:
        raise InvalidArgument(
            f"the layout is built for N={layout.group_size} ranks but the cluster has {cluster.world_size}: "
            f"gather it on a RankCluster({layout.group_size}) or rebuild the layout with N={cluster.world_size}"
        )
    limit = live_gather_limit(cluster)
    if layout.total_bytes > limit:
        where = "CPU-emulated ranks" if cluster.backend == "gloo" else "GPU ranks"
        raise InvalidArgument(
            f"layout of {human_bytes(layout.total_bytes)} is over the {human_bytes(limit)} live-gather limit on "
            f"{where} (each rank holds the full buffer and reference copies): pick a smaller layer, e.g. the "
            "1/32-scale K3-like preset"
        )
    reports = cluster.run(gather_layout, layout, layout.group_size, seed)
    planned = [[(p.name, p.entry_start, p.entry_stop, p.chunk_start, p.chunk_stop) for p in layout.pieces(r)]
               for r in range(layout.group_size)]
    return GatherSummary(
        group_size=layout.group_size,
        total_bytes=layout.total_bytes,
        mode=cluster.mode,
        emulation=cluster.emulation,
        reports=reports,
        pieces_match=[[tuple(p) for p in rep["pieces"]] == planned[rep["group_rank"]] for rep in reports],
    )


def _summary_html(summary: GatherSummary) -> str:
    head = html.escape(summary.text().splitlines()[0])
    cells = "".join(
        f"<tr><td>{r['rank']}</td><td>{r['pieces']}</td><td>{r['pieces_as_planned']}</td><td>{r['bytes']}</td>"
        f"<td>{r['mismatched_bytes']}</td><td>{r['views_equal']}</td><td>{r['ms']:.2f}</td></tr>"
        for r in summary.rows()
    )
    verdict = "byte-exact on every rank" if summary.ok else "MISMATCH: see the rows above"
    color = "green" if summary.ok else "red"
    return (
        f"<p>{head}</p><table><tr><th>rank</th><th>pieces</th><th>as planned</th><th>bytes</th>"
        f"<th>mismatched bytes</th><th>views equal</th><th>ms</th></tr>{cells}</table>"
        f"<p style='color:{color}'><b>{verdict}</b></p>"
    )


def _in_kernel() -> bool:
    from IPython.core.interactiveshell import InteractiveShell

    return InteractiveShell.initialized()


def _show(out: W.Output, fig: go.Figure | None) -> None:
    # Outside a kernel (plain pytest) there is nothing to draw on -- and clear_output would print
    # terminal escapes -- so the figure only stays in panel.figure.
    if not _in_kernel():
        return
    out.clear_output(wait=True)
    if fig is not None:
        with out:
            fig.show()


class LayoutPanel:
    """Pick weights (a preset or custom text) and N; see the layout table and chunk map; gather live.

    State a notebook or test can read: ``layout`` (the current :class:`FlatLayout`, or ``None`` when
    the input is invalid), ``error`` (the message shown instead), ``figure`` (the chunk map),
    ``result`` (the last :class:`GatherSummary`), ``clusters`` (by size). Drive it with ``panel.preset.value = ...``,
    ``panel.n.value = ...``, ``panel.custom.value = ...`` and ``panel.gather_button.click()``.
    """

    def __init__(
        self,
        cluster: RankCluster | None = None,
        *,
        preset: str = "demo",
        group_size: int | None = None,
        start_missing: bool = True,
        backend: str | None = None,
        start_cluster: Callable[[int], RankCluster] | None = None,
    ) -> None:
        self.start_missing = start_missing
        self.backend = backend or (cluster.backend if cluster is not None else "auto")
        # How a missing cluster of n ranks is made (tests pass a factory that records the calls).
        self._start_cluster = start_cluster or (lambda n: RankCluster(n, backend=self.backend).start())
        self._clusters: dict[int, RankCluster] = {}
        self._owned: set[int] = set()  # sizes of the clusters this panel started (and must close)
        if cluster is not None:
            self._clusters[cluster.world_size] = cluster
        n = group_size or (cluster.world_size if cluster is not None else 4)

        options = [(p.title, key) for key, p in LAYOUT_PRESETS.items()] + [("custom: type weights below", CUSTOM)]
        # Wide enough for the presets' titles and for a slider track that can be dragged; the row wraps.
        style = {"description_width": "70px"}
        self.preset = W.Dropdown(options=options, value=preset, description="weights", style=style,
                                 layout=W.Layout(width="760px", max_width="100%"))
        self.n = W.IntSlider(value=n, min=1, max=MAX_GROUP_SIZE, description="N ranks", style=style,
                             layout=W.Layout(width="420px"))
        self.custom = W.Textarea(
            value=DEFAULT_CUSTOM_TEXT, continuous_update=False, layout=W.Layout(width="760px", height="130px")
        )
        self.gather_button = W.Button(description="gather on ranks", button_style="primary", icon="play")
        self.status = W.HTML()
        self.table = W.HTML()
        self.map_out = W.Output()
        self.result_html = W.HTML()

        self.layout: FlatLayout | None = None
        self.error = ""
        self.figure: go.Figure | None = None
        self.result: GatherSummary | None = None

        for w in (self.preset, self.n, self.custom):
            w.observe(lambda _change: self.refresh(), names="value")
        self.gather_button.on_click(lambda _b: self.gather())
        self.widget = W.VBox(
            [W.HBox([self.preset, self.n], layout=W.Layout(flex_flow="row wrap")), self.custom, self.status, self.table, self.map_out,
             self.gather_button, self.result_html]
        )
        self.refresh()

    # ---- layout ----------------------------------------------------------------------------
    def refresh(self) -> None:
        """Rebuild the layout, table and chunk map from the current choice; clear the last gather."""
        self.custom.layout.display = "" if self.preset.value == CUSTOM else "none"
        self.result = None
        self.result_html.value = ""
        try:
            self.layout = build_layout(self.preset.value, self.n.value, self.custom.value)
        except LayoutError as e:
            self.layout, self.error, self.figure = None, str(e), None
            self.status.value = f"<span style='color:red'>{html.escape(str(e))}</span>"
            self.table.value = ""
            _show(self.map_out, None)
            self.gather_button.disabled = True
            return
        source = LAYOUT_PRESETS[self.preset.value].source if self.preset.value != CUSTOM else "typed above"
        note = over_limit_message(self.layout, self.backend_for(self.layout.group_size))
        self.error = note or ""
        self.gather_button.disabled = note is not None
        self.status.value = f"<i>shapes: {html.escape(source)}</i>" + (f"<br>{html.escape(note)}" if note else "")
        self.table.value = pre_html(self.layout.table(), 11)
        self.figure = chunk_map_figure(self.layout)
        _show(self.map_out, self.figure)

    # ---- clusters and the live gather --------------------------------------------------------
    def backend_for(self, n: int) -> str:
        """The backend a gather over ``n`` ranks runs on (its size limit is shown before any click)."""
        if n in self._clusters:
            return self._clusters[n].backend
        return choose_backend(n, self.backend)[0] if self.backend == "auto" else self.backend

    def cluster_for(self, n: int) -> RankCluster:
        """The cluster of ``n`` ranks: the one passed in, one started earlier, or a new one."""
        if n in self._clusters:
            return self._clusters[n]
        if not self.start_missing:
            raise InvalidArgument(
                f"no cluster of {n} ranks: this panel has clusters of sizes {sorted(self._clusters)}; set N to one "
                "of them, or build the panel with start_missing=True"
            )
        cluster = self._start_cluster(n)
        if cluster.world_size != n:
            raise InvalidArgument(f"start_cluster({n}) returned a cluster of {cluster.world_size} ranks")
        self._clusters[n] = cluster
        self._owned.add(n)
        return cluster

    def gather(self) -> GatherSummary | None:
        """What the button does: gather the current layout on a cluster of N ranks and show the check."""
        if self.layout is None:
            return None
        self.result = None
        note = over_limit_message(self.layout, self.backend_for(self.layout.group_size))
        if note is not None:  # a plain sentence, not an error: the layer is valid, only too large here
            self.error = note
            self.result_html.value = f"<p>{html.escape(note)}</p>"
            return None
        n = self.layout.group_size
        self.result_html.value = (
            f"<i>gathering {human_bytes(self.layout.total_bytes)} on {n} rank(s)"
            + ("" if n in self._clusters else f" (starting {n} rank processes first)") + " ...</i>"
        )
        try:
            self.result = run_gather(self.cluster_for(n), self.layout)
        except Exception as e:  # noqa: BLE001 - every failure is shown in the panel and kept in .error
            self.error = f"{type(e).__name__}: {e}"
            self.result_html.value = f"<pre style='color:red'>{html.escape(self.error)}</pre>"
            return None
        self.error = ""
        self.result_html.value = _summary_html(self.result)
        return self.result

    @property
    def clusters(self) -> dict[int, RankCluster]:
        """The clusters the panel can use, by size (read-only view)."""
        return dict(self._clusters)

    def close(self) -> None:
        """Stop the clusters this panel started; the one passed in is left to its owner."""
        for n in sorted(self._owned):
            self._clusters.pop(n).close()
        self._owned.clear()

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)


def build_layout_panel(cluster: RankCluster | None = None, **kwargs: Any) -> LayoutPanel:
    """A :class:`LayoutPanel` (display it, or its ``.widget``); ``kwargs`` go to the constructor."""
    return LayoutPanel(cluster, **kwargs)


__all__ = [
    "CUSTOM",
    "GatherSummary",
    "LayoutPanel",
    "backend_gather_limit",
    "build_layout",
    "build_layout_panel",
    "live_gather_limit",
    "over_limit_message",
    "parse_custom_specs",
    "run_gather",
]
