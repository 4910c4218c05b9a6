"""``wsharding bench serve --graphs`` on CPU: the option, the pair rule (both variants graphed or
neither, the reason said once), ``--graphs on`` refused where it cannot be kept -- before any rank
starts on a machine without a GPU, on every rank before anything is built where the communicator
cannot capture -- the per-variant graph counts in the report's JSON and text, and one pool per
(variant, budget) reused by every trial. The GPU side is tests/lab/test_gpu_serve_graphs.py."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch

from wsharding.core.errors import InvalidArgument, Unsupported
from wsharding.lab.bench.serve import format_table, read_serve_report, run_serve_bench, summarize
from wsharding.lab.cluster import RemoteError
from wsharding.lab.tasks.serve import serve_rank
from wsharding.serve import Workload
from wsharding.serve.metrics import SLO
from wsharding.serve.runner import pair_eager_reason

WORKLOAD = Workload(requests=4, prompt=(4, 12), output=(3, 6))
SLO_ = SLO(ttft_ms=60_000, tpot_ms=60_000)


def _comm(device: str = "cuda", world_size: int = 2, captures: bool = True, shared: bool = False):
    """What :func:`~wsharding.comm_by_name.graph_unsupported` reads of a communicator."""
    return SimpleNamespace(device=torch.device(device), world_size=world_size, captures_gathers=captures,
                           shared_gpu=shared)


def test_the_pair_is_graphed_or_eager_together_and_says_why():
    assert pair_eager_reason("auto", _comm()) is None  # our NCCL, one GPU per rank
    assert pair_eager_reason("on", _comm(world_size=1, captures=False)) is None  # one rank: its gathers are copies
    assert pair_eager_reason("off", _comm()) == "turned off: both variants run every step eagerly"
    sliced = pair_eager_reason("auto", _comm(shared=True))
    assert sliced == ("both variants run every step eagerly: the sharded variant's steps cannot be captured here "
                      "(several ranks share one GPU: capturing their gathers hung when tried there)")
    assert "needs our NCCL communicator" in pair_eager_reason("auto", _comm(captures=False))
    assert "CPU ranks" in pair_eager_reason("auto", _comm("cpu"))
    with pytest.raises(Unsupported, match=r"^--graphs on: the sharded variant's steps cannot be captured in CUDA "
                                          r"graphs here: several ranks share one GPU.*pass --graphs auto"):
        pair_eager_reason("on", _comm(shared=True))
    with pytest.raises(InvalidArgument, match="graphs: one of auto, on, off, got 'yes'"):
        pair_eager_reason("yes", _comm())


def test_the_option_parses_and_refuses_a_mode_it_does_not_know(capsys):
    import argparse

    from wsharding.lab.args.bench_serve import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).graphs == "auto" and p.parse_args(["--graphs", "off"]).graphs == "off"
    with pytest.raises(SystemExit):
        p.parse_args(["--graphs", "sometimes"])
    assert "invalid choice: 'sometimes'" in capsys.readouterr().err


def test_graphs_on_without_a_gpu_is_refused_before_any_rank_starts(monkeypatch, capsys):
    import wsharding.lab.bench.serve as bench
    from wsharding.lab import cli

    monkeypatch.setattr(bench, "gpu_count", lambda: 0)
    monkeypatch.setattr(bench, "run_on_ranks", lambda *a, **k: pytest.fail("a rank was started"))
    assert cli.main(["bench", "serve", "--graphs", "on", "--json", ""]) == 2
    err = capsys.readouterr().err
    assert "--graphs on: CUDA graphs need a GPU and this machine has none" in err and len(err.splitlines()) == 1
    with pytest.raises(InvalidArgument, match="--graphs on: CUDA graphs need a GPU and this machine has none"):
        run_serve_bench(2, "tiny-deep", WORKLOAD, budgets=[1 << 30], token_budget=32, graphs="on")
    with pytest.raises(InvalidArgument, match="graphs: one of auto, on, off"):
        run_serve_bench(2, "tiny-deep", WORKLOAD, budgets=[1 << 30], token_budget=32, graphs="maybe")


def test_graphs_on_that_ranks_cannot_keep_is_refused_on_every_rank(cluster_of):
    """CPU ranks stand in for a communicator that cannot capture: every rank refuses before it builds."""
    with pytest.raises(RemoteError) as err:
        cluster_of(2).run(serve_rank, "tiny-deep", workload=WORKLOAD.as_dict(), budgets=[{"kv_share": 0.5}],
                          rates=[None], trials=1, token_budget=32, graphs="on")
    text = str(err.value)
    assert "--graphs on: the sharded variant's steps cannot be captured" in text and "CPU ranks" in text
    assert "building" not in text


@pytest.fixture(scope="module")
def served(cluster_of):
    # two rates x two trials at one budget: every run of a variant on its one pool, reset in between
    return cluster_of(2).run(serve_rank, "tiny-deep", workload=WORKLOAD.as_dict(), budgets=[{"kv_share": 0.3}],
                             rates=[None, 400.0], trials=2, token_budget=32)


def test_cpu_ranks_run_both_variants_eagerly_on_one_pool_per_budget_and_say_why_once(served):
    for r in served:
        g = r["graphs"]
        assert g["mode"] == "auto" and "CPU ranks" in g["eager_reason"]
        (info,) = g["by_budget"]
        # one pool per variant for its 4 runs; the sharded variant's replays (one per rate) share a second
        assert {v: i["pools"] for v, i in info.items()} == {"replicated": 1, "sharded": 2}
        # every run after a pool's first is served on it reset (tests/serve/test_pool_reuse.py: as a fresh one)
        assert {v: i["resets"] for v, i in info.items()} == {"replicated": 3, "sharded": 3 + 1}
        assert all(i["shapes"] == 0 and i["capture_s"] == 0.0 and i["replay_graphed_steps"] == 0 for i in info.values())
        assert info["sharded"]["replay_eager_steps"] > 0
        for v in ("replicated", "sharded"):
            assert len(r["runs"][v]) == 4
            for run in r["runs"][v].values():
                assert (run["graphed_steps"], run["eager_steps"]) == (0, run["steps"])
    report = summarize(served, SLO_, warmup=1)
    assert report["graphs"] == {"mode": "auto", "eager_reason": served[0]["graphs"]["eager_reason"]}
    for v in ("replicated", "sharded"):
        counts = report["rows_by_budget"][0][v]["graphs"]
        steps = sum(run["steps"] for r in served for run in r["runs"][v].values())
        assert (counts["graphed_steps"], counts["eager_steps"], counts["shapes"]) == (0, steps, 0)
    text = format_table(report)
    assert sum("CUDA graphs" in line for line in text.splitlines()) == 1  # one line, not one per budget or step
    assert f"  CUDA graphs: none (--graphs auto): {report['graphs']['eager_reason']}" in text.splitlines()
    assert report["equal"]


def test_a_graphed_report_says_per_variant_what_was_replayed_and_reads_back(served, tmp_path):
    """The text and JSON of a run whose steps were replayed (the counts set as a GPU run leaves them),
    read back through the schema; a report that says graphs ran but lacks a variant's counts is refused."""
    results = copy.deepcopy(served)
    for r in results:
        r["graphs"]["eager_reason"] = None
        for v, info in r["graphs"]["by_budget"][0].items():
            info.update(shapes=3 + r["rank"], capture_s=0.25 * (1 + r["rank"]))
            for run in r["runs"][v].values():
                run["graphed_steps"], run["eager_steps"] = run["steps"] - 1, 1
    report = summarize(results, SLO_, warmup=1)
    rep = report["rows_by_budget"][0]["replicated"]["graphs"]
    steps = sum(run["steps"] for r in results for run in r["runs"]["replicated"].values())
    assert (rep["graphed_steps"], rep["eager_steps"], rep["shapes"], rep["capture_s"]) == (steps - 8, 8, 4, 0.5)
    text = format_table(report)
    assert "  CUDA graphs (--graphs auto): both variants replay the decode-only steps" in text
    line = next(x for x in text.splitlines() if x.startswith("   CUDA graphs: "))
    assert f"replicated {steps - 8:,} steps replayed, 8 eager, 4 shapes captured in 0.50 s; sharded " in line
    path = tmp_path / "g.json"
    path.write_text(json.dumps(report))
    assert format_table(read_serve_report(path)) == text
    del report["rows_by_budget"][0]["sharded"]["graphs"]["eager_steps"]
    path.write_text(json.dumps(report))
    with pytest.raises(InvalidArgument, match=r"field rows_by_budget\[0\]\.sharded\.graphs\.eager_steps is missing"):
        read_serve_report(path)


def test_a_later_trial_one_rank_cannot_fit_on_its_reused_pool_stops_every_rank(cluster_of):
    """The first trial fits both ranks' pools of 2 blocks; the second trial's requests on rank 1 need 3.
    The reused pool is checked for every trial's requests on every rank: rank 0 stops too, rather than
    wait alone at the barrier after its run for a rank that raised."""
    from wsharding.lab.bench.serve import replicated_footprint
    from wsharding.serve import BLOCK_TOKENS, blocks_for

    wl = Workload(requests=4, prompt=(4, 30), output=(3, 6))
    need = [[blocks_for(max(q.kv_tokens for q in wl.with_(seed=t).for_rank(r, 192))) for r in (0, 1)] for t in (0, 1)]
    assert need == [[2, 2], [2, 3]], "the seed must give trial 2 alone a request of 3 blocks, on rank 1"
    f = replicated_footprint("tiny-deep", None, 32, wl)
    budget = f["resident_bytes"] + f["reserve_bytes"] + 3 * BLOCK_TOKENS * f["kv_bytes_per_token"]  # 2 + scratch
    with pytest.raises(RemoteError) as err:
        cluster_of(2).run(serve_rank, "tiny-deep", workload=wl.as_dict(), budgets=[{"bytes": budget}], rates=[None],
                          trials=2, token_budget=32)
    text = str(err.value)
    assert "of rank 1 needs" in text and "the whole pool holds 32" in text and "another rank refused" in text
