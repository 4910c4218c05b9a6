"""The paired comparison of two variants timed in the same rounds (``wsharding.lab.bench.paired``)."""

from __future__ import annotations

import pytest

from wsharding.lab.bench.paired import PairedDifference, interval_coverage, paired_difference


def test_coverage_of_the_order_statistic_interval_is_the_sign_tests():
    assert interval_coverage(3, 1) == 0.75  # 1 - 2/8
    assert interval_coverage(7, 1) == 1 - 2 / 128
    assert interval_coverage(7, 2) == 1 - 2 * 8 / 128
    assert interval_coverage(10, 2) == 1 - 2 * 11 / 1024


def test_the_narrowest_interval_with_the_coverage_asked_for():
    a = [10.0 + i for i in range(10)]
    b = [10.0] * 10  # differences 0..9
    d = paired_difference(a, b, ("x", "y"), coverage=0.9)
    # k = 2 holds the median with 97.9 %, k = 3 with 89.1 %: the interval is d_(2) .. d_(9)
    assert (d.low_ms, d.high_ms, d.rounds, d.median_ms) == (1.0, 8.0, 10, 4.5)
    assert d.coverage == interval_coverage(10, 2)
    assert d.verdict == "x slower than y"  # the whole interval lies above zero


def test_pairs_are_taken_round_by_round_not_sorted_apart():
    # a drifting run: both variants slow down together, a is always 1 ms faster in its own round.
    # Sorted apart the two sets overlap entirely; paired, every round says the same.
    a = [5.0, 7.0, 9.0, 11.0, 13.0, 15.0, 17.0]
    b = [6.0, 8.0, 10.0, 12.0, 14.0, 16.0, 18.0]
    d = paired_difference(a, b, ("on", "off"))
    assert (d.median_ms, d.low_ms, d.high_ms) == (-1.0, -1.0, -1.0)
    assert d.verdict == "on faster than off" and d.enough_rounds


def test_three_rounds_never_name_a_side():
    # three rounds that all agree still hold the median with only 75 %: no verdict at 90 %
    d = paired_difference([7.0, 7.1, 7.2], [6.0, 6.0, 6.0], ("lookahead", "no lookahead"))
    assert d.low_ms > 0 and d.coverage == 0.75
    assert d.verdict == "cannot tell lookahead from no lookahead: 3 rounds hold the median with at most 75%"
    assert not d.enough_rounds
    assert paired_difference([7.0, 7.1, 7.2], [6.0, 6.0, 6.0], coverage=0.7).verdict == "a slower than b"


def test_noisy_rounds_cannot_tell():
    d = paired_difference([27.0, 29.5, 25.6, 26.0, 27.0], [26.2, 29.0, 26.3, 26.5, 26.0], ("lookahead", "no lookahead"))
    assert d.coverage == 1 - 2 / 32 and d.low_ms < 0 < d.high_ms
    assert d.verdict == "cannot tell lookahead from no lookahead (94% interval spans zero)"
    assert d.line().startswith("lookahead - no lookahead: +0.500 ms (-0.700 .. +1.000 ms")
    assert PairedDifference(**d.as_dict()) == d  # what reports keep, read back


def test_unpaired_samples_are_refused():
    with pytest.raises(ValueError, match="each round must time both variants once"):
        paired_difference([1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        paired_difference([], [])
