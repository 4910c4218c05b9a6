"""A rank started through ``init_from_env`` tears its process group down when the script exits
([Note: tearing down at exit] in wsharding/core/context.py): after every peer reached its exit, sub-groups
before the world, within a time limit, and without waiting for peers after an uncaught exception.

The ranks here are plain processes given torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...), so
each test pays only the ranks' start-up, not a launcher's.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Registered before init_from_env, so atexit runs it after the package's teardown: it tells what was
# destroyed, when, and whether a group is left.
PROLOGUE = """
import atexit, json, os, sys, time
import torch
import torch.distributed as dist

destroyed = []
_destroy = dist.destroy_process_group

def recording_destroy(group=None):
    destroyed.append(("world" if group is None else dist.get_process_group_ranks(group), time.time()))
    return _destroy(group)

dist.destroy_process_group = recording_destroy

def report():
    print("EXIT " + json.dumps({"destroyed": destroyed, "initialized": dist.is_initialized()}), flush=True)

atexit.register(report)

from wsharding.core.context import init_from_env

ctx = init_from_env(timeout_s=float(os.environ["TEST_TIMEOUT_S"]))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_ranks(tmp_path: Path, body: str, world: int, timeout_s: float) -> list[tuple[subprocess.Popen, Path]]:
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(PROLOGUE) + textwrap.dedent(body))
    port = str(_free_port())
    ranks = []
    for rank in range(world):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   TEST_TIMEOUT_S=str(timeout_s))
        log = tmp_path / f"rank{rank}.log"
        with log.open("w") as f:
            ranks.append((subprocess.Popen([sys.executable, str(script)], stdout=f, stderr=subprocess.STDOUT,
                                           env=env, cwd=tmp_path), log))
    return ranks


def _finish(ranks: list[tuple[subprocess.Popen, Path]], rank: int, timeout: float) -> tuple[int, str, float]:
    """Wait for ``rank``: its exit code, output and the seconds it took from now."""
    proc, log = ranks[rank]
    start = time.monotonic()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        for p, _ in ranks:
            p.kill()
        raise AssertionError(f"rank {rank} did not exit within {timeout} s:\n{log.read_text()[-3000:]}") from None
    return proc.returncode, log.read_text(), time.monotonic() - start


def _exit_report(output: str) -> dict:
    lines = [line for line in output.splitlines() if line.startswith("EXIT ")]
    assert lines, output[-3000:]
    return json.loads(lines[-1][len("EXIT "):])


def _kill_all(ranks: list[tuple[subprocess.Popen, Path]]) -> None:
    for p, _ in ranks:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def test_exit_destroys_subgroups_then_the_world_after_every_peer_reached_its_exit(tmp_path):
    body = """
    comm = ctx.shard_comm(1)                   # in a world of 2: a sub-group of one rank each
    world = ctx.comm
    full = torch.empty(2, dtype=torch.uint8)
    world.all_gather_into(full, torch.tensor([ctx.rank], dtype=torch.uint8))
    assert full.tolist() == [0, 1]
    if ctx.rank == 1:
        time.sleep(2.0)                        # a peer still busy when rank 0 reaches its exit
    print("END", time.time(), flush=True)
    """
    ranks = _start_ranks(tmp_path, body, world=2, timeout_s=60)
    try:
        results = [_finish(ranks, r, 120) for r in (0, 1)]
    finally:
        _kill_all(ranks)
    ends = {}
    for rank, (code, output, _) in enumerate(results):
        assert code == 0, output[-3000:]
        assert "terminate called" not in output
        report = _exit_report(output)
        assert not report["initialized"], f"rank {rank} left with its process group alive"
        assert [what for what, _ in report["destroyed"]] == [[rank], "world"], report  # sub-group first
        ends[rank] = float(next(line.split()[1] for line in output.splitlines() if line.startswith("END ")))
        results[rank] = report
    # the barrier: rank 0 destroyed nothing before rank 1 had finished its work
    first_destroy_rank0 = results[0]["destroyed"][0][1]
    assert first_destroy_rank0 >= ends[1], (first_destroy_rank0, ends[1])


def test_exit_teardown_that_blocks_is_left_after_its_time_limit(tmp_path):
    body = """
    dist.destroy_process_group = lambda group=None: time.sleep(600)   # a destroy that never returns
    """
    ranks = _start_ranks(tmp_path, body, world=1, timeout_s=1)
    try:
        code, output, seconds = _finish(ranks, 0, 90)
    finally:
        _kill_all(ranks)
    assert code == 0, output[-3000:]
    assert "was not torn down within 6 s" in output and "leaving without it" in output, output[-3000:]
    # start-up (importing torch) included; the limit is the group timeout (1 s) plus 5 s
    assert seconds < 60


def test_exit_after_an_uncaught_exception_does_not_wait_for_peers(tmp_path):
    body = """
    if ctx.rank == 0:
        print("RAISE", time.time(), flush=True)
        raise RuntimeError("rank 0 failed")
    time.sleep(120)                            # rank 1 never reaches its exit while rank 0 leaves
    """
    ranks = _start_ranks(tmp_path, body, world=2, timeout_s=40)
    try:
        code, output, _ = _finish(ranks, 0, 120)
        # rank 0's exit must not wait for rank 1 in an exit barrier (up to the 40 s group timeout)
        report = _exit_report(output)
        assert ranks[1][0].poll() is None, "rank 1 should still be sleeping"
    finally:
        _kill_all(ranks)
    assert code == 1 and "RuntimeError: rank 0 failed" in output, output[-3000:]
    assert "exit barrier" not in output, output[-3000:]
    assert not report["initialized"]
    raised = float(next(line.split()[1] for line in output.splitlines() if line.startswith("RAISE ")))
    done = report["destroyed"][-1][1]
    assert done - raised < 20, f"rank 0 took {done - raised:.0f} s from its exception to its teardown"
