"""The draft model's first layer: gathered between the target and the draft (a prefetch), waited on
before the draft's step; a cold start gathers inline. CPU ranks: async gloo handles (emulated)."""

from __future__ import annotations

import pytest
import torch

from wsharding.comm_by_name import shard_comm_for
from wsharding.core.comm import CommError
from wsharding.lab.bench.draft import format_table, summarize
from wsharding.lab.tasks.draft import draft_equality, draft_exposed
from wsharding.models import decoder_config
from wsharding.models.draft import build_draft_pair, draft_config

COUNTS = [[3, 5], [1, 2], [4, 1]]


def test_draft_equal_in_every_mode(cluster_of):
    results = cluster_of(2).run(draft_equality, "tiny", COUNTS)
    for r in results:
        assert r["first_layer"] == 0 and r["sharded_layers"] == [0, 1]  # the draft's dense layer 0 is sharded
        m = r["modes"]
        for mode in ("dedicated", "inline", "no_wait", "no_calls"):
            assert m[mode]["equal"] == [True, True, True], (mode, m[mode])
            assert m[mode]["gathers"] == [2, 2, 2], (mode, m[mode])  # one per sharded layer, prefetch included
        assert (m["dedicated"]["prefetches"], m["dedicated"]["cold_starts"]) == (3, 0)
        assert (m["inline"]["prefetches"], m["inline"]["cold_starts"]) == (3, 3)   # cold start: gathered inline
        assert (m["no_wait"]["prefetches"], m["no_wait"]["cold_starts"]) == (3, 0)  # waited inside the step
        assert (m["no_calls"]["prefetches"], m["no_calls"]["cold_starts"]) == (0, 0)  # the plain path
        assert "stand-in for the weight-sharding design's commit step" in r["region"]


def test_prefetch_hides_behind_the_region(cluster_of):
    results = cluster_of(2).run(draft_exposed, "tiny", steps=5, warmup=2, commit_ms=10.0, comm="torch")
    report = summarize(results)
    text = format_table(report)
    assert "emulated" in text and "cpu-gloo" in text and "stand-in for the weight-sharding design's commit step" in text
    rows = {r["mode"]: r for r in report["rows"]}
    assert list(rows) == ["dedicated", "inline"]  # no streams on CPU ranks: no "shared" row
    # a 10 ms region is far longer than a 0.16 MiB gather: prefetched, the wait is short; inline it is the gather
    assert rows["dedicated"]["exposed_us"] < rows["inline"]["exposed_us"]
    assert all(r["cold_starts"] == 5 + 2 for r in results)  # every inline step was a cold start


def prefetch_twice(ctx) -> str:
    comm = shard_comm_for(ctx, "torch")
    _, draft = build_draft_pair(draft_config(decoder_config("tiny")), comm)
    draft.first_prefetch.prefetch()
    try:
        draft.first_prefetch.prefetch()
    except CommError as e:
        draft.first_prefetch.wait()  # leave the group consistent: every rank gathered once
        with torch.no_grad():
            draft(torch.zeros(1, dtype=torch.long))
        return str(e)
    return ""


def test_second_prefetch_before_the_step_is_refused(cluster_of):
    msgs = cluster_of(2).run(prefetch_twice)
    for rank, m in enumerate(msgs):
        assert f"layer 0: FirstLayerPrefetch.prefetch() called twice on rank {rank}" in m


def test_unknown_mode_is_refused_before_any_gather(cluster_of):
    from wsharding.lab.cluster import RemoteError

    with pytest.raises(RemoteError, match="mode 'nope': use one of"):
        cluster_of(2).run(draft_equality, "tiny", COUNTS[:1], modes=["nope"])
