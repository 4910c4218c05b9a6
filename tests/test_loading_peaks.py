"""Load peaks on CPU ranks, checked against bounds computed here from the config alone.

Row-shard loading (BF16, ModelOpt FP8): R/N <= peak <= R/N + padding/N + two slots + one tensor (the
largest tensor read whole, or one weight gathered at finalize). Block FP8 is requant-then-shard:
its peak is not reduced (>= R, above the row-shard bound). On CPU ranks the device is host memory:
the numbers are the resident set, and say so."""

from __future__ import annotations

import math

import pytest
from safetensors import safe_open

from wsharding.lab.tasks.loading import load_variant, variant_config

N = 2
ITEMSIZE = {"F8_E4M3": 1, "I8": 1, "BF16": 2, "F16": 2, "F32": 4}
COUNTS = [[3, 2]]


def bill(cfg, itemsize: int) -> dict[str, int]:
    """R, the two slots and the sum of the chunks, by hand: entries 16-byte aligned, layer padded to 16 N."""
    h, q, kv = cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    shapes = [(q + 2 * kv, h), (h, q), (cfg.latent, h), (h, cfg.latent), (2 * cfg.shared_inter, h),
              (h, cfg.shared_inter)]
    end = 0
    for r, c in shapes:
        end = -(-end // 16) * 16 + r * c * itemsize
    total = -(-end // (16 * N)) * 16 * N
    layers = cfg.layers - 1
    payload = sum(r * c for r, c in shapes) * itemsize
    return {"R": payload * layers, "chunks": total // N * layers, "slots": 2 * total}


@pytest.mark.parametrize("variant, itemsize", [("bf16", 2), ("fp8", 1), ("fp8_block", 1)])
def test_load_peak_within_bounds(cluster_of, tmp_path, variant, itemsize):
    path = tmp_path / f"{variant}.safetensors"
    results = cluster_of(N).run(load_variant, "small", variant, str(path), COUNTS)
    b = bill(variant_config("small", variant), itemsize)
    with safe_open(str(path), framework="pt") as f:  # the largest tensor of the file (safetensors' own reader)
        largest = max(math.prod(f.get_slice(k).get_shape()) * ITEMSIZE[f.get_slice(k).get_dtype()] for k in f.keys())
    row_bound = b["chunks"] + b["slots"] + largest  # R/N + padding/N + two slots + one tensor
    for r in results:
        p = r["load_peak"]
        assert r["equal"] == [True]
        assert r["replicated_bytes"] == b["R"] and r["formula_bytes"] == b["chunks"] + b["slots"]
        assert p["device_is_host"] and p["host_exact"] and p["device_peak_bytes"] == p["host_peak_bytes"]
        if variant == "fp8_block":
            assert p["held_bytes"] == b["R"]  # full-shape weights before finalize
            assert p["device_peak_bytes"] >= b["R"]  # not reduced ...
            assert p["device_peak_bytes"] > row_bound  # ... and above what row-shard loading needs
        else:
            assert p["held_bytes"] == b["R"] // N  # only this rank's rows exist before finalize
            assert b["R"] // N <= p["device_peak_bytes"] <= row_bound
