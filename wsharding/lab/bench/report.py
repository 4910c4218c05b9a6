"""Writing a benchmark's report: the JSON, then its figure where plotly is installed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def save_report(report: dict[str, Any], prefix: str, figure: Callable[[dict[str, Any]], Any]) -> None:
    """Write ``prefix.json`` and the figure that ``figure(report)`` draws (it imports plotly when
    called). The GPU machine has no plotly: there the JSON is the result, drawn elsewhere."""
    out = Path(prefix)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    print(f"  wrote {out.with_suffix('.json')}")
    try:
        from wsharding.lab.viz.export import save_figure

        fig = figure(report)
    except ImportError as e:
        print(f"  (no figure: {e}; draw it from the JSON)")
        return
    for path in save_figure(fig, out):
        print(f"  wrote {path}")
