"""The options of ``wsharding info`` (:mod:`wsharding.lab.info` runs it)."""

from __future__ import annotations

import argparse

from wsharding.lab.cliargs import add_json_option


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_json_option(p, "the facts")
