"""The package's own one-line errors where torch's (or none) came before: a model built under
``torch.inference_mode()``, one plug-in passed where a list belongs, a switch given as text. Each is
refused before anything of the model changes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.core.test_library_edges import Loopback
from wsharding.core.errors import InvalidType, ShardingError
from wsharding.core.next_step import NextStepPrefetch
from wsharding.core.runner import shard_blocks
from wsharding.core.sharding import WeightSharding


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Module() for _ in range(2))
        for b in self.layers:
            b.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.layers:
            x = b.fc(x)
        return x


def stack() -> nn.Module:
    return Stack()


def test_a_model_built_under_inference_mode_is_refused_before_anything_changes():
    # torch's "Inference tensors do not track version counter" came from finalize, after every weight shrank.
    with torch.inference_mode():
        m = stack()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ShardingError, match=r"layer 0 fc.weight on rank 0 is an inference tensor .*"
                                            r"torch.inference_mode\(\).*torch.no_grad\(\)"):
        shard_blocks(m, "layers", ["fc"], Loopback())
    after = m.state_dict()
    assert all(torch.equal(after[k], v) and after[k].shape == v.shape for k, v in before.items())


def test_sharding_under_inference_mode_of_a_model_built_outside_it_runs():
    m, ref = stack(), stack()
    ref.load_state_dict(m.state_dict())
    x = torch.randn(3, 8)
    with torch.inference_mode():
        ws = shard_blocks(m, "layers", ["fc"], Loopback())
        got = m(x)
    with torch.no_grad():
        want = ref(x)
    assert torch.equal(got, want)
    ws.close()


@pytest.mark.parametrize("plugins, said", [
    (NextStepPrefetch(), r"got one NextStepPrefetch; pass plugins=\[NextStepPrefetch\(\)\]"),
    ("NextStepPrefetch", "got str"),
    ({"a": 1}, "got dict"),
    ([NextStepPrefetch, 3], "type, int is not a planner plug-in"),
])
def test_plugins_not_a_list_of_plugins_is_refused(plugins, said):
    with pytest.raises(InvalidType, match=said):
        shard_blocks(stack(), "layers", ["fc"], Loopback(), plugins=plugins)
    with pytest.raises(InvalidType, match=said):
        WeightSharding(Loopback(), plugins=plugins)


@pytest.mark.parametrize("option", ["lookahead", "trace", "keep_initial_weights", "verify_replicas"])
@pytest.mark.parametrize("value", ["no", "False", 0, 1, None, 1.0])
def test_a_switch_is_true_or_false(option, value):
    # lookahead="no" was taken as a truth value: on.
    with pytest.raises(InvalidType, match=rf"{option}: expected True or False, got {value!r}"):
        WeightSharding(Loopback(), **{option: value})
    with pytest.raises(InvalidType, match=rf"{option}: expected True or False"):
        shard_blocks(stack(), "layers", ["fc"], Loopback(), **{option: value})


def test_the_planner_s_lookahead_switch_is_true_or_false_too():
    ws = shard_blocks(stack(), "layers", ["fc"], Loopback())
    with pytest.raises(InvalidType, match="lookahead: expected True or False, got 'no'"):
        ws.planner.lookahead = "no"
    assert ws.planner.lookahead is True
    ws.planner.lookahead = False
    assert ws.planner.lookahead is False
    ws.close()
