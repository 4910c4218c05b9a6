"""A refused call leaves the model exactly as it was ([Note: refused before anything changes] in
``wsharding/core/bound.py``): ``model.half()`` used to convert every module before the first sharded
linear (a LayerNorm left in fp16) and only then refuse; ``load_state_dict`` copied into them likewise."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.core.test_library_edges import Loopback
from wsharding.core.errors import ShardingError
from wsharding.core.runner import shard_blocks


class Normed(nn.Module):
    """A norm and an embedding-like table before the blocks, a head and a buffer after: modules that
    a walk in order reaches before and after the sharded linears."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.norm = nn.LayerNorm(8)
        nn.init.normal_(self.norm.weight)
        self.layers = nn.ModuleList(nn.Module() for _ in range(2))
        for b in self.layers:
            b.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x) * self.scale
        for b in self.layers:
            x = b.fc(x)
        return self.head(x)


def _plain_state(m: nn.Module) -> dict[str, tuple]:
    """Every tensor that is not a sharded weight: its class, dtype, device and bytes."""
    out = {}
    for name, t in [*m.named_parameters(), *m.named_buffers()]:
        if not getattr(type(t), "slot_bound", False):
            out[name] = (type(t), t.dtype, t.device, t.detach().clone())
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k][:3] == b[k][:3] and torch.equal(a[k][3].view(torch.uint8), b[k][3].view(torch.uint8)) for k in a)


REFUSED = {
    "half": lambda m: m.half(),
    "float16 by to": lambda m: m.to(torch.float16),
    "float64 by to": lambda m: m.to(dtype=torch.float64),
    "bfloat16": lambda m: m.bfloat16(),
    "double": lambda m: m.double(),
    "type": lambda m: m.type(torch.float16),
    "meta": lambda m: m.to("meta"),
    "to_empty": lambda m: m.to_empty(device="cpu"),
    "share_memory": lambda m: m.share_memory(),
    "load_state_dict": lambda m: m.load_state_dict(Normed(seed=5).state_dict()),
    "load_state_dict, not strict": lambda m: m.load_state_dict(
        {k: v for k, v in Normed(seed=5).state_dict().items() if k != "head.bias"}, strict=False),
}


@pytest.mark.parametrize("call", sorted(REFUSED))
def test_a_refused_call_changes_nothing(call):
    m = Normed()
    ws = shard_blocks(m, "layers", ["fc"], Loopback())
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = m(x)
    before = _plain_state(m)
    with pytest.raises(ShardingError, match="layer 0 fc.weight"):
        REFUSED[call](m)
    assert _same(_plain_state(m), before), call
    assert [b.fc.weight.dtype for b in m.layers] == [torch.float32, torch.float32]
    with torch.no_grad():
        assert torch.equal(m(x), want)
    ws.close()


def test_a_call_on_a_part_of_the_model_is_checked_there_and_one_that_changes_nothing_runs():
    m = Normed()
    ws = shard_blocks(m, "layers", ["fc"], Loopback())
    before = _plain_state(m)
    with pytest.raises(ShardingError, match="layer 1 fc.weight"):
        m.layers[1].half()  # the block alone: its bias is not converted first
    assert _same(_plain_state(m), before)
    m.float()  # float32 already: a no-op on every weight, sharded or not
    m.to("cpu")
    m.norm.half()  # no sharded weight below it: converted as usual
    assert m.norm.weight.dtype == torch.float16
    ws.close()
