"""Weight sharding on GPUs (run on the GPU machine: python3 -m pytest -m gpu). Skipped without CUDA."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.ranktasks import graph_replay, memory_over_steps, model_off_the_comm_device
from wsharding.comm_by_name import multi_rank_per_gpu_supported, shard_comm_for
from wsharding.core.units import align_up
from wsharding.lab.cluster import RankCluster
from wsharding.models.equality import model_equality

pytestmark = pytest.mark.gpu

COUNTS = [[3, 5], [6, 2], [0, 3], [1, 8]]


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(scope="module", params=[1, 2], ids=["1gpu", "2gpu"])
def gpu_cluster(request):
    n = request.param
    if _gpus() < n:
        pytest.skip(f"needs {n} GPUs, this machine has {_gpus()}")
    with RankCluster(n, backend="nccl", task_timeout=600) as c:
        yield c


COMMS = ["torch", "nccl"]  # torch.distributed NCCL, and our binding (symmetric windows, copy engine)


@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("lookahead", [True, False])
@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_gpu_sharded_equals_replicated(gpu_cluster, preset, lookahead, comm):
    counts = [row[: gpu_cluster.world_size] for row in COUNTS]
    for r in gpu_cluster.run(model_equality, preset, counts, lookahead=lookahead, comm=comm):
        assert r["mode"].startswith("gpu-nccl")
        assert r["max_abs_diff"] == 0.0
        assert all(e in (True, None) for e in r["equal"]) and any(r["equal"])
        assert r["resident_bytes"] == r["formula_bytes"]
        assert r["gathers"] == [len(r["sharded_layers"])] * len(counts)


@pytest.mark.parametrize("comm", COMMS)
def test_gpu_next_step_prefetch_equals_replicated(gpu_cluster, comm):
    """[Note: the next step's first gather] on GPUs: the first gather issued during the previous
    step's last layers (gated on the first slot's last reader) changes no bit."""
    counts = [row[: gpu_cluster.world_size] for row in COUNTS]
    for r in gpu_cluster.run(model_equality, "small", counts, comm=comm, prefetch_next_step=True):
        assert r["max_abs_diff"] == 0.0
        assert all(e in (True, None) for e in r["equal"]) and any(r["equal"])
        assert r["gathers"] == [len(r["sharded_layers"])] * len(counts)
        assert r["next_step_prefetches"] == len(counts)


@pytest.mark.parametrize("comm", COMMS)
def test_gpu_cuda_graph_replay_equals_eager(gpu_cluster, comm):
    for r in gpu_cluster.run(graph_replay, "small", 16, comm=comm):
        assert r["replays"] == [(True, True)] * 3


@pytest.mark.parametrize("comm", COMMS)
def test_gpu_model_built_on_the_cpu_is_refused(gpu_cluster, comm):
    """A model built on the CPU, sharded over a GPU communicator: refused before sharding, naming the
    block, the weight and both devices (without the guard the target rows went to the GPU, the rest stayed,
    and the first forward failed inside torch). Moved to the GPU first, it shards and computes there."""
    for r in gpu_cluster.run(model_off_the_comm_device, comm=comm):
        assert r["device"].startswith("cuda")
        assert r["refused"] is not None
        assert f"rank {r['rank']}: block 0's fc1.weight is on cpu" in r["refused"]
        assert "model.to(ctx.device)" in r["refused"]
        assert r["out_device"] == r["device"] and r["gathers"] == 2


@pytest.mark.parametrize("comm", COMMS)
def test_gpu_no_memory_growth_over_100_steps(gpu_cluster, comm):
    for r in gpu_cluster.run(memory_over_steps, "small", 100, comm=comm):
        assert r["after"] == r["before"]


# ---- the gate on CUDA streams ---------------------------------------------------------------------
#: ~50 ms of a spinning kernel at ~2 GHz: the compute stream sits in front of each layer's reads
#: this long, while a gather issued without the gate (a copy of 2 MiB, microseconds) lands at once.
SLEEP_CYCLES = 100_000_000


def _seeded_linear(d: int, rows: int, seed: int, device: torch.device) -> torch.nn.Linear:
    """A bias-free BF16 ``d -> rows`` linear with weights from ``seed`` (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    fc = torch.nn.Linear(d, rows, bias=False, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        fc.weight.copy_((torch.randn(rows, d, generator=g) / d**0.5).to(torch.bfloat16))
    return fc


class HeavyBlock(torch.nn.Module):
    """Sleeps on the compute stream, then reads its slot-bound weight in a few GEMMs: an ungated gather
    into its slot certainly lands before the reads (the race made certain, not timed)."""

    def __init__(self, d: int, seed: int, device: torch.device) -> None:
        super().__init__()
        self.fc = _seeded_linear(d, d, seed, device)

    def forward(self, x):
        from wsharding.core.runner import prepare_layer_weight_shard_forward

        prepare_layer_weight_shard_forward(self)
        torch.cuda._sleep(SLEEP_CYCLES)  # before the reader: the gate must hold the next gather this long
        for _ in range(2):
            x = torch.tanh(self.fc(x))
        return x


def cuda_gate_race(ctx, gate: bool):
    from wsharding.core.runner import run_layers
    from wsharding.core.schedule import lookahead_schedule
    from wsharding.core.sharding import WeightSharding

    # Our NCCL communicator, plain slots: its gathers (here the own chunk's copy, a group of one) run on
    # its gather stream, so only the gate's event orders them after the layer reading the slot. (The
    # torch.distributed comm issues from the compute stream, which orders it without any gate, and a
    # mapped own chunk has nothing to copy: neither could show the race.)
    comm = shard_comm_for(ctx, "nccl")
    dev = comm.device
    blocks = [HeavyBlock(1024, 10 + i, dev) for i in range(6)]
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(1)).to(dev, torch.bfloat16)
    with torch.no_grad():
        ref = x
        for b in blocks:
            ref = b(ref)
        ws = WeightSharding(comm, blocks, {i: ["fc"] for i in range(6)}, map_own_chunk=False).setup().finalize()
        planner = ws.planner

        def ungated(sharded, slot_of, start, end):
            # one ahead over two slots: at block i's start the host issues layer i+1's gather into the slot
            # block i-1 read, whose kernels (a long sleep first) are still queued; without its gate (None
            # on every gather) nothing orders the gather after them on the GPU: the race. (Two ahead over
            # two slots is caught on the host: the slot's accounting sees layer i's own slot overwritten
            # and gathers it again, synchronously, with a ScheduleMissWarning.)
            sched = lookahead_schedule(sharded, slot_of, 1, start, end)
            if gate:
                return sched
            bare = lambda gs: tuple(dataclasses.replace(g, gate=None) for g in gs)  # noqa: E731
            return dataclasses.replace(sched, at_step_start=bare(sched.at_step_start),
                                       at_block_start={b: bare(gs) for b, gs in sched.at_block_start.items()})

        planner.set_schedule(ungated)
        h = run_layers(blocks, x, planner)
        torch.cuda.synchronize(dev)
    return bool(torch.equal(h, ref))


def test_gpu_gate_orders_side_stream_after_compute():
    if _gpus() < 1:
        pytest.skip("needs a GPU")
    with RankCluster(1, backend="nccl") as c:
        assert c.run(cuda_gate_race, True) == [True]
        assert c.run(cuda_gate_race, False) == [False]  # without the gate event: a slot overwritten in use


# ---- several ranks on one GPU with our NCCL binding (NCCL >= 2.30, NCCL_MULTI_RANK_GPU_ENABLE=1) -----


@pytest.mark.parametrize("ranks", [2, 4])
def test_gpu_shared_ranks_with_our_nccl(ranks):
    if not multi_rank_per_gpu_supported():
        pytest.skip("needs NCCL >= 2.30 (WSHARDING_NCCL_LIBRARY) and NCCL_MULTI_RANK_GPU_ENABLE=1")
    counts = [[3, 5, 1, 7], [6, 2, 4, 1], [0, 3, 2, 5]]
    # gloo between the rank processes (CPU side); the gathers go through our NCCL communicator, all
    # ranks time-slicing one GPU: the code path of N GPUs, not their bandwidth
    with RankCluster(ranks, backend="gloo", task_timeout=600) as c:
        for r in c.run(model_equality, "small", counts, lookahead=True, comm="nccl"):
            assert r["mode"] == "gpu-nccl-shared"
            assert r["max_abs_diff"] == 0.0 and all(e in (True, None) for e in r["equal"])
            assert r["resident_bytes"] == r["formula_bytes"]
        for r in c.run(graph_replay, "small", 16, comm="nccl"):
            assert r["replays"] == [(True, True)] * 3
        for r in c.run(memory_over_steps, "small", 100, comm="nccl"):
            assert r["after"] == r["before"]


# ---- [Note: the own chunk mapped, not copied] (NCCL >= 2.30) ----------------------------------------


def _mapped_supported() -> bool:
    from wsharding.accel.nccl.library import MIN_MAPPED_VIEW, NcclLibraryError, default_library

    try:
        return torch.cuda.is_available() and default_library().supports(MIN_MAPPED_VIEW)
    except NcclLibraryError:
        return False


@pytest.mark.parametrize("ranks", [2, 4])
def test_gpu_mapped_views_equal_replicated_and_copy_nothing_of_their_own(ranks):
    if not multi_rank_per_gpu_supported():
        pytest.skip("needs NCCL >= 2.30 (WSHARDING_NCCL_LIBRARY) and NCCL_MULTI_RANK_GPU_ENABLE=1")
    counts = [[3, 5, 1, 7], [6, 2, 4, 1], [0, 3, 2, 5]]
    counts = [row[:ranks] for row in counts]
    with RankCluster(ranks, backend="gloo", task_timeout=600) as c:
        for r in c.run(model_equality, "small", counts, comm="nccl", map_own_chunk=True, close=True):
            assert r["max_abs_diff"] == 0.0 and all(e in (True, None) for e in r["equal"]) and any(r["equal"])
            assert r["resident_bytes"] == r["formula_bytes"] == r["pool_bytes_sharded"]
            # what the KV-cache comparison counts: the layer views are address ranges over the chunks
            # and pages, not memory (counted, they added ~R and made replicated look roomier)
            mb = r["model_bytes"]
            assert mb["sharded"] == mb["replicated"] - r["replicated_bytes"] + r["resident_bytes"]
            # after finalize a slot keeps only the peers' pages: 2 (N-1)/N max|T| instead of 2 max|T|
            assert r["formula_bytes"] == sum(r["chunk_bytes"]) + 2 * (ranks - 1) * max(r["chunk_bytes"])
            assert r["gathers"] == [len(r["sharded_layers"])] * len(counts)
            # every gather sends the own slice of the layer's view: in place, nothing copied in
            assert r["in_place_gathers"] == len(r["sharded_layers"])
            before, after = r["pool_bytes"]
            assert after == before  # close gave back every page, chunk and mapped range
            mapped_slots = r["pool_bytes_sharded"] - sum(r["chunk_bytes"])
        for r in c.run(model_equality, "small", counts, comm="nccl"):
            assert r["in_place_gathers"] == 0 and r["max_abs_diff"] == 0.0  # the plain slots copy the own chunk
            assert r["resident_bytes"] == r["formula_bytes"] == r["pool_bytes_sharded"]
            # the slots of the mapped sharding hold less, though its pieces are padded to 2 MiB pages
            # (this model's layers are 7.5 MiB: 8 and 12 MiB of pages at 2 and 4 ranks, against 15)
            assert mapped_slots < r["pool_bytes_sharded"] - sum(r["chunk_bytes"])


def test_gpu_mapped_views_one_rank():
    if not _gpus():
        pytest.skip("needs a GPU")
    if not _mapped_supported():
        pytest.skip("needs NCCL >= 2.30 (WSHARDING_NCCL_LIBRARY)")
    with RankCluster(1, backend="nccl", task_timeout=600) as c:
        (r,) = c.run(model_equality, "small", [[3], [6], [1]], comm="nccl", map_own_chunk=True, close=True)
        assert r["max_abs_diff"] == 0.0 and all(r["equal"]) and r["resident_bytes"] == r["formula_bytes"]
        mb = r["model_bytes"]
        assert mb["sharded"] == mb["replicated"] - r["replicated_bytes"] + r["resident_bytes"]
        # alone, a rank has no peers' pages: after finalize the layer views are the chunks themselves
        assert r["formula_bytes"] == r["pool_bytes_sharded"] == sum(r["chunk_bytes"])
        assert r["in_place_gathers"] == len(r["sharded_layers"]) and r["pool_bytes"][0] == r["pool_bytes"][1]


class WideBlock(torch.nn.Module):
    """``x + fc(x)[:, :d]`` with ``rows`` output rows: blocks of different sizes that still chain."""

    def __init__(self, d: int, rows: int, seed: int, device: torch.device) -> None:
        super().__init__()
        self.fc = _seeded_linear(d, rows, seed, device)

    def forward(self, x):
        return x + self.fc(x)[:, : x.shape[1]]


class WideStack(torch.nn.Module):
    def __init__(self, rows: list[int], device: torch.device) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(WideBlock(1024, r, 40 + i, device) for i, r in enumerate(rows))

    def forward(self, x):
        for b in self.layers:
            x = b(x)
        return x


def mapped_mixed_sizes(ctx) -> dict:
    """Layers 0 and 1 of 2 MiB, 2 and 3 of 8 MiB, mapped: slot A holds layers 0 and 2, whose chunks (2
    and 4 MiB over 2 ranks, in 2 MiB pages) end at different bytes of the peer's page."""
    from wsharding.core.runner import shard_blocks

    comm = shard_comm_for(ctx, "nccl")
    model = WideStack([1024, 1024, 4096, 4096], comm.device)
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(3)).to(comm.device, torch.bfloat16)
    with torch.no_grad():
        ref = model(x)
        ws = shard_blocks(model, "layers", ["fc"], comm, map_own_chunk=True)
        equal = [bool(torch.equal(model(x), ref)) for _ in range(3)]
    out = {"equal": equal, "segments": [ws.slots.segment_bytes(0), ws.slots.segment_bytes(1)],
           "resident": ws.resident_bytes(), "formula": ws.formula_bytes()}
    ws.close()
    return out


def test_gpu_mapped_views_of_layers_of_different_sizes():
    """A peer's slice of a smaller layer's view must be whole allocations: before the pages were cut
    at every chunk size (MappedSlotPool.segment_bytes), its cuMemMap failed with CUresult 801."""
    if not multi_rank_per_gpu_supported():
        pytest.skip("needs NCCL >= 2.30 (WSHARDING_NCCL_LIBRARY) and NCCL_MULTI_RANK_GPU_ENABLE=1")
    mib = 1 << 20
    with RankCluster(2, backend="gloo", task_timeout=300) as c:
        for r in c.run(mapped_mixed_sizes):
            assert r["equal"] == [True] * 3
            assert r["segments"] == [[2 * mib, 2 * mib], [2 * mib, 2 * mib]]
            assert r["resident"] == r["formula"] == (2 + 2 + 4 + 4) * mib + 2 * 4 * mib


def test_gpu_map_own_chunk_auto_maps_where_it_can_and_holds_no_more():
    """[Note: map_own_chunk="auto"], the package's default: with NCCL >= 2.30 the `small` model
    (7.5 MiB layers) is mapped and the `tiny` one (KiB layers, each chunk would be a 2 MiB page) keeps
    plain slots; with an older NCCL neither is mapped, and the reason names the version."""
    if not _gpus():
        pytest.skip("needs a GPU")
    with RankCluster(1, backend="nccl", task_timeout=600) as c:
        (small,) = c.run(model_equality, "small", [[3], [6]], comm="nccl", map_own_chunk="auto", close=True)
        (tiny,) = c.run(model_equality, "tiny", [[3], [6]], comm="nccl", map_own_chunk="auto", close=True)
    for r in (small, tiny):
        assert r["max_abs_diff"] == 0.0 and all(r["equal"])
        assert r["resident_bytes"] == r["formula_bytes"] == r["pool_bytes_sharded"]
        assert r["pool_bytes"][0] == r["pool_bytes"][1]
    if _mapped_supported():
        assert small["map_own_chunk"] and small["in_place_gathers"] == len(small["sharded_layers"])
        assert small["map_own_chunk_reason"].startswith("own chunk mapped: ")
        # world size 1, mapped: the layer views are the chunks, no slot page is left
        assert small["formula_bytes"] == sum(small["chunk_bytes"])
        assert not tiny["map_own_chunk"] and tiny["in_place_gathers"] == 0
        assert "2 MiB page padding of every chunk" in tiny["map_own_chunk_reason"]
        g = 4096  # our NCCL communicator's allocation unit (alloc_granularity)
        assert tiny["formula_bytes"] == (sum(align_up(b, g) for b in tiny["chunk_bytes"])
                                         + 2 * align_up(max(tiny["layout_bytes"]), g))
    else:
        for r in (small, tiny):
            assert not r["map_own_chunk"] and "is older than 2.30.0" in r["map_own_chunk_reason"]


def test_gpu_mapped_views_refused_by_an_older_nccl():
    if not _gpus():
        pytest.skip("needs a GPU")
    if _mapped_supported():
        pytest.skip("the loaded NCCL maps views: the gate has nothing to refuse here")
    from wsharding.accel.nccl.library import NcclLibraryError

    with RankCluster(1, backend="nccl", task_timeout=600) as c:
        with pytest.raises(Exception, match="map_own_chunk .* needs NCCL >= 2.30.0") as info:
            c.run(model_equality, "small", [[3]], comm="nccl", map_own_chunk=True)
        assert "NcclLibraryError" in str(info.value) or isinstance(info.value, NcclLibraryError)
