"""ipywidgets panels for the notebooks: each a thin wrapper over a package function that tests
call directly. One module per stage."""

import html as _html
from collections.abc import Callable
from typing import Any

#: How a panel shows a block of fixed-width text: wrapped at spaces only. JupyterLab's output area
#: wraps a <pre> anywhere (``word-break: break-all``), which cuts numbers and names in two at 1280 px.
PRE_STYLE = "white-space: pre-wrap; word-break: normal; overflow-wrap: normal; margin: 0; line-height: 1.35"


def pre_html(text: str, px: int = 12) -> str:
    """``text`` as a <pre> block for an ``HTML`` widget, wrapped at spaces only (:data:`PRE_STYLE`)."""
    return f"<pre style='{PRE_STYLE}; font-size: {px}px'>{_html.escape(text)}</pre>"


def run_into(panel: Any, out: Any, make_view: Callable[[], Any], show: Callable[[Any], None]) -> None:
    """One press of a panel's run button: ``panel.view`` becomes what ``make_view()`` returns, or None
    with the error it raised in ``panel.error`` (callers and tests read it; the panel shows it);
    ``panel.runs`` counts the presses; ``out`` then shows the error or ``show(view)``."""
    from IPython.display import HTML, display

    panel.error = ""
    try:
        panel.view = make_view()
    except Exception as e:  # noqa: BLE001 -- shown in the panel, kept in panel.error for callers
        panel.view, panel.error = None, f"{type(e).__name__}: {e}"
    panel.runs += 1
    out.clear_output(wait=True)
    with out:
        if panel.view is None:
            display(HTML(pre_html(panel.error)))
        else:
            show(panel.view)
