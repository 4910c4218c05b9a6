"""No command writes into the checkout's tracked folders unless asked ([Note: the default output folder]
in wsharding.lab.outdir): every default output path lies in the git-ignored ``wsharding-out/`` at the
top of the checkout when a command runs anywhere inside it, and in ``./wsharding-out/`` elsewhere."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest

from wsharding.lab import cli, outdir
from wsharding.lab.bench import serve as bench_serve

ROOT = Path(__file__).resolve().parents[2]
#: The options whose value is where a command writes (a file, a prefix or a folder).
OUTPUT_DESTS = {"json", "figures", "checkpoint"}
SAVED_SERVE = ROOT / "docs" / "measurements" / "cpu-2026-12-05" / "bench_serve_tiny-deep_2ranks_gloo.json"


def _git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout


def _commands(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    """Every leaf command of the ``wsharding`` parser ("demo", "bench serve", ...)."""
    out = {}
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return {prefix.strip(): parser}
    for name, sub in subs[0].choices.items():
        out.update(_commands(sub, f"{prefix} {name}"))
    return out


def default_outputs() -> dict[str, str]:
    """"command --option" -> its default output path, for every command, as parsed in the current folder."""
    found = {}
    for name, parser in _commands(cli.build_parser()).items():
        for action in parser._actions:
            if action.dest in OUTPUT_DESTS and isinstance(action.default, str) and action.default not in ("", "-"):
                found[f"{name} {action.option_strings[0]}"] = action.default
    return found


def test_the_commands_with_default_outputs_are_all_found(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert set(default_outputs()) == {"demo --figures", "bench step --json", "bench schedule --json",
                                      "bench load --checkpoint", "bench load --json", "bench draft --json",
                                      "bench profile --json", "bench serve --json"}


@pytest.mark.parametrize("where", [".", "notebooks", "tests/lab"])
def test_inside_the_checkout_every_default_is_in_the_ignored_folder(monkeypatch, where):
    """Run from any folder of the checkout (a learner runs commands from notebooks/ too), every default
    output lands in <checkout>/wsharding-out/, which git ignores; `bench serve` and `bench draft` wrote
    into the tracked figures/ before."""
    monkeypatch.chdir(ROOT / where)
    for what, path in default_outputs().items():
        full = (ROOT / where / path.format(model="tiny-blocks")).resolve()
        assert full.is_relative_to(ROOT / outdir.OUT_NAME), f"{what} defaults to {path}"
        written = full / "demo_timeline.html" if what.endswith("--figures") else full  # a folder: a file in it
        ignored = subprocess.run(["git", "check-ignore", "-q", str(written)], cwd=ROOT)
        assert ignored.returncode == 0, f"{what} defaults to {full}, which git does not ignore"


def test_outside_the_checkout_defaults_are_in_the_current_folder(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for what, path in default_outputs().items():
        assert path.startswith(f"{outdir.OUT_NAME}/") or path == outdir.OUT_NAME, f"{what} defaults to {path}"
    assert outdir.default_out_dir() == tmp_path.resolve() / outdir.OUT_NAME


def test_help_says_where_the_default_goes(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit):
        cli.main(["bench", "serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default wsharding-out/bench_serve; wsharding-out/ is at the top of the wsharding checkout" in text


def test_running_the_defaults_leaves_git_status_unchanged(monkeypatch, capsys):
    """The defaults run for real from a folder inside the checkout: the demo draws a saved report into
    its default folder, `bench serve` writes its JSON and figure (its ranks replaced by a saved run:
    what is tested is where the files go)."""
    before = _git_status()
    monkeypatch.chdir(ROOT / "tests")
    assert cli.main(["demo", "--figures-from", str(ROOT / "figures" / "demo_cpu_report.json")]) == 0
    saved = bench_serve.read_serve_report(SAVED_SERVE)
    monkeypatch.setattr(bench_serve, "run_serve_bench", lambda *a, **k: saved)
    assert cli.main(["bench", "serve"]) == 0
    out = capsys.readouterr().out
    assert f"wrote {ROOT / outdir.OUT_NAME / 'bench_serve.json'}" in out
    assert (ROOT / outdir.OUT_NAME / "demo_timeline.html").is_file()
    assert _git_status() == before
