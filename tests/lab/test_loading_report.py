"""The load numbers in the demo report and in ``wsharding plan``."""

from __future__ import annotations

import json
import subprocess
import sys

from wsharding.lab.demo import demo_rank, format_table, summarize


def test_demo_reports_the_finalize_peak_within_its_bound(cluster_of):
    counts = [[3, 2], [1, 0]]
    reports = cluster_of(2).run(demo_rank, "tiny", counts, timed_steps=1)
    report = summarize(reports, "tiny", 2)
    for r, load in zip(reports, report["load_peak_per_rank"], strict=True):
        assert load["device_is_host"] and load["host_exact"]  # CPU ranks: labelled as the resident set
        assert load["bound_bytes"] == r["formula_bytes"] + load["largest_weight_bytes"]
        assert load["held_bytes"] == r["replicated_bytes"] // 2  # the row shards before finalize
        # the tiny preset's weights are KiBs: a resident-set peak is dominated by the process itself
        # here (code pages touched for the first time); tests/loading/test_loading_peaks.py checks the bound
        assert load["device_peak_bytes"] >= load["held_bytes"]
    # CPU ranks: a resident set is not compared with a bound of tensor bytes, only shown beside it
    assert "finalize peak per rank (max, measured)" not in format_table(report)
    assert "resident set, up to" in format_table(report) and "not comparable" in format_table(report)
    # ranks sharing one GPU are emulated as well, but their peak is the CUDA allocator's: compared, no such note
    on_gpu = dict(report, load_peak_per_rank=[dict(load, device_is_host=False) for load in report["load_peak_per_rank"]])
    assert on_gpu["emulation"] and "resident set, up to" not in format_table(on_gpu)
    assert "finalize peak per rank (max, measured)" in format_table(on_gpu)
    # lookahead against no lookahead, paired round by round over the demo's rounds (3 on CPU ranks)
    assert report["lookahead_vs_off"]["rounds"] == len(report["step_ms_samples"]["sharded"]) == 3
    assert "lookahead - no lookahead: " in format_table(report)
    # the ratios are against the replicated ranks' mean; the slowest rank's are printed beside them
    for variant, ms in report["step_ms"].items():
        per_rank = [r[variant] for r in report["step_ms_per_rank"]]
        assert ms == sum(per_rank) / 2 and report["step_ms_slowest_rank"][variant] == max(per_rank)
    slow = report["step_ms_slowest_rank"]
    assert (f"slowest rank: replicated {slow['replicated']:.3f} ms | sharded {slow['sharded']:.3f} ms, "
            "sharded / replicated ") in format_table(report)  # a ratio only with its interval


def test_plan_reports_load_peaks():
    out = subprocess.run([sys.executable, "-m", "wsharding.lab.plan", "--preset", "kimi-k3-b200-fp8", "--json"],
                         capture_output=True, text=True, check=True).stdout
    d = json.loads(out)
    w = d["largest_weight_bytes"]
    assert d["load_peak_device_bytes"] == d["resident_shard_bytes"] + d["slot_bytes"] + w
    assert d["load_peak_device_requant_then_shard_bytes"] == d["replicated_bytes"] + d["resident_shard_bytes"] + \
        d["slot_bytes"]
    assert d["load_peak_host_bytes"] == d["resident_shard_bytes"] + w
    # the largest single weight is a layer's KDA projections: the preset splits its 28.50 GiB over the 69 KDA
    # layers as evenly as whole bytes allow, so the largest share is the quotient rounded up (the MoE
    # peripherals, 183.5e6 B per layer, are smaller)
    assert w == -(-int(28.5 * 2**30) // 69) == 443_502_058


def test_progress_only_on_rank_0_on_a_terminal_outside_ci(monkeypatch):
    import sys

    from wsharding.checkpoint import show_progress

    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert show_progress(0) and not show_progress(1)
    monkeypatch.setenv("CI", "true")
    assert not show_progress(0)  # quiet in CI logs
    monkeypatch.delenv("CI")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert not show_progress(0)  # and when stderr is a file


def test_progress_bar_when_asked(tmp_path, capsys):
    from wsharding.checkpoint import load_checkpoint, save_checkpoint
    from wsharding.models import PRESETS, ToyDecoder

    cfg = PRESETS["tiny"].with_(layers=2)
    save_checkpoint(ToyDecoder(cfg), tmp_path / "c.safetensors")
    load_checkpoint(ToyDecoder(cfg), tmp_path / "c.safetensors", progress=True)
    assert "loading c.safetensors" in capsys.readouterr().err
    load_checkpoint(ToyDecoder(cfg), tmp_path / "c.safetensors", progress=False)
    assert capsys.readouterr().err == ""
