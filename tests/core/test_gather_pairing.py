"""No gather pairs different layers, on CPU ranks (gloo): a rank that refuses or misses leaves the group
in step ([Note: one collective sequence per step] in wsharding/core/step_owner.py), a gather outside
the steps that would combine different layers is refused on every rank ([Note: the stamp of a gather
outside the steps] in wsharding/core/stamp.py), and so is a steps' gather that lands with another
layer's bytes ([Note: the sample of a steps' gather], there too). Each case also shows what the same
calls produced without the guard: wrong outputs, no error."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.core.test_checked_at_use import Model, _x
from wsharding.core.comm import CommError
from wsharding.core.errors import ShardingError
from wsharding.core.planner import MismatchedGatherError, ScheduleMissWarning, read_stamp, stamp_of
from wsharding.core.runner import shard_blocks
from wsharding.lab.cluster import RankCluster


@pytest.fixture(scope="module")
def short_timeouts():
    """Two ranks whose collectives time out after 2 s (a gather that completes takes milliseconds), for the
    cases where a rank waits for a peer that never comes. The test without the drain comes last: its
    timeout closes the group's gloo pairs."""
    with RankCluster(2, backend="gloo", collective_timeout=2, task_timeout=90) as c:
        yield c


def _outcome(model, ref, x) -> object:
    """True (bitwise equal to the replica), False (wrong bytes, no error) or the error's text."""
    try:
        return bool(torch.equal(model(x), ref(x)))
    except (ShardingError, CommError) as e:
        return f"{type(e).__name__}: {e}"


# ---- a rank that refuses (on_miss="raise") ----------------------------------------------------------
def one_rank_reverses(ctx, on_miss: str, drain: bool = True, steps: int = 4) -> list:
    """Rank 1 runs step 1's blocks in reverse; every step's outcome on every rank. ``drain=False`` gives
    a refused step up the way the planner did before: the rest of its schedule left unissued, and the
    steps' gathers unchecked when they land."""
    model, ref = Model(5), Model(5)
    ws = shard_blocks(model, "layers", ["fc*"], ctx.comm, on_miss=on_miss)
    if not drain:
        p = ws.planner
        p.state.samples = None  # which would catch the mispairing too ([Note: the sample of a steps' gather])

        def abort_as_before() -> None:  # a step that left its schedule: joined, the rest never issued
            if not p._missed:
                type(p).abort_step(p)
                return
            for s in p.state.landing_slots():
                p._join_slot(s)
            p._close_step()

        p.abort_step = abort_as_before
    out = []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", ScheduleMissWarning)
        for s in range(steps):
            model.reverse = ref.reverse = ctx.rank == 1 and s == 1
            out.append(_outcome(model, ref, _x(s, ctx.rank)))
    model.reverse = ref.reverse = False
    ws.close()
    return out


def test_a_rank_that_refuses_still_issues_its_steps_gathers(cluster_of):
    r0, r1 = cluster_of(2).run(one_rank_reverses, "raise")
    assert r0 == [True, True, True, True]  # the refusing rank issued the rest of step 1: the peer is exact
    assert r1[0] is True and r1[2:] == [True, True]
    assert r1[1].startswith("ShardingError: layer 4 on rank 1: block 4 ran where the schedule expected block 0")


def test_a_rank_that_misses_alone_issues_the_rest_first_and_errs_alone(short_timeouts):
    # on_miss="gather": rank 1 alone gathers layer 4 outside the steps, which no peer joins; it issued the
    # rest of step 1's gathers first, so rank 0 computes step 1 exact while rank 1 waits and times out.
    # (A step 2 in the same task would race rank 1's timeout: rank 0 would wait there as long.)
    r0, r1 = short_timeouts.run(one_rank_reverses, "gather", True, 2)
    after = short_timeouts.run(one_rank_reverses, "gather", True, 1)  # the steps' channel is still in step
    assert r0 == [True, True] and r1[0] is True
    assert r1[1].startswith("CommError: weight gather of layer 4 failed on rank 1 (step 1), outside the steps: layer "
                            "4: gather outside the schedule did not complete on rank 1 (every rank of the shard group "
                            "must make this call)"), r1[1]
    assert "Its slot was not written" in r1[1]
    assert after == [[True], [True]]


#: A rank process's sharded model kept from one task to the next (the ranks outlive a task).
_KEPT: dict = {}


def lone_call_over_a_prefetch(ctx) -> dict:
    """With the next step's first gather issued ahead (layer 0 into slot A), rank 1 alone calls block 2,
    whose slot is A, between steps: its gather outside the steps times out."""
    from wsharding.core.next_step import NextStepPrefetch

    model, ref = Model(5), Model(5)
    ws = shard_blocks(model, "layers", ["fc*"], ctx.comm, plugins=[NextStepPrefetch()])
    _KEPT.update(model=model, ref=ref, ws=ws)
    out: dict = {"step": _outcome(model, ref, _x(0, ctx.rank)), "ahead": ws.planner.ahead_layers}
    if ctx.rank == 1:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", ScheduleMissWarning)
            try:
                model.layers[2](_x(5, ctx.rank))
                out["alone"] = "ran"
            except CommError as e:
                out["alone"] = str(e)
    out["ahead_after"] = ws.planner.ahead_layers
    return out


def next_step_of_the_kept_model(ctx) -> object:
    model, ref, ws = _KEPT.pop("model"), _KEPT.pop("ref"), _KEPT.pop("ws")
    with torch.no_grad():
        out = _outcome(model, ref, _x(1, ctx.rank))
    ws.close()
    return out


def test_a_lone_call_that_fails_keeps_the_next_steps_prefetch(short_timeouts):
    # The failed call wrote nothing into slot A, so rank 1 keeps the prefetched layer 0 as every peer does;
    # given up there (as a call that succeeds gives it up), rank 1 alone would gather layer 0 again in the
    # next step: one gather more than its peer, every later gather paired with the peer's next one.
    r0, r1 = short_timeouts.run(lone_call_over_a_prefetch)
    after = short_timeouts.run(next_step_of_the_kept_model)  # a second task: see test_checked_at_use
    assert after == [True, True]
    assert r0 == {"step": True, "ahead": [0], "ahead_after": [0]}
    assert r1["step"] is True and r1["ahead"] == r1["ahead_after"] == [0]
    assert "gather outside the schedule did not complete on rank 1" in r1["alone"]


def test_without_the_drain_a_refusing_rank_leaves_its_peers_wrong(short_timeouts):
    # What the planner did before: the refusing rank's step-1 gathers stop at its refusal, the peer's
    # pending ones pair with the refusing rank's step 2: wrong outputs on both ranks, no error, until a
    # gather times out (which closes the group's gloo pairs: the last test of its cluster).
    r0, r1 = short_timeouts.run(one_rank_reverses, "raise", False)
    assert r0[:3] == [True, False, False], r0  # step 1 computed layers 2-4 with rank 1's step-2 chunks
    assert r1[1].startswith("ShardingError: layer 4 on rank 1") and r1[2:] == [False, False], r1


# ---- different blocks called alone on different ranks -------------------------------------------------
def different_blocks_alone(ctx, guard: bool) -> dict:
    """After a step (slots A, B hold layers 4, 3), rank r calls block r on its own: both miss and gather
    outside the steps at once, rank 0 layer 0 and rank 1 layer 1. ``guard=False`` sends the bare chunk
    on that channel, as the planner did before (no stamp)."""
    model, ref = Model(5), Model(5)
    ws = shard_blocks(model, "layers", ["fc*"], ctx.comm)
    p = ws.planner
    if not guard:
        p._gather_outside = lambda layer, what: ctx.comm.gather_outside_steps(
            p.slots.full_buffer(layer), p.layers_chunk(layer), what=what)
    out: dict = {}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", ScheduleMissWarning)
        out["step"] = _outcome(model, ref, _x(0, ctx.rank))
        x = _x(1, ctx.rank)
        block = model.layers[ctx.rank]
        try:
            out["alone"] = bool(torch.equal(block(x), ref.layers[ctx.rank](x)))
        except ShardingError as e:
            out["alone"] = f"{type(e).__name__}: {e}"
        out["occupancy"] = p.occupancy()
        out["next"] = _outcome(model, ref, _x(2, ctx.rank))
    ws.close()
    return out


def test_different_blocks_alone_on_different_ranks_raise_on_every_rank(cluster_of):
    r0, r1 = cluster_of(2).run(different_blocks_alone, True)
    for rank, r in enumerate((r0, r1)):
        assert r["step"] is True and r["next"] is True  # the group is still in step afterwards
        assert r["alone"].startswith(f"MismatchedGatherError: layer {rank} on rank {rank}: its gather outside the "
                                     "steps was paired with other gathers: rank 0 sent layer 0 of step 0, rank 1 sent "
                                     "layer 1 of step 0"), r["alone"]
        assert "every rank of the shard group must make the same call" in r["alone"]
        assert "Nothing was written into its slot" in r["alone"]
        assert r["occupancy"] == {"A": 4, "B": 3}  # what the step left: the mixed bytes never reached a slot


def test_without_the_stamp_different_blocks_alone_compute_with_mixed_layers(cluster_of):
    r0, r1 = cluster_of(2).run(different_blocks_alone, False)
    assert r0["alone"] is False and r1["alone"] is False  # layer 0's chunk beside layer 1's: wrong, no error


# ---- the stamp ---------------------------------------------------------------------------------------------
def test_a_stamp_reads_back_as_its_layer_and_step():
    s = stamp_of(7, 123456789012)
    assert s.dtype == torch.uint8 and s.numel() == 16
    assert read_stamp(s) == (7, 123456789012)
    assert read_stamp(torch.zeros(16, dtype=torch.uint8)) is None  # no magic: not a stamp
    assert MismatchedGatherError.__mro__[1].__name__ == "ShardingError"


# ---- steps over different blocks on different ranks: the steps' gathers pair different layers ------------
class SameSizeBlocks(torch.nn.Module):
    """Five blocks of one size: a gather of one layer fits another's slot exactly, as in a decoder."""

    def __init__(self) -> None:
        super().__init__()
        from tests.core.test_library_edges import Block

        self.layers = torch.nn.ModuleList(Block(16, seed=i) for i in range(5))

    def forward(self, x):
        for b in self.layers:
            x = b(x)
        return x


def steps_over_different_blocks(ctx, guard: bool) -> list:
    """Step 0 over every block on both ranks; step 1 over blocks [r, 5) and step 2 over [1 - r, 5) on rank
    r (each rank issues as many gathers in all). ``guard=False`` takes the sampled bytes off, as the
    planner was before ([Note: the sample of a steps' gather])."""
    from wsharding.core.runner import run_layers

    model, ref = SameSizeBlocks(), SameSizeBlocks()
    ws = shard_blocks(model, "layers", ["fc"], ctx.comm)
    if not guard:
        ws.planner.state.samples = None
    out = []
    with torch.no_grad():
        for s, start in enumerate((0, ctx.rank, 1 - ctx.rank)):
            x = torch.randn(2, 16, generator=torch.Generator().manual_seed(10 * s + ctx.rank))
            expected = x
            for b in ref.layers[start:]:
                expected = b(expected)
            try:
                out.append(bool(torch.equal(run_layers(model.layers, x, ws.planner, start), expected)))
            except ShardingError as e:
                out.append(f"{type(e).__name__}: {e}")
    ws.close()
    return out


def test_steps_over_different_blocks_raise_on_every_rank_never_compute(cluster_of):
    r0, r1 = cluster_of(2).run(steps_over_different_blocks, True)
    for rank, r in enumerate((r0, r1)):
        assert r[0] is True
        layer = rank  # rank 0's layer 0 met rank 1's layer 1, and the other way round
        assert r[1].startswith(f"MismatchedGatherError: layer {layer} on rank {rank}: its gather of step 1 was "
                               f"paired with another gather on rank(s) [{1 - rank}]"), r[1]
        assert "every rank must run the same steps over the same blocks" in r[1]
        assert r[2].startswith("MismatchedGatherError: layer ") and "on rank(s)" in r[2], r[2]


def test_without_the_samples_steps_over_different_blocks_compute_with_mixed_layers(cluster_of):
    r0, r1 = cluster_of(2).run(steps_over_different_blocks, False)
    assert r0 == [True, False, True]  # step 1: each layer made of rank 1's next layer's chunk; no error
    assert r1 == [True, False, False]  # step 2's layer 0 met rank 0's layer 4 of step 1
