"""The seed-shaped decoder: sharded output equals replicated output bit for bit on CPU ranks."""

from __future__ import annotations

import pytest

from wsharding.models import PRESETS
from wsharding.models.equality import model_equality

# steps x ranks: different token counts per rank and per step, one idle rank in step 2
COUNTS = [[3, 5, 1, 7], [6, 2, 4, 1], [0, 3, 2, 5], [1, 1, 8, 2]]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("lookahead", [True, False])
def test_sharded_decoder_equals_replicated(cluster_of, n, lookahead):
    cfg = PRESETS["tiny"]
    results = cluster_of(n).run(model_equality, "tiny", COUNTS, lookahead=lookahead)
    sharded_layers = list(range(1, cfg.layers))
    per_layer = cfg.sharded_bytes_per_layer()
    for r in results:
        expected_equal = [None if COUNTS[s][r["rank"]] == 0 else True for s in range(len(COUNTS))]
        assert r["equal"] == expected_equal, r
        assert r["max_abs_diff"] == 0.0
        assert r["sharded_layers"] == sharded_layers
        # exactly one gather and one wait per sharded layer per step, idle steps included
        assert r["gathers"] == [len(sharded_layers)] * len(COUNTS)
        assert r["waits"] == [len(sharded_layers)] * len(COUNTS)
        assert r["replicated_bytes"] == per_layer * len(sharded_layers)
        # resident bytes measured from the storages == R/N + padding/N + 2 slots, exactly
        total = -(-per_layer // (16 * n)) * 16 * n  # every target is a multiple of 16 B: tail padding only
        assert r["layout_bytes"] == [total] * len(sharded_layers)
        assert r["resident_bytes"] == r["formula_bytes"] == len(sharded_layers) * total // n + 2 * total
        assert r["slot_bytes"] == total
        # the KV-cache comparison counts the sharded model as the replicated one, less R, plus what it holds
        mb = r["model_bytes"]
        assert mb["sharded"] == mb["replicated"] - r["replicated_bytes"] + r["resident_bytes"]
