"""The base of every error the package raises, and the few kinds that need no class of their own.

Each error class of the package also derives from the built-in exception it has always been (a
``ShardingError`` is a ``ValueError``, a ``CommError`` a ``RuntimeError``), so code that catches the
built-in keeps working, and ``except WshardingError`` catches everything the package raises.

:func:`require_int` is the one check of every whole-number argument (sizes, counts, ranks, group
sizes, layer indices, alignments): [Note: whole numbers only].
"""

from __future__ import annotations

import numbers


class WshardingError(Exception):
    """Base of every exception raised by wsharding."""


class InvalidArgument(WshardingError, ValueError):
    """An argument or input the package cannot use; the message names it and says what to pass."""


class InvalidType(WshardingError, TypeError):
    """An argument of the wrong kind; the message names it and the kind expected."""


class NotFound(WshardingError, KeyError):
    """A name looked up that is not there (a layer that is not sharded, a key a report lacks)."""

    def __str__(self) -> str:  # KeyError quotes its argument; a sentence reads better unquoted
        return str(self.args[0]) if self.args else ""


class Unsupported(WshardingError, NotImplementedError):
    """What this machine, build or method cannot do (a CUDA-only path on CPU ranks, a quant method
    without a float path); a ``RuntimeError``, as ``NotImplementedError`` is."""


class ShardingError(WshardingError, ValueError):
    """A target that cannot be sharded, or a sharding used out of order (it lives here, not with the
    sharding, so that the planner below the sharding can raise it too)."""


# [Note: whole numbers only]
# A size, a count, a rank, a group size, a layer index or an alignment is a whole number, and a value
# that is not one is refused rather than converted: int(2.5) is 2 and int("8") is 8, so a conversion
# turns a typo (or a value read from a file as text) into another run than the one asked for, without
# a word. A bool is an int in Python (True == 1), so FlatLayout(..., True) would be a group of one
# rank: refused too. numbers.Integral admits numpy's integers (a size computed with numpy is fine) and
# nothing fractional. The range is checked in the same place, so the message names the argument, the
# value, the rule and what to pass -- never a TypeError from deep inside, never a silent clip.
def require_int(value: object, name: str, *, minimum: int | None = 0, maximum: int | None = None, where: str = "",
                todo: str = "", error: type[WshardingError] | None = None) -> int:
    """``value`` as a plain ``int`` when it is a whole number (``numbers.Integral``, never a ``bool``)
    in ``[minimum, maximum]`` (``None``: no bound); else an error naming ``name`` and the value
    ([Note: whole numbers only]).

    ``where`` prefixes the message with the function or field that was given it; ``todo`` replaces
    the default advice (``pass an int >= minimum``). The error is :class:`InvalidType` for a value that
    is not a whole number and :class:`InvalidArgument` for one out of range, unless ``error`` names the
    one class a module answers with (the cost model's ``CostModelError``, the cluster's ``ClusterError``).
    """
    prefix = f"{where}: " if where else ""
    if todo:
        advice = todo
    elif maximum is None:
        advice = "pass an int" + (f" >= {minimum}" if minimum is not None else "")
    else:
        advice = f"pass an int in {minimum if minimum is not None else '...'} .. {maximum}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise (error or InvalidType)(f"{prefix}{name}: expected an integer, got {value!r} ({_kind(value)}); {advice}")
    number = int(value)  # a numpy integer becomes a plain int: it is what every caller computes with
    if minimum is not None and number < minimum:
        raise (error or InvalidArgument)(f"{prefix}{name}: must be >= {minimum}, got {number}; {advice}")
    if maximum is not None and number > maximum:
        raise (error or InvalidArgument)(f"{prefix}{name}: must be <= {maximum}, got {number}; {advice}")
    return number


def require_bool(value: object, name: str, *, where: str = "") -> bool:
    """``value`` when it is a ``bool``; else :class:`InvalidType` naming ``name``. A switch is True or
    False: ``"no"`` or ``"false"`` is a non-empty string, and taken as a truth value it means on."""
    if not isinstance(value, bool):
        prefix = f"{where}: " if where else ""
        kind = ("a str: any non-empty text is true, 'no' included" if isinstance(value, str)
                else f"a {type(value).__name__}")
        raise InvalidType(f"{prefix}{name}: expected True or False, got {value!r} ({kind}); pass a bool")
    return value


def _kind(value: object) -> str:
    """What ``value`` is, said so that the user sees why it is not taken as a whole number."""
    if isinstance(value, bool):
        return "a bool, not a number: True would count as 1"
    if isinstance(value, float):
        whole = value.is_integer()
        return "a float, never rounded" + (f": write {int(value)}" if whole else "")
    if isinstance(value, (str, bytes)):
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        digits = text.strip().lstrip("+-").isdigit()
        kind = type(value).__name__
        return f"a {kind}: numbers are not read from text" + (f"; write {int(text)}, not {value!r}" if digits else "")
    return f"a {type(value).__name__}"
