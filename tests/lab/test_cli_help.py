"""``--help`` is read in a terminal: no command shows the reStructuredText its docstrings are written in
("The ``wsharding`` command" was the first line of ``wsharding --help``)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

from wsharding.lab import cli
from wsharding.lab.cliargs import plain_text

MARKUP = re.compile(r"``|:(?:mod|func|class|meth|attr|data|exc|obj|ref):`")


def every_parser(parser: argparse.ArgumentParser, name: str = "wsharding") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                yield from every_parser(p, f"{name} {sub}")


def test_plain_text_drops_the_markup_and_keeps_the_words():
    assert plain_text("The ``wsharding`` command") == "The wsharding command"
    assert plain_text("see :func:`~wsharding.core.layout.plan` and :class:`wsharding.Plan`") == \
        "see plan and wsharding.Plan"
    assert plain_text("10**9 B/s, a `name` and --json [PATH]") == "10**9 B/s, a `name` and --json [PATH]"


def test_no_help_shows_markup():
    parsers = dict(every_parser(cli.build_parser()))
    assert {"wsharding", "wsharding demo", "wsharding plan", "wsharding bench serve", "wsharding soak"} <= set(parsers)
    for name, parser in parsers.items():
        text = parser.format_help() + parser.format_usage()
        assert not MARKUP.search(text), f"{name} --help shows markup: {MARKUP.search(text).group(0)!r}"
    assert cli.build_parser().format_help().splitlines()[2].startswith("The wsharding command: ")


@pytest.mark.parametrize("module", ["wsharding.lab.plan", "wsharding.lab.bench"])
def test_python_dash_m_help_is_plain(module):
    r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, check=True)
    assert not MARKUP.search(r.stdout), r.stdout[:300]
