"""The generic path: a GPT-style model's nn.Linear weights sharded from the outside, on CPU ranks."""

from __future__ import annotations

import pytest
import torch

from tests.core.gpt_blocks import TinyGPT
from wsharding.core.comm import Communicator
from wsharding.core.runner import shard_blocks
from wsharding.core.sharding import ShardingError


def generic_equality(ctx, lookahead: bool, steps: int, dtype_name: str):
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)  # identical weights on every rank, as a replicated model has
    model = TinyGPT(dtype=dtype).eval()
    comm = ctx.comm
    inputs = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * ctx.rank + step)  # different tokens on every rank
        n_tok = 1 + (ctx.rank * 3 + step * 5) % 9
        inputs.append(torch.randint(0, 97, (1, n_tok), generator=g))
    with torch.no_grad():
        expected = [model(x) for x in inputs]
        ws = shard_blocks(model, "blocks", ["q_proj", "k_proj", "v_proj", "o_proj", "fc*"], comm,
                          lookahead=lookahead)
        got = []
        gathers = []
        for x in inputs:
            got.append(model(x))
            gathers.append(ws.planner.gathers_this_step)
    return {
        "equal": [torch.equal(a, b) for a, b in zip(expected, got, strict=True)],
        "gathers": gathers,
        "sharded": ws.sharded_layer_ids,
        "resident": ws.resident_bytes(),
        "formula": ws.formula_bytes(),
        "replicated": ws.replicated_bytes(),
        "weight_is_view": model.blocks[1].fc1.weight.untyped_storage().data_ptr()
        == ws.slots.buffers[1].untyped_storage().data_ptr(),
    }


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("lookahead", [True, False])
def test_generic_gpt_sharded_equals_replicated(cluster_of, n, lookahead):
    results = cluster_of(n).run(generic_equality, lookahead, 4, "float32")
    d, ff = 48, 96
    per_layer = 4 * d * d * 4 + 2 * d * ff * 4  # q k v o + fc1 fc2, fp32
    for r in results:
        assert r["equal"] == [True] * 4
        assert r["gathers"] == [4] * 4  # exactly one gather per sharded layer per step
        assert r["sharded"] == [0, 1, 2, 3]
        assert r["replicated"] == 4 * per_layer
        assert r["resident"] == r["formula"]
        assert r["weight_is_view"]
    # exact formula: every entry here is a multiple of 16 B, so the only padding is the tail
    total = -(-per_layer // (16 * n)) * 16 * n
    assert results[0]["formula"] == 4 * total // n + 2 * total


def test_generic_bf16(cluster_of):
    for r in cluster_of(2).run(generic_equality, True, 2, "bfloat16"):
        assert r["equal"] == [True, True]


def test_tp_target_is_refused():
    from wsharding.core.sharding import WeightSharding

    class FakeComm(Communicator):
        rank, world_size, device, mode = 0, 2, torch.device("cpu"), "cpu-gloo"

    lin = torch.nn.Linear(4, 4)
    lin.tp_size = 1
    block = torch.nn.Module()
    block.proj = torch.nn.Module()
    block.proj.weight = torch.nn.Parameter(torch.zeros(4, 4))
    block.proj.tp_size = 2
    with pytest.raises(ShardingError, match="layer 0: target 'proj' has tp_size 2"):
        WeightSharding(FakeComm(), [block], {0: ["proj"]})
    with pytest.raises(ShardingError, match="declared target 'nope' does not exist"):
        WeightSharding(FakeComm(), [block], {0: ["nope"]})
    odd = torch.nn.Module()
    odd.a = torch.nn.Linear(4, 3)
    odd.b = torch.nn.Linear(4, 4)
    with pytest.warns(UserWarning, match=r"layer 0: 1 weight left replicated, rows not divisible by the group size 2: a.weight \(3 rows\)"):
        ws = WeightSharding(FakeComm(), [odd], {0: ["a", "b"]})
    assert [t.name for t in ws.targets[0]] == ["b"] and ws.skipped == ["0:a"]


def test_skipped_weights_warn_once_per_layer_on_rank_0():
    """Non-divisible weights: one warning per layer naming all of them, and only rank 0 says it
    (every rank skips the same weights); each rank still records what it skipped."""
    import warnings

    from wsharding.core.declare import ShardingSkipWarning
    from wsharding.core.sharding import WeightSharding

    def comm(rank):
        return type("FakeComm", (Communicator,), {"rank": rank, "world_size": 2, "device": torch.device("cpu"), "mode": "cpu-gloo"})()

    def layer():
        m = torch.nn.Module()
        m.a, m.b, m.c = torch.nn.Linear(4, 3), torch.nn.Linear(4, 5), torch.nn.Linear(4, 4)
        return m

    for rank in (0, 1):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ws = WeightSharding(comm(rank), [layer(), layer()], {0: ["a", "b", "c"], 1: ["a", "b", "c"]})
        got = [str(w.message) for w in caught if issubclass(w.category, ShardingSkipWarning)]
        assert got == ([f"layer {i}: 2 weights left replicated, rows not divisible by the group size 2: "
                        "a.weight (3 rows), b.weight (5 rows)" for i in (0, 1)] if rank == 0 else [])
        assert ws.skipped == ["0:a", "0:b", "1:a", "1:b"]
