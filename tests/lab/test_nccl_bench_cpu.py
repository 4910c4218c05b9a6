"""``wsharding bench allgather`` on CPU (the gloo variant, labelled emulated), the merge of
per-rank rows, the figures from the kept GPU run, and the benchmark widget."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest

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
