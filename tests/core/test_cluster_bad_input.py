"""Bad input to ``init_from_env`` and ``RankCluster``: each mistake is refused before any work starts
(no process group, no rank process) by a :class:`~wsharding.lab.cluster.ClusterError` whose message names the
argument or variable at fault and says what to do -- never a KeyError, a ZeroDivisionError, a worker
that dies at start-up, or a rendezvous that waits for a socket timeout naming no rank."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from wsharding.core.context import ClusterError, init_from_env
from wsharding.lab.cluster import RankCluster

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def torchrun_env(monkeypatch):
    """``set(**vars)``: the environment of a torchrun rank, with only the given variables; the process
    group, should a check be missing and one get made, is destroyed afterwards."""
    import torch.distributed as dist

    def set_env(**values: str) -> None:
        for name in TORCHRUN_VARS:
            monkeypatch.delenv(name, raising=False)
        for name, value in values.items():
            monkeypatch.setenv(name, value)

    yield set_env
    if dist.is_initialized():
        dist.destroy_process_group()


def _world_of_one() -> dict[str, str]:
    return {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}


def _refused(call: Callable[[], object], *culprit: str) -> str:
    """``call()`` raises exactly ClusterError, quickly, and its message names every ``culprit``."""
    start = time.monotonic()
    with pytest.raises(BaseException) as info:  # noqa: PT011 - the exact class is asserted below
        call()
    assert type(info.value) is ClusterError, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    assert [c for c in culprit if c not in message] == [], message
    assert time.monotonic() - start < 5.0, "refused only after waiting"
    return message


# ---- init_from_env ---------------------------------------------------------------------------------
def test_init_from_env_outside_torchrun_names_the_missing_variables(torchrun_env):
    torchrun_env()
    _refused(init_from_env, "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "torchrun")


def test_init_from_env_names_the_one_missing_variable(torchrun_env):
    env = _world_of_one()
    del env["MASTER_PORT"]
    torchrun_env(**env)
    _refused(init_from_env, "missing: MASTER_PORT.", "torchrun")


def test_init_from_env_refuses_a_rank_that_is_not_a_number(torchrun_env):
    torchrun_env(**{**_world_of_one(), "RANK": "abc"})
    _refused(init_from_env, "RANK='abc'", "integer")


def test_init_from_env_refuses_a_rank_outside_the_world(torchrun_env):
    torchrun_env(**{**_world_of_one(), "RANK": "3", "WORLD_SIZE": "2"})
    _refused(lambda: init_from_env(timeout_s=3), "RANK=3", "WORLD_SIZE=2", "0 .. 1")


def test_init_from_env_refuses_nccl_without_a_gpu(torchrun_env, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    torchrun_env(**_world_of_one())
    _refused(lambda: init_from_env(backend="nccl"), "backend='nccl'", "GPU", "gloo")


def test_init_from_env_refuses_an_unknown_backend(torchrun_env):
    torchrun_env(**_world_of_one())
    _refused(lambda: init_from_env(backend="mpi"), "backend='mpi'", "'auto', 'gloo' or 'nccl'")


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("nan"), float("inf")])
def test_init_from_env_refuses_a_timeout_that_is_not_a_positive_number(torchrun_env, timeout_s):
    torchrun_env(**_world_of_one())
    _refused(lambda: init_from_env(timeout_s=timeout_s), "timeout_s", f"got {timeout_s!r}")


# ---- RankCluster -----------------------------------------------------------------------------------
@pytest.mark.parametrize("threads", [0, -2, 1.5])
def test_rank_cluster_refuses_threads_per_rank_below_one(threads):
    _refused(lambda: RankCluster(2, backend="gloo", threads_per_rank=threads), "threads_per_rank", f"got {threads!r}")


def test_rank_cluster_refuses_an_env_value_that_is_not_a_string():
    _refused(lambda: RankCluster(2, backend="gloo", env={"OMP_NUM_THREADS": 4}),
             "env['OMP_NUM_THREADS']", "int", "string")


@pytest.mark.parametrize(("name", "value"), [("collective_timeout", 0), ("collective_timeout", -5),
                                             ("start_timeout", 0), ("task_timeout", float("nan"))])
def test_rank_cluster_refuses_a_timeout_that_is_not_a_positive_number(name, value):
    _refused(lambda: RankCluster(2, backend="gloo", **{name: value}), name, f"got {value!r}")


# ---- a script without the __main__ guard -----------------------------------------------------------
SCRIPT = """
from wsharding.lab.cluster import RankCluster

def main():
    with RankCluster(1, backend="gloo", start_timeout=60) as cluster:
        print("ranks:", cluster.world_size)
"""


def _run_script(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(SCRIPT) + textwrap.dedent(body))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)


def test_script_without_main_guard_is_refused_with_the_reason(tmp_path):
    out = _run_script(tmp_path, "\nmain()\n")
    assert out.returncode == 1, out.stdout + out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("wsharding.core.context.ClusterError:"), out.stderr[-3000:]
    line = (tmp_path / "job.py").read_text().splitlines().index("main()") + 1
    # the line that starts the ranks, the reason and what to do
    for words in (f"job.py:{line}", 'if __name__ == "__main__":', "re-imports", "would run this line again"):
        assert words in last, last


def test_script_with_main_guard_starts_its_ranks(tmp_path):
    out = _run_script(tmp_path, '\nif __name__ == "__main__":\n    main()\n')
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ranks: 1" in out.stdout
