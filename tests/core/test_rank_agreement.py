"""Ranks of one group must shard the same layout, and a sharded weight must have no other holder.

* Ranks that declare different layouts (other targets, another hidden size, one more block, other
  ``sharded_layers``) all raise the same :class:`ShardingError` at finalize, naming the first
  difference -- before any gather whose size depends on the layout, so no rank waits in a gather
  that pairs different weights (a wrong output) or of another size (gloo aborts the process).
* A target whose storage another parameter or buffer shares -- the model's head tied to a block's
  weight, or a non-target of the same block -- is refused with the weight and its other holder
  named: sharded, that holder would read a slot that other layers' gathers overwrite.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from wsharding.checkpoint import load_sharded, save_checkpoint
from wsharding.core.runner import shard_blocks
from wsharding.core.sharding import WeightSharding


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, d, bias=False)
        self.fc2 = nn.Linear(d, d, bias=False)
        self.register_buffer("fc2_t", None, persistent=False)  # a cached transpose of fc2.weight, when set

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + self.fc2(torch.relu(self.fc1(x)))
        return y if self.fc2_t is None else y + x @ self.fc2_t


class Stack(nn.Module):
    """Blocks in ``layers`` and a ``head`` outside them; the same seed gives the same weights."""

    def __init__(self, d: int = 16, n: int = 3, seed: int = 0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, d, bias=False)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.layers:
            x = b(x)
        return self.head(x)


def _outcome(call, model: nn.Module, ref: nn.Module, d: int) -> tuple[str, object]:
    """``(error class, message)`` when sharding raises, else ``("ran", max |sharded - replicated|)``."""
    try:
        ws = call()
    except Exception as e:  # noqa: BLE001 - the class and the text are what the tests check
        return type(e).__name__, str(e)
    x = torch.randn(3, d, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        diff = (model(x) - ref(x)).abs().max().item()
    ws.close()
    return "ran", diff


# ---- rank agreement ---------------------------------------------------------------------------------
def shard_mismatched(ctx, variant: str) -> tuple[str, object]:
    """Rank 1 differs from rank 0 in one way (``variant``); every rank reports what sharding did."""
    odd = ctx.rank == 1
    d, n, patterns, sharded = 16, 3, ["fc1", "fc2"], None
    if variant == "targets":
        patterns = ["fc1", "fc2"] if odd else ["fc1"]
    elif variant == "hidden":
        d = 32 if odd else 16
    elif variant == "blocks":
        n = 4 if odd else 3
    elif variant == "sharded_layers":
        sharded = [1, 2] if odd else [0, 1, 2]
    model, ref = Stack(d, n), Stack(d, n)
    return _outcome(lambda: shard_blocks(model, "layers", patterns, ctx.comm, sharded_layers=sharded), model, ref, d)


FIRST_DIFFERENCE = {
    # weights of the same size: without the agreement the gathers paired fc2 of one rank with fc1 of the other
    "targets": "layer 0: rank 0 shards fc1.weight only, rank 1 shards fc1.weight, fc2.weight",
    "hidden": "layer 0 fc1.weight: rank 0 has fp32 [16, 16], rank 1 has fp32 [32, 32]",
    "blocks": "layer 3: rank 0 shards nothing, rank 1 shards fc1.weight, fc2.weight",
    "sharded_layers": "layer 0: rank 0 shards fc1.weight, fc2.weight, rank 1 shards nothing",
}


@pytest.mark.parametrize("variant", list(FIRST_DIFFERENCE))
def test_ranks_with_different_layouts_all_raise_naming_the_first_difference(cluster_of, variant):
    results = cluster_of(2).run(shard_mismatched, variant)
    assert [kind for kind, _ in results] == ["ShardingError", "ShardingError"], results
    assert results[0][1] == results[1][1], "every rank raises the same message"
    msg = results[0][1]
    assert FIRST_DIFFERENCE[variant] in msg, msg
    assert "declare the same targets on every rank" in msg


# ---- tied weights -------------------------------------------------------------------------------------
def tie(m: Stack, how: str) -> Stack:
    """Give layer 0's ``fc2.weight`` a second holder (``how``); layer 2 shares its slot, so a holder
    read outside layer 0 reads layer 2's weights."""
    fc2 = m.layers[0].fc2
    if how == "head":  # the head tied to a block's weight, as an lm_head to the embeddings
        m.head.weight = fc2.weight
    elif how == "head_module":  # the whole linear used again outside the blocks
        m.head = fc2
    elif how == "block_buffer":  # a non-target of the same block viewing the weight's memory
        m.layers[0].fc2_t = fc2.weight.detach().t()
    elif how == "block_linear":  # a non-target linear of the same block holding the same Parameter
        m.layers[0].fc1.weight = fc2.weight
    elif how == "other_block":  # a non-target linear of another block: it runs while layer 2 holds the slot
        m.layers[2].fc1.weight = fc2.weight
    return m


def shard_tied(ctx, how: str, entry: str, path: str | None) -> tuple[str, object]:
    """Shard every block's ``fc2`` of a model tied as ``how`` (``"none"``: untied), through ``entry``."""
    ref = tie(Stack(seed=0), how)
    if entry == "load_sharded":  # built with other weights: the checkpoint's (seed 0) replace them
        model = tie(Stack(seed=1), how)
        return _outcome(lambda: load_sharded(model, path, "layers", ["fc2"], ctx.comm), model, ref, 16)
    model = tie(Stack(seed=0), how)
    if entry == "weight_sharding":
        return _outcome(lambda: WeightSharding(ctx.comm, model.layers, {i: ["fc2"] for i in range(3)}), model, ref, 16)
    return _outcome(lambda: shard_blocks(model, "layers", ["fc2"], ctx.comm), model, ref, 16)


def _checkpoint(tmp_path, how: str) -> str:
    path = tmp_path / f"{how}.safetensors"
    save_checkpoint(tie(Stack(seed=0), how), path)
    return str(path)


@pytest.mark.parametrize("entry", ["shard_blocks", "load_sharded"])
@pytest.mark.parametrize("how", ["head", "head_module"])
def test_a_target_tied_to_a_tensor_outside_the_blocks_is_refused(cluster_of, tmp_path, how, entry):
    path = _checkpoint(tmp_path, how) if entry == "load_sharded" else None
    for kind, msg in cluster_of(2).run(shard_tied, how, entry, path):
        assert kind == "ShardingError", msg
        assert msg.startswith("layer 0 fc2.weight on rank ") and "also head.weight of the model" in msg, msg
        assert "Untie them" in msg and "leave fc2 out of the targets" in msg, msg


@pytest.mark.parametrize(("how", "holder"), [("block_buffer", "layer 0 fc2_t"), ("block_linear", "layer 0 fc1.weight"),
                                             ("other_block", "layer 2 fc1.weight")])
@pytest.mark.parametrize("entry", ["weight_sharding", "shard_blocks", "load_sharded"])
def test_a_target_tied_to_a_non_target_of_a_block_is_refused(cluster_of, tmp_path, how, holder, entry):
    path = _checkpoint(tmp_path, how) if entry == "load_sharded" else None
    for kind, msg in cluster_of(2).run(shard_tied, how, entry, path):
        assert kind == "ShardingError", msg
        assert msg.startswith("layer 0 fc2.weight on rank ") and f"also {holder} (a tied weight)" in msg, msg
        assert "leave fc2 out of the targets" in msg, msg


@pytest.mark.parametrize("entry", ["shard_blocks", "load_sharded"])
def test_an_untied_model_with_a_head_is_bitwise_equal_to_the_replica(cluster_of, tmp_path, entry):
    path = _checkpoint(tmp_path, "none") if entry == "load_sharded" else None
    assert cluster_of(2).run(shard_tied, "none", entry, path) == [("ran", 0.0), ("ran", 0.0)]


# ---- a rank that stops before finalize ----------------------------------------------------------------
def shard_with_one_rank_failing(ctx, where: str, folder: str) -> tuple[str, object, float]:
    """Rank 1 stops before finalize (its load raises, or its checkpoint is not there); rank 0 goes on
    into finalize. Every rank reports its error class, message and how long sharding took."""
    import time

    model, ref = Stack(), Stack()
    path = folder if ctx.rank == 0 or where == "load" else folder + "-missing"

    def load(ws: WeightSharding) -> None:
        if ctx.rank == 1:
            raise OSError("the disk under this rank's copy of the checkpoint failed")
        from wsharding.checkpoint import load_checkpoint
        load_checkpoint(model, path)

    t0 = time.perf_counter()
    if where == "load":
        kind, msg = _outcome(lambda: shard_blocks(model, "layers", ["fc1", "fc2"], ctx.comm,
                                                  keep_initial_weights=False, load=load), model, ref, 16)
    else:
        kind, msg = _outcome(lambda: load_sharded(model, path, "layers", ["fc1", "fc2"], ctx.comm), model, ref, 16)
    return kind, msg, time.perf_counter() - t0


@pytest.mark.parametrize("where", ["load", "checkpoint"])
def test_a_rank_that_stops_before_finalize_stops_its_peers_at_once(cluster_of, tmp_path, where):
    # Without the agreement, rank 0 waits in finalize's gather for rank 1 until the collective timeout
    # and then raises a CommError that names no cause.
    save_checkpoint(Stack(), tmp_path / "ckpt")
    (r0, m0, t0), (r1, m1, _) = cluster_of(2).run(shard_with_one_rank_failing, where, str(tmp_path / "ckpt"))
    assert r1 == ("OSError" if where == "load" else "CheckpointError"), (r1, m1)
    assert r0 == "ShardingError", (r0, m0)
    assert "rank(s) [1] cannot finalize" in m0
