"""Will it fit: the need per rank counted from the model's shapes, the refusal before any rank
starts (demo) or any task runs (the planner panel), and the demo's output kept out of the checkout."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import subprocess
import time
from pathlib import Path

import pytest

from wsharding.core.units import GiB
from wsharding.lab import demo, memory
from wsharding.lab.cluster import RankCluster
from wsharding.lab.memory import (
    CPU_RANK_BASE,
    MemoryCheckError,
    check_demo_fits,
    check_fits,
    demo_need_per_rank,
    model_bytes,
)
from wsharding.lab.widgets.planner import planner_view
from wsharding.models import PRESETS, ToyDecoder

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_model_bytes_equal_the_built_model(preset):
    cfg = PRESETS[preset]
    model = ToyDecoder(cfg, seed=0)
    params = list(model.parameters())
    mb = model_bytes(cfg)
    assert mb.replicated == sum(p.numel() * p.element_size() for p in params)
    assert mb.max_param_numel == max(p.numel() for p in params)
    assert mb.sharded_targets == (cfg.layers - 1) * cfg.sharded_bytes_per_layer()
    # N = 1 keeps everything plus two slots
    assert mb.sharded_resident(1) == mb.replicated + 2 * cfg.sharded_bytes_per_layer()


def test_demo_need_is_base_plus_both_models_plus_the_build_peak():
    mb = model_bytes(PRESETS["small"])
    need = demo_need_per_rank("small", 4)
    assert need == CPU_RANK_BASE + mb.replicated + mb.sharded_resident(4) + mb.max_layer_targets + 4 * mb.max_param_numel
    # the case: k3-like on 4 CPU ranks does not fit in 24 GB
    assert 4 * demo_need_per_rank("k3-like", 4) > 24e9


def test_refusal_names_need_have_and_what_to_pass():
    with pytest.raises(MemoryCheckError) as info:
        check_demo_fits("k3-like", 4, [None] * 4, have=30 * GiB)
    msg = str(info.value)
    need = demo_need_per_rank("k3-like", 4)
    assert msg.startswith(f"demo --preset k3-like on 4 ranks needs about 4 x {need / GiB:.1f} GiB = {4 * need / GiB:.1f} GiB")
    assert "this machine has 30.0 GiB available (given)" in msg
    assert msg.endswith("Pass --ranks 2 or --preset small instead.")
    assert 2 * demo_need_per_rank("k3-like", 2) <= 30 * GiB < 3 * demo_need_per_rank("k3-like", 3)
    with pytest.raises(MemoryCheckError, match="No preset fits on this machine at all"):
        check_demo_fits("tiny", 2, [None, None], have=1)
    check_demo_fits("tiny-deep", 4, [None] * 4, have=2 * GiB)  # fits: no error


def test_gpu_ranks_add_up_per_gpu(monkeypatch):
    monkeypatch.setattr(memory, "gpu_available", lambda index: {0: 10 * GiB, 1: 3 * GiB}[index])
    check_fits(4 * GiB, 2, what="x", device_indices=[0, 0])  # 8 of 10 GiB on GPU 0
    with pytest.raises(MemoryCheckError, match=r"x needs about 1 x 4.0 GiB = 4.0 GiB on GPU 1; it has 3.0 GiB free"):
        check_fits(4 * GiB, 2, what="x", device_indices=[0, 1])
    with pytest.raises(MemoryCheckError, match=r"3 x 4.0 GiB = 12.0 GiB on GPU 0"):
        check_fits(4 * GiB, 3, what="x", device_indices=[0, 0, 0])


def test_cpu_available_reads_meminfo():
    have, source = memory.cpu_available()
    meminfo = Path("/proc/meminfo").read_text()
    avail = int(meminfo.split("MemAvailable:")[1].split()[0]) * 1024
    assert 0 < have and (source.startswith("MemAvailable") and abs(have - avail) < 2**30 or "cgroup" in source)


def _demo_args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    return p.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_demo_refuses_before_starting_ranks(monkeypatch, capsys):
    monkeypatch.setattr(memory, "cpu_available", lambda: (8 * GiB, "MemAvailable in /proc/meminfo"))
    # the session's shared clusters (conftest) may be running: only new rank processes count
    before = {p.pid for p in mp.active_children()}
    t0 = time.monotonic()
    assert demo.main(_demo_args(preset="k3-like", ranks=4, backend="gloo")) == 2
    assert time.monotonic() - t0 < 5
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs about 4 x" in err and "8.0 GiB available" in err
    assert not [p for p in mp.active_children() if p.name.startswith("wsharding-rank") and p.pid not in before]


def test_planner_panel_refuses_before_running(monkeypatch):
    monkeypatch.setattr(memory, "cpu_available", lambda: (1 * GiB, "MemAvailable in /proc/meminfo"))
    cluster = RankCluster(2, backend="gloo")  # never started: the check comes first
    with pytest.raises(MemoryCheckError, match=r"the sharded k3-like \(12 layers\) on 2 ranks needs about 2 x"):
        planner_view(cluster, "k3-like")
    assert cluster.starts == 0


def test_demo_writes_into_an_ignored_folder(tmp_path, monkeypatch):
    args = _demo_args(preset="tiny", ranks=2, backend="gloo", steps=2, timed_steps=1, report=str(tmp_path / "r.json"))
    assert args.figures == "wsharding-out"
    monkeypatch.chdir(tmp_path)
    assert demo.main(args) == 0
    written = sorted(p.name for p in (tmp_path / "wsharding-out").iterdir() if p.suffix == ".html")
    assert written == ["demo_memory.html", "demo_slots.html", "demo_timeline.html", "demo_timeline_no_lookahead.html"]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["outputs_equal"] and report["max_abs_diff"] == 0.0 and report["world_size"] == 2
    # and in a checkout that folder is ignored: a demo run leaves `git status` clean
    probe = subprocess.run(["git", "check-ignore", "-q", "wsharding-out/demo_memory.html"], cwd=ROOT)
    assert probe.returncode == 0


def test_demo_without_plotly_reports_and_skips_the_figures(tmp_path, monkeypatch, capsys):
    """A GPU machine with torch alone (no notebook stack): the run, the table and the report stand;
    the figures are skipped with a line that says why (without the check: ModuleNotFoundError at the end)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(demo.importlib.util, "find_spec", lambda name, *a: None if name == "plotly" else real(name, *a))
    monkeypatch.chdir(tmp_path)
    args = _demo_args(preset="tiny", ranks=2, backend="gloo", steps=2, timed_steps=1, rounds=1,
                      report=str(tmp_path / "r.json"))
    assert demo.main(args) == 0
    out = capsys.readouterr().out
    assert "figures skipped: plotly is not installed" in out and "median of 1 rounds" in out
    assert not (tmp_path / "wsharding-out").exists() and json.loads((tmp_path / "r.json").read_text())["outputs_equal"]


def test_model_bytes_skips_address_only_storages():
    """A mapped pool's layer views own no memory: model_bytes must not count them (the GPU mapped
    tests check the same on real views); a plain pool has none."""
    import torch

    from wsharding.core.slots import SlotPool
    from wsharding.models.kv_cache import model_bytes

    backing = torch.zeros(256)
    m = torch.nn.Linear(8, 8, bias=False)
    m.weight = torch.nn.Parameter(backing[:64].view(8, 8), requires_grad=False)
    assert model_bytes(m) == backing.untyped_storage().nbytes()
    assert model_bytes(m, address_only={backing.untyped_storage().data_ptr()}) == 0
    assert SlotPool.address_only_ptrs(object.__new__(SlotPool)) == set()
