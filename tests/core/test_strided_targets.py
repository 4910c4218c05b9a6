"""A target that is not contiguous -- a transposed weight, a transpose of a bigger parameter, every
other column -- is refused at declare, on every rank, naming the weight and its strides: sharded, it
would become a contiguous view of its slot, and the matmul would round differently from the
replicated model. Made contiguous first (the way out the message gives), it shards bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.core.test_rank_agreement import Stack
from wsharding.core.runner import shard_blocks
from wsharding.core.sharding import WeightSharding


def strided(weight: torch.Tensor, how: str) -> nn.Parameter:
    """``weight``'s values in a non-contiguous tensor (``how``)."""
    out, inp = weight.shape
    w = weight.detach()
    if how == "transposed":  # the same values stored column-major: strides (1, out)
        return nn.Parameter(w.t().contiguous().t())
    if how == "transpose_of_bigger":  # rows of a bigger parameter's transpose: strides (1, 2 * out)
        big = torch.zeros(inp, 2 * out)
        big[:, :out] = w.t()
        return nn.Parameter(big.t()[:out])
    wide = torch.zeros(out, 2 * inp)  # every other column of a wider tensor: strides (2 * inp, 2)
    wide[:, ::2] = w
    return nn.Parameter(wide[:, ::2])


def strided_stack(how: str, d: int = 16) -> Stack:
    m = Stack(d)
    for b in m.layers:
        b.fc1.weight = strided(b.fc1.weight, how)
    return m


def make_contiguous(model: nn.Module) -> nn.Module:
    for p in model.parameters():
        p.data = p.data.contiguous()
    return model


HOWS = ["transposed", "transpose_of_bigger", "every_other_column"]


@pytest.mark.parametrize("how", HOWS)
def test_a_strided_weight_rounds_differently_from_its_contiguous_copy(how):
    # What the refusal guards against: a sharded weight is a contiguous view of its slot, so without
    # it the sharded model would compute as the contiguous copy does -- not bit for bit the replica.
    differ = []
    for d in (16, 48, 96):
        x = torch.randn(5, d, generator=torch.Generator().manual_seed(d))
        model = strided_stack(how, d)
        assert not model.layers[0].fc1.weight.is_contiguous()
        with torch.no_grad():
            ref = model(x)
            differ.append(not torch.equal(ref, make_contiguous(model)(x)))
    assert any(differ), "every size happened to round alike on this machine"


def shard_strided(ctx, how: str, entry: str, fix: bool) -> tuple[str, object]:
    """Shard every block's fc1 and fc2 of a model whose fc1 weights are strided (``how``), through
    ``entry``; with ``fix``, after the message's way out on both the model and its replica."""
    model, ref = strided_stack(how), strided_stack(how)
    if fix:
        make_contiguous(model), make_contiguous(ref)
    try:
        if entry == "weight_sharding":
            ws = WeightSharding(ctx.comm, model.layers, {i: ["fc1", "fc2"] for i in range(3)}).finalize()
        else:
            ws = shard_blocks(model, "layers", ["fc1", "fc2"], ctx.comm)
    except Exception as e:  # noqa: BLE001 - the class and the text are what the tests check
        return type(e).__name__, str(e)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        equal = torch.equal(model(x), ref(x))
    ws.close()
    return "ran", equal


STRIDES = {"transposed": "strides (1, 16)", "transpose_of_bigger": "strides (1, 32)",
           "every_other_column": "strides (32, 2)"}


@pytest.mark.parametrize("entry", ["weight_sharding", "shard_blocks"])
@pytest.mark.parametrize("how", HOWS)
def test_a_strided_target_is_refused_on_every_rank_naming_it_and_its_strides(cluster_of, how, entry):
    for kind, msg in cluster_of(2).run(shard_strided, how, entry, False):
        assert kind == "ShardingError", msg
        assert msg.startswith("layer 0 fc1.weight is not contiguous (shape [16, 16], "), msg
        assert STRIDES[how] in msg and "contiguous: (16, 1)" in msg, msg
        assert "for p in model.parameters(): p.data = p.data.contiguous()" in msg, msg


@pytest.mark.parametrize("how", HOWS)
def test_made_contiguous_it_shards_bit_for_bit(cluster_of, how):
    assert cluster_of(2).run(shard_strided, how, "shard_blocks", True) == [("ran", True), ("ran", True)]
