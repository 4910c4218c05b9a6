"""The draft model's first-layer prefetch on GPUs (marker ``gpu``; skipped without CUDA).

Run: ``PYTHONPATH=. python3 -m pytest -m gpu -q tests/lab/test_gpu_draft.py -s`` (``-s`` prints the measured
exposed times). With one GPU, the 2-rank cases need NCCL >= 2.30 (``WSHARDING_NCCL_LIBRARY``) and
``NCCL_MULTI_RANK_GPU_ENABLE=1``, or they skip: ranks then time-slice one GPU (mode ``gpu-nccl-shared``).
"""

from __future__ import annotations

import os

import pytest
import torch

from wsharding.core.first_layer import FirstLayerPrefetch
from wsharding.core.runner import run_layers
from wsharding.lab.bench.draft import format_table, summarize
from wsharding.lab.cluster import RankCluster
from wsharding.lab.tasks.draft import MODES, draft_equality, draft_exposed, draft_graph_replay

pytestmark = pytest.mark.gpu
COUNTS = [[3, 5], [1, 2], [4, 1]]


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _two_ranks() -> RankCluster:
    if _gpus() >= 2:
        return RankCluster(2, backend="nccl", task_timeout=600)
    from wsharding.accel.nccl.library import MIN_MULTI_RANK_GPU, NcclLibraryError, default_library

    try:
        ok = default_library().supports(MIN_MULTI_RANK_GPU)
    except NcclLibraryError:
        ok = False
    if not ok or os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
        pytest.skip("2 ranks on 1 GPU need NCCL >= 2.30 (WSHARDING_NCCL_LIBRARY) and NCCL_MULTI_RANK_GPU_ENABLE=1")
    return RankCluster(2, backend="gloo", task_timeout=600, env={"NCCL_MULTI_RANK_GPU_ENABLE": "1"})


@pytest.fixture(scope="module")
def two():
    with _two_ranks() as c:
        yield c


@pytest.mark.parametrize("comm", ["torch", "nccl"])
def test_gpu_draft_equal_in_every_mode(two, comm):
    if comm == "torch" and two.backend != "nccl":
        pytest.skip("torch.distributed's own NCCL refuses 2 ranks on 1 GPU")
    for r in two.run(draft_equality, "small", COUNTS, modes=MODES, comm=comm):
        for mode in (*MODES, "no_wait", "no_calls"):
            assert r["modes"][mode]["equal"] == [True] * 3, (mode, r["modes"][mode])
            assert r["modes"][mode]["gathers"] == [2] * 3
        assert r["modes"]["inline"]["cold_starts"] == 3 and r["modes"]["dedicated"]["cold_starts"] == 0


def test_gpu_draft_exposed_dedicated_vs_shared_vs_inline(two):
    comm = "nccl" if two.backend == "gloo" else "auto"
    results = two.run(draft_exposed, "small", steps=20, commit_ms=4.0, comm=comm)
    report = summarize(results)
    print("\n" + format_table(report))
    rows = {r["mode"]: r for r in report["rows"]}
    assert list(rows) == list(MODES)
    assert "stand-in for the weight-sharding design's commit step" in report["region"] and "GEMM" in report["region"]
    # under a 4 ms region the prefetched gather is done before the draft starts; inline it is all exposed
    assert rows["dedicated"]["exposed_us"] < rows["inline"]["exposed_us"]


@pytest.mark.parametrize("comm", ["torch", "nccl"])
def test_gpu_draft_graph_replay_with_layer0_outside(two, comm):
    if comm == "torch" and two.backend != "nccl":
        pytest.skip("torch.distributed's own NCCL refuses 2 ranks on 1 GPU")
    for r in two.run(draft_graph_replay, "small", 8, 3, comm=comm):
        assert r["replays_equal"] == [True] * 3
        assert r["gathers_in_captured_step"] == 2  # layer 0 counted (prefetched), layer 1 captured


# ---- the fork: the prefetch must not overwrite a slot the previous draft step still reads ----------
class HeavyBlock(torch.nn.Module):
    """``gemms`` GEMMs reading the same slot-bound weight; ``started`` is recorded once its weights are in."""

    def __init__(self, d: int, seed: int, device: torch.device, gemms: int = 1) -> None:
        super().__init__()
        self.gemms = gemms
        self.started = torch.cuda.Event()
        g = torch.Generator().manual_seed(seed)
        self.fc = torch.nn.Linear(d, d, bias=False, dtype=torch.bfloat16, device=device)
        with torch.no_grad():
            self.fc.weight.copy_((torch.randn(d, d, generator=g) / d**0.5).to(torch.bfloat16))

    def forward(self, x):
        from wsharding.core.runner import prepare_layer_weight_shard_forward

        prepare_layer_weight_shard_forward(self)
        self.started.record()
        for _ in range(self.gemms):
            x = torch.tanh(self.fc(x))
        return x


def cuda_prefetch_race(ctx, fork: bool) -> bool:
    from wsharding.comm_by_name import shard_comm_for
    from wsharding.core.sharding import WeightSharding

    comm = shard_comm_for(ctx, "torch")
    dev = comm.device
    # layers 0 and 2 share slot A; layer 2 computes for long (~20 ms)
    blocks = [HeavyBlock(4096, 20 + i, dev, gemms=64 if i == 2 else 1) for i in range(3)]
    x = torch.randn(8192, 4096, generator=torch.Generator().manual_seed(2)).to(dev, torch.bfloat16)
    with torch.no_grad():
        ref = x
        for b in blocks:
            ref = b(ref)
        ws = WeightSharding(comm, blocks, {i: ["fc"] for i in range(3)}).setup().finalize()
        p = ws.planner
        ahead = FirstLayerPrefetch.of(p)

        def step():
            return run_layers(blocks, x, p)  # a first layer handed over by the prefetch is joined, not gathered

        step()
        torch.cuda.synchronize(dev)
        out = step()  # the host returns while the GPU still works on this step
        while not blocks[2].started.query():
            pass  # the GPU is now inside layer 2, which reads slot A for ~20 ms
        ahead.prefetch(fork=fork)  # writes layer 0 into slot A: after layer 2 only with the fork
        ahead.wait()
        torch.cuda.synchronize(dev)
    return bool(torch.equal(out, ref))


def test_gpu_prefetch_fork_orders_after_the_previous_step():
    if _gpus() < 1:
        pytest.skip("needs a GPU")
    with RankCluster(1, backend="nccl") as c:
        assert c.run(cuda_prefetch_race, True) == [True]
        assert c.run(cuda_prefetch_race, False) == [False]  # without the fork: slot A overwritten in use
