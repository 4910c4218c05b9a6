"""The demo's side-by-side timing: every variant measured in every round, the order rotated, the
planner's lookahead off exactly while the no-lookahead variant runs."""

from __future__ import annotations

import torch

from wsharding.lab.demo import side_by_side


class _Planner:
    lookahead = True


class _Comm:
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.barriers = 0

    def barrier(self) -> None:
        self.barriers += 1


def test_rounds_rotate_the_order_and_switch_lookahead_only_for_its_variant():
    planner, comm, ran = _Planner(), _Comm(), []

    def variant(name: str):
        return lambda step: ran.append((name, step, planner.lookahead))

    samples = side_by_side({"replicated": variant("rep"), "sharded": variant("sh"),
                            "sharded_no_lookahead": variant("nol")}, planner, comm, steps=2, rounds=3)
    order = [name for name, step, _ in ran if step == 0]
    # an untimed pass of each, then the rounds; without the rotation the first-timed variant would
    # carry every round's start-up cost
    assert order == ["rep", "sh", "nol"] + ["rep", "sh", "nol", "sh", "nol", "rep", "nol", "rep", "sh"]
    assert all(look == (name != "nol") for name, _, look in ran)
    assert [step for _, step, _ in ran[:2]] == [0, 1] and len(ran) == 12 * 2
    assert {k: len(v) for k, v in samples.items()} == {"replicated": 3, "sharded": 3, "sharded_no_lookahead": 3}
    assert comm.barriers == 9 and planner.lookahead is True
