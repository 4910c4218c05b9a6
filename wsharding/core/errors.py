"""The base of every error the package raises, and the few kinds that need no class of their own.

Each error class of the package also derives from the built-in exception it has always been (a
``ShardingError`` is a ``ValueError``, a ``CommError`` a ``RuntimeError``), so code that catches the
built-in keeps working, and ``except WshardingError`` catches everything the package raises.
"""

from __future__ import annotations


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
