"""The three quant variants sharded on 2 CPU ranks, loaded from a quantized checkpoint: outputs bit
for bit equal to the same quantized model replicated; weight bytes in the layout, scales replicated;
rows read exactly as each variant's loading path says."""

from __future__ import annotations

import pytest

from wsharding.lab.tasks.loading import load_variant

COUNTS = [[5, 3], [2, 0], [7, 4]]  # rank 1 idle in step 1


@pytest.mark.parametrize("variant", ["int8", "fp8", "fp8_block"])
def test_quant_variant_sharded_equals_replicated(cluster_of, tmp_path, variant):
    n = 2
    results = cluster_of(n).run(load_variant, "tiny", variant, str(tmp_path / f"{variant}.safetensors"), COUNTS)
    for r in results:
        assert r["emulation"]  # CPU ranks say so
        assert r["max_abs_diff"] == 0.0
        assert r["equal"] == ([True, True, True] if r["rank"] == 0 else [True, None, True])
        # the layout holds only the quantized weight bytes (1 byte each); the scales stay outside
        assert r["layout_payload_bytes"] == r["replicated_bytes"]
        assert r["replicated_bytes"] == sum(x["rows"] * x["row_bytes"] for x in r["reads"])
        assert all(x["row_bytes"] == 96 or x["row_bytes"] == 48 for x in r["reads"])  # in=96 or 48, 1 B each
        assert r["replicated_scale_bytes"] > 0
        assert r["resident_bytes"] == r["formula_bytes"]
        for x in r["reads"]:
            if variant == "fp8_block":  # requant-then-shard: the whole weight is loaded
                assert x["mode"] == "requant_then_shard" and x["loaded_rows"] == x["rows"]
            else:  # only this rank's rows
                assert x["mode"] == "rows" and x["loaded_rows"] == x["rows"] // n
                assert x["window"] == [r["rank"] * x["rows"] // n, (r["rank"] + 1) * x["rows"] // n]
        read = sum(x["loaded_rows"] * x["row_bytes"] for x in r["reads"])
        assert r["counts"]["sharded_bytes_read"] == read
        assert read == (r["replicated_bytes"] if variant == "fp8_block" else r["replicated_bytes"] // n)
    if variant == "fp8_block":
        assert results[0]["quant_block"] == 48  # 128 does not divide the tiny preset's dims
