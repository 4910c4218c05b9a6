"""The torch.distributed communicator's own edges: world size 1 (no peers: the copy is the gather),
a collective that fails as it is issued, and a backend whose work has no future."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from wsharding.core import torch_backend
from wsharding.core.comm import CommError
from wsharding.core.torch_backend import TorchDistComm, _WorkHandle


# ---- tasks (module level: spawned ranks import them by name) --------------------------------------
def world_one_gathers(ctx) -> dict:
    c = ctx.comm
    issued_before = c.gathers_issued  # the rank process is shared by the session's tests
    chunk = torch.arange(8, dtype=torch.uint8)
    full = torch.zeros(8, dtype=torch.uint8)
    handle = c.all_gather_into(full, chunk, async_op=True)
    handle.wait()
    prepared_full = torch.zeros(8, dtype=torch.uint8)
    g = c.prepare_gather(prepared_full, chunk)
    g.start()
    called: list[int] = []
    g.add_done_callback(lambda: called.append(1))
    g.wait()
    in_place = torch.arange(8, dtype=torch.uint8)
    before = in_place.data_ptr()
    h = c.prepare_gather(in_place, in_place)
    h.start()
    h.wait()
    return {"world": c.world_size, "direct": full.tolist(), "prepared": prepared_full.tolist(), "called": called,
            "in_place": in_place.tolist(), "same_storage": in_place.data_ptr() == before,
            "issued": c.gathers_issued - issued_before}


def issue_that_fails(ctx) -> list[str]:
    """The process group refuses the collective as it is issued (here: a stand-in that raises what
    gloo raises when a peer's connection is gone): the error names the gather and the rank."""
    c = ctx.comm
    full = torch.zeros(8 * c.world_size, dtype=torch.uint8)
    chunk = full.narrow(0, c.rank * 8, 8)

    def refuse(*args, **kwargs):
        raise RuntimeError("[gloo] Connection closed by peer")

    torch_backend.all_gather_single = refuse
    messages = []
    try:
        for call in (lambda: c.prepare_gather(full, chunk, what="layer 3: gather").start(),
                     lambda: c.all_gather_into(full, chunk, async_op=True, what="layer 4: gather")):
            try:
                call()
            except CommError as e:
                messages.append(str(e))
            else:
                messages.append("no error")
    finally:
        torch_backend.all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return messages


# ---- tests --------------------------------------------------------------------------------------
def test_world_size_one_copies_the_chunk_and_calls_back(cluster_of):
    (r,) = cluster_of(1).run(world_one_gathers)
    assert r["world"] == 1
    assert r["direct"] == r["prepared"] == r["in_place"] == list(range(8))
    assert r["same_storage"] and r["called"] == [1]
    assert r["issued"] == 3  # every gather counts, the copy-only ones of world size 1 included


def test_a_collective_refused_at_issue_is_a_comm_error_naming_the_gather(cluster_of):
    for rank, msgs in enumerate(cluster_of(2).run(issue_that_fails)):
        assert msgs == [f"layer {n}: gather failed on rank {rank}: [gloo] Connection closed by peer" for n in (3, 4)]


def test_a_communicator_needs_an_initialised_process_group():
    if dist.is_initialized():
        pytest.skip("this process already has a process group")
    with pytest.raises(CommError, match=r"torch.distributed is not initialised: start the ranks first \(torchrun and wsharding.core.context.init_from_env, or a RankCluster"):
        TorchDistComm()


class _WorkWithoutFuture:
    def __init__(self) -> None:
        self.waited = 0

    def wait(self) -> None:
        self.waited += 1

    def get_future(self):
        raise RuntimeError("this backend's Work has no future")


class _WorkThatTimesOut(_WorkWithoutFuture):
    def wait(self) -> None:
        raise RuntimeError("[gloo] Timed out waiting 5000ms for recv operation to complete")


def test_a_work_without_a_future_calls_back_when_waited():
    work = _WorkWithoutFuture()
    handle = _WorkHandle(work, "layer 2: gather")
    called: list[str] = []
    handle.add_done_callback(lambda: called.append("done"))
    assert called == []  # nothing to hang it on: stamped when the caller waits
    handle.wait()
    assert called == ["done"] and work.waited == 1


def test_a_timeout_while_waiting_names_the_gather():
    with pytest.raises(CommError, match=r"^layer 2: gather did not complete: \[gloo\] Timed out"):
        _WorkHandle(_WorkThatTimesOut(), "layer 2: gather").wait()


def test_a_prepared_gather_whose_work_has_no_future_calls_back_at_once():
    """Planner traces hang their gather-end stamp on the work's future; without one, now."""
    from wsharding.core.torch_backend import TorchPreparedGather

    g = object.__new__(TorchPreparedGather)
    g._work = _WorkWithoutFuture()
    called: list[str] = []
    g.add_done_callback(lambda: called.append("now"))
    assert called == ["now"]
    g._work = None  # nothing in flight (world size 1): also at once
    g.add_done_callback(lambda: called.append("idle"))
    assert called == ["now", "idle"]
