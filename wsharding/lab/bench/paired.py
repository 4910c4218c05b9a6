"""Is variant A slower than variant B, or is the difference inside the noise of the run?

Two variants are timed in rounds, each round both of them (``rounds.py``), so round r gives a pair
(a_r, b_r) that shares whatever drifted at that moment of the run. The difference d_r = a_r - b_r
is what the rounds agree or disagree on. Without assuming any distribution of the noise, the sorted
differences d_(1) <= ... <= d_(n) bound their median: it lies in [d_(k), d_(n+1-k)] with probability
1 - 2 P(Binomial(n, 1/2) <= k - 1) (the sign test's interval). With 7 rounds the interval from the
smallest to the largest difference holds the median with probability 98.4 %; with 3 rounds, only
75 %, which is why three rounds cannot settle a difference of the size of the spread.

The verdict names the side the whole interval lies on, or says that the run cannot tell: when the
interval spans zero, or when the rounds are too few to hold the median with the coverage asked for
(90 % by default: at least 5 rounds).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from wsharding.core.errors import InvalidArgument


@dataclass(frozen=True)
class PairedDifference:
    """``a - b`` over paired rounds: the median, a distribution-free interval and its coverage."""

    a: str
    b: str
    rounds: int
    median_ms: float
    low_ms: float
    high_ms: float
    coverage: float
    verdict: str
    #: Whether the rounds were enough for the coverage asked for (otherwise no side is named).
    enough_rounds: bool

    def line(self) -> str:
        """One line for a table: '<a> - <b>: +0.41 ms (-1.20 .. +2.03 ms, 98% of medians): cannot tell'."""
        return (f"{self.a} - {self.b}: {self.median_ms:+.3f} ms ({self.low_ms:+.3f} .. {self.high_ms:+.3f} ms holds the "
                f"median with {self.coverage:.0%}, {self.rounds} paired rounds): {self.verdict}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def interval_coverage(n: int, k: int) -> float:
    """Probability that [d_(k), d_(n+1-k)] of ``n`` paired differences holds their median."""
    return 1.0 - 2.0 * sum(math.comb(n, i) for i in range(k)) / 2**n


def _check_pairs(a: list[float], b: list[float]) -> None:
    if len(a) != len(b) or not a:
        raise InvalidArgument(f"paired rounds: {len(a)} and {len(b)} samples; each round must time both variants once")


def median_interval(values: list[float], coverage: float) -> tuple[float, float, float]:
    """(low, high, its coverage): the narrowest order-statistic interval of ``values`` that holds their
    median with at least ``coverage`` (the sign test's); with too few values, the widest one (smallest
    to largest), whose coverage is then below the one asked for."""
    d, n, k = sorted(values), len(values), 1
    while k + 1 <= (n + 1) // 2 and interval_coverage(n, k + 1) >= coverage:
        k += 1
    return d[k - 1], d[n - k], interval_coverage(n, k)


@dataclass(frozen=True)
class PairedRatio:
    """``a / b`` over paired rounds: the median of the per-round ratios and the distribution-free
    interval that holds it (:func:`median_interval`). A ratio of two run-wide medians has no interval,
    and on CPU ranks it swung from 2.38x to 0.66x between two runs; this one says how far it can be
    trusted."""

    rounds: int
    median: float
    low: float
    high: float
    coverage: float

    def text(self) -> str:
        """'2.20x (1.98x .. 2.34x holds the median with 75%)'."""
        return f"{self.median:.2f}x ({self.low:.2f}x .. {self.high:.2f}x holds the median with {self.coverage:.0%})"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def paired_ratio(a: list[float], b: list[float], *, coverage: float = 0.9) -> PairedRatio:
    """``a[r] / b[r]`` for the rounds r that timed both variants, its median and the interval around it.

    >>> r = paired_ratio([2.0, 2.2, 1.8], [1.0, 1.0, 1.0])
    >>> r.text()
    '2.00x (1.80x .. 2.20x holds the median with 75%)'
    """
    _check_pairs(a, b)
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    low, high, cover = median_interval(ratios, coverage)
    return PairedRatio(len(ratios), statistics.median(ratios), low, high, cover)


def paired_difference(a: list[float], b: list[float], names: tuple[str, str] = ("a", "b"), *,
                      coverage: float = 0.9) -> PairedDifference:
    """Compare two variants timed in the same rounds (``a[r]`` and ``b[r]`` from round r).

    The interval is the narrowest order-statistic interval that holds the median difference with at
    least ``coverage``; when the rounds are too few for that, the widest one (smallest to largest),
    and the verdict names no side however the differences fall.

    >>> d = paired_difference([5.0, 5.2, 5.1, 5.3, 5.0, 5.2, 5.1], [6.0, 6.1, 6.3, 6.0, 6.2, 6.1, 6.0], ("on", "off"))
    >>> d.verdict, round(d.median_ms, 2), d.rounds
    ('on faster than off', -0.9, 7)
    >>> paired_difference([5.0, 5.1, 5.2], [6.0, 6.0, 6.0]).verdict
    'cannot tell a from b: 3 rounds hold the median with at most 75%'
    """
    _check_pairs(a, b)
    n = len(a)
    d = sorted(x - y for x, y in zip(a, b, strict=True))
    low, high, cover = median_interval(d, coverage)
    na, nb = names
    if cover < coverage:
        verdict = f"cannot tell {na} from {nb}: {n} rounds hold the median with at most {cover:.0%}"
    elif low > 0:
        verdict = f"{na} slower than {nb}"
    elif high < 0:
        verdict = f"{na} faster than {nb}"
    else:
        verdict = f"cannot tell {na} from {nb} ({cover:.0%} interval spans zero)"
    return PairedDifference(na, nb, n, statistics.median(d), low, high, cover, verdict, cover >= coverage)


def variants_paired(per_rank: list[dict[str, list[float]]], a: str, b: str, names: tuple[str, str]) -> PairedDifference:
    """Variant ``a`` against ``b`` from every rank's per-round times: round by round the slowest
    rank's (a step ends when every rank ends), then :func:`paired_difference`."""
    slowest = [[max(col) for col in zip(*(r[v] for r in per_rank), strict=True)] for v in (a, b)]
    return paired_difference(*slowest, names)


def lookahead_vs_off(per_rank: list[dict[str, list[float]]]) -> PairedDifference:
    """``sharded`` against ``sharded_no_lookahead`` (:func:`variants_paired`)."""
    return variants_paired(per_rank, "sharded", "sharded_no_lookahead", ("lookahead", "no lookahead"))
