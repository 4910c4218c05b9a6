"""Writing a benchmark's report: the JSON, then its figure where plotly is installed."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def json_path(prefix: str | os.PathLike[str]) -> Path:
    """The JSON file of a ``--json PREFIX``: the prefix with ``.json`` appended (one that already ends in
    ``.json`` kept as given). Not ``Path.with_suffix``: a prefix with a dot in its last part --
    ``run_kv0.05`` -- would lose it (``run_kv0.json``), and the next run at ``kv0.6`` would overwrite
    that file without a word."""
    return Path(figure_prefix(prefix) + ".json")


def figure_prefix(prefix: str | os.PathLike[str]) -> str:
    """The path before each figure's own ending (``.html``, ``_crossover.html``): ``--json PREFIX`` less a
    trailing ``.json``, so that ``--json run.json`` draws ``run.html``, not ``run.json.html``."""
    text = os.fspath(prefix)
    return text[: -len(".json")] if text.endswith(".json") else text


def save_report(report: dict[str, Any], prefix: str, figure: Callable[[dict[str, Any]], Any]) -> None:
    """Write ``prefix.json`` and the figure that ``figure(report)`` draws (it imports plotly when
    called). The GPU machine has no plotly: there the JSON is the result, drawn elsewhere."""
    path = json_path(prefix)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"  wrote {path}")
    try:
        from wsharding.lab.viz.export import save_figure

        fig = figure(report)
    except ImportError as e:
        print(f"  (no figure: {e}; draw it from the JSON)")
        return
    for path in save_figure(fig, figure_prefix(prefix)):
        print(f"  wrote {path}")
