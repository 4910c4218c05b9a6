"""``wsharding bench allgather`` on CPU (the gloo variant, labelled emulated), the merge of
per-rank rows, the figures from the kept GPU run, and the benchmark widget."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest

from wsharding.core.errors import NotFound
from wsharding.lab.bench import allgather as A
from wsharding.lab.viz import comm as V
from wsharding.lab.widgets.comm import build_allgather_panel, parse_sizes, run_allgather_panel

MiB = 1 << 20


def test_merge_takes_slowest_rank_and_exact_bandwidth():
    rows = lambda t, bad: [{"impl": "x", "size_bytes": 4 * MiB, "time_ms": t, "mismatched_bytes": bad}]  # noqa: E731
    (m,) = A.merge([{"rows": rows(1.0, 0)}, {"rows": rows(2.0, 3)}], world=4)
    assert m["time_ms"] == 2.0 and m["mismatched_bytes"] == 3
    assert m["algbw_GBps"] == 4 * MiB / 2e-3 / 1e9
    assert m["busbw_GBps"] == 0.75 * 4 * MiB / 2e-3 / 1e9


def test_cpu_variant_is_exact_and_labelled(cluster_of):
    result = A.run_cpu(2, [0.0625, 0.25], iters=2, cluster=cluster_of(2))
    assert [r["mismatched_bytes"] for r in result["rows"]] == [0, 0]
    assert [r["size_bytes"] for r in result["rows"]] == [65536, 262144]
    assert result["mode"] == "cpu-gloo" and "emulated" in result["emulation"] and "needs CUDA" in result["emulation"]
    assert "NOTE: emulated" in A.format_table(result)


def test_cli_on_cpu_says_gpu_path_needs_cuda(capsys, tmp_path):
    from wsharding.lab.cli import main

    out = tmp_path / "ag.json"
    assert main(["bench", "allgather", "--ranks", "2", "--sizes", "0.0625", "--iters", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "needs CUDA" in text and "not GPU timings" in text
    assert json.loads(out.read_text())["rows"][0]["mismatched_bytes"] == 0


KEPT = sorted(glob.glob(str(Path(__file__).resolve().parents[2] / "figures" / "allgather_h200_*ranks-1gpu_*.json")))


@pytest.mark.parametrize("path", KEPT)
def test_kept_gpu_run_figures(path):
    result = V.load_result(path)
    assert result["mode"] == "gpu-nccl-shared" and "NVIDIA H200" in result["machine"]
    assert all(r["mismatched_bytes"] == 0 for r in result["rows"])
    assert {r["impl"] for r in result["rows"]} == {"nccl-ce (policy 2)", "nccl-sm (policy 0)", "torch.distributed"}
    assert all(c["2"]["copy_engine"] is True and c["0"]["copy_engine"] is False for c in result["ce_check"].values())
    fig = V.allgather_bandwidth_figure(result)
    assert len(fig.data) == 3
    assert result["machine"] in fig.layout.title.text and result["date"][:10] in fig.layout.title.text
    assert "several ranks time-slice one GPU" in fig.layout.title.text


def test_kept_runs_exist():
    assert len(KEPT) == 2


def test_collective_bytes():
    b = V.collective_bytes(367_000_000, tokens=64, hidden=7168, n=8)
    assert b["allgather_weights"] == 7 / 8 * 367_000_000
    assert b["allreduce_activations"] == 2 * 7 / 8 * 64 * 7168 * 2
    assert V.collective_bytes(367_000_000, 4096, 7168, 8)["allgather_weights"] == b["allgather_weights"]


def test_widget_runs_cpu_variant(cluster_of):
    c = cluster_of(2)
    assert parse_sizes("1, 0.5") == [1.0, 0.5]
    with pytest.raises(ValueError, match="'x' is not a number"):
        parse_sizes("1, x")
    result, fig = run_allgather_panel(2, [0.0625], cluster=c, iters=1)
    assert result["rows"][0]["mismatched_bytes"] == 0 and fig.data[0].name == "torch.distributed gloo (CPU)"
    panel = build_allgather_panel(c)
    panel.sizes.value = "0.0625"
    panel.run_button.click()
    assert panel.result["rows"][0]["size_bytes"] == 65536 and "emulated" in panel.status.value
    panel.sizes.value = "-1"
    panel.run_button.click()
    assert "every value must be more than 0 MiB" in panel.status.value


# ---- the figures of notebook 02 --------------------------------------------------------------------


def test_crossover_tokens_is_the_first_count_where_the_allreduce_moves_more():
    S, hidden, n = 367_000_000, 7168, 8
    t = V.crossover_tokens(S, hidden, n)
    assert t == 12_800  # S / (2 * 7168 * 2) = 12,799.94
    more = lambda tokens: V.collective_bytes(S, tokens, hidden, n)["allreduce_activations"] > (  # noqa: E731
        V.collective_bytes(S, tokens, hidden, n)["allgather_weights"])
    assert more(t) and not more(t - 1)
    assert V.crossover_tokens(28_672 * 10, hidden, 4) == 11  # an exact multiple: equal bytes are not "more"
    with pytest.raises(ValueError, match="N >= 2"):
        V.crossover_tokens(S, hidden, 1)


def test_gather_vs_allreduce_figure_speaks_one_unit_and_marks_the_crossover():
    fig = V.gather_vs_allreduce_figure(367_000_000, 7168, 8, [1, 16, 256, 4096, 65536])
    assert "S = 367 MB" in fig.layout.title.text and "MiB" not in fig.layout.title.text
    assert fig.layout.yaxis.title.text == "MB per rank per layer"
    assert fig.data[0].y[0] == pytest.approx(321.125)
    assert fig.layout.shapes[0].x0 == 12_800
    assert any("12,800 tokens" in a.text for a in fig.layout.annotations)
    # plain labels on both log axes: 0.1 reads "0.1", never a lone digit for an in-between tick
    assert "0.1" in fig.layout.yaxis.ticktext and "1,000" in fig.layout.xaxis.ticktext


def test_plain_log_ticks():
    vals, text = V.plain_log_ticks(0.4, 30)
    assert text == ["0.2", "0.5", "1", "2", "5", "10", "20", "50"]
    assert vals[1] == 0.5
    vals, text = V.plain_log_ticks(1, 16384)  # many decades: powers of ten only
    assert text == ["1", "10", "100", "1,000", "10,000"]
    with pytest.raises(ValueError):
        V.plain_log_ticks(0, 1)


def test_cpu_run_figure_draws_the_spread_and_says_it_is_noise():
    rows = [{"impl": "torch.distributed gloo (CPU)", "size_bytes": int(m * MiB), "time_ms": t, "time_min_ms": t / 2,
             "time_max_ms": 3 * t, "reps": 3, "mismatched_bytes": 0, "busbw_GBps": m * MiB / 2 / t / 1e6}
            for m, t in ((0.25, 1.0), (1, 2.0), (4, 20.0))]
    result = {"machine": "CPU", "date": "2026-12-02", "mode": "cpu-gloo", "world_size": 2, "rows": rows,
              "emulation": "emulated: gloo"}
    fig = V.allgather_bandwidth_figure(result)
    (trace,) = fig.data
    assert list(trace.error_y.array) == pytest.approx([r["busbw_GBps"] for r in rows])  # fastest repeat: 2x
    assert list(trace.error_y.arrayminus) == pytest.approx([r["busbw_GBps"] * 2 / 3 for r in rows])
    assert "noise-bound" in fig.layout.title.text
    assert list(fig.layout.xaxis.ticktext) == ["0.25", "1", "4"]


def test_saved_two_gpu_run_and_its_overlap_figure():
    reports = V.saved_allgather_reports()
    run = V.multi_gpu_allgather(reports)
    assert run["mode"] == "gpu-nccl" and run["ranks_per_gpu"] == 1 and run["world_size"] == 2
    assert "H200" in run["machine"] and all(r["mismatched_bytes"] == 0 for r in run["rows"])
    fig = V.overlap_exposed_figure(run)
    assert run["machine"] in fig.layout.title.text and run["date"][:10] in fig.layout.title.text
    bars = {t.name: list(t.y) for t in fig.data}
    assert bars["nccl-ce (policy 2)"] == [o["exposed_ms"] for o in run["overlap"] if o["impl"] == "nccl-ce (policy 2)"]
    # what notebook 02 teaches: the copy engine's gather hides beside the GEMM, the SM kernels' does not
    for ce, sm in zip(bars["nccl-ce (policy 2)"], bars["nccl-sm (policy 0)"], strict=True):
        assert ce < sm / 3
    assert fig.layout.yaxis.range[1] > max(max(y) for y in bars.values())
    with pytest.raises(NotFound, match="no saved bench allgather report"):
        V.multi_gpu_allgather({k: v for k, v in reports.items() if v["mode"] != "gpu-nccl"})
    with pytest.raises(ValueError, match="--overlap"):
        V.overlap_exposed_figure(dict(run, overlap=[]))
