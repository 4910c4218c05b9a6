"""The command line answers bad input in one line, before any rank starts; errors from the ranks
come back as one line per distinct error; every option has help and one name for the JSON path."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from wsharding.lab import cli, cliargs, demo
from wsharding.lab.bench import allgather
from wsharding.lab.cliargs import InputError, check_output_path, error_lines, run_command
from wsharding.lab.cluster import RemoteError

ROOT = Path(__file__).resolve().parents[2]
#: The committed CPU demo report: docs/design.md shows its table, --figures-from draws it.
CPU_REPORT = ROOT / "figures" / "demo_cpu_report.json"
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU answers need a machine without CUDA")


@pytest.fixture
def no_ranks(monkeypatch):
    """Fail the test if a command starts rank processes: bad input must be refused before that."""

    def refuse(*a, **k):
        raise AssertionError("a RankCluster was started for bad input")

    monkeypatch.setattr(demo, "RankCluster", refuse)
    monkeypatch.setattr(allgather, "RankCluster", refuse)
    from wsharding.lab.bench import step

    monkeypatch.setattr(step, "RankCluster", refuse)
    from wsharding.lab.bench import ranks  # draft, profile and serve start their ranks here

    monkeypatch.setattr(ranks, "RankCluster", refuse)
    from wsharding.lab import soak

    monkeypatch.setattr(soak, "RankCluster", refuse)


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse refuses while parsing
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


BAD = [
    (["demo", "--ranks", "0"], "argument --ranks: must be at least 1, got 0"),
    (["demo", "--ranks", "-1"], "argument --ranks: must be at least 1, got -1"),
    (["demo", "--ranks", "x"], "argument --ranks: 'x' is not a whole number"),
    (["demo", "--steps", "0"], "argument --steps: must be at least 1, got 0"),
    (["demo", "--timed-steps", "0"], "argument --timed-steps: must be at least 1, got 0"),
    (["demo", "--figures-from", "/no/such/report.json"], "--figures-from /no/such/report.json does not exist"),
    # a share is a fraction: refused while parsing, not after the ranks started and built a model
    (["bench", "serve", "--kv-share", "0.05,2"], "argument --kv-share: '2': every value must be less than 1"),
    (["bench", "serve", "--kv-share", "1"], "argument --kv-share: '1': every value must be less than 1"),
    (["plan", "--serve", "--profile", "measure", "--kv-share", "2"], "argument --kv-share: '2': every value must be less "
                                                                      "than 1"),
    # a missing saved report is not a file to remove
    (["bench", "serve", "--from-json", "/no/such/serve.json"],
     "saved report /no/such/serve.json does not exist (No such file or directory); pass a JSON report"),
    (["plan", "--model", "README.md"], "model file README.md: a model description is a .json, .yaml or .yml file, "
                                       "not .md"),
    (["bench", "allgather", "--sizes", "abc"], "argument --sizes: 'abc' is not a number of MiB"),
    (["bench", "allgather", "--sizes", "1,-4"], "argument --sizes: '-4': every value must be more than 0 MiB"),
    (["bench", "allgather", "--ranks", "0"], "argument --ranks: must be at least 1, got 0"),
    (["bench", "allgather", "--policies", "1"], "argument --policies: CTA policy 1 is not measured here"),
    (["bench", "allgather", "--iters", "0"], "argument --iters: must be at least 1, got 0"),
    (["bench", "step", "--tokens", "abc"], "argument --tokens: 'abc' is not a whole number of tokens"),
    (["bench", "step", "--tokens", "1,0"], "argument --tokens: '0': every value must be at least 1 tokens"),
    (["bench", "step", "--ranks", "0"], "argument --ranks: must be at least 1, got 0"),
    (["bench", "draft", "--tokens", "0"], "argument --tokens: must be at least 1, got 0"),
    (["bench", "draft", "--commit-ms", "-1"], "argument --commit-ms: must be at least 0, got -1"),
    (["bench", "draft", "--json", "/etc/passwd/x"], "--json /etc/passwd/x.json: /etc/passwd is a file"),
    (["plan", "--preset", "kimi-k3-b200-fp8", "--ranks", "0"], "ranks: must be >= 1, got 0"),
    # every whole-number option: 0 and -1 where they cannot work, a fraction never rounded
    (["plan", "--preset", "kimi-k3-b200-fp8", "--ranks", "-1"], "ranks: must be >= 1, got -1"),
    (["plan", "--preset", "kimi-k3-b200-fp8", "--ranks", "2.5"], "argument --ranks: '2.5' is not a whole number"),
    (["plan", "--preset", "kimi-k3-b200-fp8", "--tokens", "-1"], "tokens: must be >= 0, got -1"),
    (["plan", "--preset", "kimi-k3-b200-fp8", "--context", "0"], "context: must be >= 1, got 0"),
    (["plan", "--preset", "kimi-k3-b200-fp8", "--kv-bytes-per-token", "0"], "kv_bytes_per_token: must be >= 1, got 0"),
    (["bench", "step", "--steps", "0"], "argument --steps: must be at least 1, got 0"),
    (["bench", "step", "--repeats", "-1"], "argument --repeats: must be at least 1, got -1"),
    (["bench", "schedule", "--depths", "1,0"], "argument --depths: '0': every value must be at least 1 depths"),
    (["bench", "schedule", "--ranks", "2.5"], "argument --ranks: '2.5' is not a whole number"),
    (["bench", "allgather", "--ranks-per-gpu", "0"], "argument --ranks-per-gpu: must be at least 1, got 0"),
    (["bench", "allgather", "--reps", "0"], "argument --reps: must be at least 1, got 0"),
    (["bench", "draft", "--steps", "0"], "argument --steps: must be at least 1, got 0"),
    (["bench", "profile", "--tokens", "0"], "argument --tokens: must be at least 1, got 0"),
    (["bench", "serve", "--layers", "1"], "argument --layers: must be at least 2, got 1"),
    (["bench", "serve", "--requests", "0"], "argument --requests: must be at least 1, got 0"),
    (["bench", "serve", "--token-budget", "-1"], "argument --token-budget: must be at least 1, got -1"),
    # nan passes every comparison and inf every lower bound: both ended in a traceback after parsing
    (["plan", "--preset", "kimi-k3-b200-fp8", "--kv-pool-gib", "nan"], "argument --kv-pool-gib: 'nan' is not a finite"),
    (["plan", "--preset", "kimi-k3-b200-fp8", "--kv-pool-gib", "inf"], "argument --kv-pool-gib: 'inf' is not a finite"),
    (["plan", "--preset", "kimi-k3-b200-fp8", "--kv-pool-gib", "-1"], "argument --kv-pool-gib: must be at least 0, got -1"),
    (["plan", "--preset", "kimi-k3-b200-fp8", "--latency-us", "inf"], "argument --latency-us: 'inf' is not a finite"),
    (["bench", "allgather", "--sizes", "nan"], "argument --sizes: 'nan' is not a finite number of MiB"),
    (["bench", "allgather", "--sizes", "1,inf"], "argument --sizes: 'inf' is not a finite number of MiB"),
    (["bench", "allgather", "--sizes", "1e-9"], "every size must be at least 16 bytes (1.53e-05 MiB)"),
    (["bench", "allgather", "--cpu", "--overlap", "1"], "--overlap times gathers beside a bf16 GEMM on GPUs, and "
                                                         "with --cpu the gloo variant runs; leave --overlap out"),
    (["bench", "allgather", "--cpu", "--ranks-per-gpu", "2"], "--ranks-per-gpu 2 places ranks on GPUs, and with --cpu"),
    (["bench", "draft", "--commit-ms", "nan"], "argument --commit-ms: 'nan' is not a finite number"),
    (["bench", "draft", "--commit-ms", "inf"], "argument --commit-ms: 'inf' is not a finite number"),
    (["bench", "draft", "--commit-ms", "1e9"], "argument --commit-ms: must be at most 1000, got 1e9"),
    (["bench", "step", "--json", "/etc/passwd/x"], "--json /etc/passwd/x.json: /etc/passwd is a file"),
    # the soak's ranks need a warm-up of 50 steps before the first count, and know the presets
    (["soak", "--steps", "0"], "argument --steps: must be at least 51 (50 warm-up steps, then the checked ones), got 0"),
    (["soak", "--steps", "-5"], "argument --steps: must be at least 51"),
    (["soak", "--steps", "30"], "argument --steps: must be at least 51 (50 warm-up steps, then the checked ones), got 30"),
    (["soak", "--preset", "nope"], "argument --preset: invalid choice: 'nope' (choose from"),
    (["soak", "--ranks", "0"], "argument --ranks: must be at least 1, got 0"),
    # an empty path passed every check and failed when the result was written, after the whole run
    *[(argv + ["--json", ""], "argument --json: an empty path: give a file path, or --json alone (or -)")
      for argv in (["demo"], ["plan", "--preset", "kimi-k3-b200-fp8"], ["soak"], ["bench", "allgather"], ["info"])],
    (["demo", "--report", ""], "argument --report: an empty path"),
    (["demo", "--figures-from", ""], "argument --figures-from: an empty path: give a file path"),  # ran the whole demo
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_before_any_work(argv, message, capsys, no_ranks):
    rc, out, err = run_cli(argv, capsys)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"wsharding {argv[0]}") and ": error: " in lines[0] and message in lines[0], lines[0]


HUGE = str(10**18)


@pytest.mark.parametrize("argv", [["demo"], ["soak"], ["bench", "step"], ["bench", "schedule"], ["bench", "draft"],
                                  ["bench", "profile"], ["bench", "serve"], ["bench", "allgather"]],
                         ids=" ".join)
def test_a_huge_number_of_ranks_is_one_line_before_any_rank(argv, capsys):
    """``--ranks 10**18`` passes argparse (a whole number >= 1); the command's bound, or RankCluster's
    (:data:`wsharding.lab.cluster.MAX_LOCAL_RANKS`), refuses it in one line before a process starts --
    not a MemoryError from a list of 10**18 devices."""
    rc, out, err = run_cli([*argv, "--ranks", HUGE], capsys)
    lines = err.strip().splitlines()
    assert rc in (1, 2) and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"wsharding {argv[0]}") and HUGE in lines[0], lines[0]


@CPU_ONLY
@pytest.mark.parametrize(("argv", "message"), [
    (["demo", "--backend", "nccl"], "--backend nccl needs CUDA GPUs and this machine has none; use --backend gloo"),
    (["demo", "--comm", "nccl"], "--comm nccl (our NCCL binding: symmetric windows, copy engine) needs CUDA GPUs"),
    (["demo", "--ranks", "1000"], f"--ranks 1000: at most {cliargs.MAX_CPU_RANKS} CPU rank processes"),
    (["demo", "--map-own-chunk"], "--map-own-chunk maps each layer's own chunk under its gather range: that "
                                  "needs our NCCL binding on GPUs (--comm nccl, NCCL >= 2.30); this machine has no CUDA GPU"),
    (["bench", "step", "--issue-thread"], "--issue-thread is a thread of our NCCL binding on GPUs"),
    (["demo", "--issue-thread"], "--issue-thread starts a thread that issues the gathers of our NCCL binding on GPUs "
                                 "(--comm nccl); this machine has no CUDA GPU"),
    (["bench", "allgather", "--ranks", "1000"], f"--ranks 1000: at most {cliargs.MAX_CPU_RANKS} CPU rank processes"),
    (["bench", "allgather", "--overlap", "1"], "--overlap times gathers beside a bf16 GEMM on GPUs, and this machine "
                                               "has no CUDA GPU; leave --overlap out"),
    (["bench", "allgather", "--ranks-per-gpu", "2"], "--ranks-per-gpu 2 places ranks on GPUs, and this machine has no "
                                                     "CUDA GPU; leave --ranks-per-gpu out"),
])
def test_cpu_machine_refuses_what_needs_gpus(argv, message, capsys, no_ranks):
    rc, out, err = run_cli(argv, capsys)
    assert rc == 2 and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("argv", [
    ["demo", "--json", "{file}/r.json"],
    ["demo", "--report", "{file}/r.json"],  # the old spelling, a hidden alias
    ["demo", "--figures", "{file}"],
    ["demo", "--figures-from", str(CPU_REPORT), "--figures", "{file}/figs"],
    ["bench", "allgather", "--json", "{file}/a.json"],
    ["plan", "--preset", "kimi-k3-b200-fp8", "--json", "{file}/p.json"],
    ["info", "--json", "{file}/i.json"],
])
def test_unwritable_output_is_refused_first(argv, tmp_path, capsys, no_ranks):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    rc, out, err = run_cli([a.format(file=blocker) for a in argv], capsys)
    assert rc == 2 and err.count("\n") == 1, err
    assert str(blocker) in err and ("is a file" in err or "is not a folder" in err), err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("argv", [
    ["demo", "--json", "/proc/wsharding-check/r.json"],
    ["demo", "--json", "/proc/r.json"],
    ["demo", "--figures", "/proc/wsharding-figures"],
    ["demo", "--figures", "/proc/self"],  # a folder that exists, where no file can be made
    ["plan", "--preset", "kimi-k3-b200-fp8", "--json", "/proc/p.json"],
    ["soak", "--json", "/proc/s.json"],
    ["bench", "allgather", "--json", "/proc/a.json"],
    ["bench", "step", "--json", "/proc/bench_step"],
    ["bench", "draft", "--json", "/proc/bench_draft"],
    ["bench", "serve", "--json", "/proc/bench_serve"],
    ["bench", "serve", "--engine", "transformers", "--json", "/proc/bench_serve"],
    ["info", "--json", "/proc/i.json"],
], ids=" ".join)
def test_output_under_proc_is_refused_even_where_permission_bits_say_yes(argv, monkeypatch, capsys, no_ranks):
    """Root passes ``os.access`` everywhere, yet can create nothing under /proc: the check creates
    (and removes) what it needs instead of asking the permission bits -- made to lie here, as for root."""
    monkeypatch.setattr(cliargs.os, "access", lambda *a, **k: True)
    rc, out, err = run_cli(argv, capsys)
    option = "--figures" if "--figures" in argv else "--json"
    assert rc == 2 and err.count("\n") == 1, err
    assert f"{option} /proc/" in err and ": cannot create /proc/" in err and "choose another path" in err, err


def test_output_check_leaves_nothing_behind(tmp_path):
    """The check creates the missing folders and the file to know it can, then removes what it made."""
    (tmp_path / "kept.json").write_text("as it was")
    check_output_path(tmp_path / "new" / "deeper" / "r.json", "--json")
    check_output_path(tmp_path / "figs" / "sub", "--figures", directory=True)
    check_output_path(tmp_path, "--figures", directory=True)
    check_output_path(tmp_path / "kept.json", "--json")
    assert [p.name for p in tmp_path.iterdir()] == ["kept.json"]
    assert (tmp_path / "kept.json").read_text() == "as it was"


def test_plan_refuses_a_binary_model_file(tmp_path, capsys):
    """A binary file (a program, a checkpoint) given as --model was a UnicodeDecodeError traceback."""
    binary = tmp_path / "model"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(128, 256)))
    rc, out, err = run_cli(["plan", "--model", str(binary)], capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert f"wsharding plan: error: model file {binary}: not a JSON/YAML model description (a binary file" in err, err


def test_soak_refuses_a_preset_that_does_not_fit_before_any_rank(monkeypatch, capsys, no_ranks):
    """``soak --preset k3-like --ranks 2`` was killed for memory minutes in: its ranks build what the
    demo's build, so the demo's check runs first (here with 4 GiB available)."""
    from wsharding.lab import memory

    monkeypatch.setattr(memory, "cpu_available", lambda: (4 * 2**30, "MemAvailable in /proc/meminfo"))
    rc, out, err = run_cli(["soak", "--preset", "k3-like", "--ranks", "2", "--no-faults"], capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("wsharding soak: error: --preset k3-like --ranks 2: a soak rank holds what a demo rank "
                          "holds (the replicated model and its sharded twin), and demo --preset k3-like on 2 ranks "
                          "needs about 2 x "), err
    assert "this machine has 4.0 GiB available" in err and "instead." in err, err


def test_figures_from_checks_the_file(tmp_path, capsys, no_ranks):
    cases = {
        "corrupt.json": ('{"mode": "cpu-gloo", ', "not JSON (Expecting"),
        "list.json": ("[1, 2]", "holds a JSON list, not a demo report"),
        "plan.json": (json.dumps({"preset": "x", "ranks": 8}), "not a demo report (missing mode, emulation, world_size"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        rc, out, err = run_cli(["demo", "--figures-from", str(tmp_path / name), "--figures", str(tmp_path)], capsys)
        assert rc == 2 and err.count("\n") == 1 and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(cases)  # nothing drawn


def test_figures_from_a_saved_report_draws(tmp_path, capsys):
    report = CPU_REPORT
    rc, out, err = run_cli(["demo", "--figures-from", str(report), "--figures", str(tmp_path), "--prefix", "t_"], capsys)
    assert rc == 0, err
    assert "outputs equal bit for bit: yes" in out
    assert {"t_demo_timeline.html", "t_demo_timeline_no_lookahead.html", "t_demo_slots.html",
            "t_demo_memory.html"} <= {p.name for p in tmp_path.iterdir()}


def test_the_documented_demo_output_is_the_saved_report():
    """The demo's sample output (docs/design.md, linked from the README's first command) is the
    committed CPU report as the demo prints it today: a change to
    the demo's lines without a new run (``wsharding demo --json figures/demo_cpu_report.json --figures
    figures``) fails here."""
    text = (ROOT / "docs" / "design.md").read_text()
    start = text.index("```\n", text.index("--json figures/demo_cpu_report.json --figures figures")) + 4
    shown = text[start:text.index("\n```", start)]
    saved = json.loads(CPU_REPORT.read_text())
    assert shown == demo.format_table(saved), "the demo output in docs/design.md is stale: run the demo as it says"


def test_one_rank_demo_says_why_sharding_holds_more(tmp_path, capsys):
    """With one rank the sharded model holds the replicated bytes plus the two slots (plain slots on CPU
    ranks): the demo says why under its header, and only there (the four-rank report has no such line)."""
    rc, out, err = run_cli(["demo", "--ranks", "1", "--figures", "", "--json", str(tmp_path / "r.json")], capsys)
    assert rc == 0, err
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["world_size"] == 1
    assert r["sharded_resident_bytes_per_rank"] == r["replicated_bytes_per_rank"] + 2 * r["slot_bytes"]
    assert out.splitlines().count(f"  NOTE: {demo.ONE_RANK_NOTE}") == 1, out
    assert demo.ONE_RANK_NOTE not in demo.format_table(json.loads(CPU_REPORT.read_text()))


def test_check_output_path(tmp_path):
    check_output_path(tmp_path / "new" / "deeper" / "r.json", "--json")  # folders to be created: fine
    check_output_path(tmp_path, "--figures", directory=True)
    check_output_path("-", "--json")
    with pytest.raises(InputError, match="this path exists and is not a file"):
        check_output_path(tmp_path, "--json")
    (tmp_path / "f").write_text("")
    with pytest.raises(InputError, match="is a file, so nothing can be written below it"):
        check_output_path(tmp_path / "f" / "x" / "r.json", "--json")


def test_a_dotted_json_prefix_keeps_its_dot(tmp_path, capsys):
    """``--json run_kv0.05`` then ``--json run_kv0.6``: two files, each its own report. With
    ``Path.with_suffix`` both were written to ``run_kv0.json``, the second over the first, without a word."""
    from wsharding.lab.bench.report import figure_prefix, json_path, save_report

    def no_figure(report):
        raise ImportError("no figure in this test")

    for share in ("0.05", "0.6"):
        save_report({"kv_share": share}, str(tmp_path / f"run_kv{share}"), no_figure)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run_kv0.05.json", "run_kv0.6.json"]
    assert json.loads((tmp_path / "run_kv0.05.json").read_text()) == {"kv_share": "0.05"}
    assert json.loads((tmp_path / "run_kv0.6.json").read_text()) == {"kv_share": "0.6"}
    assert json_path("out/r.json") == Path("out/r.json") and json_path("out/r") == Path("out/r.json")
    assert figure_prefix("out/r.json") == "out/r" and figure_prefix("out/r_kv0.05") == "out/r_kv0.05"


# ---- errors from the ranks ------------------------------------------------------------------------
def raise_on_ranks(ctx, which: str):
    if which == "same":
        raise ValueError("weight 'w' has 3 rows, not divisible by 2")
    raise ValueError(f"rank {ctx.rank} saw a different thing")


def test_rank_errors_one_line_per_distinct_error(cluster_of, capsys):
    cluster = cluster_of(2)
    with pytest.raises(RemoteError) as same:
        cluster.run(raise_on_ranks, "same")
    assert error_lines(same.value) == ["ranks 0, 1: ValueError: weight 'w' has 3 rows, not divisible by 2",
                                       "(--verbose shows the remote traceback)"]
    with pytest.raises(RemoteError) as differ:
        cluster.run(raise_on_ranks, "differ")
    assert error_lines(differ.value)[:2] == ["rank 0: ValueError: rank 0 saw a different thing",
                                             "rank 1: ValueError: rank 1 saw a different thing"]
    verbose = error_lines(differ.value, verbose=True)
    assert verbose[2] == "--- remote traceback (rank 0) ---" and any("raise_on_ranks" in x for x in verbose)

    # Through a command: one error line plus the hint, exit status 1; --verbose adds the traceback.
    args = argparse.Namespace(verbose=False)
    assert run_command("demo", lambda a: cluster.run(raise_on_ranks, "same"), args) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == ["wsharding demo: error: ranks 0, 1: ValueError: weight 'w' has 3 rows, not divisible by 2",
                   "  (--verbose shows the remote traceback)"]
    args.verbose = True
    assert run_command("demo", lambda a: cluster.run(raise_on_ranks, "same"), args) == 1
    assert "remote traceback (rank 0)" in capsys.readouterr().err


def test_a_bug_keeps_its_traceback():
    """Only errors the package explains become lines; anything else is a bug and keeps its traceback."""
    with pytest.raises(ZeroDivisionError):
        run_command("demo", lambda a: 1 / 0, argparse.Namespace(verbose=False))


# ---- honest, consistent options --------------------------------------------------------------------
def leaf_parsers(parser: argparse.ArgumentParser, prefix: str = "wsharding"):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield prefix, parser
    for s in subs:
        for name, p in s.choices.items():
            yield from leaf_parsers(p, f"{prefix} {name}")


def test_every_option_has_help_and_json_is_one_name():
    leaves = dict(leaf_parsers(cli.build_parser()))
    assert {"wsharding demo", "wsharding plan", "wsharding info", "wsharding bench allgather",
            "wsharding bench step", "wsharding bench draft"} <= set(leaves)
    for name, p in leaves.items():
        for a in p._actions:
            if a.option_strings and a.help is not argparse.SUPPRESS:
                assert a.help, f"{name} {a.option_strings} has no help"
        opts = {o for a in p._actions for o in a.option_strings if a.help is not argparse.SUPPRESS}
        assert "--json" in opts and "--verbose" in opts, name
        assert not {"--report", "--out"} & opts, f"{name} shows another name for the JSON path"
        assert "--report" not in p.format_help()


def test_help_defaults_match_what_runs():
    leaves = dict(leaf_parsers(cli.build_parser()))
    text = " ".join(leaves["wsharding bench allgather"].format_help().split())
    assert "default 1,2,4,8,16,32,64,128,256,512 on GPU, 0.25,1,4 on CPU" in text
    assert (allgather.DEFAULT_SIZES_MIB, allgather.CPU_SIZES_MIB) == ([1, 2, 4, 8, 16, 32, 64, 128, 256, 512], [0.25, 1, 4])
    assert f"default 20 on GPU, {allgather.CPU_ITERS} on CPU" in text
    step_help = " ".join(leaves["wsharding bench step"].format_help().split())
    assert "1,16,256 on CPU" in step_help


def test_json_alone_prints_json_and_path_writes_it(tmp_path, capsys):
    rc, out, _ = run_cli(["plan", "--preset", "kimi-k3-b200-fp8", "--json"], capsys)
    printed = json.loads(out)
    rc2, out2, _ = run_cli(["plan", "--preset", "kimi-k3-b200-fp8", "--json", str(tmp_path / "p.json")], capsys)
    assert rc == rc2 == 0 and "wrote" in out2 and "replicated" in out2  # the table, then the file
    assert json.loads((tmp_path / "p.json").read_text()) == printed



def test_the_documented_command_line_names_every_option():
    """The command list of docs/design.md (the README links to it) matches the program: every option a
    command shows is in it, and it names no option that does not exist."""
    import re

    readme = (ROOT / "docs" / "design.md").read_text()
    leaves = dict(leaf_parsers(cli.build_parser()))
    shown = set()
    for name, p in leaves.items():
        for a in p._actions:
            if a.help is argparse.SUPPRESS or a.option_strings == ["-h", "--help"]:
                continue
            for o in a.option_strings:
                shown.add(o)
                if o != "--verbose":  # said once for all commands
                    assert o in readme, f"docs/design.md does not mention {name} {o}"
        assert name.removeprefix("wsharding ") in readme
    start = readme.index("## The command line")
    section = readme[start:readme.index("\n## ", start + 1)]
    assert "--" in section, "the command line section lists no option"
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", section)) - {"--help"}
    assert named <= shown, f"docs/design.md names options no command has: {named - shown}"


@pytest.mark.parametrize("argv, kind", [
    (["plan", "--model", "/dev/zero"], "a character device"),  # read until killed, after about 70 s
    (["plan", "--model", "{fifo}"], "a FIFO (named pipe)"),  # waited for a writer, forever
    (["demo", "--figures-from", "{fifo}"], "a FIFO (named pipe)"),
    (["demo", "--figures-from", "/dev/zero"], "a character device"),
], ids=["plan --model /dev/zero", "plan --model FIFO", "demo --figures-from FIFO", "demo --figures-from /dev/zero"])
def test_a_path_that_is_not_a_regular_file_is_refused_not_read(tmp_path, argv, kind):
    """The command itself, in a process of its own (a timeout that fails the test, should the check go,
    rather than a hung or killed test run): one line, exit status 2, before any work."""
    import os
    import subprocess
    import sys

    os.mkfifo(tmp_path / "fifo")
    argv = [a.format(fifo=tmp_path / "fifo") for a in argv]
    done = subprocess.run([sys.executable, "-m", "wsharding", *argv], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"wsharding {argv[0]}: error: "), done.stderr
    assert f"{argv[-1]}: {kind}, not a regular file" in lines[0] and "only regular files are read" in lines[0], lines[0]


@pytest.mark.parametrize(("argv", "message"), [
    # Workload's rule, reached after parsing: a full traceback ending in InvalidArgument before
    (["bench", "serve", "--rate", "0"], "wsharding bench serve: error: rate: requests per second must be > 0 "
                                        "(inf: all at once), got 0.0"),
    (["bench", "serve", "--rate", "-2"], "wsharding bench serve: error: rate: requests per second must be > 0 "
                                         "(inf: all at once), got -2.0"),
    (["bench", "serve", "--rate", "nan"], "wsharding bench serve: error: argument --rate: 'nan' is not a number of "
                                          "requests per second (inf: all at once)"),
], ids=["rate 0", "rate -2", "rate nan"])
def test_the_command_answers_a_package_error_in_one_line(argv, message, tmp_path):
    """Through the installed entry's module, as a user runs it: one line on stderr, exit status 2 as
    argparse's, no traceback, nothing on stdout -- and no rank started (it would print first)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "wsharding", *argv, "--json", ""], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stdout, done.stderr)
    assert done.stderr.splitlines() == [message + (" (see wsharding bench serve --help)" if "argument" in message
                                                    else "")], done.stderr


def test_rate_inf_is_accepted_as_its_error_says():
    """``inf: all at once`` (the default, and what the error above says) was refused by --rate's type."""
    args = cli.build_parser().parse_args(["bench", "serve", "--rate", "inf"])
    assert args.rate == [float("inf")]  # a comma list of rates: one, all at once


def test_run_command_sorts_package_errors_into_bad_input_and_failures(capsys):
    """Every WshardingError is one line: a value refused (a ValueError kind) exits 2 with the message
    alone; a failure while working (a RuntimeError or AssertionError kind) exits 1 naming its class.
    Anything else is a bug and keeps its traceback."""
    from wsharding.core.errors import InvalidArgument, ShardingError, Unsupported
    from wsharding.lab.bench.serve import ServeMismatch

    def raising(exc: BaseException):
        def main(_args):
            raise exc
        return main

    args = argparse.Namespace(verbose=False)
    for exc, rc, line in [
        (InvalidArgument("prompt lengths: need 1 <= low <= high, got 3..2"), 2,
         "wsharding x: error: prompt lengths: need 1 <= low <= high, got 3..2"),
        (ShardingError("patterns: got the str 'fc*'"), 2, "wsharding x: error: patterns: got the str 'fc*'"),
        (ServeMismatch("replicated and sharded generated different tokens"), 1,
         "wsharding x: error: ServeMismatch: replicated and sharded generated different tokens"),
        (Unsupported("draft_graph_replay needs CUDA ranks"), 1,
         "wsharding x: error: Unsupported: draft_graph_replay needs CUDA ranks"),
    ]:
        assert run_command("x", raising(exc), args) == rc
        assert capsys.readouterr().err.splitlines() == [line]
    with pytest.raises(ValueError, match="a bug"):
        run_command("x", raising(ValueError("a bug")), args)


def test_every_comm_option_offers_the_registry_s_communicators():
    """The ``--comm`` choices come from one registry (wsharding.comm_by_name.COMMS): a communicator
    added there is offered by every command, and none is offered that the registry lacks."""
    from wsharding.comm_by_name import COMM_CHOICES, COMMS

    comm_options = {name: tuple(a.choices) for name, p in leaf_parsers(cli.build_parser())
                    for a in p._actions if "--comm" in a.option_strings}
    assert len(comm_options) >= 7, sorted(comm_options)
    # the soak has no "auto" (it names what it soaks); every other command offers the registry's choices
    assert comm_options.pop("wsharding soak") == tuple(COMMS)
    differ = {name for name, choices in comm_options.items() if choices != COMM_CHOICES}
    assert not differ, differ
    # the options modules name them without importing torch: their copy must be the registry's
    from wsharding.lab.args import names

    assert names.COMM_CHOICES == COMM_CHOICES
