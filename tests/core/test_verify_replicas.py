"""Ranks must shard one model: the same bytes in every target, not only the same layouts.

* Ranks whose weights, kept as built, differ (built without one seed) all raise the same
  :class:`ShardingError` at finalize, naming the first weight that differs and which ranks hold
  what -- before any gather, so no rank is left waiting.
* ``verify_replicas=False`` skips the check, and shows what it guards against: every rank then runs
  the same mixture of rows of different models, unequal to its own replica and to every other.
* The same weights (one seed, or one checkpoint loaded over any weights) shard as before: bit for
  bit equal to the replica.
* The digest itself: exact on bytes, one changed word always changes it, the same for any view of
  the same values.
"""

from __future__ import annotations

import pytest
import torch

from tests.core.test_rank_agreement import Stack
from wsharding.checkpoint import load_checkpoint, load_sharded, save_checkpoint
from wsharding.core.replicas import replica_difference, weight_digest
from wsharding.core.runner import shard_blocks
from wsharding.core.sharding import WeightSharding
from wsharding.models import ToyDecoder, decoder_config


def _ran(ws: WeightSharding, model: torch.nn.Module, ref: torch.nn.Module) -> tuple[str, float, list[int], list[int]]:
    """``("ran", max |sharded - own replica| for one fixed input, digests of the sharded weights as
    gathered, digests of the replica's)``."""
    x = torch.randn(3, model.head.in_features, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        diff = (model(x) - ref(x)).abs().max().item()
    gathered = [weight_digest(w) for w in ws.full_state_dict().values()]
    own = [weight_digest(getattr(b, fc).weight) for b in ref.layers for fc in ("fc1", "fc2")]
    ws.close()
    return "ran", diff, gathered, own


def shard_with_seeds(ctx, seeds: list[int], entry: str = "shard_blocks", verify: bool = True,
                     folder: str = "", d: int = 16) -> tuple:
    """Rank ``r`` builds its model with seed ``seeds[r]`` and shards it through ``entry``; returns the
    error class and message, or what :func:`_ran` returns."""
    seed = seeds[ctx.rank]
    model, ref = Stack(d, seed=seed), Stack(d, seed=seed)
    try:
        if entry == "shard_blocks":
            ws = shard_blocks(model, "layers", ["fc1", "fc2"], ctx.comm, verify_replicas=verify)
        elif entry == "load_over_kept":  # weights kept as built, then one checkpoint loaded over them
            ref = Stack(seed=0)
            ws = shard_blocks(model, "layers", ["fc1", "fc2"], ctx.comm, load=lambda ws: load_checkpoint(model, folder))
        else:  # load_sharded: every row from the checkpoint (seed 0)
            ref = Stack(seed=0)
            ws = load_sharded(model, folder, "layers", ["fc1", "fc2"], ctx.comm, verify_replicas=verify)
    except Exception as e:  # noqa: BLE001 - the class and the text are what the tests check
        return type(e).__name__, str(e)
    return _ran(ws, model, ref)


def test_ranks_that_built_different_weights_all_raise_naming_the_weight_and_the_ranks(cluster_of):
    results = cluster_of(2).run(shard_with_seeds, [0, 1])
    assert [kind for kind, _ in results] == ["ShardingError", "ShardingError"], results
    assert results[0][1] == results[1][1], "every rank raises the same message"
    msg = results[0][1]
    assert "layer 0 fc1.weight on rank 1 differs from layer 0 fc1.weight on rank 0" in msg, msg
    assert "torch.manual_seed" in msg and "load_sharded" in msg and "verify_replicas=False" in msg, msg


def test_the_refusal_groups_the_ranks_by_what_they_hold(cluster_of):
    results = cluster_of(3).run(shard_with_seeds, [0, 5, 0], d=24)  # 24 rows: divisible by 3
    assert {kind for kind, _ in results} == {"ShardingError"}, results
    assert "layer 0 fc1.weight on rank 1 differs from layer 0 fc1.weight on ranks 0, 2" in results[0][1]


def test_without_the_check_different_weights_give_a_silently_wrong_model(cluster_of):
    # What the guard prevents: every rank gathers the same mixture of both models' rows -- equal
    # across ranks, so no later comparison between ranks notices -- which is neither rank's weights,
    # and neither rank's output is its own replica's.
    (k0, d0, gathered0, own0), (k1, d1, gathered1, own1) = cluster_of(2).run(shard_with_seeds, [0, 1],
                                                                             "shard_blocks", False)
    assert (k0, k1) == ("ran", "ran")
    assert d0 > 0 and d1 > 0, (d0, d1)
    assert gathered0 == gathered1
    assert all(g not in (a, b) for g, a, b in zip(gathered0, own0, own1, strict=True))


def test_ranks_with_the_same_weights_are_bitwise_equal_to_the_replica(cluster_of):
    for verify in (True, False):
        results = cluster_of(2).run(shard_with_seeds, [3, 3], "shard_blocks", verify)
        assert [r[:2] for r in results] == [("ran", 0.0), ("ran", 0.0)], verify


@pytest.mark.parametrize("entry", ["load_over_kept", "load_sharded"])
def test_rows_loaded_from_one_checkpoint_are_not_compared_as_built(cluster_of, tmp_path, entry):
    # Built with different seeds, then every target's rows read from one checkpoint: the bytes
    # digested at setup are gone, so there is nothing to refuse, and the model is the checkpoint's.
    save_checkpoint(Stack(seed=0), tmp_path / "ckpt")
    results = cluster_of(2).run(shard_with_seeds, [0, 1], entry, True, str(tmp_path / "ckpt"))
    assert [r[:2] for r in results] == [("ran", 0.0), ("ran", 0.0)], results


def decoder_with_seed(ctx, verify: bool) -> tuple[str, str]:
    """The toy decoder, whose layers shrink themselves as they are built (``setup_layer``), with a
    seed that depends on the rank."""
    ws = WeightSharding(ctx.comm, sharded_layers=range(1, 4), verify_replicas=verify)
    ToyDecoder(decoder_config("tiny"), seed=ctx.rank, weight_sharding=ws)
    try:
        ws.finalize()
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    ws.close()
    return "ran", ""


def test_a_model_that_shrinks_its_own_layers_is_checked_too(cluster_of):
    results = cluster_of(2).run(decoder_with_seed, True)
    assert [kind for kind, _ in results] == ["ShardingError", "ShardingError"], results
    assert results[0][1].startswith("finalize refused on every rank: the ranks of this group built different "
                                    "weights -- layer 1 attn."), results[0][1]
    assert cluster_of(2).run(decoder_with_seed, False) == [("ran", ""), ("ran", "")]


# ---- the digest -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("numel", [1, 7, 8, 1000, (1 << 21) + 3])
def test_every_changed_byte_changes_the_digest(dtype, numel):
    g = torch.Generator().manual_seed(numel)
    w = torch.randint(-100, 100, (numel,), generator=g).to(dtype)
    d = weight_digest(w)
    assert weight_digest(w.clone()) == d
    raw = w.view(-1).view(torch.uint8)
    for at in sorted({0, raw.numel() // 2, raw.numel() - 1}):
        other = raw.clone()
        other[at] ^= 1
        assert weight_digest(other.view(dtype)) != d, at


def test_the_digest_reads_values_in_row_major_order_from_any_view():
    w = torch.randn(48, 64)
    d = weight_digest(w)
    assert weight_digest(w.t().contiguous().t()) == d  # the same values, another memory order
    assert weight_digest(w.t()) != d  # other values in row-major order
    assert weight_digest(torch.cat([torch.zeros(1), w.flatten()])[1:].view(48, 64)) == d  # at an odd offset
    assert weight_digest(w.view(torch.int32)) == d  # the same bytes


def test_the_first_difference_names_the_weight_and_groups_the_ranks():
    held = [{"a": 1, "b": 2}, {"a": 1, "b": 3}, {"a": 1}, {"a": 1, "b": 2}]
    assert replica_difference(["a", "b"], held) == ("b", [[0, 3], [1]])
    assert replica_difference(["a"], held) is None


# ---- structured changes: none may leave the digest equal -----------------------------------------
def _changes(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """What a user or a bug can do to a weight's bytes without changing its shape or dtype."""
    flat = w.flatten()
    out = {}
    for every in (2, 4, 8):  # sign flips of many elements (the top bit of each), the first or last of a word
        for first in (0, every - 1):
            x = flat.clone()
            x[first::every] = -x[first::every]
            out[f"sign of every {every}th from {first}"] = x.view_as(w)
    two = flat.clone()
    two[:2] = -two[:2]
    out["sign of two"] = two.view_as(w)
    out["sign of all"] = (-flat).view_as(w)
    out["rows swapped"] = w[[1, 0, *range(2, w.shape[0])]]
    out["rows reversed"] = w.flip(0)
    out["elements permuted"] = flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(1))].view_as(w)
    out["columns rolled"] = w.roll(1, dims=1)
    raw = flat.clone().view(torch.uint8)
    for bits in (1, 2, 3, 64):  # any number of bit flips, the same bit of many bytes too
        x = raw.clone()
        x[: bits] ^= 0x80
        out[f"{bits} top bits"] = x.view(w.dtype).view_as(w)
    x = raw.clone()
    x[::8] ^= 1
    out["low bit of every 8th byte"] = x.view(w.dtype).view_as(w)
    out["transposed"] = w.t().contiguous().view_as(w)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_every_structured_change_changes_the_digest(dtype):
    # The sum-like digest this replaced collided on several of these: every odd fp32 element or every
    # 4th bf16 element from the 3rd negated gave the same value (two top-bit flips add 2^64).
    w = (torch.randn(16, 16, generator=torch.Generator().manual_seed(3)) * 50).to(dtype)
    d = weight_digest(w)
    changed = {what: x for what, x in _changes(w).items() if not torch.equal(x.view(torch.uint8), w.view(torch.uint8))}
    assert len(changed) >= 17, sorted(changed)
    same = [what for what, x in changed.items() if weight_digest(x) == d]
    assert same == [], same
    digests = [weight_digest(x) for x in changed.values()]
    assert len(set(digests)) == len(digests)  # and no two changes give one value


def with_signs_flipped(ctx) -> tuple:
    """Rank 1 negates every odd element of its fp32 weights (every 4th from the 3rd of bf16 ones):
    the top bit of every 64-bit word, which the sum-like digest could not see."""
    out = []
    for dtype, every in ((torch.float32, 2), (torch.bfloat16, 4)):
        model, ref = Stack(16, seed=0), Stack(16, seed=0)
        model.to(dtype)
        if ctx.rank == 1:
            with torch.no_grad():
                for b in model.layers:
                    b.fc1.weight.view(-1)[every - 1::every].neg_()
        try:
            shard_blocks(model, "layers", ["fc1", "fc2"], ctx.comm).close()
            out.append(("ran", ""))
        except Exception as e:  # noqa: BLE001 - the class is what the test checks
            out.append((type(e).__name__, str(e)[:80]))
        del ref
    return out


def test_ranks_whose_weights_differ_by_sign_flips_are_refused(cluster_of):
    results = cluster_of(2).run(with_signs_flipped)
    for rank in results:
        assert [kind for kind, _ in rank] == ["ShardingError", "ShardingError"], results


def test_the_digest_holds_nothing_after_the_call():
    # The sum-like digest kept a table of position factors per device (8,388,608 B each) for the
    # life of the process, in no account (resident_bytes). Now the module holds no tensor at all.
    import wsharding.core.replicas as replicas

    weight_digest(torch.randn(4096))
    held = 0
    for value in vars(replicas).values():
        items = value.values() if isinstance(value, dict) else [value]
        held += sum(t.untyped_storage().nbytes() for t in items if isinstance(t, torch.Tensor))
    assert held == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_the_digest_of_a_weight_on_a_gpu_is_its_digest_on_the_cpu(dtype):
    # Read to the host in blocks of 8 MiB: a weight of three blocks and a tail, and one at an odd offset.
    w = torch.randn((3 << 21) + 5, generator=torch.Generator().manual_seed(2)).to(dtype)
    assert weight_digest(w.cuda()) == weight_digest(w)
    assert weight_digest(w.cuda()[1:]) == weight_digest(w[1:])
    flipped = w.clone()
    flipped.view(torch.uint8)[-1] ^= 0x80
    assert weight_digest(flipped.cuda()) != weight_digest(w)
