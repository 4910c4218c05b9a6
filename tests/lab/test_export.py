"""Saving figures: HTML that opens offline with one shared plotly.js per folder, PNG only when the
optional exporter and a browser are present (never downloaded)."""

from __future__ import annotations

import plotly.graph_objects as go
import pytest
from plotly.offline import get_plotlyjs

from wsharding.lab.viz import export


def test_html_shares_one_bundle(tmp_path, monkeypatch):
    monkeypatch.setattr(export, "png_unavailable_reason", lambda: "test: no PNG")
    fig = go.Figure(go.Bar(x=[1], y=[2]))
    first = export.save_figure(fig, tmp_path / "a")
    assert first == [str(tmp_path / "plotly.min.js"), str(tmp_path / "a.html")]
    assert export.save_figure(fig, tmp_path / "b") == [str(tmp_path / "b.html")]  # bundle already there
    html = (tmp_path / "b.html").read_text()
    assert '<script charset="utf-8" src="plotly.min.js"></script>' in html and "cdn.plot.ly" not in html
    assert len(html) < 50_000
    (tmp_path / "plotly.min.js").write_text("/* stale bundle */")
    assert export.save_figure(fig, tmp_path / "c")[0] == str(tmp_path / "plotly.min.js")
    assert (tmp_path / "plotly.min.js").read_text() == get_plotlyjs()


def test_no_png_without_exporter_or_browser(tmp_path, monkeypatch):
    monkeypatch.setenv("BROWSER_PATH", str(tmp_path / "no-such-browser"))
    assert export.find_browser() is None
    assert "Chromium" in export.png_unavailable_reason() or "kaleido" in export.png_unavailable_reason()
    written = export.save_figure(go.Figure(), tmp_path / "x")
    assert not any(p.endswith(".png") for p in written)


def test_png_when_available(tmp_path):
    if export.png_unavailable_reason() is not None:
        pytest.skip(export.png_unavailable_reason())
    written = export.save_figure(go.Figure(go.Bar(x=[1], y=[2])), tmp_path / "p")
    assert str(tmp_path / "p.png") in written
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_suffix_is_refused(tmp_path):
    with pytest.raises(ValueError, match="without a suffix"):
        export.save_figure(go.Figure(), tmp_path / "a.html")
