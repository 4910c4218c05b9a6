"""The questions of every notebook live in the package: the cell a learner edits holds only the
prediction and the check, never the answer, its hint or its explanation."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from wsharding.core.errors import InvalidArgument, NotFound
from wsharding.lab.questions import BANK, ask, questions

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("0*.ipynb"))


def test_answers_from_the_package_alone():
    q1, q2, q3 = questions("01")
    assert (q1.answer, q2.answer, q3.answer) == (112, 48, 3)
    assert questions("02", "q1")[0].answer == 12800
    assert ask("03.q4").answer == pytest.approx(25.0)  # 5 gathers, each 5 ms longer than the layer before it
    assert ask("05.q1").answer == 8 * 128 + 2 * 128 and ask("05.q2").answer == 2
    assert ask("06.q1").answer == 11
    assert ask("00.q1").answer == 367_000_064 // 8


def test_answers_from_what_the_run_produced():
    table = {i: {"layer": i, "slot": "AB"[(i - 1) % 2], "gate": i - 2 if i > 2 else None} for i in range(1, 8)}
    assert [q.answer for q in questions("03", "q1", "q2", "q3", table=table)] == [7, "B", 4]
    served = {"rows_by_budget": [{"sharded": {"pool_tokens": 900}, "replicated": {"pool_tokens": 400}}],
              "kv_bytes_per_token": 1536}
    q = ask("07.q2", served=served)
    assert q.answer == 500 and "1,536 B per token" in q.why
    blocks = {"rows": [{"floor_ms": 4.6}], "bus_bandwidth_GBps": 380.0, "sharded_layers": 8}
    q = ask("08.q1", blocks=blocks)
    assert q.answer == 4.6 and "380.0 GB/s" in q.text


def test_a_missing_input_or_id_is_named():
    with pytest.raises(InvalidArgument, match="question 03.q2 is computed from table: pass table=..."):
        ask("03.q2")
    with pytest.raises(NotFound, match="no question '00.q9'"):
        ask("00.q9")
    with pytest.raises(NotFound, match="no questions for notebook '99'"):
        questions("99")


def _question_cells(nb: Path) -> list[str]:
    return [("".join(c["source"])) for c in json.loads(nb.read_text())["cells"]
            if c["cell_type"] == "code" and re.search(r"^my_\w+\s*=\s*None\b", "".join(c["source"]), re.M)]


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_question_cell_holds_only_the_prediction_and_the_check(nb):
    cells = _question_cells(nb)
    assert cells, f"{nb.name}: no question cell"
    for text in cells:
        assert "Question(" not in text and "why=" not in text and "hint=" not in text, text[:300]
        assert "print(" not in text, f"{nb.name}: a question cell prints something: {text[:200]}"
    # every question the bank holds for this notebook is asked
    asked = "\n".join(cells)
    for key in BANK[nb.name[:2]]:
        assert re.search(rf"\b{key}\b", asked), f"{nb.name}: question {key} is never asked"
