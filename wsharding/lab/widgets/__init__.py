"""ipywidgets panels for the notebooks: each a thin wrapper over a package function that tests
call directly. One module per stage."""

import html as _html

#: How a panel shows a block of fixed-width text: wrapped at spaces only. JupyterLab's output area
#: wraps a <pre> anywhere (``word-break: break-all``), which cuts numbers and names in two at 1280 px.
PRE_STYLE = "white-space: pre-wrap; word-break: normal; overflow-wrap: normal; margin: 0; line-height: 1.35"


def pre_html(text: str, px: int = 12) -> str:
    """``text`` as a <pre> block for an ``HTML`` widget, wrapped at spaces only (:data:`PRE_STYLE`)."""
    return f"<pre style='{PRE_STYLE}; font-size: {px}px'>{_html.escape(text)}</pre>"
