"""The next step's first gather, issued while the step's last layers run ([Note: the next step's first
gather] in wsharding/core/next_step.py), on CPU ranks: exact outputs step after step, one gather per sharded
layer per step, the hold on the slot's last reader, the cancel when a layer is gathered into that
slot between steps, partial ranges, and what it refuses."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from wsharding.core.comm import CommError
from wsharding.core.first_layer import FirstLayerPrefetch
from wsharding.core.next_step import NextStepPrefetch
from wsharding.core.runner import aligned_forward, prepare_layer_weight_shard_forward, run_layers
from wsharding.core.schedule import GatherSchedule
from wsharding.core.sharding import WeightSharding
from wsharding.lab.tasks.planner import LandingComm, ReadTwiceBlock
from wsharding.models import build_pair, decoder_config

D = 32


def _pair(comm, n_layers: int, sharded: range, between=None):
    blocks = [ReadTwiceBlock(D, seed=10 + i, pause=0.0, between=between) for i in range(n_layers)]
    ref = [ReadTwiceBlock(D, seed=10 + i, pause=0.0) for i in range(n_layers)]
    ws = WeightSharding(comm, blocks, {i: ["fc"] for i in sharded}, plugins=[NextStepPrefetch()]).setup().finalize()
    return blocks, ref, ws


def _next(p) -> NextStepPrefetch:
    plugin = NextStepPrefetch.attached_to(p)
    assert plugin is not None
    return plugin


def _x(step: int, rank: int, tokens: int = 3) -> torch.Tensor:
    return torch.randn(tokens, D, generator=torch.Generator().manual_seed(100 * step + rank))


# ---- tasks (module level: spawned ranks import them by name) --------------------------------------
def steps_with_prefetch(ctx, n_layers: int, first: int, steps: int) -> dict:
    blocks, ref, ws = _pair(ctx.comm, n_layers, range(first, n_layers))
    p = ws.planner
    equal, gathers, prefetches = [], [], []
    with torch.no_grad():
        for s in range(steps):
            x = _x(s, ctx.rank)
            equal.append(bool(torch.equal(run_layers(blocks, x, p), run_layers(ref, x, None))))
            gathers.append(p.gathers_this_step)
            prefetches.append(_next(p).prefetches)
    pending = p.ahead_layers == [first]
    wrap_gate = next(g.gate for g in p.schedule(0, n_layers).order() if g.next_step)
    ws.close()  # joins the prefetch still in flight
    return {"equal": equal, "gathers": gathers, "prefetches": prefetches, "pending_at_end": pending,
            "wrap_gate": wrap_gate}


class IssuedAtTheLastStart(NextStepPrefetch):
    """What the schedule guards against: the next step's first gather issued when the last layer (4,
    which reads the first layer's slot) starts, behind no gate."""

    def shape(self, schedule: GatherSchedule) -> GatherSchedule:
        shaped = super().shape(schedule)
        g = next(g for gs in shaped.at_block_end.values() for g in gs if g.next_step)
        return dataclasses.replace(shaped, at_block_end={}, at_block_start={
            **shaped.at_block_start, 4: (*shaped.at_block_start.get(4, ()), dataclasses.replace(g, gate=None))})


def hold_on_the_running_reader(ctx, hold: bool) -> dict:
    """Five sharded layers: slots A B A B A, so the last layer (4) reads the first layer's slot. Between
    its two reads every gather in flight lands (:class:`LandingComm`): the schedule issues the next step's
    first gather at layer 4's end; issued at its start with no gate (``hold=False``), it lands in layer 4's
    slot before the second read."""
    comm = LandingComm(ctx.comm)
    blocks = [ReadTwiceBlock(D, seed=10 + i, pause=0.0, between=comm.land_all) for i in range(5)]
    ref = [ReadTwiceBlock(D, seed=10 + i, pause=0.0) for i in range(5)]
    plugin = NextStepPrefetch() if hold else IssuedAtTheLastStart()
    ws = WeightSharding(comm, blocks, {i: ["fc"] for i in range(5)}, plugins=[plugin]).setup().finalize()
    p = ws.planner
    at_end = [g.layer for g in p.schedule(0, 5).at_block_end.get(4, ()) if g.next_step]
    with torch.no_grad():
        run_layers(blocks, _x(0, ctx.rank), p)  # step 0 (its end prefetches step 1's first gather)
        x = _x(1, ctx.rank)
        h = run_layers(blocks, x, p)
        want = run_layers(ref, x, None)
    ws.close()
    return {"equal": bool(torch.equal(h, want)), "held": at_end == [0], "prefetches": plugin.prefetches}


def layer_called_between_steps(ctx) -> dict:
    """Six sharded layers (A B A B A B): after a step, layer 4 (slot A, the first layer's slot) is
    called on its own and gathers its weights into slot A again -- over the prefetched first layer."""
    comm = LandingComm(ctx.comm)
    blocks, ref, ws = _pair(comm, 6, range(6))
    p = ws.planner
    with torch.no_grad():
        run_layers(blocks, _x(0, ctx.rank), p)
        comm.land_all()  # the prefetch has certainly landed before layer 4 gathers into the same slot
        prepare_layer_weight_shard_forward(blocks[4])  # what a layer of ours calls at its start
        alone = blocks[4](_x(7, ctx.rank))
        alone_equal = bool(torch.equal(alone, ref[4](_x(7, ctx.rank))))
        x = _x(1, ctx.rank)
        equal = bool(torch.equal(run_layers(blocks, x, p), run_layers(ref, x, None)))
    ws.close()
    return {"alone_equal": alone_equal, "equal": equal, "cancels": _next(p).cancels, "misses": p.misses}


def partial_ranges(ctx) -> dict:
    blocks, ref, ws = _pair(ctx.comm, 6, range(6))
    p = ws.planner
    out = {}
    with torch.no_grad():
        x = _x(0, ctx.rank)
        run_layers(blocks, x, p)  # full: prefetches the next step's layer 0
        out["after_full"] = _next(p).prefetches
        h = _x(1, ctx.rank)
        # a step that starts past layer 0 joins the prefetch it does not use, and issues none itself
        out["from_2_equal"] = bool(torch.equal(run_layers(blocks, h, p, start_layer=2),
                                               run_layers(ref, h, None, start_layer=2)))
        out["after_from_2"] = _next(p).prefetches
        # a step that ends before the last sharded layer issues none either
        out["to_3_equal"] = bool(torch.equal(run_layers(blocks, h, p, end_layer=3),
                                             run_layers(ref, h, None, end_layer=3)))
        out["after_to_3"] = _next(p).prefetches
        out["full_again_equal"] = bool(torch.equal(run_layers(blocks, x, p), run_layers(ref, x, None)))
        out["gathers"] = p.gathers_this_step
    try:
        FirstLayerPrefetch.of(p)
        out["draft_prefetch"] = "allowed"
    except CommError as e:
        out["draft_prefetch"] = str(e)
    ws.close()
    return out


def decoder_with_idle_ranks(ctx, steps: int) -> dict:
    """The ToyDecoder (dense layer 0, layers 1.. sharded) with token counts that change per rank and
    step, rank 1 idle every third step (a one-token dummy forward keeps the collectives aligned)."""
    cfg = decoder_config("tiny")
    replicated, sharded = build_pair(cfg, ctx.comm)
    NextStepPrefetch.switch(sharded.planner, True)
    equal = []
    with torch.no_grad():
        for s in range(steps):
            n = 0 if (ctx.rank == 1 and s % 3 == 2) else 1 + (s + ctx.rank) % 4
            x = torch.randint(0, cfg.vocab, (n,), generator=torch.Generator().manual_seed(s))
            out = aligned_forward(sharded, x, sharded.dummy_tokens)
            equal.append(None if out is None else bool(torch.equal(out, replicated(x))))
    return {"equal": equal, "prefetches": _next(sharded.planner).prefetches,
            "gathers_total": sharded.planner.gathers_total, "sharded": len(sharded.planner.sharded_ids)}


# ---- tests --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("n_layers", "first", "wrap_gate"), [(6, 0, 4), (6, 1, 5), (1, 0, 0)])
def test_every_step_exact_with_one_gather_per_sharded_layer(cluster_of, n_layers, first, wrap_gate):
    """Even and odd counts of sharded layers (the last reader of the first slot is the layer before
    the last, or the last itself), and a single sharded layer (its own last reader)."""
    for r in cluster_of(2).run(steps_with_prefetch, n_layers, first, 4):
        assert r["equal"] == [True] * 4
        assert r["gathers"] == [n_layers - first] * 4  # the prefetched gather counts in the step that uses it
        assert r["prefetches"] == [1, 2, 3, 4] and r["pending_at_end"]
        assert r["wrap_gate"] == wrap_gate


def test_the_schedule_keeps_the_prefetch_out_of_a_slot_being_read(cluster_of):
    for r in cluster_of(2).run(hold_on_the_running_reader, True):
        assert r["held"] is True  # scheduled at layer 4's end
        assert r["equal"] and r["prefetches"] == 2
    for r in cluster_of(2).run(hold_on_the_running_reader, False):
        assert r["held"] is False and not r["equal"]  # landed between layer 4's reads


def test_a_layer_gathered_into_the_slot_between_steps_cancels_the_prefetch(cluster_of):
    # layer 4 is gathered on its own (a miss, warned) over the prefetch: the prefetch is given up and the
    # next step gathers its layer 0 by its schedule, not from a slot that holds layer 4
    for r in cluster_of(2).run(layer_called_between_steps):
        assert r["alone_equal"] and r["equal"] and r["cancels"] == 1 and r["misses"] == 1


def test_partial_ranges_and_the_draft_prefetch(cluster_of):
    for r in cluster_of(2).run(partial_ranges):
        assert r["after_full"] == 1
        assert r["from_2_equal"] and r["after_from_2"] == 1
        assert r["to_3_equal"] and r["after_to_3"] == 1
        assert r["full_again_equal"] and r["gathers"] == 6
        assert r["draft_prefetch"] == ("FirstLayerPrefetch: this planner already gathers its first layer ahead "
                                       "(NextStepPrefetch); use one of the two, on every rank the same")


def test_decoder_with_idle_ranks(cluster_of):
    results = cluster_of(2).run(decoder_with_idle_ranks, 9)
    for r in results:
        assert all(e in (True, None) for e in r["equal"]) and r["prefetches"] == 9
        assert r["gathers_total"] == 9 * r["sharded"] + 1  # 9 steps' gathers and the one still pending
    assert results[1]["equal"].count(None) == 3


def test_the_model_task_counts_prefetches(cluster_of):
    """The task the GPU test runs (tests/models/test_gpu_sharding.py), here on CPU ranks."""
    from wsharding.models.equality import model_equality

    counts = [[3, 5], [6, 2], [0, 3], [1, 8]]
    for r in cluster_of(2).run(model_equality, "tiny", counts, prefetch_next_step=True):
        assert all(e in (True, None) for e in r["equal"]) and r["max_abs_diff"] == 0.0
        assert r["gathers"] == [len(r["sharded_layers"])] * 4 and r["next_step_prefetches"] == 4


def shard_blocks_with_prefetch(ctx) -> dict:
    """The plug-in passed in: ``shard_blocks(..., plugins=[NextStepPrefetch()])`` on a model of our blocks."""
    from wsharding.core.runner import shard_blocks

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(ReadTwiceBlock(D, seed=10 + i, pause=0.0) for i in range(4))

        def forward(self, x):
            for b in self.layers:
                x = b(x)
            return x

    model, ref = Model(), Model()
    ws = shard_blocks(model, "layers", ["fc"], ctx.comm, plugins=[NextStepPrefetch()])
    with torch.no_grad():
        equal = [bool(torch.equal(model(_x(s, ctx.rank)), ref(_x(s, ctx.rank)))) for s in range(3)]
    out = {"equal": equal, "on": _next(ws.planner).enabled, "prefetches": _next(ws.planner).prefetches}
    ws.close()
    return out


def test_shard_blocks_takes_the_plugin(cluster_of):
    for r in cluster_of(2).run(shard_blocks_with_prefetch):
        assert r == {"equal": [True] * 3, "on": True, "prefetches": 3}
