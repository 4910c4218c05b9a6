"""What every notebook of the series holds as a lesson, read from the committed sources: no lab-log
material in the text, a link to the glossary, and a closing "Check yourself" whose predictions start
empty (the answers come from the package, not from the learner's cell)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("0*.ipynb"))
#: Lab-log material that belongs in docs/measurements/, not in a lesson.
LAB_LOG = [r"issue #\d", r"\b20\d\d-\d\d-\d\d\b", r"REFERENCES\.md", r"GPU\.md", r"\bthe seed\b", r"inspect\.getsource",
           r"\bhelp\(", r"bench_step_h200", r"LD_PRELOAD"]


def sources(nb: Path) -> list[tuple[str, str]]:
    return [(c["cell_type"], "".join(c["source"])) for c in json.loads(nb.read_text())["cells"]]


def lab_log_in(cells: list[tuple[str, str]]) -> list[str]:
    """Every lab-log pattern found, with the start of its cell. A date is allowed in a figure caption
    that says when a measurement was taken (code that reads a saved report), not in prose."""
    found = []
    for kind, text in cells:
        for pat in LAB_LOG:
            if pat.startswith(r"\b20") and kind == "code":
                continue
            if re.search(pat, text):
                found.append(f"{pat}: {text[:60]!r}")
    return found


def empty_predictions(cells: list[tuple[str, str]]) -> int:
    """How many predictions (``my_x = None``) the notebook's questions start with."""
    return sum(len(re.findall(r"^my_\w+\s*=\s*None\b", text, re.M)) for kind, text in cells if kind == "code")


def literal_brackets(cells: list[tuple[str, str]]) -> list[str]:
    """Bold text holding ``[...]`` that is not a link: d2l's ``[**claim**]`` marks, which JupyterLab
    renders with their brackets (STYLE.md: write the claim in bold alone). Fenced code is skipped."""
    found = []
    for kind, text in cells:
        if kind != "markdown":
            continue
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        found += [m[:80] for m in re.findall(r"\[\*\*.*?\*\*\]", prose, re.S)]
        for bold in re.findall(r"\*\*(.+?)\*\*", prose, re.S):
            if re.search(r"\[[^\]]*\](?!\()", bold):
                found.append(bold[:80])
    return found


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_notebook_is_a_lesson(nb):
    cells = sources(nb)
    assert lab_log_in(cells) == [], f"{nb.name}: lab-log material in the lesson"
    assert "glossary.md" in cells[0][1] or "glossary.md" in cells[1][1], f"{nb.name}: no glossary link at the top"
    assert re.search(r"\b(ask|questions)\(\"\d\d", "".join(t for _, t in cells)), f"{nb.name}: no Check-yourself questions"
    assert empty_predictions(cells) >= 2, f"{nb.name}: fewer than two predictions that start empty"
    assert literal_brackets(cells) == [], f"{nb.name}: takeaways that render with literal brackets"


def test_the_rules_see_a_lab_log_and_a_filled_prediction():
    cells = [("markdown", "As issue #5 showed on 2026-11-30"), ("code", "my_x = 7\nq.check(my_x)")]
    assert len(lab_log_in(cells)) == 2
    assert empty_predictions(cells) == 0
    assert empty_predictions([("code", "my_x = None  # <- your prediction\nmy_y = None")]) == 2


def test_the_bracket_rule_sees_d2l_marks_and_spares_links():
    assert len(literal_brackets([("markdown", "So [**the claim**] holds."),
                                 ("markdown", "**Takeaway: [the claim\non two lines].**")])) == 2
    assert literal_brackets([("markdown", "**see [the glossary](../docs/glossary.md)**"),
                             ("markdown", "```\n**x[1]**\n```"), ("code", "print('**[x]**')")]) == []


def test_the_linear_contract_says_first_why_a_weight_sharding_course_needs_it():
    nb = next(p for p in NOTEBOOKS if p.name.startswith("05_"))
    opening = sources(nb)[0][1][:700]
    assert "tp_size == 1" in opening and "sharding targets" in opening, opening


def test_serving_and_performance_are_their_own_notebooks_and_the_draft_leaves_03():
    names = [p.name for p in NOTEBOOKS]
    assert "07_serving.ipynb" in names and "08_performance.ipynb" in names
    text = {p.name[:2]: "".join(t for _, t in sources(p)) for p in NOTEBOOKS}
    assert "draft_exposed" not in text["03"] and "draft_exposed" in text["08"]
    assert "run_serve_bench" not in text["06"] and "run_serve_bench" in text["07"]
    assert text["07"].count("format_table(") == 0  # the serve table is the panel's: printed once, by it
