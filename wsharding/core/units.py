"""Units and the two integer roundings that every stage uses (one home for each)."""

from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
GB = 10**9


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, without floats."""
    return -(-a // b)


def align_up(n: int, alignment: int) -> int:
    """Smallest multiple of ``alignment`` that is >= ``n``."""
    return ceil_div(n, alignment) * alignment


def fmt_bytes(n: int | float) -> str:
    """``n`` bytes in binary and decimal units, both named: ``'48.79 GiB (52.39 GB)'``."""
    if abs(n) >= GiB / 10:
        return f"{n / GiB:.2f} GiB ({n / GB:.2f} GB)"
    if abs(n) >= MiB:
        return f"{n / MiB:.2f} MiB ({n / 1e6:.2f} MB)"
    if abs(n) >= KiB:
        return f"{n / KiB:.1f} KiB ({n} B)"
    return f"{int(n)} B"
