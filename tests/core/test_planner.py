"""Slots, the planner's sequence, collective alignment and memory over many steps (the gate
experiment is in test_widgets_planner.py, on the package's own gate_experiment task)."""

from __future__ import annotations

import time

import pytest
import torch

from tests.core.test_lifecycle import FcBlock
from wsharding.core.layout import FlatLayout
from wsharding.core.runner import run_layers
from wsharding.core.sharding import WeightSharding
from wsharding.core.slots import SlotPool
from wsharding.lab.cluster import RankCluster, RemoteError


def _blocks(n_layers=6, d=32):
    return [FcBlock(d, seed=10 + i) for i in range(n_layers)]


def seed_sequence(ctx, lookahead: bool, steps: int, tokens: list[int]):
    blocks = _blocks(d=48)
    ws = WeightSharding(ctx.comm, blocks, {i: ["fc"] for i in range(1, len(blocks))}, lookahead=lookahead,
                        trace=True).setup().finalize()
    outs, counts = [], []
    with torch.no_grad():
        for step in range(steps):
            x = torch.randn(tokens[step % len(tokens)], 48, generator=torch.Generator().manual_seed(step))
            y = run_layers(blocks, x, ws.planner)
            counts.append((ws.planner.gathers_this_step, ws.planner.waits_this_step))
            # checking again a layer whose weights are still in its slot is free
            ws.planner.ensure(5)
            counts.append((ws.planner.gathers_this_step, ws.planner.waits_this_step))
            # ... but layer 3's slot A now holds layer 5: layer 3 is gathered again (never computes
            # with another layer's weights)
            ws.planner.ensure(3)
            counts.append(ws.planner.misses)
            trace = ws.planner.finish_step()
            outs.append(y)
    slots_used = [r["slot"] for r in trace.records()]
    return counts, slots_used, ws.planner.occupancy()


@pytest.mark.parametrize("lookahead", [True, False])
def test_sequence_counts_slots_and_trace(cluster_of, lookahead):
    for counts, slots_used, occupancy in cluster_of(3).run(seed_sequence, lookahead, 3, [2, 5]):
        # layers 1..5 sharded: 5 gathers, 5 waits per step, never more; one re-gather per step
        assert counts == [(5, 5), (5, 5), 1, (5, 5), (5, 5), 2, (5, 5), (5, 5), 3]
        assert slots_used == ["A", "B", "A", "B", "A"]
        assert occupancy == {"A": 3, "B": 4}


def stale_layer_call(ctx):
    """After a step, run layer 1 on its own: its slot A holds layer 5 by then."""
    blocks = _blocks(d=32)
    ref = _blocks(d=32)
    ws = WeightSharding(ctx.comm, blocks, {i: ["fc"] for i in range(1, len(blocks))}).setup().finalize()
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(ctx.rank))
    with torch.no_grad():
        run_layers(blocks, x, ws.planner)
        occupant_before = ws.planner.occupancy()["A"]
        out = blocks[1](x)
        want = ref[1](x)
    return occupant_before, bool(torch.equal(out, want)), ws.planner.misses


def test_a_layer_called_after_the_step_gathers_its_own_weights_again(cluster_of):
    for occupant_before, equal, misses in cluster_of(2).run(stale_layer_call):
        assert occupant_before == 5  # without the occupancy check layer 1 would read layer 5's weights
        assert equal and misses == 1


def test_slot_pool_parity_and_gates():
    class C:
        rank, world_size, device, mode = 0, 2, torch.device("cpu"), "cpu-gloo"

        def alloc(self, n, tag=""):
            return torch.empty(n, dtype=torch.uint8)

    lays = {i: FlatLayout([("w", (i + 1, 8), torch.float32)], 2) for i in (1, 2, 3, 5)}
    pool = SlotPool(C(), lays)
    assert [pool.slot_of(i) for i in (1, 2, 3, 5)] == [0, 1, 0, 1]
    assert [pool.previous_occupant(i) for i in (1, 2, 3, 5)] == [None, None, 1, 2]
    assert pool.slot_bytes == lays[5].total_bytes == 192
    with pytest.raises(KeyError, match="layer 4 is not a sharded layer"):
        pool.slot_of(4)


def skip_a_step(ctx):
    blocks = _blocks(4)
    ws = WeightSharding(ctx.comm, blocks, {i: ["fc"] for i in range(4)}).setup().finalize()
    x = torch.randn(2, 32)
    with torch.no_grad():
        run_layers(blocks, x, ws.planner)
        if ctx.rank == 1:
            return "skipped"  # an idle rank that does not run the step
        t0 = time.monotonic()
        try:
            run_layers(blocks, x, ws.planner)
        finally:
            ctx.store["stuck_for"] = time.monotonic() - t0


def test_rank_that_skips_a_step_gives_a_clear_timeout():
    # the timeout also bounds the gloo group's set-up: 4 s was too short on a loaded 2-core machine
    with RankCluster(2, backend="gloo", collective_timeout=8, task_timeout=60) as c:
        t0 = time.monotonic()
        with pytest.raises(RemoteError) as info:
            c.run(skip_a_step)
        elapsed = time.monotonic() - t0
    err = str(info.value)
    assert info.value.rank == 0
    assert "weight gather of layer 0 failed on rank 0 (step 1)" in err
    assert "a rank that skips a step" in err
    assert elapsed < 30


def many_steps(ctx, steps: int):
    blocks = _blocks(4, d=64)
    ws = WeightSharding(ctx.comm, blocks, {i: ["fc"] for i in range(4)}).setup().finalize()
    ptrs = [t.data_ptr() for t in ws.chunks.values()] + [b.data_ptr() for b in ws.slots.buffers]

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    with torch.no_grad():
        for s in range(5):
            run_layers(blocks, torch.randn(1 + s % 3, 64), ws.planner)
        before = rss()
        for s in range(steps):
            run_layers(blocks, torch.randn(1 + s % 3, 64), ws.planner)
        after = rss()
    same = ptrs == [t.data_ptr() for t in ws.chunks.values()] + [b.data_ptr() for b in ws.slots.buffers]
    return after - before, same, len(ws.planner.traces), ws.planner.gathers_total


def test_no_memory_growth_over_50_steps(cluster_of):
    for growth, same_buffers, traces, gathers in cluster_of(2).run(many_steps, 50):
        assert same_buffers and traces == 0  # trace off: nothing kept per step
        assert gathers == 55 * 4
        assert growth < 1 << 20, f"RSS grew by {growth} B over 50 steps"


def test_exposed_gather_counts_only_waits_while_the_gather_ran():
    """A wait measured on the compute stream also holds the time the GPU idled for the host: counted
    whole, "exposed gather" exceeded the gathers themselves at host-bound steps (a fraction of 3.97)."""
    from wsharding.core.trace import StepTrace

    tr = StepTrace(0, 0, cuda=False)
    tr.layers = {
        1: {"gather_start": 0.0, "gather_end": 100.0, "wait_start": 150.0, "wait_end": 160.0},  # done long before
        2: {"gather_start": 100.0, "gather_end": 300.0, "wait_start": 200.0, "wait_end": 320.0},  # 100 us of it
        3: {"wait_start": 0.0, "wait_end": 5.0},  # no gather marks (a backend without them): the wait itself
    }
    assert tr.exposed_gather_us() == 105.0
    assert tr.gather_us() == 300.0
