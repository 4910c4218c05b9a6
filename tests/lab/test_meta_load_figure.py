"""The start-up peak figure draws the bench's numbers as they are: built whole against built on meta."""

from __future__ import annotations

from wsharding.core.units import MiB
from wsharding.lab.bench.load import load_peak_rank
from wsharding.lab.viz.meta_load import meta_load_figure


def test_meta_load_figure_draws_each_rank_whole_against_meta(cluster_of, tmp_path):
    results = cluster_of(2).run(load_peak_rank, "tiny-blocks", str(tmp_path / "m.safetensors"), 4, comm="torch")
    for r in results:  # exact byte counts: R whole before the read, R/N of it on meta
        assert r["whole"]["load_peak"] == r["whole"]["replicated"] + r["whole"]["rest"]
        assert r["meta"]["load_peak"] == r["meta"]["replicated"] // 2 + r["meta"]["rest"]
    fig = meta_load_figure(results)
    whole, meta, big_r, bound = fig.data
    assert list(whole.y) == [r["whole"]["load_peak"] / MiB for r in results]
    assert list(meta.y) == [r["meta"]["load_peak"] / MiB for r in results]
    assert big_r.y[0] == results[0]["whole"]["replicated"] / MiB and bound.y[0] == results[0]["whole"]["bound"] / MiB
    assert "emulated" in fig.layout.title.text and "exact" in fig.layout.title.text
