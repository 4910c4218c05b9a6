"""The planner's parts on their own, without ranks: the one account of the slots
(wsharding/core/slot_state.py) and the replay of a schedule (wsharding/core/replay.py)."""

from __future__ import annotations

import pytest

from wsharding.core.comm import CommError
from wsharding.core.replay import Replay, flatten
from wsharding.core.schedule import lookahead_schedule, slot_binding
from wsharding.core.slot_state import SlotState


class _Gather:
    def __init__(self, fail: bool = False) -> None:
        self.fail, self.waited = fail, 0

    def start(self, gate, marks, *, inline=False) -> None:
        pass

    def wait(self, stream=None) -> None:
        self.waited += 1
        if self.fail:
            raise CommError("the peer went away")


def test_a_slot_is_empty_landing_then_ready_and_tells_what_was_issued_for_which_step():
    gathers = {1: _Gather(), 2: _Gather(), 3: _Gather(fail=True)}
    st = SlotState(2, gathers, {1: 0, 2: 1, 3: 0})
    assert st.occupancy() == {"A": None, "B": None}
    st.start(0, 1, 5, None, None, False)
    assert st.landing(0) == 1 and st.holds(0) is None and st.issued_for(1, 5) and not st.issued_for(1, 6)
    assert st.join(0, None) == 1 and st.holds(0) == 1 and st.landing_slots() == []
    st.receiving(1, 2, 6, join=lambda: None)  # issued ahead, for the next step
    assert st.ahead(5) == {2: 1} and st.ahead(6) == {} and st.landing_slots(upto_step=5) == []
    assert st.filled(1, 1, 5) == 2  # a gather outside the schedule replaced the one issued ahead
    assert st.ahead(5) == {} and st.holds(1) == 1
    st.start(0, 3, 5, None, None, False)
    with pytest.raises(CommError, match="the peer went away"):
        st.join(0, None)
    assert st.holds(0) is None and st.landing(0) is None and st.issued_for(3, 5)  # failed: empty, still issued
    st.forget(0)
    assert not st.issued_for(3, 5) and st.occupancy() == {"A": None, "B": 1}


def test_the_replay_holds_a_gather_until_its_gate_ends_and_gives_the_rest_up_at_once():
    layers = [0, 1, 2, 3]
    sched = lookahead_schedule(layers, slot_binding(layers, 2), 2)  # two ahead over two slots: gates matter
    issued, held = [], []
    r = Replay(lambda g, here, ungated: issued.append((g.layer, ungated)), held.append)
    r.begin(flatten(sched))
    assert issued == [(0, False), (1, False)] and held == [2]  # 2 overwrites 0's slot: held behind block 0
    r.own_gather(0)
    r.block_start(0)
    r.block_end(0, True)
    assert issued[-1] == (2, False)  # its gate ended
    r.own_gather(1)
    r.block_start(1)
    assert held == [2, 3]  # issued at block 1's start, behind block 1 itself
    assert [g.layer for g in r.rest()] == [3]  # given up: the held one, its gate ignored
    assert r.rest() == []
