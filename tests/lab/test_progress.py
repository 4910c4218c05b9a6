"""Long commands tell their stages as they start (on standard error), so a user can tell a slow stage
from a hang: before, `wsharding demo` printed nothing for 13-20 s and `bench serve` for 34 s."""

from __future__ import annotations

import io
import time
from pathlib import Path

from wsharding.lab import cli
from wsharding.lab.bench import serve as bench_serve
from wsharding.lab.progress import Stages, rank_stage

SAVED = Path(__file__).parents[2] / "docs" / "measurements" / "cpu-2026-12-05" / "bench_serve_tiny-deep_2ranks_gloo.json"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_each_stage_is_a_line_as_it_starts_and_its_time_when_it_ends():
    out = io.StringIO()
    stages = Stages("wsharding demo", out)
    stages.start("starting 4 rank processes")
    assert out.getvalue() == "wsharding demo: starting 4 rank processes ...\n"  # told before the work, not after
    stages.start("the ranks build")
    stages.done()
    lines = out.getvalue().splitlines()
    assert lines[1].startswith("  (starting 4 rank processes: ") and lines[1].endswith(" s)")
    assert lines[2] == "wsharding demo: the ranks build ..." and lines[3].startswith("  (the ranks build: ")
    assert "\r" not in out.getvalue()  # a file or a pipe gets lines only


def test_on_a_terminal_the_running_stage_ticks_its_seconds():
    out = _Terminal()
    stages = Stages("wsharding bench serve", out, tick_s=0.01)
    stages.start("serving")
    time.sleep(0.1)
    stages.done()
    assert "\r      0 s" in out.getvalue() and out.getvalue().endswith(" s)\n")


def test_only_rank_0_of_a_command_that_asked_tells_its_stages(capsys):
    rank_stage(1, "wsharding demo", "building")
    rank_stage(0, None, "building")
    rank_stage(0, "wsharding demo", "building")
    assert capsys.readouterr().err == "wsharding demo: rank 0: building\n"


def test_bench_serve_asks_its_ranks_for_progress(monkeypatch, capsys, tmp_path):
    seen = {}

    def fake(*args, **kwargs):
        seen.update(kwargs)
        return bench_serve.read_serve_report(SAVED)

    monkeypatch.setattr(bench_serve, "run_serve_bench", fake)
    assert cli.main(["bench", "serve", "--json", str(tmp_path / "r")]) == 0
    assert seen["progress"] == "wsharding bench serve"  # its stage line comes once the ranks are up
