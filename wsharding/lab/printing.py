"""Printed text that fits a notebook's output area.

JupyterLab wraps a printed line wider than the output area anywhere (``word-break: break-all``): at
1280 px with the file browser open (about 105 characters of output) "conservative" prints as
"conser vative". :func:`say` prints like ``print`` but wraps each line longer than :data:`WIDTH` at
spaces, indenting its continuation, so that a number or a name is never cut in two. The notebooks
print through it; ``tests/lab/test_browser.py`` checks that no printed line wraps.
"""

from __future__ import annotations

import textwrap
from typing import Any

#: Characters per printed line (the output area holds about 105 at 1280 px with the file browser open).
WIDTH = 100


def wrap(text: str, width: int = WIDTH) -> str:
    """``text`` with every line longer than ``width`` wrapped at spaces; a continuation is indented
    two more than its line (a line without spaces stays whole)."""
    out = []
    for line in text.split("\n"):
        if len(line) <= width:
            out.append(line)
            continue
        indent = " " * (len(line) - len(line.lstrip()) + 2)
        out.append(textwrap.fill(line, width, subsequent_indent=indent, break_long_words=False,
                                 break_on_hyphens=False, replace_whitespace=False, drop_whitespace=True))
    return "\n".join(out)


def say(*parts: Any, sep: str = " ", width: int = WIDTH) -> None:
    """``print(*parts, sep=sep)``, each line wrapped at spaces to ``width`` (:func:`wrap`)."""
    print(wrap(sep.join(str(p) for p in parts), width))
