"""Aligned serving on two CPU ranks (gloo, the sharded tiny model): a rank pads with idle steps only
while a peer computes, and while no rank has anything to compute no rank steps -- they wait for the
earliest arrival (the engine's agreement on when that is, :func:`~wsharding.serve.engine.serve`)."""

from __future__ import annotations

from tests.serve.serve_tasks import serve_across_a_gap


def test_aligned_ranks_pad_only_while_a_peer_computes_and_wait_through_a_gap(cluster_of):
    gap = 1.0
    r0, r1 = cluster_of(2).run(serve_across_a_gap, "tiny", gap_s=gap)
    assert r0["outputs"] == {0: 2, 2: 2} and r1["outputs"] == {1: 5, 3: 2}
    # rank 1's first request takes 5 steps, rank 0 pads 3 of them; the second requests take 2 steps on
    # both. Seven steps in all: none in the gap, where a rank that padded while no rank had work ran
    # a padding step after another (over a hundred in that second)
    assert r0["step_requests"] == [1, 1, 0, 0, 0, 1, 1] and r1["step_requests"] == [1] * 7
    assert r0["idle_steps"] == 3 and r1["idle_steps"] == 0
    for r in (r0, r1):
        assert max(r["schedule_times"][:5]) < gap <= min(r["schedule_times"][5:])
