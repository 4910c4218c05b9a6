"""One registry of communicators (wsharding.comm_by_name): the "auto" rule reads it, unknown names
are refused naming the choices, and what a communicator can do is its own answer, not its class."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from wsharding import comm_by_name as C
from wsharding.core.comm import Communicator
from wsharding.core.errors import InvalidArgument, Unsupported


def test_the_choices_are_auto_then_the_registry_in_order():
    assert C.COMM_CHOICES == ("auto", "nccl", "torch")
    assert C.COMMS["nccl"].devices == ("cuda",) and C.COMMS["torch"].devices == ("cpu", "cuda")


def test_auto_is_the_first_communicator_that_runs_on_the_ranks_devices(monkeypatch):
    ours = C.CommKind("nccl", "ours", ("cuda",), C.COMMS["nccl"].make, lambda: True)
    monkeypatch.setitem(C.COMMS, "nccl", ours)
    assert C.resolve_comm("auto", on_gpus=True) == "nccl"
    assert C.resolve_comm("auto", on_gpus=False) == "torch"  # ours gathers on GPUs only
    monkeypatch.setitem(C.COMMS, "nccl", C.CommKind("nccl", "ours", ("cuda",), ours.make, lambda: False))
    assert C.resolve_comm("auto", on_gpus=True) == "torch"  # no libnccl new enough here
    assert C.resolve_comm("nccl", on_gpus=False) == "nccl" and C.resolve_comm("torch", on_gpus=True) == "torch"


def test_a_new_communicator_is_one_registry_line(monkeypatch):
    """Put first in the registry, a communicator that runs here on CPU is what "auto" picks, and
    shard_comm_for makes it over the rank's group (the whole world by default)."""
    made = []
    new = C.CommKind("mine", "a test communicator", ("cpu",), lambda ctx, g: made.append(g) or "mine over " + str(g))
    monkeypatch.setattr(C, "COMMS", {"mine": new, **C.COMMS})
    assert C.resolve_comm("auto", on_gpus=False) == "mine"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # CPU ranks
    ctx = SimpleNamespace(world_size=4, rank=1)
    assert C.shard_comm_for(ctx, "auto") == "mine over 4" and C.shard_comm_for(ctx, "mine", 2) == "mine over 2"
    assert made == [4, 2]


def test_an_unknown_communicator_is_refused_naming_the_choices():
    with pytest.raises(InvalidArgument, match=r"^unknown communicator 'gloo': use one of 'auto', 'nccl', 'torch'$"):
        C.resolve_comm("gloo", on_gpus=False)
    with pytest.raises(InvalidArgument, match="unknown communicator 'NCCL'"):
        C.shard_comm_for(SimpleNamespace(world_size=2, rank=0), "NCCL")


def _comm(device: str, world_size: int, **can) -> Communicator:
    c = Communicator()
    c.device, c.world_size = torch.device(device), world_size
    for k, v in can.items():
        setattr(c, k, v)
    return c


def test_graph_capture_is_refused_from_what_the_communicator_answers():
    assert C.graph_unsupported(_comm("cpu", 2)) == "CUDA graphs need GPUs (these are CPU ranks)"
    assert C.graph_unsupported(_comm("cuda", 1)) is None  # no gather to capture
    assert C.graph_unsupported(_comm("cuda", 2)) == "capturing gathers needs our NCCL communicator (--comm nccl)"
    assert C.graph_unsupported(_comm("cuda", 2, captures_gathers=True)) is None
    assert C.graph_unsupported(_comm("cuda", 2, captures_gathers=True, shared_gpu=True)).startswith(
        "several ranks share one GPU")


def test_a_communicator_without_an_issue_thread_refuses_one_and_has_none():
    c = _comm("cpu", 2)
    assert not c.offers_issue_thread and c.issuer is None and c.stream is None and c.group_ranks == ()
    c.set_issue_thread(False)  # nothing runs: nothing to stop
    with pytest.raises(Unsupported, match="Communicator has no issue thread: it needs our NCCL communicator"):
        c.set_issue_thread(True)
