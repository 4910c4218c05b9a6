""""Check yourself": the closing questions of every notebook.

The package computes each answer; the learner predicts it first. A question starts without a
prediction (``None``): checking it then only asks for one. A right prediction is confirmed, a wrong
one gets a short message with a hint -- never a traceback, so the next question still runs -- and
the answer itself is shown only on request (:meth:`Question.reveal`, or the panel's button)::

    q = Question("gathers per step, 8 layers", answer=7, hint="one per sharded layer", why="...")
    my_gathers = None     # <- your prediction
    q.check(my_gathers)   # "write your prediction in my_gathers first"
    q.reveal()            # the answer and why, when you want it
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from typing import Any

from wsharding.core.errors import InvalidArgument


@dataclass
class Question:
    """One question: its text, the package's answer, and what to say about it.

    ``rel``: a relative tolerance (0: exact). ``unit``: printed after numbers. ``hint``: said after a
    wrong prediction (it must not give the answer away). ``why``: said with the answer."""

    text: str
    answer: Any
    rel: float = 0.0
    unit: str = ""
    hint: str = ""
    why: str = ""

    def __post_init__(self) -> None:
        if self.rel < 0:
            raise InvalidArgument(f"rel must be >= 0, got {self.rel}")

    def verdict(self, guess: Any, *, panel: bool = False) -> tuple[bool | None, str]:
        """``(right, message)`` for ``guess``: right is None when there is no prediction yet, or when
        it is not something the answer can be compared with. ``panel``: the message is shown in
        :func:`quiz_panel`, where the learner types into a box and presses buttons (no cell to run
        again, no ``.reveal()`` to call)."""
        if guess is None or guess is Ellipsis:
            how = ("type it in the box, then press Check." if panel else
                   "write it after my_... = (it starts as None), then run the cell again.")
            return None, f"{self.text}: write your prediction first; {how}"
        if isinstance(self.answer, str):
            ok = str(guess).strip().lower() == self.answer.strip().lower()
        else:
            try:
                g = float(guess.replace(",", "")) if isinstance(guess, str) else float(guess)
                a = float(self.answer)
            except (TypeError, ValueError):
                return None, f"{self.text}: {guess!r} is not a number; write a number, e.g. 12800."
            if math.isnan(g):
                return None, f"{self.text}: nan is not a prediction; write a number."
            ok = g == a if self.rel == 0 else abs(g - a) <= self.rel * abs(a)
        tol = f" (within {self.rel:.0%})" if self.rel else ""
        if ok:
            return True, f"right{tol}: {self.text} = {self._fmt(self.answer)}{self.unit}. {self.why}".rstrip()
        return False, (f"not yet: {self.text} -- your {self._fmt(guess)}{self.unit} is not it{tol}. "
                       + (f"Hint: {self.hint} " if self.hint else "")
                       + ("Try again, or press Show answer." if panel else
                          "Try again, or call .reveal() to see the answer.")).rstrip()

    def check(self, guess: Any) -> None:
        """Print the verdict on ``guess`` (nothing raised: a wrong answer is part of learning)."""
        print(_wrapped(self.verdict(guess)[1]))

    def answer_text(self) -> str:
        """The package's answer and why, in one line."""
        return f"answer: {self.text} = {self._fmt(self.answer)}{self.unit}. {self.why}".rstrip()

    def reveal(self) -> None:
        """Print the package's answer and why."""
        print(_wrapped(self.answer_text()))

    @staticmethod
    def _fmt(x: Any) -> str:
        """12,800 rather than 12800.0; 0.1667 rather than 0.16666666666666666."""
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            return str(x)
        if float(x).is_integer():
            return f"{int(x):,}"
        return f"{x:,.4g}"


def _wrapped(text: str) -> str:
    """``text`` in lines of at most 100 characters: a notebook's output area breaks longer lines inside words."""
    return textwrap.fill(text, 100, subsequent_indent="  ")


def quiz_panel(*questions: Question) -> Any:
    """The questions as an ipywidgets panel: a box for each prediction, "Check" and "Show answer"
    buttons, the verdict beside them. A thin wrapper over :meth:`Question.verdict`."""
    import ipywidgets as w

    rows = []
    for q in questions:
        box = w.Text(placeholder="your prediction", layout=w.Layout(width="160px"))
        out = w.HTML(layout=w.Layout(margin="0 0 0 8px", flex="1 1 auto"))
        # each button as wide as its label: ipywidgets' default width (148 px) cut "Show answer"
        check = w.Button(description="Check", layout=w.Layout(width="auto", min_width="80px", flex="0 0 auto"))
        show = w.Button(description="Show answer", layout=w.Layout(width="auto", min_width="120px", flex="0 0 auto"))

        def on_check(_b: Any, q: Question = q, box: w.Text = box, out: w.HTML = out) -> None:
            text = box.value.strip()
            try:
                guess: Any = float(text.replace(",", "")) if text else None
            except ValueError:
                guess = text
            out.value = q.verdict(guess, panel=True)[1]

        def on_show(_b: Any, q: Question = q, out: w.HTML = out) -> None:
            out.value = q.answer_text()

        check.on_click(on_check)
        show.on_click(on_show)
        rows.append(w.VBox([w.HTML(f"<b>{q.text}</b>"), w.HBox([box, check, show, out])]))
    panel = w.VBox(rows)
    panel.add_class("wsharding-quiz")  # a page can tell the questions from the lesson's panels
    return panel
