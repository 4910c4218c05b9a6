"""A torchrun job reaches the same code through env:// (CPU ranks with gloo here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_torchrun_example_shards_and_matches(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # --standalone: the launcher's own store binds port 0 (no free-port guess that another process can take)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "examples" / "torchrun_shard.py"), "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    # Each rank writes its own file: two ranks' stdout lines may interleave, files cannot.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.json", "rank1.json"]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in reports] == [0, 1]
    for r in reports:
        assert r["equal"] and r["world_size"] == 2 and r["mode"] == "cpu-gloo" and "emulated" in r["emulation"]
        assert r["gathers_per_step"] == 3 and r["targets"] == 3 * 6
