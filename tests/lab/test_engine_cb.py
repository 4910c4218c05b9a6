"""A sharded tiny Llama served by transformers' continuous batching on 2 CPU ranks (gloo) whose loads
differ: every request's tokens equal the replicated engine's bit for bit, on every rank; an idle rank
runs dummy steps exactly while its peer works; a rank that fails makes every rank raise.

Without the adapter (transformers' own ``generate_batch`` on the sharded model) the busier rank's
forward waits in a gather its idle peer never joins, and the engine returns truncated outputs after
the collective timeout: ``test_without_the_adapter_the_engine_truncates`` shows it, briefly."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from wsharding.lab.tasks.engine import engine_equal, engine_failure  # noqa: E402


def check_equal(results, counts, new_tokens):
    for r in results:
        assert r["emulation"]
        assert len(r["tokens"]) == counts[r["rank"]]
        assert r["equal"] == [True] * counts[r["rank"]], (r["tokens"], r["expected"])
        assert all(len(t) == new_tokens[r["rank"]] for t in r["tokens"])
        c = r["counters"]
        # every rank made the same number of agreements, and stepped (for real or as a dummy) in the same rounds
        assert c["rounds"] == results[0]["counters"]["rounds"]
        assert c["steps"] + c["idle_steps"] == results[0]["counters"]["steps"] + results[0]["counters"]["idle_steps"]
        # one gather per sharded layer per forward, the dummy forwards included: the ranks issued the same gathers
        assert r["gathers_total"] == results[0]["gathers_total"]


def test_three_prompts_against_one(cluster_of):
    """3 prompts of 10 new tokens against 1 of 4 (the load on which the engine alone truncates)."""
    counts, new = [3, 1], [10, 4]
    results = engine_equal_run(cluster_of, counts, new)
    check_equal(results, counts, new)
    busy, light = (r["counters"] for r in results)
    # the light rank ran a dummy step in every round its peer computed and it did not (the busy rank may have
    # run one too, if its peer's request reached the engine first)
    assert light["idle_steps"] >= busy["steps"] - light["steps"] > 0


def engine_equal_run(cluster_of, counts, new, **kwargs):
    return cluster_of(2).run(engine_equal, counts, new, **kwargs)


def test_one_rank_with_no_request(cluster_of):
    counts, new = [2, 0], [5, 5]
    results = engine_equal_run(cluster_of, counts, new)
    check_equal(results, counts, new)
    idle = results[1]["counters"]
    assert idle["steps"] == 0 and idle["idle_steps"] == results[0]["counters"]["steps"] > 0


def test_arrivals_over_time(cluster_of):
    """Requests added through add_request while the engines run: rounds where nobody works (nobody steps)
    alternate with rounds where one or both do."""
    counts, new = [3, 2], [6, 6]
    results = engine_equal_run(cluster_of, counts, new, arrivals_s=[0.0, 0.2, 0.4])
    check_equal(results, counts, new)
    assert all(r["counters"]["quiet_rounds"] > 0 for r in results)


def test_a_failed_rank_fails_every_rank(cluster_of):
    """Rank 1's first decoder layer raises in its third forward: both ranks raise (none returns the
    tokens generated so far as outputs), rank 0 naming rank 1."""
    results = cluster_of(2).run(engine_failure, 1)
    for r in results:
        assert r["outputs"] is None, r
        assert r["raised"] == "RequestFailed"
    assert "fault injected in forward 3" in results[1]["message"]
    assert "rank(s) 1 of the shard group failed" in results[0]["message"]


def test_without_the_adapter_the_engine_truncates(cluster_of):
    """The guard's reason: the engine alone, 3 prompts of 10 tokens against 1 of 4, gathers timing out after
    2 s. Rank 1 finishes; rank 0's fifth forward waits for rank 1 in a gather, fails, and generate_batch hands
    back its requests cut short, with an error string and no exception."""
    from wsharding.lab.tasks.engine import engine_unaligned

    busy, light = cluster_of(2).run(engine_unaligned)
    assert light["errors"] == [None] and [len(t) for t in light["tokens"]] == [4]
    assert all(e is not None for e in busy["errors"]), busy
    assert all(len(t) < 10 for t in busy["tokens"])


def test_example_script_runs(cluster_of, capsys):
    """examples/serve_transformers.py's main on the session's 2 CPU ranks: tokens equal, labelled emulated,
    every rank's rounds and both variants' serving metrics printed."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "serve_transformers.py"
    spec = importlib.util.spec_from_file_location("serve_transformers_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--requests", "3"], cluster=cluster_of(2)) == 0
    out = capsys.readouterr().out
    assert "every request's tokens equal to the replicated engine's: yes" in out
    assert "NOTE: emulated" in out
    assert out.count(" rounds, ") == 2
    assert "   sharded: KV pool [32, 32] blocks of 16 tokens" in out and "replicated: KV pool" in out


def test_engine_rows_for_the_notebook(cluster_of):
    """run_engine_trial + engine_rows, as notebook 07 calls them beside the package's own scheduler: every
    request's tokens equal, every record in trial_metrics' fields, one row per variant."""
    from wsharding.lab.tasks.engine import engine_rows, run_engine_trial
    from wsharding.serve.metrics import SLO
    from wsharding.serve.workload import Workload

    workload = Workload(requests=3, prompt=(4, 8), output=(2, 6), rate=50.0)
    trial = run_engine_trial(cluster_of(2), workload, SLO(ttft_ms=5000, tpot_ms=1000))
    assert trial["tokens_equal"] and trial["emulation"]
    for variant in ("sharded", "replicated"):
        records = trial[variant]["records"]
        assert sorted((r["rank"], r["rid"]) for r in records) == [(k, i) for k in range(2) for i in range(3)]
        for r in records:
            assert set(r) == {"rid", "rank", "arrival_s", "sent_s", "token_s", "prompt_tokens", "output_tokens",
                              "preempted"}
            assert len(r["token_s"]) == r["output_tokens"] and r["token_s"] == sorted(r["token_s"])
            assert r["sent_s"] <= r["token_s"][0]
    rows = engine_rows(trial)
    assert [r["variant"] for r in rows] == ["sharded", "replicated"]
    assert all(r["kv_blocks_per_rank"] == [32, 32] and r["emulated"] for r in rows)


def engine_serve_stderr(ctx, workload, sharded: bool) -> str:
    """:func:`~wsharding.lab.tasks.engine.engine_serve` on this rank, and what it wrote to the rank's standard
    error (file descriptor 2, where transformers' logger writes)."""
    import os
    import sys
    import tempfile

    from wsharding.lab.tasks.engine import engine_serve

    sys.stderr.flush()
    kept = os.dup(2)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 2)
        try:
            engine_serve(ctx, workload, sharded=sharded)
        finally:
            sys.stderr.flush()
            os.dup2(kept, 2)
            os.close(kept)
        f.seek(0)
        return f.read().decode(errors="replace")


def test_the_engine_writes_nothing_to_stderr(cluster_of):
    """Notebook 07 runs the engine on its ranks, and a rank's standard error shows under the cell in red:
    ipykernel reads the kernel's file descriptor 2, which spawned ranks inherit. Without psutil (the hf
    extra installs it) transformers' engine logs "Cannot get memory breakdown on CPU without psutil" (ERROR)
    and "psutil is not available" (WARNING) on every rank, for every engine it builds. The browser test
    would see them too; this sees them in seconds."""
    from wsharding.serve.workload import Workload

    workload = Workload(requests=1, prompt=(4, 4), output=(2, 2), rate=50.0)
    for sharded in (True, False):
        written = cluster_of(2).run(engine_serve_stderr, workload, sharded)
        assert written == ["", ""], f"sharded={sharded}: the ranks wrote to stderr:\n" + "".join(written)


def test_compiled_sharded_model_is_one_graph(cluster_of):
    """torch.compile (aot_eager: functionalization included, no C++ build) of the sharded Llama: one graph with
    no break in the layer loop, as the replicated model, and logits equal to it bit for bit."""
    from wsharding.lab.tasks.engine import compile_counts

    for r in cluster_of(2).run(compile_counts, layers=2, lengths=(5,)):
        assert (r["replicated"]["explain_graphs"], r["replicated"]["explain_breaks"]) == (1, 0)
        assert (r["sharded"]["explain_graphs"], r["sharded"]["explain_breaks"]) == (1, 0)
        assert r["equal_compiled"] == [True] and r["equal_eager"] == [True]


def test_without_graph_ops_every_block_breaks_the_graph(cluster_of):
    """The guard's reason ([Note: the planner's calls as graph ops]): the planner's calls traced as Python break
    the sharded model's graph at every block -- the 2 layers give 5 breaks, 6 graphs (4 layers: 7, 8)."""
    from wsharding.lab.tasks.engine import compile_counts

    for r in cluster_of(2).run(compile_counts, layers=2, lengths=(5,), graph_ops=False, explain_only=True):
        assert (r["sharded"]["explain_graphs"], r["sharded"]["explain_breaks"]) == (6, 5)


def test_asynchronous_batching_is_refused():
    """On one rank (no collective): the engine's asynchronous batching prepares the next batch while one
    computes, outside the agreement -- refused by name, before anything runs."""
    from types import SimpleNamespace

    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from wsharding.core.errors import Unsupported
    from wsharding.engines.transformers_cb import AlignedEngine
    from wsharding.lab.tasks.loading import build_llama, tiny_llama_config

    model = build_llama(tiny_llama_config(), 0)
    with pytest.raises(Unsupported, match=r"asynchronous batching .*use_async_batching=False"):
        AlignedEngine(model, SimpleNamespace(rank=0, world_size=1),
                      cb_config=ContinuousBatchingConfig(use_async_batching=True, num_blocks=8, max_batch_tokens=32))
