"""The cost model's error and the checks every part of it shares on what a user wrote.

One error class for the whole cost model, so a caller catches one thing whatever part refused
(a device name, a model file, a deployment); each message names the bad field.
"""

from __future__ import annotations

from typing import Any

import torch

from wsharding.core.errors import WshardingError
from wsharding.core.errors import require_int as require_whole
from wsharding.core.layout import LayoutError, parse_dtype


class CostModelError(WshardingError, ValueError):
    """A model description or deployment that the cost model cannot price; names the bad field."""


def require_int(value: Any, what: str, *, minimum: int = 0, maximum: int | None = None) -> int:
    """``value`` if it is an integer in ``[minimum, maximum]``; else a :class:`CostModelError` naming ``what``.

    The check is :func:`wsharding.core.errors.require_int` ([Note: whole numbers only]), answered with
    the cost model's one error class."""
    return require_whole(value, what, minimum=minimum, maximum=maximum, error=CostModelError)


def require_dtype(value: Any, what: str) -> torch.dtype:
    """The torch dtype that ``value`` names (a dtype or one of the layout's names), as a
    :class:`CostModelError` naming ``what`` when it names none."""
    try:
        return parse_dtype(value, what=what)
    except LayoutError as e:
        raise CostModelError(str(e)) from None
