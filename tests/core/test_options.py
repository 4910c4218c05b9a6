"""ShardingOptions (wsharding/core/options.py): checked once, as it is made, each error naming its option;
frozen; what shard_blocks passes to WeightSharding and the planner."""

from __future__ import annotations

import dataclasses

import pytest

from tests.core.test_library_edges import Loopback
from wsharding.core.errors import InvalidArgument, InvalidType, ShardingError
from wsharding.core.options import ShardingOptions
from wsharding.core.sharding import WeightSharding


@pytest.mark.parametrize(("changes", "error", "words"), [
    ({"on_miss": "skip"}, ShardingError, "on_miss must be 'gather' (such a layer is gathered now, warned) or 'raise', "
                                         "got 'skip'"),
    ({"map_own_chunk": "yes"}, ShardingError, "map_own_chunk must be True, False or 'auto', got 'yes'"),
    ({"map_own_chunk": 1}, ShardingError, "map_own_chunk must be True, False or 'auto', got 1"),
    ({"prefetch_depth": 0}, InvalidArgument, "prefetch_depth"),
    ({"lookahead": "no"}, InvalidType, "lookahead: expected True or False, got 'no'"),
    ({"sharded_layers": 1}, ShardingError, "sharded_layers: got the int 1"),
    ({"plugins": object()}, InvalidType, "plugins: expected a list of planner plug-ins"),
])
def test_each_bad_option_is_named_once_as_the_options_are_made(changes, error, words):
    with pytest.raises(error) as e:
        ShardingOptions(**changes)
    assert words in str(e.value)


def test_options_are_frozen_and_normalised():
    o = ShardingOptions(sharded_layers=range(1, 3), plugins=[])
    assert o.sharded_layers == (1, 2) and o.plugins == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.on_miss = "raise"


def test_weight_sharding_takes_options_or_keywords_not_both():
    ws = WeightSharding(Loopback(), options=ShardingOptions(on_miss="raise", lookahead=False))
    assert ws.options.on_miss == "raise" and ws.options.lookahead is False
    with pytest.raises(ShardingError, match="either as one ShardingOptions or as keyword arguments, not both"):
        WeightSharding(Loopback(), on_miss="raise", options=ShardingOptions())
