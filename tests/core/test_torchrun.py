"""A torchrun job reaches the same code through env:// (CPU ranks with gloo here): one node of two
ranks, and two "nodes" of two ranks each on this host (two launchers meeting at a c10d rendezvous)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from wsharding.core.context import RankContext
from wsharding.core.groups import ShardGroupAcrossNodesWarning

ROOT = Path(__file__).resolve().parents[2]


def test_torchrun_example_shards_and_matches(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # --standalone: the launcher's own store binds port 0 (no free-port guess that another process can take)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "examples" / "torchrun_shard.py"), "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "terminate called" not in out.stdout + out.stderr
    assert "leaked semaphore" not in out.stderr  # reported once by a newcomer; not reproduced since
    # Each rank writes its own file: two ranks' stdout lines may interleave, files cannot.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.json", "rank1.json"]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in reports] == [0, 1]
    for r in reports:
        assert r["equal"] and r["world_size"] == 2 and r["mode"] == "cpu-gloo" and "emulated" in r["emulation"]
        assert r["gathers_per_step"] == 3 and r["targets"] == 3 * 6
        assert r["node"] == 0 and r["group_size"] == 2  # one node: one group of the whole node


# ---- shard groups and nodes ------------------------------------------------------------------------
NODES_SCRIPT = """
import json, os, sys, warnings
from pathlib import Path

import torch

from wsharding.core.context import init_from_env
from wsharding.core.groups import ShardGroupAcrossNodesWarning

ctx = init_from_env(timeout_s=60)
report = {"rank": ctx.rank, "torchrun_node": int(os.environ["GROUP_RANK"]), "nodes": list(ctx.nodes), "groups": {}}
for g in (2, 4):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm = ctx.shard_comm(g)
    full = torch.empty(comm.world_size, dtype=torch.uint8)
    comm.all_gather_into(full, torch.tensor([ctx.rank], dtype=torch.uint8))  # the group's members, gathered
    report["groups"][g] = {"members": full.tolist(),
                           "warnings": [str(w.message) for w in caught if w.category is ShardGroupAcrossNodesWarning]}
Path(sys.argv[1], f"rank{ctx.rank}.json").write_text(json.dumps(report))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_groups_stay_in_a_node_and_a_group_across_nodes_warns(tmp_path):
    script = tmp_path / "nodes.py"
    script.write_text(NODES_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    port = _free_port()
    launchers = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "wsharding-two-nodes", str(script), str(tmp_path)]
        log = (tmp_path / f"node{node}.log").open("w")
        launchers.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path), log))
    try:
        codes = [p.wait(timeout=150) for p, _ in launchers]
    finally:
        for p, log in launchers:
            if p.poll() is None:
                p.kill()
                p.wait(10)
            log.close()
    logs = "\n".join((tmp_path / f"node{n}.log").read_text() for n in (0, 1))
    assert codes == [0, 0], logs[-4000:]  # every rank exited 0 (the launcher fails when one does not)
    assert "terminate called" not in logs, logs[-4000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    node_of = {r["rank"]: r["torchrun_node"] for r in reports}
    for r in reports:
        assert r["nodes"] == [0, 0, 1, 1]
        same_node = sorted(q for q in range(4) if node_of[q] == node_of[r["rank"]])
        two, four = r["groups"]["2"], r["groups"]["4"]
        assert two == {"members": same_node, "warnings": []}, r  # groups of 2: inside the rank's node, silent
        assert four["members"] == [0, 1, 2, 3]
        assert len(four["warnings"]) == 1, r
        for words in (f"rank {r['rank']}", "[0, 1, 2, 3]", "spans nodes [0, 1]", "inter-node network",
                      "at most 2", "shard_comm(4, across_nodes=True)"):
            assert words in four["warnings"][0], four["warnings"][0]


def _context(nodes: tuple[int, ...], rank: int = 0) -> RankContext:
    from datetime import timedelta

    return RankContext(rank, len(nodes), torch.device("cpu"), "gloo", "cpu-gloo", "", timedelta(seconds=5), nodes=nodes)


def test_group_across_nodes_warns_unless_asked_for(monkeypatch):
    import wsharding.core.torch_backend as tb

    monkeypatch.setattr(tb, "new_shard_comms", lambda g, **kw: f"comm of {g}")  # no process group needed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        two_nodes = _context((0, 0, 1, 1))
        assert two_nodes.node_group_size == 2
        two_nodes.shard_comm(2)
        assert caught == []
        two_nodes.shard_comm(4)  # the world of 4: both nodes
        assert [w.category for w in caught] == [ShardGroupAcrossNodesWarning]
        assert caught[0].filename == __file__  # points at the caller's line
        two_nodes.shard_comm(4)  # made once, said once
        assert two_nodes.shard_comm() == "comm of 2"  # the default: the largest group inside one node
        assert len(caught) == 1
        _context((0, 0, 1, 1)).shard_comm(4, across_nodes=True)  # meant: silent
        _context((0, 0, 0, 0)).shard_comm(4)  # one node: nothing to say
        assert len(caught) == 1


def test_our_nccl_groups_across_nodes_warn_too():
    from wsharding.accel.nccl.group import gloo_shard_group_for

    ctx = _context((0, 0, 1, 1), rank=3)
    with pytest.warns(ShardGroupAcrossNodesWarning, match=r"rank 3: shard group \[0, 1, 2, 3\]"):
        assert gloo_shard_group_for(ctx, 4) is None  # a gloo world is its own CPU group: no group is made
