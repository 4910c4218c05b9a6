"""The order variants are timed in: rounds, each starting one variant later.

Timed one after another in a fixed order, the variants measured last carry whatever drifts during a
run -- GPU clocks settling, the host slowing down, the allocator growing: on an H200 the first timed
round of the k3-like demo ran ~50 % slow for every variant. Rotating the start spreads
that over all of them; the reports take the median over the rounds.
"""

from __future__ import annotations


def round_orders(names: list[str], rounds: int) -> list[list[str]]:
    """``rounds`` orders of ``names``, round ``r`` starting with ``names[r % len(names)]``."""
    return [names[r % len(names):] + names[: r % len(names)] for r in range(rounds)]
