"""Every whole-number argument of the public surface -- a size, a count, a rank, a group size, a layer
index, an alignment -- is an int or refused ([Note: whole numbers only] in ``wsharding/core/errors.py``).

One row per argument: how to pass it a value, the name its message must say, and which of the edge
values (0, -1, 10**18) are legal for it. Every row is fed ``True``, ``2.5``, ``"2"``, ``b"2"`` (never
legal: a bool is not a number, and nothing is rounded or read from text) and the three edge values; a
refusal is a package error (:class:`~wsharding.core.errors.WshardingError`) naming the argument and the
value, a legal value gets through. A new argument is one more row. No rank processes: every call here
is refused (or accepted) before anything would connect.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch

from wsharding.core.errors import WshardingError
from wsharding.core.groups import shard_group_of, shard_group_ranks

HUGE = 10**18
NEVER_LEGAL = (True, 2.5, "2", b"2")
EDGES = (0, -1, HUGE)


@dataclass(frozen=True)
class Arg:
    """One argument: ``call(value)`` passes it; ``name`` is what the refusal says; ``legal``: the edge
    values it accepts. ``passed(exc)`` tells, for a legal value, that an exception raised later (no GPU,
    an NCCL too old on purpose) came after the argument was taken."""

    name: str
    call: Callable[[object], object]
    legal: tuple[object, ...] = ()
    passed: Callable[[BaseException], bool] = lambda exc: False


# ---- builders ------------------------------------------------------------------------------------
SPEC = [("w", (4, 4), torch.float16)]


def _layout(**kw: object) -> object:
    from wsharding.core.layout import FlatLayout

    return FlatLayout(SPEC, **{"group_size": 2, **kw})


def _layout_of_shape(shape: tuple) -> object:
    from wsharding.core.layout import FlatLayout

    return FlatLayout([("w", shape, torch.float16)], 2)


def _entries(group_size: object) -> object:
    from wsharding.core.layout import FlatLayout

    return FlatLayout.from_entries(_layout().entries, group_size)


def _context(world: int = 2, rank: int = 0) -> object:
    from wsharding.core.context import RankContext

    return RankContext(rank, world, torch.device("cpu"), "gloo", "cpu-gloo", "", timedelta(seconds=1))


def _blocks(n: int = 2) -> torch.nn.Module:
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(n))
    for block in model.layers:
        block.fc = torch.nn.Linear(4, 4, bias=False)
    return model


def _shard_blocks(depth: object) -> object:
    from tests.core.test_library_edges import Loopback
    from wsharding.core.runner import shard_blocks

    return shard_blocks(_blocks(), "layers", ["fc"], Loopback(), prefetch_depth=depth)


def _weight_sharding(depth: object) -> object:
    from tests.core.test_library_edges import Loopback
    from wsharding.core.sharding import WeightSharding

    # setup (every layer declared) is where the depth meets its bound: the number of sharded layers
    return WeightSharding(Loopback(), list(_blocks().layers), {0: ["fc"], 1: ["fc"]}, prefetch_depth=depth).setup()


def _old_nccl():
    """A loaded NCCL that says it is 2.28.2: a communicator that takes its arguments stops right after,
    at the version check, on any machine (the "old nccl" row of test_bad_input)."""
    from wsharding.accel.nccl import library

    return dataclasses.replace(library.default_library(), version_code=22802)


def _nccl(**kw: object) -> object:
    from wsharding.accel.nccl.communicator import NcclCommunicator

    return NcclCommunicator(library=_old_nccl(), **kw)


def _past_nccl_arguments(exc: BaseException) -> bool:
    from wsharding.accel.nccl.library import NcclLibraryError

    return isinstance(exc, NcclLibraryError)


def _from_context(g: object) -> object:
    from wsharding.accel.nccl.communicator import from_context

    return from_context(_context(), group_size=g)


def _shard_comm_for(g: object) -> object:
    from wsharding.comm_by_name import shard_comm_for

    return shard_comm_for(_context(), "torch", g)


def _model(**changes: object) -> dict:
    d = {"name": "toy", "kinds": {"a": {"groups": [{"name": "w", "dtype": "bf16", "bytes": 64}]}},
         "sequence": [["a", 2]], "defaults": {}}
    for path, value in changes.items():
        where = d
        *parents, last = path.split(".")
        for p in parents:
            where = where[int(p)] if isinstance(where, list) else where[p]
        if isinstance(where, list):
            where[int(last)] = value
        else:
            where[last] = value
    return d


def _model_field(path: str) -> Callable[[object], object]:
    from wsharding.costmodel import model_from_dict

    return lambda v: model_from_dict(_model(**{path: v}))


def _shape(v: object) -> object:
    from wsharding.costmodel import model_from_dict

    d = _model()
    d["kinds"]["a"]["groups"][0] = {"name": "w", "dtype": "bf16", "weights": [{"name": "q", "shape": [4, v]}]}
    return model_from_dict(d)


def _deployment(**kw: object) -> object:
    from wsharding.costmodel import Deployment, get_device

    return Deployment(**{"ranks": 2, "device": get_device("b200"), "tokens": 1, **kw})


def _cluster(**kw: object) -> object:
    from wsharding.lab.cluster import RankCluster

    return RankCluster(**{"world_size": 2, "backend": "gloo", **kw})  # not started: only its plan


# ---- the table: one row per argument -------------------------------------------------------------
ARGS: dict[str, Arg] = {
    # FlatLayout is arithmetic: a group of 10**18 ranks is a (pointless) layout, not an error
    "FlatLayout group_size": Arg("group_size", lambda v: _layout(group_size=v), legal=(HUGE,)),
    "FlatLayout alignment": Arg("alignment", lambda v: _layout(alignment=v)),  # 10**18: no power of two
    "FlatLayout chunk_alignment": Arg("chunk_alignment", lambda v: _layout(chunk_alignment=v)),
    "FlatLayout shape dimension": Arg("dimension", lambda v: _layout_of_shape((4, v)), legal=(0, HUGE)),
    "FlatLayout.from_entries group_size": Arg("group_size", _entries, legal=(HUGE,)),
    "FlatLayout.chunk_range rank": Arg("rank", lambda v: _layout().chunk_range(v), legal=(0,)),
    "FlatLayout.pieces rank": Arg("rank", lambda v: _layout().pieces(v), legal=(0,)),
    "FlatLayout.owner_of byte": Arg("byte", lambda v: _layout().owner_of(v), legal=(0,)),
    "shard_group_ranks group_size": Arg("group_size", lambda v: shard_group_ranks(8, v)),
    "shard_group_of rank": Arg("rank", lambda v: shard_group_of(v, 8, 4), legal=(0,)),
    "RankContext rank": Arg("rank", lambda v: _context(rank=v), legal=(0,)),
    "RankContext world_size": Arg("world_size", lambda v: _context(world=v), legal=(HUGE,)),
    "RankContext.shard_comm group_size": Arg("group_size", lambda v: _context().shard_comm(v)),
    "shard_comm_for group_size": Arg("group_size", _shard_comm_for),
    "nccl from_context group_size": Arg("group_size", _from_context),
    "NcclCommunicator cta_policy": Arg("cta_policy", lambda v: _nccl(cta_policy=v), legal=(0,),
                                       passed=_past_nccl_arguments),
    # the index is checked against the GPUs once CUDA is up (startup.cuda_device); here only its kind
    "NcclCommunicator device": Arg("device", lambda v: _nccl(device=v), legal=(0, HUGE), passed=_past_nccl_arguments),
    "RankCluster world_size": Arg("world_size", lambda v: _cluster(world_size=v)),
    "RankCluster threads_per_rank": Arg("threads_per_rank", lambda v: _cluster(threads_per_rank=v)),
    "RankCluster ranks_per_gpu": Arg("ranks_per_gpu", lambda v: _cluster(ranks_per_gpu=v)),
    "shard_blocks prefetch_depth": Arg("prefetch_depth", _shard_blocks),
    "WeightSharding prefetch_depth": Arg("prefetch_depth", _weight_sharding),
    "model file repeat": Arg("toy.repeat", _model_field("repeat")),
    "model file first_layer": Arg("toy.first_layer", _model_field("first_layer"), legal=(0, HUGE)),
    "model file sequence count": Arg("toy.sequence[0].count", _model_field("sequence.0.1")),
    "model file bytes": Arg("toy.kinds.a.w.bytes", _model_field("kinds.a.groups.0.bytes"), legal=(HUGE,)),
    "model file shape": Arg("toy.kinds.a.w.weights.q.shape", _shape, legal=(HUGE,)),
    "model file kv_bytes_per_token": Arg("toy.kv_bytes_per_token", _model_field("kv_bytes_per_token"), legal=(HUGE,)),
    "model file defaults.ranks": Arg("toy.defaults.ranks", _model_field("defaults.ranks"), legal=(HUGE,)),
    "model file defaults.tokens": Arg("toy.defaults.tokens", _model_field("defaults.tokens"), legal=(0, HUGE)),
    "model file defaults.context": Arg("toy.defaults.context", _model_field("defaults.context"), legal=(HUGE,)),
    "model file defaults.kv_pool_bytes": Arg("toy.defaults.kv_pool_bytes", _model_field("defaults.kv_pool_bytes"),
                                             legal=(0, HUGE)),
    "Deployment ranks": Arg("ranks", lambda v: _deployment(ranks=v), legal=(HUGE,)),
    "Deployment tokens": Arg("tokens", lambda v: _deployment(tokens=v), legal=(0, HUGE)),
    "Deployment context": Arg("context", lambda v: _deployment(context=v), legal=(HUGE,)),
    "Deployment kv_bytes_per_token": Arg("kv_bytes_per_token", lambda v: _deployment(kv_bytes_per_token=v),
                                         legal=(HUGE,)),
    "Deployment kv_pool_bytes": Arg("kv_pool_bytes", lambda v: _deployment(kv_pool_bytes=v), legal=(0, HUGE)),
}

CASES = [(key, value) for key in ARGS for value in NEVER_LEGAL + EDGES]


@pytest.mark.parametrize(("key", "value"), CASES, ids=[f"{k}={v!r}" for k, v in CASES])
def test_whole_number_argument(key: str, value: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from wsharding.accel.nccl import library

    monkeypatch.delenv(library.ENV_VAR, raising=False)
    monkeypatch.delenv("NCCL_CTA_POLICY", raising=False)
    arg = ARGS[key]
    legal = value in arg.legal and not isinstance(value, bool)
    try:
        arg.call(value)
    except Exception as exc:  # noqa: BLE001 - the kind is asserted below
        if legal:
            assert arg.passed(exc), f"{key}: the legal value {value!r} was refused: {type(exc).__name__}: {exc}"
            return
        assert isinstance(exc, WshardingError), f"{key}={value!r}: {type(exc).__name__}: {exc}"
        message = str(exc)
        assert arg.name in message, f"{key}={value!r}: the message does not name {arg.name!r}: {message}"
        shown = repr(value) if value in NEVER_LEGAL else str(value)
        assert shown in message, f"{key}={value!r}: the message does not show the value: {message}"
        return
    assert legal, f"{key}: {value!r} was accepted"


def test_require_int_itself():
    """The helper: numpy integers pass as plain ints; the message names the argument, the value, why and
    what to pass; ``error`` keeps a module's one error class."""
    import numpy as np

    from wsharding.core.errors import InvalidArgument, InvalidType, require_int
    from wsharding.core.layout import LayoutError

    assert require_int(np.int64(4), "n") == 4 and type(require_int(np.int64(4), "n")) is int
    with pytest.raises(InvalidType, match=r"f: n: expected an integer, got 2.0 \(a float, never rounded: write 2\)"):
        require_int(2.0, "n", where="f")
    with pytest.raises(InvalidType, match=r"got '8' \(a str: numbers are not read from text; write 8, not '8'\)"):
        require_int("8", "n")
    with pytest.raises(InvalidArgument, match=r"n: must be <= 3, got 4; pass an int in 1 .. 3"):
        require_int(4, "n", minimum=1, maximum=3)
    with pytest.raises(LayoutError, match="a bool, not a number"):
        require_int(True, "n", error=LayoutError)
