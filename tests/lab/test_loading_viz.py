"""Notebook 04's figures draw what load_variant returned (one bar per rank and weight, one step per
finalize stage), labelled as emulated on CPU ranks."""

from __future__ import annotations

import pytest

from wsharding.core.errors import InvalidArgument
from wsharding.lab.memory import resident_share
from wsharding.lab.tasks.loading import held_peak_bytes, load_variant
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
    names = [t.name for t in f.data]
    assert any(n.startswith("bound:") for n in names) and any(n.startswith("R:") for n in names)  # in the legend
    bound = next(t for t in f.data if t.name.startswith("bound:"))
    r0 = res["bf16"][0]
    assert bound.y[0] * 2**20 == r0["formula_bytes"] + r0["largest_weight_bytes"]  # the label is on its own line
    v = variants_figure(res)
    assert list(v.data[0].x) == ["bf16", "fp8_block"] and len(v.data) == 6
    assert v.layout.yaxis.type == "log" and all(t != "" for t in v.layout.yaxis.ticktext)  # scales visible
    assert v.layout.xaxis.range[0] <= -0.9  # room for the first bar's label beside the tick labels ("32 MiB20.6 MiB")
    peak, resident = v.data[2], v.data[3]  # like with like: both held (allocated) bytes
    assert peak.y[0] * 2**20 == held_peak_bytes(r0) >= resident.y[0] * 2**20 == r0["resident_bytes"]
    assert peak.y[1] * 2**20 >= res["fp8_block"][0]["replicated_bytes"]  # requant-then-shard: not reduced


def test_resident_share_is_one_over_n_plus_two_slots():
    assert resident_share("small", 2) == 0.9  # 5 sharded layers: the losing example
    assert abs(resident_share("small", 4, layers=12) - (1 / 4 + 2 / 11)) < 1e-3
    with pytest.raises(InvalidArgument):
        resident_share("small", 4, layers=1)
