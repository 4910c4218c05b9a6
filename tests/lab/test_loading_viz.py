"""Notebook 04's figures draw what load_variant returned (one bar per rank and weight, one step per
finalize stage), labelled as emulated on CPU ranks."""

from __future__ import annotations

from wsharding.lab.tasks.loading import load_variant
from wsharding.lab.viz.loading import finalize_figure, row_reads_figure, variants_figure


def test_loading_figures(cluster_of, tmp_path):
    c = cluster_of(2)
    res = {v: c.run(load_variant, "tiny", v, str(tmp_path / f"{v}.safetensors"), [[2, 1]], layers=3)
           for v in ("bf16", "fp8_block")}
    fig = row_reads_figure(res["bf16"], layer=1)
    assert len(fig.data) == 2 * 6  # 2 ranks x 6 targets
    assert [tuple(b.base) for b in fig.data[:6]] == [(0,)] * 6 and fig.data[6].base[0] > 0  # rank 1 starts at R/2
    assert "(emulated)" in fig.layout.title.text
    f = finalize_figure(res["bf16"][0])
    stages = res["bf16"][0]["finalize_steps"]
    assert len(f.data[0].x) == len(stages) == 2 + 3 * 2  # loaded, slots, then 3 stages per sharded layer
    blk = finalize_figure(res["fp8_block"][0])
    assert "requant_then_shard" in blk.layout.title.text
    v = variants_figure(res)
    assert list(v.data[0].x) == ["bf16", "fp8_block"] and len(v.data) == 5
