"""A layer never computes with bytes that are not its own ([Note: checked at use] in
wsharding/core/step_owner.py), on CPU ranks: what a hostile caller does to the schedule -- blocks in reverse,
a linear or a block called on its own, one rank alone, a peer that raises mid-step and keeps serving,
two threads -- and depth k. Each case shows, where it can, what the slot held before the check."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from torch import nn

from wsharding.core.bound import raw_access
from wsharding.core.comm import CommError
from wsharding.core.errors import ShardingError
from wsharding.core.planner import ConcurrentStepError, ScheduleMissWarning
from wsharding.core.runner import run_layers, shard_blocks
from wsharding.core.schedule import GatherSchedule, ScheduledGather, lookahead_schedule, with_next_step_first
from wsharding.core.sharding import WeightSharding
from wsharding.lab.cluster import RankCluster

D = 16


class Mlp(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc1 = nn.Linear(D, 2 * D, bias=False)
        self.fc2 = nn.Linear(2 * D, D, bias=False)
        with torch.no_grad():
            self.fc1.weight.copy_(torch.randn(2 * D, D, generator=g) / D**0.5)
            self.fc2.weight.copy_(torch.randn(D, 2 * D, generator=g) / D**0.5)
        self.fail = False
        self.pause: threading.Event | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("this block failed on purpose")
        if self.pause is not None:
            self.pause.wait(20)
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Model(nn.Module):
    def __init__(self, n: int = 5, reverse: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Mlp(30 + i) for i in range(n))
        self.reverse = reverse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in (reversed(self.layers) if self.reverse else self.layers):
            x = b(x)
        return x


def _x(step: int, rank: int = 0) -> torch.Tensor:
    return torch.randn(3, D, generator=torch.Generator().manual_seed(100 * step + rank))


def _shard(ctx, n: int = 5, **kw):
    model, ref = Model(n), Model(n)
    ws = shard_blocks(model, "layers", ["fc*"], ctx.comm, **kw)
    return model, ref, ws


# ---- tasks (module level: spawned ranks import them by name) --------------------------------------
def reversed_loop(ctx, on_miss: str) -> dict:
    model, ref, ws = _shard(ctx, on_miss=on_miss)
    model.reverse = ref.reverse = True
    out: dict = {}
    with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for s in range(2):
            x = _x(s, ctx.rank)
            try:
                out.setdefault("equal", []).append(bool(torch.equal(model(x), ref(x))))
            except ShardingError as e:
                out["error"] = str(e)
                break
    out["warnings"] = sorted({str(w.message).split(";")[0] for w in seen if w.category is ScheduleMissWarning})
    out["misses"] = ws.planner.misses
    # the model is still usable in order afterwards
    model.reverse = ref.reverse = False
    with torch.no_grad():
        out["in_order_after"] = bool(torch.equal(model(_x(9, ctx.rank)), ref(_x(9, ctx.rank))))
    ws.close()
    return out


def linear_called_alone(ctx) -> dict:
    model, ref, ws = _shard(ctx)
    x = _x(0, ctx.rank)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", ScheduleMissWarning)
        model(x)
        before = ws.planner.occupancy()  # slot A holds layer 4 after a step of five layers
        alone = torch.equal(model.layers[0].fc1(x), ref.layers[0].fc1(x))
        # and before any step of a fresh model: its slots hold the last layers finalize rebuilt
        after_step = bool(torch.equal(model(x), ref(x)))
    ws.close()
    return {"before": before, "alone": alone, "after_step": after_step}


#: A rank process's sharded model kept from one task to the next (the ranks outlive a task).
_KEPT: dict = {}


def one_rank_calls_a_block(ctx) -> dict:
    model, ref, ws = _shard(ctx)
    _KEPT.update(model=model, ref=ref, ws=ws)
    out: dict = {}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", ScheduleMissWarning)
        out["step"] = bool(torch.equal(model(_x(0, ctx.rank)), ref(_x(0, ctx.rank))))
        if ctx.rank == 1:  # a debugging call on one rank only: its slot holds layer 4
            try:
                model.layers[0](_x(5, ctx.rank))
                out["alone"] = "ran"
            except CommError as e:
                out["alone"] = str(e)
    return out


def next_step_of_the_kept_model(ctx) -> bool:
    model, ref, ws = _KEPT.pop("model"), _KEPT.pop("ref"), _KEPT.pop("ws")
    with torch.no_grad():
        equal = bool(torch.equal(model(_x(1, ctx.rank)), ref(_x(1, ctx.rank))))
    ws.close()
    return equal


def peer_raises_mid_step(ctx) -> dict:
    model, ref, ws = _shard(ctx)
    out: dict = {"steps": []}
    with torch.no_grad():
        for s in range(3):
            model.layers[1].fail = ctx.rank == 1 and s == 1  # rank 1 fails inside layer 1 of step 1
            x = _x(s, ctx.rank)
            try:
                out["steps"].append(bool(torch.equal(model(x), ref(x))))
            except RuntimeError as e:
                out["steps"].append(f"raised: {e}")
    ws.close()
    return out


def two_threads(ctx) -> dict:
    model, ref, ws = _shard(ctx)
    gate = threading.Event()
    model.layers[2].pause = gate
    result: dict = {}

    def first() -> None:
        with torch.no_grad():
            result["first"] = bool(torch.equal(model(_x(0, ctx.rank)), ref(_x(0, ctx.rank))))

    t = threading.Thread(target=first)
    t.start()
    while ws.planner._owner is None:  # the first thread is inside its step
        pass
    try:
        with torch.no_grad():
            model(_x(1, ctx.rank))
        result["second"] = "ran"
    except ConcurrentStepError as e:
        result["second"] = str(e)
    gate.set()
    t.join(30)
    model.layers[2].pause = None
    with torch.no_grad():  # the next step, from this thread, is fine
        result["after"] = bool(torch.equal(model(_x(2, ctx.rank)), ref(_x(2, ctx.rank))))
    ws.close()
    return result


def depth_k(ctx, depth: int) -> dict:
    model, ref, ws = _shard(ctx, n=7, prefetch_depth=depth)
    with torch.no_grad():
        equal = [bool(torch.equal(model(_x(s, ctx.rank)), ref(_x(s, ctx.rank)))) for s in range(3)]
    out = {"equal": equal, "slots": ws.slots.count, "resident": ws.resident_bytes(), "formula": ws.formula_bytes(),
           "gathers": ws.planner.gathers_this_step, "misses": ws.planner.misses,
           "schedule": ws.planner.schedule(0, 7).describe()}
    ws.close()
    return out


# ---- tests ------------------------------------------------------------------------------------------
def test_blocks_in_reverse_are_exact_and_warned(cluster_of):
    for r in cluster_of(2).run(reversed_loop, "gather"):
        assert r["equal"] == [True, True] and r["in_order_after"]
        assert any("ran where the schedule expected block 0" in w for w in r["warnings"])
        assert r["misses"] > 0


def test_blocks_in_reverse_refused_with_on_miss_raise(cluster_of):
    for r in cluster_of(2).run(reversed_loop, "raise"):
        assert r["equal"] == []
        assert r["error"].startswith("layer 4 on rank ")
        assert "block 4 ran where the schedule expected block 0, so its slot does not hold its weights " \
               "(on_miss='raise')" in r["error"]
        assert r["in_order_after"]  # the refusal gave the step up cleanly


def test_a_linear_called_on_its_own_is_gathered(cluster_of):
    for r in cluster_of(2).run(linear_called_alone):
        assert r["before"]["A"] == 4  # without the check fc1 of layer 0 would read layer 4's bytes
        assert r["alone"] and r["after_step"]


def test_one_rank_calling_a_block_alone_errs_and_never_mixes_a_peer():
    with RankCluster(2, backend="gloo", collective_timeout=6, task_timeout=90) as c:
        r0, r1 = c.run(one_rank_calls_a_block)
        # The next step, once the lone call has timed out (a second task: run in the first, rank 0's step
        # would wait on rank 1 as long as rank 1 waits on the lone call). Had the lone call gone to the
        # steps' channel, it would have paired with rank 0's first gather of this step, or timed out
        # there and closed that channel: either way this step would not be exact.
        after = c.run(next_step_of_the_kept_model)
    assert r0 == {"step": True} and r1["step"] is True
    # the lone call waits on the channel of gathers outside the steps, not in a peer's next step
    assert r1["alone"].startswith("weight gather of layer 0 failed on rank 1 (step 0), outside the steps: layer 0: "
                                  "gather outside the schedule did not complete on rank 1 (every rank of the shard "
                                  "group must make this call)"), r1["alone"]
    assert after == [True, True]


def test_a_peer_that_raises_mid_step_leaves_the_healthy_rank_exact(cluster_of):
    r0, r1 = cluster_of(2).run(peer_raises_mid_step)
    assert r0["steps"] == [True, True, True]  # the failed rank still issued the step's gathers
    assert r1["steps"][0] is True and r1["steps"][1] == "raised: this block failed on purpose"
    assert r1["steps"][2] is True  # and its next step is aligned with the peer's


def test_a_second_thread_is_refused(cluster_of):
    for r in cluster_of(2).run(two_threads):
        assert r["first"] is True and r["after"] is True
        assert "while another thread runs a step of it" in r["second"]
        assert "batching them into one forward, or serialise the calls" in r["second"]


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_depth_k_exact_with_k_plus_one_slots_and_the_formula(cluster_of, depth):
    for r in cluster_of(2).run(depth_k, depth):
        assert r["equal"] == [True] * 3 and r["misses"] == 0
        assert r["slots"] == depth + 1 and r["resident"] == r["formula"] and r["gathers"] == 7
        # layers 0 .. depth at the step's start, then one per block, `depth` ahead
        assert r["schedule"][0].count("gather") == depth + 1
        assert r["schedule"][1].startswith(f"block 1 start: gather {depth + 1} -> slot")


# ---- the schedule as a value ------------------------------------------------------------------------
def test_lookahead_schedule_gates_and_hooks():
    slot_of = {i: i % 3 for i in range(6)}
    s = lookahead_schedule(range(6), slot_of, 2)
    assert [g.layer for g in s.at_step_start] == [0, 1, 2]
    assert {b: [(g.layer, g.gate) for g in gs] for b, gs in s.at_block_start.items()} == {
        1: [(3, 0)], 2: [(4, 1)], 3: [(5, 2)]}
    # every gate ends before its gather's hook on the host: [Note: the gate, for depth k]
    for b, gs in s.at_block_start.items():
        assert all(g.gate is None or g.gate < b for g in gs)
    off = lookahead_schedule(range(6), slot_of, 0)
    assert not off.at_step_start and all(gs[0].inline and gs[0].layer == b for b, gs in off.at_block_start.items())
    nxt = with_next_step_first(lookahead_schedule(range(5), {i: i % 2 for i in range(5)}, 1))
    assert nxt.at_block_end[4] == (ScheduledGather(0, 0, 4, next_step=True),)  # the last layer reads slot A


def bad_schedule(ctx) -> str:
    blocks = [Mlp(i) for i in range(3)]
    ws = WeightSharding(ctx.comm, blocks, {i: ["fc1"] for i in range(3)}).setup().finalize()
    ws.planner.set_schedule(lambda sharded, slot_of, start, end: GatherSchedule(
        (0, 1, 2), slot_of, 1, start, 3 if end is None else end, (ScheduledGather(0, 0, None),)))
    try:
        with torch.no_grad():
            run_layers(blocks, _x(0), ws.planner)
    except ShardingError as e:
        return str(e)
    return "ran"


def test_a_schedule_that_skips_a_layer_is_refused(cluster_of):
    for msg in cluster_of(2).run(bad_schedule):
        assert msg == "schedule: the step over blocks [0, 3) must gather each of its sharded layers [0, 1, 2] once; " \
                      "it gathers [0]"


def edit_through_data(ctx) -> dict:
    model, ref, ws = _shard(ctx)
    w = model.layers[1].fc1.weight
    with raw_access():
        raw = torch._C.TensorBase.data.__get__(w)  # what `.data` of a plain Parameter hands out
    with torch.no_grad():
        model(_x(0, ctx.rank))
        v = w._version
        raw.add_(0)  # its own version counter: an edit through it is invisible to the check
        unseen = w._version == v
        try:
            w.data.mul_(2)  # the guarded `.data`: refused at once, between steps
            out = "ran"
        except ShardingError as e:
            out = str(e)
        same = torch.equal(model(_x(1, ctx.rank)), ref(_x(1, ctx.rank)))
    return {"unseen_without_guard": unseen, "refused": out, "then_exact": same}


def test_an_edit_through_data_is_refused(cluster_of):
    for r in cluster_of(2).run(edit_through_data):
        assert r["unseen_without_guard"]
        assert "layer 1 fc1.weight on rank" in r["refused"] and "Tensor.mul_ outside its linear's forward" in r["refused"]
        assert r["then_exact"]
