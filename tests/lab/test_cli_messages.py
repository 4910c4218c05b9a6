"""The command's first answers to a newcomer: an unknown option is named, one mistake is worded one
way whichever command parses it, the README lists every benchmark, and the demo's step times and
their ratio are read from the same rounds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from wsharding.lab import cli
from wsharding.lab.demo import step_time_line

ROOT = Path(__file__).resolve().parents[2]


def refusal(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_an_unknown_option_before_the_command_is_named(capsys):
    # argparse checks for the missing COMMAND first: without the rewording only that is said
    assert "unrecognized arguments: --frobnicate" in refusal(["--frobnicate"], capsys)
    assert "the following arguments are required: COMMAND" in refusal([], capsys)  # nothing else to name


@pytest.mark.parametrize("command", [["demo"], ["plan"], ["bench", "step"], ["bench", "load"]])
def test_a_word_for_a_number_is_refused_in_the_same_words_everywhere(command, capsys):
    err = refusal([*command, "--ranks", "two"], capsys)
    assert "argument --ranks: 'two' is not a whole number" in err, err


def test_the_readme_lists_every_benchmark():
    from wsharding.lab.bench import BENCHES

    line = next(x for x in (ROOT / "README.md").read_text().splitlines() if "bench allgather" in x)
    listed = re.search(r"bench ([a-z|]+)", line).group(1).split("|")
    missing = [name for name in BENCHES if name not in listed]
    assert missing == [], f"the README's command list lacks {missing}: {line}"


def _ratio(line: str) -> float:
    return float(re.search(r"sharded / replicated ([0-9.]+)x", line).group(1))


def test_the_demo_step_times_are_the_rounds_the_ratio_is_taken_from():
    # per rank, medians that put sharded below replicated; over the rounds (mean of the ranks) it is
    # slower, and every per-round ratio says so
    samples = {"replicated": [10.0, 10.0, 10.0], "sharded": [11.0, 12.0, 11.5],
               "sharded_no_lookahead": [13.0, 13.0, 13.0]}
    line = step_time_line({"replicated": 10.5, "sharded": 10.2, "sharded_no_lookahead": 13.0}, samples)
    assert "replicated 10.000 ms | sharded 11.500 ms | no lookahead 13.000 ms" in line, line
    assert "the median of 3 rounds" in line and "noise decides" not in line


def test_the_demo_says_when_medians_and_the_ratio_disagree():
    # medians: sharded 3 > replicated 2; per-round ratios 3, 0.8, 0.5: median 0.8 < 1
    samples = {"replicated": [1.0, 5.0, 2.0], "sharded": [3.0, 4.0, 1.0]}
    line = step_time_line({}, samples)
    assert "sharded: the medians and the per-round ratio fall on the two sides of 1x" in line, line
