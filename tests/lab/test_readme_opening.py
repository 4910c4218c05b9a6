"""The README's opening, as a newcomer reads it: the two commands first, how long each takes, who the
package is for, and every symbol said before it is used (the first sentence used R/N + 2·max_l |T_l|
before saying what R and T are)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ("bash scripts/setup.sh && .venv/bin/wsharding demo\n"
            "bash scripts/setup.sh --test && .venv/bin/python -m pytest")


def _opening() -> tuple[str, str]:
    """(the README's first lines up to its first code block, the prose from there to the first section)."""
    text = (ROOT / "README.md").read_text()
    head, rest = text.split("```bash\n", 1)
    return head, rest[:rest.index("\n## ")]


def test_the_readme_starts_with_the_two_commands():
    head, rest = _opening()
    assert head.count("\n") == 2 and head.startswith("# wsharding"), "only the title comes before the commands"
    assert rest.startswith(COMMANDS + "\n```")


def test_it_says_how_long_each_command_takes():
    prose = _opening()[1].split("```", 1)[1]
    first, second = prose.split("The second", 1)
    assert re.search(r"about \d+ s on 2 CPU cores", first), "the demo's time"
    assert re.search(r"about \d+ minutes\s+on 2 CPU cores", second), "the test command's time"


def test_it_says_who_it_is_for_and_defines_before_it_uses():
    prose = _opening()[1]
    assert "**Who it is for.**" in prose and "Inference engineers and students" in prose
    assert "`R/N" not in prose and "max_l" not in prose
    assert prose.index("R the bytes") < prose.index("R/N + 2T") and prose.index("T the bytes") < prose.index("2T")
