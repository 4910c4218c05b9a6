"""The closing questions: empty until the learner predicts, friendly when wrong, the answer only on
request, nothing raised (the next question must still run)."""

from __future__ import annotations

import pytest

from wsharding.core.errors import InvalidArgument
from wsharding.lab.quiz import Question, quiz_panel


def test_an_empty_prediction_asks_for_one_and_gives_nothing_away():
    q = Question("chunk bytes C", 48, hint="pad to 16 N", why="align16(100) = 112, 112 / 4 = 28")
    right, msg = q.verdict(None)
    assert right is None and "write your prediction first" in msg
    assert "48" not in msg and "112" not in msg


def test_a_wrong_prediction_gets_a_hint_not_the_answer_and_no_exception(capsys):
    q = Question("chunk bytes C", 48, hint="pad to 16 N", why="align16(100) = 112")
    assert q.check(64) is None  # prints; returns nothing a cell would echo
    out = capsys.readouterr().out
    assert out.startswith("not yet: chunk bytes C -- your 64 is not it. Hint: pad to 16 N")
    assert "48" not in out and ".reveal()" in out


def test_right_within_tolerance_and_the_reveal(capsys):
    q = Question("break-even tokens", 12800, rel=0.1, why="S x N / (2 h)")
    assert q.verdict(12000)[0] is True and q.verdict(11000)[0] is False
    assert q.verdict(12000)[1] == "right (within 10%): break-even tokens = 12,800. S x N / (2 h)"
    q.reveal()
    assert capsys.readouterr().out == "answer: break-even tokens = 12,800. S x N / (2 h)\n"


def test_text_answers_and_predictions_that_are_not_numbers():
    assert Question("slot of layer 6", "B").verdict(" b ")[0] is True
    assert Question("slot of layer 6", "B").verdict("A")[0] is False
    right, msg = Question("gathers", 7).verdict("seven")
    assert right is None and "is not a number" in msg


def test_a_negative_tolerance_is_refused():
    with pytest.raises(InvalidArgument, match="rel must be >= 0"):
        Question("x", 1, rel=-0.1)


def test_the_panel_checks_and_reveals():
    panel = quiz_panel(Question("gathers per step", 7, hint="one per sharded layer"))
    row = panel.children[0]
    box, check, show, out = row.children[1].children
    check.click()
    assert "write your prediction first" in out.value
    box.value = "6"
    check.click()
    assert out.value.startswith("not yet") and "Hint: one per sharded layer" in out.value
    box.value = "7"
    check.click()
    assert out.value.startswith("right")
    show.click()
    assert out.value == "answer: gathers per step = 7."


def test_the_panel_speaks_of_its_box_and_buttons_not_of_cells():
    panel = quiz_panel(Question("gathers per step", 7, hint="one per sharded layer"))
    box, check, show, out = panel.children[0].children[1].children
    for value in ("", "6"):
        box.value = value
        check.click()
        assert "run the cell" not in out.value and ".reveal()" not in out.value, out.value
    assert "press Show answer" in out.value
    box.value = ""
    check.click()
    assert "type it in the box, then press Check" in out.value


def test_the_buttons_keep_their_labels_whole():
    """ipywidgets' fixed 148 px button, squeezed beside the verdict, showed "Sho..."."""
    _box, check, show, out = quiz_panel(Question("x", 1)).children[0].children[1].children
    for b in (check, show):
        assert b.layout.width == "auto" and b.layout.flex == "0 0 auto"
    assert show.layout.min_width == "120px"
