"""Saving figures to disk: HTML always, PNG when a static exporter and a browser are present.

**HTML.** Figures in ``figures/`` are committed and must open offline, so plotly.js cannot come
from a CDN (``include_plotlyjs="cdn"``). Embedding it in every file (``True``) costs ~4.7 MB per
figure; instead every HTML file references ``plotly.min.js`` in its own folder
(``include_plotlyjs="directory"``) and that bundle is written once per folder. The folder is
self-contained and works from ``file://`` without a network; four figures cost ~4.7 MB plus a few
tens of kB each instead of ~19 MB. A bundle left by an older plotly is replaced, so the figures
and the bundle always match the installed plotly.

**PNG.** Plotly's static export needs the optional ``kaleido`` package (1.x), which drives a
Chrome/Chromium already on the machine. We never download a browser: a PNG is written only when
``kaleido`` imports and a browser is found (``BROWSER_PATH``, else ``chromium``, ``chromium-browser``,
``google-chrome`` or ``chrome`` on ``PATH``); otherwise only the HTML is written, silently
(:func:`png_unavailable_reason` says why). An exporter that is present but fails gives a warning.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import warnings
from pathlib import Path

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from wsharding.core.errors import InvalidArgument

BUNDLE = "plotly.min.js"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")


def find_browser() -> str | None:
    """The Chrome/Chromium executable static export would use, or None. Never downloads one."""
    env = os.environ.get("BROWSER_PATH")
    if env:
        return env if os.path.isfile(env) and os.access(env, os.X_OK) else None
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def png_unavailable_reason() -> str | None:
    """Why :func:`save_figure` would write no PNG here (None: it will)."""
    if importlib.util.find_spec("kaleido") is None:
        return "the optional package kaleido is not installed (pip install kaleido)"
    if find_browser() is None:
        return "no Chrome/Chromium found (set BROWSER_PATH, or install the distribution's chromium package)"
    return None


def _write_bundle(folder: Path) -> Path | None:
    """Write ``plotly.min.js`` into ``folder`` unless the same bundle is already there."""
    js = get_plotlyjs()
    bundle = folder / BUNDLE
    if bundle.exists() and bundle.stat().st_size == len(js.encode("utf-8")) and bundle.read_text("utf-8") == js:
        return None
    bundle.write_text(js, encoding="utf-8")
    return bundle


def save_figure(fig: go.Figure, path_without_suffix: str | os.PathLike[str], *, png: bool = True,
                scale: float = 2.0) -> list[str]:
    """Write ``<path>.html`` (plotly.js shared in the folder, see the module doc) and, when static
    export works here and ``png`` is true, ``<path>.png``. Returns the paths written, the shared
    ``plotly.min.js`` included when this call wrote or refreshed it."""
    base = Path(path_without_suffix)
    if base.suffix in (".html", ".png"):
        raise InvalidArgument(f"path_without_suffix: give the path without a suffix, got {str(base)!r}")
    base.parent.mkdir(parents=True, exist_ok=True)
    written = []
    bundle = _write_bundle(base.parent)
    if bundle is not None:
        written.append(str(bundle))
    html = base.with_name(base.name + ".html")
    fig.write_html(html, include_plotlyjs="directory", full_html=True)
    written.append(str(html))
    if png and png_unavailable_reason() is None:
        browser = find_browser()
        out = base.with_name(base.name + ".png")
        old = os.environ.get("BROWSER_PATH")
        os.environ["BROWSER_PATH"] = browser  # the exporter looks here first: use the browser we found
        try:
            fig.write_image(out, format="png", scale=scale)
            written.append(str(out))
        except Exception as e:  # noqa: BLE001 -- the exporter is present but failed: keep the HTML, say why
            warnings.warn(f"{out}: PNG export failed ({type(e).__name__}: {e}); the HTML was written", stacklevel=2)
        finally:
            if old is None:
                os.environ.pop("BROWSER_PATH", None)
            else:
                os.environ["BROWSER_PATH"] = old
    return written
