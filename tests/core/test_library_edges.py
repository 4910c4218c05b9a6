"""The library's edges, through its public behaviour: the slot pool's bookkeeping, the sharding's
refusals at each stage, the planner's errors and out-of-order calls, the torch.distributed backend
on real ranks (a collective that times out, a finished gather), and how libnccl is found.

In-process tests use :class:`Loopback`, a one-rank communicator written here (it copies the chunk
into the slot, which is what a gather over one rank does) that can be told to fail a layer's gather.
"""

from __future__ import annotations

import ctypes.util
import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from wsharding.core.comm import CommError, Communicator, DoneHandle, PreparedGather, check_gather_args
from wsharding.core.first_layer import FirstLayerPrefetch
from wsharding.core.layout import FlatLayout
from wsharding.core.planner import PlannerClosedError
from wsharding.core.runner import prepare_layer_weight_shard_forward, run_layers, shard_blocks
from wsharding.core.schedule import lookahead_schedule
from wsharding.core.sharding import ShardingError, WeightSharding
from wsharding.core.slots import SlotPool
from wsharding.core.torch_backend import TorchDistComm, mode_label
from wsharding.lab.cluster import RankCluster, RemoteError


class Loopback(Communicator):
    """A communicator of one rank (in this process): a gather copies the chunk into the slot."""

    rank, world_size, device, mode = 0, 1, torch.device("cpu"), "cpu-loopback (test)"

    def __init__(self) -> None:
        self.fail: str | None = None  # a gather whose description contains this raises CommError
        self.started: list[str] = []

    def alloc(self, nbytes: int, *, tag: str = "") -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def prepare_gather(self, full: torch.Tensor, chunk: torch.Tensor, *, what: str = "") -> LoopbackGather:
        return LoopbackGather(self, full, chunk, what)

    def all_gather_into(self, full, chunk, *, async_op=False, what=""):
        if self.fail and self.fail in what:
            raise CommError(f"{what}: the peer went away")
        if full.data_ptr() != chunk.data_ptr():
            full.copy_(chunk)
        return DoneHandle()

    def fork(self, event) -> None:  # pragma: no cover - CUDA only
        pass

    def raise_if_failed(self, what: str) -> None:
        pass

    def barrier(self) -> None:
        pass


class LoopbackGather(PreparedGather):
    def __init__(self, comm: Loopback, full: torch.Tensor, chunk: torch.Tensor, what: str) -> None:
        self.comm, self.full, self.chunk, self.what = comm, full, chunk, what

    def start(self, gate=None, marks=None, *, inline=False) -> None:
        if self.comm.fail and self.comm.fail in self.what:
            raise CommError(f"{self.what}: the peer went away")
        self.comm.started.append(self.what.split(":")[0])
        self.full.copy_(self.chunk)

    def wait(self, stream=None) -> None:
        pass


class Block(nn.Module):
    def __init__(self, d: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc = nn.Linear(d, d, bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(d, d, generator=g) / d**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prepare_layer_weight_shard_forward(self)
        return torch.tanh(self.fc(x))


class Stack(nn.Module):
    def __init__(self, n: int = 4, d: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, 10 + i) for i in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


class _RankOfTwo(Communicator):
    rank, world_size, device, mode = 0, 2, torch.device("cpu"), "cpu-gloo"


# ---- slots ---------------------------------------------------------------------------------------
def test_slot_pool_bookkeeping():
    lays = {1: FlatLayout([("w", (5, 4), torch.float32)], 1), 2: FlatLayout([("w", (9, 4), torch.float32)], 1),
            4: FlatLayout([("w", (2, 4), torch.float16)], 1)}
    pool = SlotPool(Loopback(), lays)
    assert pool.slot_bytes == lays[2].total_bytes == 144 and pool.total_bytes == 288
    assert [pool.slot_of(i) for i in (1, 2, 4)] == [0, 1, 0]
    assert [pool.previous_occupant(i) for i in (1, 2, 4)] == [None, None, 1]
    full = pool.full_buffer(4)
    assert full.numel() == lays[4].total_bytes and full.data_ptr() == pool.buffers[0].data_ptr()
    w = pool.views(4)["w"]
    assert w.shape == (2, 4) and w.dtype == torch.float16 and w.data_ptr() == full.data_ptr()
    assert repr(pool) == "SlotPool(2 x 144 B)"  # what a slot holds is the planner's one account (slot_state)
    with pytest.raises(KeyError, match=r"layer 3 is not a sharded layer \(sharded: \[1, 2, 4\]\)"):
        pool.slot_of(3)
    with pytest.raises(ValueError, match="SlotPool needs at least one sharded layer"):
        SlotPool(Loopback(), {})


# ---- the sharding's refusals ---------------------------------------------------------------------
def test_sharding_refusals_name_the_layer_and_the_stage():
    blocks = [Block(8, 1), Block(8, 2)]
    with pytest.raises(ShardingError, match="sharded layer 5 is outside the model's 2 layers"):
        WeightSharding(_RankOfTwo(), blocks, {0: ["fc"]}, sharded_layers=[5])
    odd = nn.Module()
    odd.fc = nn.Linear(4, 3)
    with pytest.warns(UserWarning), pytest.raises(ShardingError, match="no layer has a shardable target"):
        WeightSharding(_RankOfTwo(), [odd], {0: ["fc"]})
    normed = nn.Module()
    normed.norm = nn.LayerNorm(8)
    with pytest.raises(ShardingError, match="layer 0: target 'norm' has no 2-D weight to shard"):
        WeightSharding(_RankOfTwo(), [normed], {0: ["norm"]})
    ws = WeightSharding(Loopback(), blocks, {0: ["fc"], 1: ["fc"]})
    with pytest.raises(ShardingError, match=r"resident_bytes\(\) needs stage 'finalized', the sharding is at 'declared'"):
        ws.resident_bytes()
    assert [d["slot"] for d in ws.describe()] == ["A", "B"]  # before the slots exist: by position
    ws.finalize()  # setup is implied
    with pytest.raises(ShardingError, match="declare\\(\\) after finalized"):
        ws.declare(0, blocks[0], ["fc"])
    with pytest.raises(ShardingError, match="'blocks' is a Block, expected the nn.ModuleList of blocks"):
        holder = nn.Module()
        holder.blocks = Block(8, 3)
        shard_blocks(holder, "blocks", ["fc"], Loopback())


def test_row_loader_refuses_an_unknown_sub_block():
    from wsharding.models import PRESETS, ToyDecoder

    cfg = PRESETS["tiny"]
    ws = WeightSharding(_RankOfTwo(), sharded_layers=range(1, cfg.layers))
    model = ToyDecoder(cfg, weight_sharding=ws)
    param = model.layers[1].attn.qkv_proj.weight
    with pytest.raises(ShardingError, match=r"attn.qkv_proj.weight: no sub-block with shard id 'x' \(known: \['q', 'k', 'v'\]"):
        ws.loaders[(1, "attn.qkv_proj")](param, torch.zeros(8, cfg.hidden), "x")


def test_context_manager_closes():
    blocks = [Block(8, 1), Block(8, 2)]
    with WeightSharding(Loopback(), blocks, {0: ["fc"], 1: ["fc"]}) as ws:
        ws.finalize()
    assert ws.stage == "closed"
    with pytest.raises(PlannerClosedError, match="closed"):
        ws.planner.begin_step()


# ---- the planner -------------------------------------------------------------------------------
def test_sharded_stack_equals_the_original_and_traces_without_callbacks():
    ref, model = Stack(), Stack()
    comm = Loopback()
    ws = shard_blocks(model, "blocks", ["fc"], comm, trace=True)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    trace = ws.planner.traces[-1]  # the model's end-of-step hook closed it
    # a gather without add_done_callback is stamped done when it is issued
    for r in trace.records():
        assert r["gather_start"] <= r["gather_end"] <= r["wait_end"]
    assert [r["layer"] for r in trace.records()] == [0, 1, 2, 3] and ws.planner.gathers_this_step == 4


def test_a_failed_gather_names_layer_rank_step_and_the_fix():
    model, comm = Stack(), Loopback()
    shard_blocks(model, "blocks", ["fc"], comm)
    comm.fail = "layer 2"
    with torch.no_grad(), pytest.raises(CommError) as info:
        model(torch.ones(1, 8))
    msg = str(info.value)
    assert msg.startswith("weight gather of layer 2 failed on rank 0 (step 0): layer 2: gather of")
    assert "the peer went away" in msg and "aligned_forward" in msg


def test_a_layer_called_alone_after_a_step_gathers_again_and_a_failure_there_is_named():
    ref, model = Stack(), Stack()
    comm = Loopback()
    ws = shard_blocks(model, "blocks", ["fc"], comm)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(x)
        assert torch.equal(model.blocks[1](x), ref.blocks[1](x))  # slot B holds layer 3 now: gathered again
        assert ws.planner.misses == 1
        comm.fail = "layer 0"
        with pytest.raises(CommError, match="weight gather of layer 0 failed on rank 0"):
            model.blocks[0](x)


def test_a_schedule_deeper_than_its_slots_holds_the_gather_until_its_gate_ends():
    blocks = [Block(8, i) for i in range(4)]
    comm = Loopback()
    ws = WeightSharding(comm, blocks, {i: ["fc"] for i in range(4)}).setup().finalize()
    p = ws.planner
    p.set_schedule(lambda sharded, slot_of, start, end: lookahead_schedule(sharded, slot_of, 2, start, end))
    p.begin_step(0)
    assert comm.started == ["layer 0", "layer 1"]
    p.block_start(0)  # layer 2 goes into slot A, which layer 0 reads now: held
    assert comm.started == ["layer 0", "layer 1"]
    p.block_end(0)  # its gate ended: issued
    assert comm.started == ["layer 0", "layer 1", "layer 2"] and p.gathers_this_step == 3
    p.end_step()


def test_a_traced_step_left_open_is_kept_at_the_next_reset():
    blocks = [Block(8, i) for i in range(2)]
    p = WeightSharding(Loopback(), blocks, {0: ["fc"], 1: ["fc"]}, trace=True).finalize().planner
    x = torch.ones(1, 8)
    with torch.no_grad():
        for _ in range(2):
            p.begin_step(0)
            for i, b in enumerate(blocks):
                p.block_start(i)
                x = b(x)
                p.block_end(i)
    # no finish_step: the first step's trace is kept when the second starts (which ends the first), the second is still open
    assert [t.step for t in p.traces] == [0] and p.trace is not None and p.trace.step == 1


def test_gather_arguments_are_checked_by_every_backend():
    comm = Loopback()
    with pytest.raises(CommError, match=r"full must be a contiguous 1-D uint8 tensor, got torch.float32 \(4,\)"):
        check_gather_args(comm, torch.zeros(4), torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(CommError, match="chunk is on meta, this rank's device is cpu"):
        check_gather_args(comm, torch.zeros(4, dtype=torch.uint8), torch.empty(4, dtype=torch.uint8, device="meta"))


def test_loading_helpers_refuse_mismatches_and_pad_with_zeros():
    from wsharding.linear.loading import CheckpointShapeError, copy_with_check, pad_or_narrow

    dst = torch.zeros(2, 3)
    param = torch.nn.Parameter(torch.zeros(4, 3))
    param.param_name = "layers.1.o_proj.weight"
    with pytest.raises(CheckpointShapeError, match=r"for layers.1.o_proj.weight \(rows\) has shape \(3, 3\) but "
                                                   r"this rank's parameter slice is \(2, 3\)"):
        copy_with_check(dst, torch.ones(3, 3), param, "rows")
    copy_with_check(dst, torch.ones(2, 3))
    assert torch.equal(dst, torch.ones(2, 3))
    t = torch.arange(5.0)
    assert torch.equal(pad_or_narrow(t, 0, 3, 4), torch.tensor([3.0, 4.0, 0.0, 0.0]))  # the last rank's rows
    assert torch.equal(pad_or_narrow(t, 0, 6, 2), torch.zeros(2))  # past the end: all padding
    with pytest.raises(ValueError, match="pad_or_narrow needs start >= 0 and size >= 0, got -1, 2"):
        pad_or_narrow(t, 0, -1, 2)


# ---- the torch.distributed backend on real ranks ----------------------------------------------------
def gather_then_peer_skips(ctx) -> str:
    comm = ctx.comm
    full = comm.alloc(8 * comm.world_size)
    chunk = full.narrow(0, 8 * comm.rank, 8)
    if comm.rank == 1:
        return "skipped"
    try:
        comm.all_gather_into(full, chunk, async_op=True, what="layer 7: test gather").wait()
    except CommError as e:
        return str(e)
    return "completed"


def done_callback_on_one_rank(ctx) -> list:
    comm = ctx.comm
    full = comm.alloc(16)
    g = comm.prepare_gather(full, full, what="one rank")
    calls = []
    before = comm.gathers_issued
    g.start()
    g.add_done_callback(lambda: calls.append("done"))  # nothing in flight on one rank: called at once
    g.wait()
    return [calls, repr(comm), comm.gathers_issued - before]


def test_a_gather_whose_peer_never_comes_is_a_named_error():
    with RankCluster(2, backend="gloo", collective_timeout=2.0, task_timeout=60) as c:
        out = c.run(gather_then_peer_skips)
    assert out[1] == "skipped"
    assert out[0].startswith("layer 7: test gather did not complete:") and "Timed out" in out[0]


def test_one_rank_gather_calls_back_at_once(cluster_of):
    assert cluster_of(1).run(done_callback_on_one_rank) == [
        [["done"], "TorchDistComm(rank=0, world_size=1, mode='cpu-gloo')", 1]]


def test_torch_comm_needs_ranks_and_labels_modes():
    with pytest.raises(CommError, match=r"torch.distributed is not initialised: start the ranks first \(torchrun and wsharding.core.context.init_from_env, or a RankCluster"):
        TorchDistComm()
    assert mode_label("gloo", torch.device("cpu")) == "cpu-gloo"
    assert mode_label("nccl", torch.device("cuda", 0)) == "gpu-nccl"
    assert mode_label("nccl", torch.device("cuda", 0), True) == "gpu-nccl-shared"


def torch_comm_on_rank(ctx):
    return ctx.comm.mode


def test_remote_error_keeps_every_rank(cluster_of):
    with pytest.raises(RemoteError) as info:
        cluster_of(2).run(fail_everywhere)
    assert info.value.errors == {0: ("KeyError", "'rank 0'"), 1: ("KeyError", "'rank 1'")}


def fail_everywhere(ctx):
    raise KeyError(f"rank {ctx.rank}")


# ---- finding libnccl ----------------------------------------------------------------------------------
def test_library_found_described_and_refused(monkeypatch):
    from wsharding.accel.nccl import library as L

    monkeypatch.delenv(L.ENV_VAR, raising=False)
    lib = L.load_library()  # the discovery order: here the wheel
    assert lib.path == L.find_library().path and lib.source.endswith("wheel")
    d = lib.describe()
    assert d["version"] == lib.version_str and d["symmetric_windows"] == (lib.version >= L.MIN_SYMMETRIC)
    assert d["multi_rank_per_gpu"] == (lib.version >= L.MIN_MULTI_RANK_GPU)
    with pytest.raises(L.NcclLibraryError, match=r"NCCL library '/nowhere/libnccl.so.2' does not exist"):
        L.load_library("/nowhere/libnccl.so.2")
    libm = next((line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                 if Path(line.split()[-1]).name.startswith("libm.so")), None) or ctypes.util.find_library("m")
    with pytest.raises(L.NcclLibraryError, match="has no ncclGetVersion: it is not libnccl"):
        L.load_library(libm)
    # no wheel, and a torch without libnccl: nothing to fall back to, and the error says what to install
    monkeypatch.setattr(L, "_wheel_libraries", lambda: [])
    if L._torch_loaded_library() is None:
        with pytest.raises(L.NcclLibraryError, match="no libnccl found: set WSHARDING_NCCL_LIBRARY"):
            L.find_library()
    old = dataclasses.replace(lib, version_code=22901)
    assert old.describe()["multi_rank_per_gpu"] is False and old.version_str == "2.29.1"
    # 2.29 refuses a window over several allocations: map_own_chunk="auto" keeps plain slots there
    assert old.describe()["mapped_layer_views"] is False and d["mapped_layer_views"] == (lib.version >= (2, 30, 0))


# ---- the draft model's first layer (prefetch before the step) ------------------------------------------
def test_draft_first_layer_prefetch_cold_start_and_refusals():
    ref = [Block(8, i) for i in range(3)]
    blocks = [Block(8, i) for i in range(3)]
    comm = Loopback()
    ws = WeightSharding(comm, blocks, {i: ["fc"] for i in range(3)}, trace=True).finalize()
    p = ws.planner
    ahead = FirstLayerPrefetch.of(p)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref[2](ref[1](ref[0](x)))
        for prefetch in (False, True):  # a cold start (gathered inline), then a real prefetch
            if prefetch:
                ahead.prefetch()
            ahead.wait()
            h = run_layers(blocks, x, p)
            trace = p.finish_step()
            assert torch.equal(h, want)
            assert p.gathers_this_step == 3 and p.waits_this_step == 3
            first = next(r for r in trace.records() if r["layer"] == 0)
            assert first["wait_start"] <= first["wait_end"] <= first["compute_start"]  # waited before the step
    assert (ahead.cold_starts, ahead.prefetches, ahead.first_layer) == (1, 2, 0)
    assert sorted(p.gathers) == [0, 1, 2]
    comm.fail = "layer 0: prefetch"
    with pytest.raises(CommError, match=r"weight gather of layer 0 failed on rank 0 .*the peer went away"):
        ahead.prefetch()
    comm.fail = None
    ahead.prefetch()
    with pytest.raises(CommError, match=r"layer 0: FirstLayerPrefetch.prefetch\(\) called twice on rank 0"):
        ahead.prefetch()
    ws.close()
    with pytest.raises(PlannerClosedError, match=r"FirstLayerPrefetch.prefetch\(\): this weight sharding was closed"):
        ahead.prefetch()
