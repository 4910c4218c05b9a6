"""Teardown, partial layer ranges and the NCCL watchdog's logic (it aborts a stuck communicator).

Each guard has a test that fails without it: a closed sharding whose model still ran would read
freed memory; a partial range that dispatched past its end would leave a gather nobody waits on;
a watchdog that did not abort would leave a stuck stream hanging.
"""

from __future__ import annotations

import time

import pytest
import torch

from wsharding.accel.nccl.watchdog import Watchdog
from wsharding.core.runner import PlannedBlockForward, prepare_layer_weight_shard_forward, run_layers, shard_blocks
from wsharding.core.sharding import ShardingError, WeightSharding


class FcBlock(torch.nn.Module):
    """One seeded square weight ``fc``, read through the planner's per-layer forward."""

    def __init__(self, d: int, seed: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, d, bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(d, d, generator=torch.Generator().manual_seed(seed)) / d**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prepare_layer_weight_shard_forward(self)
        return torch.tanh(2 * self.fc(x))


def _blocks(n=6, d=32):
    return [FcBlock(d, seed=10 + i) for i in range(n)]


def closed_model_raises(ctx):
    blocks = _blocks()
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(ctx.rank))
    out = {}
    with WeightSharding(ctx.comm, blocks, {i: ["fc"] for i in range(1, 6)}).setup().finalize() as ws:
        with torch.no_grad():
            run_layers(blocks, x, ws.planner)
        planner = ws.planner
    out["stage"] = ws.stage
    out["weight_numel"] = blocks[3].fc.weight.numel()
    out["still_parameter"] = isinstance(blocks[3].fc.weight, torch.nn.Parameter)
    for name, call in (("layer", lambda: blocks[3](x)), ("step", lambda: run_layers(blocks, x, planner))):
        try:
            call()
            out[name] = "ran"
        except Exception as e:  # noqa: BLE001 - the class and text are what we check
            out[name] = f"{type(e).__name__}: {e}"
    ws.close()  # idempotent
    return out


def test_a_closed_sharding_refuses_to_run(cluster_of):
    for r in cluster_of(2).run(closed_model_raises):
        assert r["stage"] == "closed" and r["weight_numel"] == 0 and r["still_parameter"]
        assert r["layer"].startswith("ShardingError: layer 3:") and "closed" in r["layer"]
        assert r["step"].startswith("PlannerClosedError") and "closed" in r["step"]


class Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16, bias=False)) for _ in range(3))
        with torch.no_grad():
            for block in self.layers:
                block[0].weight.copy_(torch.randn(16, 16, generator=g))

    def forward(self, x):
        for b in self.layers:
            x = b(x)
        return x


def closed_generic_model(ctx):
    model, ref = Blocks(), Blocks()
    x = torch.randn(2, 16)
    ws = shard_blocks(model, "layers", ["*"], ctx.comm)
    with torch.no_grad():
        equal = torch.equal(model(x), ref(x))
        ws.close()
        try:
            model(x)
            after = "ran"
        except ShardingError as e:
            after = str(e)
    return equal, after


def test_a_closed_generic_model_raises(cluster_of):
    for equal, after in cluster_of(2).run(closed_generic_model):
        assert equal
        assert after.startswith("layer 0:") and "closed" in after


def partial_range(ctx, start: int, end: int):
    blocks, ref = _blocks(), _blocks()
    ws = WeightSharding(ctx.comm, blocks, {i: ["fc"] for i in range(1, 6)}).setup().finalize()
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(ctx.rank))
    with torch.no_grad():
        y = run_layers(blocks, x, ws.planner, start_layer=start, end_layer=end)
        want = run_layers(ref, x, None, start_layer=start, end_layer=end)
        issued = ws.planner.gathers_this_step
        # the next full step starts clean: nothing of the partial step is left in flight
        full = run_layers(blocks, x, ws.planner)
        full_want = run_layers(ref, x, None)
    return bool(torch.equal(y, want)), issued, bool(torch.equal(full, full_want))


@pytest.mark.parametrize("start,end,sharded", [(0, 3, 2), (2, 4, 2), (3, 6, 3), (1, 2, 1)])
def test_partial_layer_ranges_gather_only_their_layers(cluster_of, start, end, sharded):
    for equal, issued, full_equal in cluster_of(2).run(partial_range, start, end):
        # a schedule made for the range: layer `end` is not gathered (nobody would join it)
        assert equal and full_equal
        assert issued == sharded


# ---- the watchdog's logic, without a GPU (events are anything with query()) ------------------------
class FakeEvent:
    def __init__(self, done: bool = False) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def _dog(async_error=None, timeout_s=5.0):
    aborted = []
    dog = Watchdog(lambda: async_error, aborted.append, timeout_s=timeout_s, period_s=3600)  # thread idle
    return dog, aborted


def _wait_for(done, seconds: float = 5.0) -> None:
    """Poll ``done()`` every 10 ms until it is true or ``seconds`` pass (the watchdog's thread works
    on its own; the assertions that follow say what was expected)."""
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_watchdog_drops_completed_gathers_and_aborts_a_stuck_one():
    dog, aborted = _dog(timeout_s=5.0)
    try:
        done, stuck = FakeEvent(True), FakeEvent(False)
        dog.watch(done, "layer 1: gather")
        dog.watch(stuck, "layer 2: gather")
        t0 = dog._inflight[-1][2]
        assert dog.check_once(now=t0 + 1.0) is None and dog.pending() == 1 and aborted == []
        err = dog.check_once(now=t0 + 6.0)
        assert err is not None and err.startswith("layer 2: gather did not complete within 5.0 s")
        assert aborted == [err]
    finally:
        dog.stop()


def test_watchdog_aborts_on_an_async_nccl_error():
    dog, aborted = _dog(async_error="NCCL reported remote error")
    try:
        assert dog.check_once() == "NCCL reported remote error" and aborted == ["NCCL reported remote error"]
        # the error stays: the hot path raises it at the next call
        assert dog.error == "NCCL reported remote error"
    finally:
        dog.stop()


def test_watchdog_thread_finds_the_error_by_itself():
    aborted = []
    dog = Watchdog(lambda: None, aborted.append, timeout_s=0.05, period_s=0.01)
    try:
        dog.watch(FakeEvent(False), "layer 7: gather")
        _wait_for(lambda: aborted, 2)
        assert aborted and "layer 7" in aborted[0]
    finally:
        dog.stop()


def test_sharding_error_is_a_value_error():
    assert issubclass(ShardingError, ValueError)


class RecapturedEvent:
    def query(self) -> bool:
        raise RuntimeError("CUDA error: invalid argument")  # what cudaEventQuery says after a capture


def test_watchdog_drops_an_event_recorded_again_in_a_capture():
    dog, aborted = _dog(timeout_s=5.0)
    try:
        dog.watch(RecapturedEvent(), "layer 1: gather")
        t0 = dog._inflight[-1][2]
        assert dog.check_once(now=t0 + 10.0) is None and dog.pending() == 0 and aborted == []
    finally:
        dog.stop()


def test_watchdog_thread_ends_a_process_whose_host_never_comes_for_the_error():
    """The thread by itself: an error, no call that raises it, then ``on_stuck`` (once)."""
    ended = []
    dog = Watchdog(lambda: "NCCL reported remote error", lambda m: None, timeout_s=5.0, period_s=0.01,
                   on_stuck=ended.append, stuck_after_s=0.05)
    try:
        _wait_for(lambda: ended, 3)
        assert len(ended) == 1 and ended[0].startswith("NCCL reported remote error; no call through")
    finally:
        dog.stop()


def test_a_stopped_watchdog_does_not_end_the_process():
    ended = []
    dog = Watchdog(lambda: "NCCL reported remote error", lambda m: None, timeout_s=5.0, period_s=3600,
                   on_stuck=ended.append, stuck_after_s=0.5)
    dog.check_once()
    dog.stop()  # the communicator was closed: nobody is held
    assert dog.escalate_if_stuck() is False and ended == []


def test_end_process_says_its_last_words_even_past_a_failing_handler(tmp_path):
    """``end_process`` from a helper thread while the main thread is held: stderr gets the reason,
    every handler runs (one that raises does not stop the next), the exit code is EXIT_CODE, and a
    removed handler is not called."""
    import subprocess
    import sys

    from wsharding.fatal import EXIT_CODE

    said = tmp_path / "said.txt"
    code = f"""
import threading, time
from wsharding.fatal import add_last_words, end_process, remove_last_words
def broken(msg): raise RuntimeError("a handler that fails")
def removed(msg): open({str(said)!r}, "a").write("removed was called\\n")
add_last_words(broken)
add_last_words(removed)
add_last_words(lambda msg: open({str(said)!r}, "a").write(msg + "\\n"))
remove_last_words(removed)
threading.Thread(target=end_process, args=("layer 5: gather did not complete",)).start()
time.sleep(60)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert p.returncode == EXIT_CODE
    assert f"wsharding: ending this process (exit code {EXIT_CODE}): layer 5: gather did not complete" in p.stderr
    assert said.read_text() == "layer 5: gather did not complete\n"


def test_watchdog_paused_for_a_capture_queries_nothing_until_the_next_eager_gather():
    """Querying an event that a CUDA-graph capture is recording would invalidate the capture."""

    class MustNotBeQueried:
        def query(self) -> bool:
            raise AssertionError("queried during a capture")

    dog, aborted = _dog(timeout_s=0.0)
    try:
        dog.watch(MustNotBeQueried(), "layer 1: gather")
        dog.pause_for_capture()
        assert dog.paused and dog.pending() == 0  # forgotten: the capture is ordered after them
        assert dog.check_once(now=1e12) is None and aborted == []
        dog.watch(FakeEvent(True), "layer 2: gather")  # the next eager gather resumes the checks
        assert not dog.paused and dog.check_once() is None and dog.pending() == 0
    finally:
        dog.stop()


def test_a_watchdog_that_fails_reports_it_instead_of_dying_silently():
    def broken() -> str | None:
        raise OSError("libnccl went away")

    dog = Watchdog(broken, lambda m: None, timeout_s=5.0, period_s=0.01)
    try:
        _wait_for(lambda: dog.error, 3)
        assert dog.error == "the watchdog failed: OSError: libnccl went away"
    finally:
        dog.stop()


def test_a_host_held_inside_nccl_still_gets_the_process_ended():
    """The host thread holds the communicator's lock inside an NCCL call that does not return: the
    watchdog cannot take the lock (to query or abort), yet still finds the overdue gather and ends
    the process instead of waiting on the lock with it."""
    import threading

    ended: list[str] = []
    aborted: list[str] = []
    lock = threading.RLock()
    inside_nccl = threading.Event()
    release = threading.Event()

    def host() -> None:
        with lock:  # a blocking ncclAllGather that never returns
            inside_nccl.set()
            release.wait(30)

    t = threading.Thread(target=host, daemon=True)
    t.start()
    inside_nccl.wait(5)
    dog = Watchdog(lambda: None, aborted.append, timeout_s=0.1, period_s=0.01, lock=lock,
                   on_stuck=ended.append, stuck_after_s=0.05)
    try:
        dog.watch(FakeEvent(False), "layer 6: gather")
        _wait_for(lambda: ended, 5)
        assert len(ended) == 1 and ended[0].startswith(
            "layer 6: gather did not complete within 0.1 s, and the host thread has been inside a call into NCCL")
        assert aborted == []  # the abort needs the lock: the process exit releases everything instead
    finally:
        release.set()
        dog.stop()
        t.join(5)


class RecordingPlanner:
    """The per-layer calls of a planner, recorded."""

    def __init__(self):
        self.calls = []

    def block_start(self, layer):
        self.calls.append(("start", layer))

    def block_end(self, layer):
        self.calls.append(("end", layer))

    def abort_step(self):
        self.calls.append(("abort",))


def test_planned_block_forward_wraps_and_unwraps():
    block = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    want = block(x)
    planner = RecordingPlanner()
    handle = PlannedBlockForward(block, 3, planner)
    assert torch.equal(block(x), want) and torch.equal(block.forward(x), want)
    # the hooks' sequence, for a call through the module and through .forward alike
    assert planner.calls == [("start", 3), ("end", 3)] * 2
    assert not block._forward_pre_hooks and not block._forward_hooks  # torch's fast path stays
    handle.remove()
    assert "forward" not in block.__dict__  # the class's forward again
    block(x)
    assert len(planner.calls) == 4


def test_planned_block_forward_keeps_other_wrappers():
    block = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    seen = []
    theirs_inner = block.forward

    def theirs(*a):
        seen.append("theirs")
        return theirs_inner(*a)

    block.forward = theirs  # someone wrapped the block before us: called inside ours, restored after
    planner = RecordingPlanner()
    ours = PlannedBlockForward(block, 0, planner)
    block(x)
    assert seen == ["theirs"] and planner.calls == [("start", 0), ("end", 0)]
    ours.remove()
    assert block.__dict__["forward"] is theirs
    # someone wraps after us: ours cannot come off the chain, so it stays in it doing nothing
    ours = PlannedBlockForward(block, 0, planner)
    ours_inner = block.forward
    block.forward = lambda *a: ours_inner(*a)
    ours.remove()
    planner.calls.clear()
    assert torch.equal(block(x), theirs_inner(x))
    assert planner.calls == []


def block_called_alone(ctx):
    # 3 blocks, 2 slots: after a step block 0's slot holds block 2. Called on its own, through its
    # forward, block 0 gathers its weights again (with module hooks, .forward skipped the planner and
    # computed with block 2's weights).
    model, ref = Blocks(), Blocks()
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(ctx.rank))
    ws = shard_blocks(model, "layers", ["*"], ctx.comm)
    with torch.no_grad():
        full = torch.equal(model(x), ref(x))
        alone = torch.equal(model.layers[0].forward(x), ref.layers[0](x))
    misses = ws.planner.misses
    ws.close()
    return full, alone, misses, "forward" in model.layers[0].__dict__


def test_a_block_called_through_its_forward_is_gathered_again(cluster_of):
    for full, alone, misses, wrapped_after_close in cluster_of(2).run(block_called_alone):
        assert full and alone
        assert misses == 1
        assert not wrapped_after_close


def sharded_twice(ctx):
    # Without the guard the second sharding ran, and its planner and the first one gathered into each
    # other's slots: the outputs were silently wrong on every rank.
    model, ref = Blocks(), Blocks()
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(ctx.rank))
    ws = shard_blocks(model, "layers", ["*"], ctx.comm)
    said = []
    try:
        shard_blocks(model, "layers", ["*"], ctx.comm)
    except ShardingError as e:
        said.append(str(e))
    with torch.no_grad():
        still_equal = torch.equal(model(x), ref(x))  # the refused attempt changed nothing
        ws.close()
        try:
            shard_blocks(model, "layers", ["*"], ctx.comm)
        except ShardingError as e:
            said.append(str(e))
    return said, still_equal


def test_a_model_sharded_twice_is_refused_naming_the_layer_and_rank(cluster_of):
    for rank, (said, still_equal) in enumerate(cluster_of(2).run(sharded_twice)):
        assert still_equal
        open_, closed = said
        assert open_.startswith(f"layer 0 on rank {rank}: this module is already sharded by a WeightSharding that is "
                                "still open")
        assert "close it (ws.close()) and shard a freshly built model" in open_
        assert closed.startswith(f"layer 0 on rank {rank}: this module's weight sharding was closed")
