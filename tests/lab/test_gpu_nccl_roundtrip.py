"""GPU tests of the notebook's NCCL roundtrip (``gather_roundtrip`` of ``wsharding.lab.tasks.nccl``;
marker ``gpu``; skipped without CUDA): byte-exact gathers and no memory growth over many steps.

Run on the GPU machine from the project root: ``PYTHONPATH=. python3 -m pytest -m gpu -q
tests/lab/test_gpu_nccl_roundtrip.py``. Several ranks on one GPU need NCCL >= 2.30: point
``WSHARDING_NCCL_LIBRARY`` at one (../shared/GPU.md) -- otherwise those cases skip and say why.
"""

from __future__ import annotations

import pytest
import torch

from tests.accel.nccl_tasks import nccl_cluster
from wsharding.core.units import MiB
from wsharding.lab.tasks import nccl as tasks

pytestmark = pytest.mark.gpu
SIZES = [1 * MiB, 4 * MiB + 4096 * 8, 64 * MiB]


def test_world_size_one_roundtrip_and_no_growth():
    r = tasks.gather_roundtrip(None, SIZES, steps=100, ce_probe=False)
    assert r["mode"] == "gpu-nccl-single"
    assert [s["mismatched_bytes"] for s in r["sizes"]] == [0, 0, 0]
    assert r["order"] == ["layer.0.full", "layer.1.full", "layer.2.full"]  # sorted by tag, not by alloc order
    assert r["aligned"] and r["zero_copy"] and r["after_steps_ok"] and r["closed"]
    assert r["steps"]["torch_allocated_delta"] == 0
    assert r["steps"]["device_free_delta"] == 0
    assert r["gathers_issued"] == 3 + 5 + 100


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("policy", [2, 0])
def test_multi_rank_roundtrip(n, policy):
    with nccl_cluster(n) as cluster:
        res = cluster.run(tasks.gather_roundtrip, SIZES, policy, 100)
    for r in res:
        assert [s["mismatched_bytes"] for s in r["sizes"]] == [0, 0, 0], r
        assert r["after_steps_ok"] and r["closed"]
        assert r["steps"]["torch_allocated_delta"] == 0
        assert r["steps"]["device_free_delta"] == 0
        # The copy engine launches no NCCL kernel; policy 0 does.
        assert r["ce_check"]["copy_engine"] is (policy == 2), r["ce_check"]
        if n > torch.cuda.device_count():
            assert r["mode"] == "gpu-nccl-shared" and "time-slice" in r["emulation"]
    print(n, policy, res[0]["mode"], res[0]["ce_check"], res[0]["steps"])
