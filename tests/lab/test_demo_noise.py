"""On CPU ranks the demo's times and process-level peaks are noise at its size ([Note: CPU ranks measure
noise] in wsharding.lab.demo): it says so once, prints every step-time ratio with the interval its
paired rounds give, and holds a measured peak against the bound only where both count tensor bytes."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

from wsharding.lab import demo
from wsharding.lab.bench.paired import paired_ratio

ROOT = Path(__file__).resolve().parents[2]
CPU_REPORT = json.loads((ROOT / "figures" / "demo_cpu_report.json").read_text())
#: a ratio with its interval: "2.08x (1.63x .. 2.34x holds the median with 75%)"
WITH_INTERVAL = re.compile(r"\d+\.\d+x \(\d+\.\d+x \.\. \d+\.\d+x holds the median with \d+%\)")


def _gpu_report() -> dict:
    """The saved CPU report as ranks on GPUs would write it: CUDA-allocator peaks, no CPU mode."""
    r = copy.deepcopy(CPU_REPORT)
    r["mode"], r["emulation"] = "gpu-nccl", ""
    for rank in r["load_peak_per_rank"]:
        rank["device_is_host"] = False
    return r


def test_cpu_ranks_say_once_that_times_and_peaks_are_noise():
    lines = demo.format_table(CPU_REPORT).splitlines()
    assert lines.count(f"  NOTE: {demo.CPU_NOISE_NOTE}") == 1
    assert demo.CPU_NOISE_NOTE not in demo.format_table(_gpu_report())


def test_every_ratio_comes_with_its_interval():
    """Two CPU runs gave 2.38x and 0.66x: a ratio printed alone reads as a result."""
    for report in (CPU_REPORT, _gpu_report()):
        text = demo.format_table(report)
        assert len(WITH_INTERVAL.findall(text)) == 3  # sharded, no lookahead, and the slowest rank's
        assert not re.search(r"\d\.\d+x", WITH_INTERVAL.sub("", text)), "a ratio printed without its interval"
    s = CPU_REPORT["step_ms_samples"]
    expected = paired_ratio(s["sharded"], s["replicated"]).text()
    assert f"sharded / replicated {expected}" in demo.format_table(CPU_REPORT)


def test_a_report_without_rounds_prints_no_ratio():
    r = copy.deepcopy(CPU_REPORT)
    del r["step_ms_samples"], r["step_ms_samples_slowest_rank"]
    assert not re.search(r"\d\.\d+x", demo.format_table(r))


def test_the_peak_is_held_against_the_bound_only_where_both_count_tensor_bytes():
    cpu = [line for line in demo.format_table(CPU_REPORT).splitlines() if line.startswith("  finalize")]
    assert len(cpu) == 1 and "finalize peak" not in cpu[0] and "not comparable" in cpu[0]
    assert cpu[0].startswith("  finalize bound R/N + slots + one weight")
    gpu = [line for line in demo.format_table(_gpu_report()).splitlines() if line.startswith("  finalize")]
    assert len(gpu) == 1 and gpu[0].startswith("  finalize peak per rank (max, measured)") and "bound" in gpu[0]


def test_the_summary_keeps_the_slowest_rank_per_round():
    assert set(CPU_REPORT["step_ms_samples_slowest_rank"]) == set(demo.TIMED_VARIANTS)
    assert all(len(v) == len(CPU_REPORT["step_ms_samples"]["sharded"])
               for v in CPU_REPORT["step_ms_samples_slowest_rank"].values())
