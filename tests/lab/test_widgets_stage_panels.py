"""The panels of notebooks 04 and 08 run their stage live: thin wrappers over ``loading_view`` and
``bench_view``, called here directly and through their buttons."""

from __future__ import annotations

import pytest

from wsharding.core.errors import InvalidArgument
from wsharding.lab.widgets.bench import bench_view, build_bench_panel
from wsharding.lab.widgets.loading import build_loading_panel, loading_view


def test_loading_view_loads_a_variant_and_draws_one_rank(cluster_of, tmp_path):
    view = loading_view(cluster_of(2), "tiny", "int8", tmp_path, [[3, 2]], rank=1)
    assert len(view.results) == 2 and view.rank == 1
    assert view.results[1]["equal"] == [True]
    assert "int8 on 2 ranks, rank 1: peak held" in view.text()
    assert view.figure.data  # finalize_figure of rank 1
    with pytest.raises(InvalidArgument, match="variant"):
        loading_view(cluster_of(2), "tiny", "fp4", tmp_path, [[1, 1]])
    with pytest.raises(InvalidArgument, match="rank: 5"):
        loading_view(cluster_of(2), "tiny", "bf16", tmp_path, [[1, 1]], rank=5)


def test_the_loading_panel_shows_its_run_or_its_error(cluster_of, tmp_path):
    panel = build_loading_panel(cluster_of(2), "tiny", tmp_path, [[2, 1]])
    panel.variant.value = "bf16"
    panel.run_button.click()
    assert panel.error == "" and panel.view is not None and panel.view.variant == "bf16"


def test_bench_view_times_the_variants_and_the_panel_wraps_it(cluster_of):
    view = bench_view(cluster_of(2), "tiny-blocks", [1], steps=1)
    assert [row["tokens_per_rank"] for row in view.report["rows"]] == [1]
    assert all(row["equal"] for row in view.report["rows"])
    assert view.text().startswith("mode: ") and view.figure.data
    assert "1 tokens/rank: " in view.text()  # on CPU ranks the panel says whether its rounds name a side

    with pytest.raises(InvalidArgument, match="tokens"):
        bench_view(cluster_of(2), "tiny-blocks", [])
    panel = build_bench_panel(cluster_of(2), "tiny-blocks", tokens=(1, 4))
    panel.tokens.value = (1,)
    panel.steps.value = 1
    panel.run_button.click()
    assert panel.error == "" and panel.runs == 1


def test_the_bench_panel_names_a_side_only_where_no_round_overlaps():
    from wsharding.lab.widgets.bench import side_lines

    rows = [{"tokens_per_rank": 1, "sharded_min": 5.0, "sharded_max": 6.0, "replicated_min": 2.0, "replicated_max": 3.0},
            {"tokens_per_rank": 16, "sharded_min": 2.0, "sharded_max": 6.0, "replicated_min": 3.0, "replicated_max": 4.0}]
    assert side_lines({"rows": rows}) == [
        "1 tokens/rank: every round of replicated beat every round of sharded",
        "16 tokens/rank: the rounds of sharded and replicated overlap: noise decides which is faster "
        "(more timed steps may tell)"]
