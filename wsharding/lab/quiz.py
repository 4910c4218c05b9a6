""""Check yourself": the closing cells of every notebook.

The learner writes a prediction (bytes per rank, the slot of a layer, the number of gathers, the
break-even tokens), the cell computes the answer with the package, and :func:`check` says whether
the prediction was right -- with an ``AssertionError`` that explains the answer when it was not.
The committed notebooks hold the right answers, so that they run top to bottom in CI; a learner
changes them to their own numbers first.
"""

from __future__ import annotations

from wsharding.core.errors import InvalidArgument, WshardingError


class WrongAnswer(WshardingError, AssertionError):
    """A prediction that the package's answer does not match (an ``AssertionError``, so that a
    notebook run stops at it)."""


def check(question: str, guess: float, answer: float, *, rel: float = 0.0, unit: str = "", why: str = "") -> bool:
    """Compare ``guess`` with ``answer`` (exactly, or within a relative tolerance ``rel``); print
    "right" or raise :class:`WrongAnswer` naming both numbers and ``why``."""
    if rel < 0:
        raise InvalidArgument(f"rel must be >= 0, got {rel}")
    ok = guess == answer if rel == 0 else abs(guess - answer) <= rel * abs(answer)
    tol = f" (within {rel:.0%})" if rel else ""
    if ok:
        print(f"right{tol}: {question} = {answer:,}{unit}")
        return True
    raise WrongAnswer(f"not quite -- {question}: you predicted {guess:,}{unit}, the package says {answer:,}{unit}{tol}."
                         + (f" {why}" if why else ""))
