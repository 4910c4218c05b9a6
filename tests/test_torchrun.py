"""A torchrun job reaches the same code through env:// (CPU ranks with gloo here)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_torchrun_example_shards_and_matches():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={port}", str(ROOT / "examples" / "torchrun_shard.py")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = sorted((json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")), key=lambda r: r["rank"])
    assert [r["rank"] for r in lines] == [0, 1]
    for r in lines:
        assert r["equal"] and r["world_size"] == 2 and r["mode"] == "cpu-gloo" and "emulated" in r["emulation"]
        assert r["gathers_per_step"] == 3 and r["targets"] == 3 * 6
