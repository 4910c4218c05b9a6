"""The step benchmark's rank task and report (structure and exact bytes; timings are never asserted)."""

from __future__ import annotations

import pytest
import torch

from wsharding.lab.bench import step as step_bench
from wsharding.lab.bench.step import format_table, paired_host_us, step_bench_rank, summarize
from wsharding.models import PRESETS
from wsharding.models.blocks import BLOCK_PRESETS


@pytest.mark.parametrize("model", ["tiny", "tiny-blocks"])
def test_step_bench_measures_every_variant(cluster_of, model):
    results = cluster_of(2).run(step_bench_rank, model, [1, 4], steps=1, warmup=1, repeats=2)
    report = summarize(results, model, "torch")
    assert [r["tokens_per_rank"] for r in report["rows"]] == [1, 4]
    assert report["variants"] == ["replicated", "sharded", "sharded_no_lookahead", "sharded_next_step", "fsdp2"]
    for row in report["rows"]:
        assert row["equal"] is True  # sharded == replicated bit for bit, on both paths
        for v in report["variants"]:
            assert row[f"{v}_min"] <= row[v] <= row[f"{v}_max"]
        assert row["sharded_vs_replicated"] == row["sharded"] / row["replicated"]
        # the floor: (N-1)/N of every layer over the bandwidth measured in the same run
        assert row["floor_ms"] > 0 and row["sharded_vs_floor"] == row["sharded"] / row["floor_ms"]
    assert report["planner_host_us_per_layer"] > 0 and report["bus_bandwidth_GBps"] > 0
    # the check at use, per block: the slowest rank's median, printed
    assert report["check_at_use_us"] == max(r["check_at_use_us"] for r in results) > 0
    for row in report["rows"]:  # paired host overhead: median between its quartiles
        assert row["host_overhead_us_per_layer_q1"] <= row["host_overhead_us_per_layer"] <= row["host_overhead_us_per_layer_q3"]
    for i, row in enumerate(report["rows"]):  # lookahead against off, round by round (the slowest rank)
        diffs = sorted(max(r["rows"][i]["sharded"][j] for r in results) - max(r["rows"][i]["sharded_no_lookahead"][j]
                                                                            for r in results) for j in range(2))
        assert row["lookahead_vs_off"]["rounds"] == 2
        assert row["lookahead_vs_off"]["median_ms"] == pytest.approx(sum(diffs) / 2, abs=1e-12)
        assert (row["lookahead_vs_off"]["low_ms"], row["lookahead_vs_off"]["high_ms"]) == (diffs[0], diffs[1])
    text = format_table(report)
    assert "tokens/rank, lookahead - no lookahead: " in text
    assert "host +us/layer: what the sharded forward adds to the host" in text
    assert "emulated" in text and "fsdp2" in text and "floor" in text
    assert f"the check at use (a block's slot holds its own layer, gathered in this step): {report['check_at_use_us']:.3f} us" in text
    assert "sharded_next_step: sharded, with the next step's first gather issued" in text
    # the planner's own calls, timed inside the forwards: the slowest rank's, one value per row
    for i, row in enumerate(report["rows"]):
        assert row["planner_calls_us_per_layer"] == max(r["rows"][i]["planner_calls_us_per_layer"] for r in results)
        assert sorted(row["planner_calls_us_per_layer_by_call"]) == sorted(
            ["begin_step", "block_start", "block_end", "ensure", "end_step", "finish_step"])
        # CPU ranks: no backpressure to wait in, and no GPU to drain
        assert row["planner_calls_us_per_layer_gpu_wait"] == 0.0 and "planner_calls_us_per_layer_drained" not in row
    assert "the planner's and the communicator's own calls, timed inside back-to-back forwards" in text
    assert "on CPU ranks the waits for the gathers included): sharded " in text


def test_step_bench_bytes_are_exact(cluster_of):
    results = cluster_of(2).run(step_bench_rank, "tiny", [1], steps=1, warmup=0, fsdp=False)
    report = summarize(results, "tiny", "torch")
    per_layer = PRESETS["tiny"].sharded_bytes_per_layer()  # a multiple of 32 B: no padding at N = 2
    assert report["replicated_bytes_per_rank"] == 3 * per_layer
    # with only 3 sharded layers the two slots outweigh the saving: R/2 + 2|T| > R
    assert report["sharded_resident_bytes_per_rank"] == 3 * per_layer // 2 + 2 * per_layer
    assert report["variants"] == ["replicated", "sharded", "sharded_no_lookahead", "sharded_next_step"]


def test_blocks_preset_bytes():
    # the FSDP2 baseline's block: q/k/v/o 4096->4096/1024/1024/4096, gate_up 4096->2*14336, down 14336->4096
    assert BLOCK_PRESETS["llama8b-blocks"].bytes_per_block() == 436_207_616


def test_paired_host_us_subtracts_pair_by_pair(monkeypatch):
    # A clock that only the calls advance: the base call takes 2 s, the other 5 s plus a drift that grows
    # every pair (a host slowing down). Pair by pair the difference stays 3 s + the drift of one call.
    clock = [0.0]
    order = []
    monkeypatch.setattr(step_bench.time, "perf_counter", lambda: clock[0])

    def base():
        order.append("base")
        clock[0] += 2.0

    def other():
        order.append("other")
        clock[0] += 5.0

    median, q1, q3 = paired_host_us(base, other, layers=3, pairs=6, device=torch.device("cpu"))
    assert (median, q1, q3) == (1e6, 1e6, 1e6)  # 3 s over 3 layers, in microseconds
    assert order[:4] == ["base", "other", "other", "base"]  # who goes first alternates


def test_saved_gpu_reports_print_the_calls_steady_and_drained():
    # the reports of one H200 (world size 1, and two ranks sharing it): no bandwidth where nothing
    # crosses a link, and the planner's calls printed steady with the drained value in brackets
    import json
    from pathlib import Path

    device = Path(__file__).resolve().parents[2] / "docs" / "measurements" / "h200-2026-12-01"
    one = json.loads((device / "bench_step_h200_1gpu_2026-12-01_llama8b-blocks_steady-calls.json").read_text())
    two = json.loads((device / "bench_step_h200_2ranks-1gpu_2026-12-01_llama8b-blocks_steady-calls.json").read_text())
    assert "no bus bandwidth at world size 1 (nothing crosses a link)" in format_table(one)
    assert f"bus bandwidth {two['bus_bandwidth_GBps']:.1f} GB/s" in format_table(two)
    row = two["rows"][0]
    assert (f"sharded_mapped {row['planner_calls_mapped_us_per_layer']:.1f} "
            f"({row['planner_calls_mapped_us_per_layer_drained']:.1f})") in format_table(two)


def test_bench_step_mapped_variant_on_cpu_ranks_says_why_not(cluster_of):
    from wsharding.lab.bench.step import step_bench_rank

    with pytest.raises(Exception, match="map_own_chunk=True needs our NCCL communicator"):
        cluster_of(2).run(step_bench_rank, "tiny", [1], steps=1, warmup=0, fsdp=False, mapped=True)
