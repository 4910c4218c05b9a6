"""The bad-input table: every kind of mistake a user can make, tried once, each answered by an
error (or, for a weight left replicated, a warning) of one exact class whose message names the
culprit -- the weight, the rank, the file, the option -- and says what to do. Never a hang, never a
silent conversion.

The "Errors you may see" page (docs/errors.md) is rendered from this table and the command's rows
(tests/lab/test_readme_errors.py, which also checks that the page matches).
"""

from __future__ import annotations

import builtins
import dataclasses
import io
import os
import struct
import threading
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from wsharding.core.comm import Communicator, DoneHandle


@dataclass(frozen=True)
class Case:
    """One row: what the user did, the class that answers it, the words that must name the culprit,
    what to do (README), and the code that does it (given a scratch folder and pytest's monkeypatch)."""

    did: str
    error: str  #: "module:Class" -- imported late, so that rendering the README needs no torch import
    culprit: tuple[str, ...]
    todo: str
    trigger: Callable[[Path, pytest.MonkeyPatch], object]
    warning: bool = False

    def error_class(self) -> type[BaseException]:
        module, _, name = self.error.partition(":")
        return getattr(__import__(module, fromlist=[name]), name)


# ---- the triggers (each does the mistake once) ----------------------------------------------------
class _RankOfTwo(Communicator):
    """Rank 0 of a group of 2 without processes: declaring, validating and loading do not communicate."""

    rank, world_size, device, mode = 0, 2, torch.device("cpu"), "cpu-gloo"


def _non_divisible_rows(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.core.sharding import WeightSharding

    block = torch.nn.Module()
    block.odd = torch.nn.Linear(4, 3, bias=False)  # 3 rows over 2 ranks
    block.even = torch.nn.Linear(4, 4, bias=False)
    return WeightSharding(_RankOfTwo(), [block], {0: ["odd", "even"]})


def _tp_target(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.core.sharding import WeightSharding

    # A module of the user's own that tensor parallelism already splits (the package's linears of tp > 1
    # are left alone with a reason in ws.report(); an unknown module cannot be decided, so it is refused).
    block = torch.nn.Module()
    block.proj = torch.nn.Module()
    block.proj.weight = torch.nn.Parameter(torch.zeros(8, 8))
    block.proj.tp_size = 2
    return WeightSharding(_RankOfTwo(), [block], {0: ["proj"]})


def _weight_normed_target(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.core.sharding import WeightSharding

    # A weight computed from others at each forward: bound to a slot, the next forward would recompute
    # it from the replicated originals (and with grad on, guards.install failed with "leaf variables").
    block = torch.nn.Module()
    block.fc = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(8, 8, bias=False))
    return WeightSharding(_RankOfTwo(), [block], {0: ["fc"]})


def _targets_beyond_layers(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.core.sharding import WeightSharding

    # Key 5 of two layers: its targets were never declared, and the sharding saved nothing of them.
    model = _blocks_model()
    return WeightSharding(_RankOfTwo(), list(model.layers), {0: ["fc1"], 5: ["fc1"]})


def _shared_block(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.core.sharding import WeightSharding

    # one block at two places of the list (ALBERT-style sharing): its weight would be shrunk, bound to a
    # slot and gathered once per place
    shared, other = torch.nn.Module(), torch.nn.Module()
    shared.fc = torch.nn.Linear(4, 4, bias=False)
    other.fc = torch.nn.Linear(4, 4, bias=False)
    return WeightSharding(_RankOfTwo(), [shared, other, shared], {i: ["fc"] for i in range(3)})


def _strided_target(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.core.sharding import WeightSharding

    block = torch.nn.Module()
    block.fc = torch.nn.Linear(4, 6, bias=False)
    block.fc.weight = torch.nn.Parameter(torch.randn(4, 6).t())  # a transposed weight: strides (1, 6)
    return WeightSharding(_RankOfTwo(), [block], {0: ["fc"]})


class _ThreadRank(Communicator):
    """One of two ranks that are threads of this process, gathering through shared memory: enough
    for finalize's agreement, which is all the case below reaches."""

    world_size, device, mode = 2, torch.device("cpu"), "cpu-threads"

    def __init__(self, rank: int, parts: list, meet: threading.Barrier) -> None:
        self.rank, self.parts, self.meet = rank, parts, meet

    def alloc(self, nbytes: int, *, tag: str = "") -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8)

    def all_gather_into(self, full: torch.Tensor, chunk: torch.Tensor, **_: object) -> DoneHandle:
        self.parts[self.rank] = chunk.clone()
        self.meet.wait()
        full.copy_(torch.cat(self.parts))
        self.meet.wait()
        return DoneHandle()

    def barrier(self) -> None:
        self.meet.wait()


def _replicas_differ(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.core.runner import shard_blocks

    # Two ranks that built their models without one seed: rank 1 (a thread) and rank 0 (here).
    parts: list = [None, None]
    meet = threading.Barrier(2, timeout=60)
    peer = threading.Thread(target=lambda: pytest.raises(Exception, shard_blocks, _blocks_model(), "layers", ["fc1"],
                                                         _ThreadRank(1, parts, meet)), daemon=True)
    peer.start()
    try:
        return shard_blocks(_blocks_model(), "layers", ["fc1"], _ThreadRank(0, parts, meet))
    finally:
        peer.join(60)


class _CommOfTwo(_RankOfTwo):
    """A communicator as far as shard_blocks' argument check can tell; the refusals below come before
    any gather or allocation."""

    def all_gather_into(self, full: torch.Tensor, chunk: torch.Tensor, *, async_op: bool = False) -> object:
        raise AssertionError("gathered before the arguments were checked")


def _blocks_model() -> torch.nn.Module:
    """A model of two blocks in ``model.layers``, each with linears ``fc1`` and ``fc2``."""
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(2))
    for block in model.layers:
        block.fc1 = torch.nn.Linear(4, 4, bias=False)
        block.fc2 = torch.nn.Linear(4, 4, bias=False)
    return model


def _shard_blocks(**changes: object) -> object:
    """``shard_blocks(model, "layers", ["fc1"], comm)`` with one argument changed (``blocks`` may be a
    function of the model)."""
    from wsharding.core.runner import shard_blocks

    model = _blocks_model()
    args = {"blocks": "layers", "patterns": ["fc1"], "comm": _CommOfTwo(), "sharded_layers": None, **changes}
    blocks = args.pop("blocks")
    blocks = blocks(model) if callable(blocks) else blocks
    return shard_blocks(model, blocks, args.pop("patterns"), args.pop("comm"), **args)


def _patterns_glob_str(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    return _shard_blocks(patterns="fc*")  # read character by character, "*" matched every linear


def _patterns_name_str(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    return _shard_blocks(patterns="fc1")  # read as "f", "c", "1": "no layer has a shardable target"


def _blocks_list(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    return _shard_blocks(blocks=lambda model: list(model.layers))  # the message held every block's repr


def _blocks_unknown(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    return _shard_blocks(blocks="model.layers")  # this model keeps them in "layers": an AttributeError


def _comm_none(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    return _shard_blocks(comm=None)  # an AttributeError on None, deep inside


def _comm_str(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    return _shard_blocks(comm="gloo")


def _comm_context(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from datetime import timedelta

    from wsharding.core.context import RankContext

    ctx = RankContext(0, 2, torch.device("cpu"), "gloo", "cpu-gloo", "", timedelta(seconds=1))
    return _shard_blocks(comm=ctx)


def _sharded_layers_float(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    return _shard_blocks(sharded_layers=[1.5])  # matched no layer: nothing sharded, nothing said


def _sharded_layers_int(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    return _shard_blocks(sharded_layers=1)  # a TypeError from set(1)


def _prefetch_depth_zero(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    return _shard_blocks(prefetch_depth=0)  # no slot to gather ahead into


def _on_miss_unknown(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    return _shard_blocks(on_miss="skip")  # a layer would compute with another layer's bytes


def _pattern_typo(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from tests.core.test_library_edges import Loopback
    from wsharding.core.runner import shard_blocks

    # "fc_2" for "fc2": it matched nothing, and fc2 stayed whole on every rank without a word
    return shard_blocks(_blocks_model(), "layers", ["fc1", "fc_2"], Loopback())


def _declared_name_typo(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.core.sharding import WeightSharding

    block = torch.nn.Module()
    block.fc1 = torch.nn.Linear(4, 4, bias=False)
    block.fc2 = torch.nn.Linear(4, 4, bias=False)
    return WeightSharding(_RankOfTwo(), [block], {0: ["fc1", "fc_2"]})


def _load_sharded_keep(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.checkpoint import load_sharded

    # a TypeError before: shard_blocks() got multiple values for keyword argument 'keep_initial_weights'
    return load_sharded(_blocks_model(), tmp / "absent.safetensors", "layers", ["fc1"], _CommOfTwo(),
                        keep_initial_weights=True)


def _second_thread(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    import threading

    from tests.core.test_library_edges import Loopback
    from wsharding.core.runner import shard_blocks

    model = _blocks_model()
    ws = shard_blocks(model, "layers", ["fc1"], Loopback())
    # a request handler's thread is inside a step (begin_step) when a second one runs the model
    t = threading.Thread(target=ws.planner.begin_step)
    t.start()
    t.join()
    with torch.no_grad():
        return model.layers[0](torch.ones(1, 4))


def _old_nccl(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.accel.nccl import library
    from wsharding.accel.nccl.communicator import NcclCommunicator

    mp.delenv(library.ENV_VAR, raising=False)
    old = dataclasses.replace(library.default_library(), version_code=22802)  # NCCL 2.28.2
    return NcclCommunicator(library=old)


def _mapped_old_nccl(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.accel.nccl.library import default_library
    from wsharding.core.sharding import WeightSharding

    image_nccl = dataclasses.replace(default_library(), version_code=22809)

    class Ours(_RankOfTwo):  # what map_own_chunk asks of our NCCL communicator, with the image's NCCL
        pool = object()
        library = image_nccl

        def slot_policy(self, map_own_chunk="auto"):
            from wsharding.accel.mapped_slots import MappedSlotPolicy

            return MappedSlotPolicy(self, map_own_chunk)

    return WeightSharding(Ours(), map_own_chunk=True)


def _gather_launch(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.accel.nccl.communicator import NcclCommunicator

    return NcclCommunicator(gather_launch="eager")


def _cta_policy_env(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.accel.nccl import library
    from wsharding.accel.nccl.communicator import NcclCommunicator

    mp.delenv(library.ENV_VAR, raising=False)
    mp.setenv("NCCL_CTA_POLICY", "0")  # SM kernels, while the copy engine needs policy 2
    return NcclCommunicator(cta_policy=2)


def refuse_opening(mp: pytest.MonkeyPatch, path: str | os.PathLike) -> None:
    """Make opening ``path`` (or a symlink to what it names) fail the test with an AssertionError: a path
    that is not a regular file must be refused before it is opened -- and should that check go, the
    case fails here instead of waiting on a FIFO for a writer or reading /dev/zero until killed."""
    target = os.path.realpath(path)

    def guard(real: Callable) -> Callable:
        def opener(file: object, *args: object, **kwargs: object) -> object:
            if isinstance(file, (str, bytes, os.PathLike)) and os.path.realpath(os.fsdecode(file)) == target:
                raise AssertionError(f"{path} was opened before it was checked")
            return real(file, *args, **kwargs)
        return opener

    for module in (os, io, builtins):  # os.open; io.open (pathlib's); open
        mp.setattr(module, "open", guard(module.open))


def _checkpoint(tmp: Path, edit: Callable[[dict, Path], None], quant: str | None = None,
                read: str | None = None) -> object:
    from wsharding.checkpoint import load_checkpoint, save_checkpoint
    from wsharding.core.sharding import WeightSharding
    from wsharding.models import PRESETS, ToyDecoder

    cfg = PRESETS["tiny"] if quant is None else PRESETS["tiny"].with_(quant=quant)
    if quant == "fp8_block":
        cfg = cfg.with_(quant_block=48)  # 128 does not divide the tiny preset's dimensions
    path = tmp / "tiny.safetensors"
    save_checkpoint(ToyDecoder(cfg), path)
    edit(load_file(path), path)
    model = ToyDecoder(cfg, seed=1, weight_sharding=WeightSharding(_RankOfTwo(), sharded_layers=range(1, cfg.layers)))
    return load_checkpoint(model, read or path)


def _ckpt_missing(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    def edit(t: dict, path: Path) -> None:
        del t["layers.2.moe.latent_up.weight"]
        save_file(t, path)

    return _checkpoint(tmp, edit)


def _ckpt_extra(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    def edit(t: dict, path: Path) -> None:
        t["layers.9.extra.weight"] = torch.zeros(2)
        save_file(t, path)

    return _checkpoint(tmp, edit)


def _ckpt_misshapen(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    def edit(t: dict, path: Path) -> None:
        t["layers.1.attn.k_proj.weight"] = t["layers.1.attn.k_proj.weight"][:, :-1].contiguous()
        save_file(t, path)

    return _checkpoint(tmp, edit)


def _ckpt_dtype(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.models import PRESETS, ToyDecoder

    def edit(t: dict, path: Path) -> None:  # a BF16 tensor where the FP8 model keeps e4m3 bytes
        t["layers.1.attn.o_proj.weight"] = ToyDecoder(PRESETS["tiny"]).state_dict()["layers.1.attn.o_proj.weight"]
        save_file(t, path)

    return _checkpoint(tmp, edit, quant="fp8")


def _ckpt_int_into_float(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    def edit(t: dict, path: Path) -> None:  # the embedding has no weight loader: copy_ made floats of the ints
        t["embed.weight"] = t["embed.weight"].to(torch.int32)
        save_file(t, path)

    return _checkpoint(tmp, edit)


def _ckpt_scale(quant: str, key: str, index: tuple[int, ...], value: float) -> Callable[[Path, pytest.MonkeyPatch], object]:
    """A trigger: the tiny checkpoint quantized as ``quant``, with ``value`` written at ``key[index]``."""
    def trigger(tmp: Path, mp: pytest.MonkeyPatch) -> object:
        def edit(t: dict, path: Path) -> None:
            t[key][index] = value
            save_file(t, path)

        return _checkpoint(tmp, edit, quant=quant)
    return trigger


# Unchecked, block FP8's UE8M0 requant made a NaN scale 1.0 and its block's codes NaN (an inf: +-448, and
# a finite, wrong output); a NaN k scale made every q, k and v code NaN (tests/loading/test_scale_values.py).
_ckpt_scale_nan = _ckpt_scale("fp8_block", "layers.1.attn.q_proj.weight_scale_inv", (1, 1), float("nan"))
_ckpt_scale_inf = _ckpt_scale("int8", "layers.2.moe.latent_up.weight_scale", (5,), float("inf"))
_ckpt_scale_zero = _ckpt_scale("fp8", "layers.1.attn.o_proj.input_scale", (0,), 0.0)
_ckpt_scale_negative = _ckpt_scale("fp8", "layers.1.attn.k_proj.weight_scale", (), -0.5)


def _ckpt_truncated(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    def edit(t: dict, path: Path) -> None:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])  # a copy that stopped half way

    return _checkpoint(tmp, edit)


def _ckpt_absent(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    return _checkpoint(tmp, lambda t, path: path.unlink())


def _ckpt_fifo(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    def edit(t: dict, path: Path) -> None:  # a named pipe where the file was: os.open waited for a writer
        path.unlink()
        os.mkfifo(path)
        refuse_opening(mp, path)

    return _checkpoint(tmp, edit)


def _ckpt_device(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    refuse_opening(mp, "/dev/zero")
    return _checkpoint(tmp, lambda t, path: None, read="/dev/zero")


def _ckpt_header_length(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    def edit(t: dict, path: Path) -> None:  # the first 8 bytes claim a header of 1 TiB
        data = path.read_bytes()
        path.write_bytes(struct.pack("<Q", 2**40) + data[8:])

    return _checkpoint(tmp, edit)


def _layout_group(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.core.layout import FlatLayout

    return FlatLayout([("w", (4, 4), torch.float16)], 0)


def _layout_group_bool(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.core.layout import FlatLayout

    return FlatLayout([("w", (4, 4), torch.float16)], group_size=True)  # a bool is an int: a group of 1


def _layout_rank(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.core.layout import FlatLayout

    lay = FlatLayout([("w", (4, 4), torch.float16)], 2)
    return lay.chunk(torch.zeros(lay.total_bytes, dtype=torch.uint8), 2)


def _layout_buffer(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.core.layout import FlatLayout

    lay = FlatLayout([("w", (4, 4), torch.float16)], 2)
    return lay.views(torch.zeros(lay.total_bytes - 16, dtype=torch.uint8))


def _outside_window(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.accel.nccl.communicator import NcclCommunicator
    from wsharding.accel.nccl.symmetric import SymmetricBuffer

    inside = torch.zeros(4096, dtype=torch.uint8)
    stray = torch.zeros(256, dtype=torch.uint8)  # a plain allocation, never registered
    window = SymmetricBuffer("slot.A", 0, 4096, 4096, inside.data_ptr(), inside, window=1)
    comm = types.SimpleNamespace(pool=types.SimpleNamespace(window_of=lambda t: window if window.contains(t) else None))
    NcclCommunicator.require_window(comm, inside[:128], "full", "layer 3: gather")  # inside: accepted
    return NcclCommunicator.require_window(comm, stray, "chunk", "layer 3: gather")


def _unknown_preset(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.models import decoder_config

    return decoder_config("k4-like")


def _unknown_cost_preset(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.presets import load_preset

    return load_preset("kimi-k4")


def _binary_model_file(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.costmodel import load_model_file

    path = tmp / "model.bin"
    path.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(128, 256)))  # a UnicodeDecodeError before
    return load_model_file(path)


def _device_model_file(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.costmodel import load_model_file

    refuse_opening(mp, "/dev/zero")  # read_text read it until the process was killed
    return load_model_file("/dev/zero")


def _yaml_alias_bomb(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.costmodel import load_model_file

    # nine aliases nine deep: a few hundred bytes that expand to 9**7 values
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 7)]
    path = tmp / "model.yaml"
    path.write_text("\n".join(["name: laughs", *lines, "kinds: {a: {groups: *l6}}", "sequence: [[a, 1]]"]) + "\n")
    return load_model_file(path)


def _unknown_group(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.linear.groups import ParallelState

    return ParallelState.logical(2, 0).group_named("dp_attn")


def _ranks_zero(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.lab.cluster import RankCluster

    return RankCluster(0)


def _torchrun_env(mp: pytest.MonkeyPatch, **values: str) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        mp.delenv(name, raising=False)
    for name, value in values.items():
        mp.setenv(name, value)


def _init_outside_torchrun(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.core.context import init_from_env

    _torchrun_env(mp)
    return init_from_env()


def _init_rank_not_a_number(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.core.context import init_from_env

    _torchrun_env(mp, RANK="abc", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    return init_from_env()


def _init_rank_outside_world(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.core.context import init_from_env

    _torchrun_env(mp, RANK="3", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    return init_from_env()


def _init_nccl_without_gpu(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.core.context import init_from_env

    _torchrun_env(mp, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    mp.setattr(torch.cuda, "is_available", lambda: False)
    mp.setattr(torch.cuda, "device_count", lambda: 0)
    return init_from_env(backend="nccl")


def _threads_per_rank_zero(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.lab.cluster import RankCluster

    return RankCluster(2, threads_per_rank=0)


def _env_value_not_a_string(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.lab.cluster import RankCluster

    return RankCluster(2, env={"OMP_NUM_THREADS": 4})


def _ranks_negative(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.lab.cluster import RankCluster

    return RankCluster(2, backend="nccl", ranks_per_gpu=-1)


class _OneRank(_RankOfTwo):
    """A group of one rank in this process: its gather copies the chunk into the slot."""

    world_size, mode = 1, "cpu-one-rank (test)"

    def alloc(self, nbytes: int, *, tag: str = "") -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def prepare_gather(self, full: torch.Tensor, chunk: torch.Tensor, *, what: str = "") -> object:
        from wsharding.core.comm import PreparedGather

        class Copy(PreparedGather):
            def start(self, gate=None, marks=None, *, inline=False) -> None:
                full.copy_(chunk)

            def wait(self, stream=None) -> None:
                pass

        return Copy()

    def all_gather_into(self, full, chunk, *, async_op=False, stream=None, what=""):
        from wsharding.core.comm import DoneHandle

        if full.data_ptr() != chunk.data_ptr():
            full.copy_(chunk)
        return DoneHandle()

    def fork(self, event) -> None:
        pass

    def raise_if_failed(self, what: str) -> None:
        pass

    def barrier(self) -> None:
        pass


def _sharded(step: bool = True) -> torch.nn.Module:
    """``_blocks_model()`` with ``fc1`` and ``fc2`` sharded over one rank, after one step (a block reads
    ``x @ fc1 @ fc2``): its slots hold the last layer's weights."""
    from wsharding.core.runner import shard_blocks

    model = _blocks_model()

    def forward(x: torch.Tensor) -> torch.Tensor:
        for block in model.layers:
            x = block.fc2(block.fc1(x))
        return x

    model.forward = forward
    shard_blocks(model, "layers", ["fc1", "fc2"], _OneRank())
    if step:
        with torch.no_grad():
            model(torch.ones(1, 4))
    return model


def _bound_read(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    return _sharded().layers[0].fc1.weight.clone()  # layer 1's bytes


def _bound_data_edit(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    return _sharded().layers[0].fc1.weight.data.mul_(2)  # torch's own .data: the version check missed it


def _bound_converted(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    return _sharded().half()


def _bound_to_meta(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    return _sharded().to("meta")  # the Parameters were replaced: the forward computed on meta tensors


def _bound_replaced(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    model = _sharded()
    model.layers[1].fc2.weight = torch.nn.Parameter(torch.zeros(4, 4))  # full_state_dict saved the old one


def _bound_weight_norm(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    return torch.nn.utils.parametrizations.weight_norm(_sharded().layers[0].fc2)


def _bound_outside_linear(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    x = torch.ones(1, 4, requires_grad=True)
    return x @ _sharded().layers[0].fc1.weight.t()


def _forward_after_destroy(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    import torch.distributed as dist

    from wsharding.core.runner import shard_blocks
    from wsharding.core.torch_backend import TorchDistComm

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp / "store"), 1), rank=0, world_size=1)
    model = _blocks_model()
    model.forward = lambda x: model.layers[1].fc1(model.layers[0].fc1(x))
    shard_blocks(model, "layers", ["fc1"], TorchDistComm())
    with torch.no_grad():
        model(torch.ones(1, 4))
        dist.destroy_process_group()
        return model(torch.ones(1, 4))


def _model_off_the_comm_device(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    import torch.distributed as dist

    from wsharding.core.runner import shard_blocks
    from wsharding.core.torch_backend import TorchDistComm

    # a CPU model beside a communicator on another device: "meta" stands in for a GPU on this machine
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp / "store"), 1), rank=0, world_size=1)
    try:
        return shard_blocks(_blocks_model(), "layers", ["fc1"], TorchDistComm(device="meta"))
    finally:
        dist.destroy_process_group()


def _export(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = _blocks_model().layers

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.layers:
                x = block.fc2(block.fc1(x))
            return x

    from wsharding.core.runner import shard_blocks

    model = Model()
    shard_blocks(model, "layers", ["fc1", "fc2"], _OneRank())
    return torch.export.export(model, (torch.ones(1, 4),))


def _pickled(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    import io

    return torch.save(_sharded(), io.BytesIO())


def _group_larger_than_world(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from datetime import timedelta

    from wsharding.core.context import RankContext

    # a script written for torchrun --nproc-per-node 8, launched with 2: the group of 8 became one of 2
    ctx = RankContext(0, 2, torch.device("cpu"), "gloo", "cpu-gloo", "", timedelta(seconds=1))
    return ctx.shard_comm(8)


def _group_not_dividing_world(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from datetime import timedelta

    from wsharding.core.context import RankContext

    ctx = RankContext(0, 6, torch.device("cpu"), "gloo", "cpu-gloo", "", timedelta(seconds=1))
    return ctx.shard_comm(4)  # groups (rank // 4) * 4: ranks 4 and 5 would be a group of 2


def _yaml_ranks_word(tmp: Path, mp: pytest.MonkeyPatch) -> object:
    from wsharding.costmodel import load_model_file

    path = tmp / "model.yaml"
    path.write_text("name: toy\nkinds: {a: {groups: [{name: w, dtype: bf16, bytes: 64}]}}\nsequence: [[a, 2]]\n"
                    "defaults: {ranks: eight}\n")  # a ValueError from int() once the plan read it
    return load_model_file(path)


_EXAMPLE_COMM = "ctx.shard_comm(group_size)"

CASES: dict[str, Case] = {
    "non-divisible rows": Case(
        "declared a weight whose rows the group size does not divide", "wsharding.core.declare:ShardingSkipWarning",
        ("layer 0", "odd.weight", "3 rows", "group size 2"),
        "a warning: the weight stays replicated; pick a group size that divides its rows to shard it",
        _non_divisible_rows, warning=True),
    "tp target": Case(
        "declared a module of your own that tensor parallelism splits (tp_size > 1)", "wsharding.core.sharding:ShardingError",
        ("layer 0", "'proj'", "tp_size 2"),
        "shard only weights replicated on every rank (tp 1); remove it from the targets", _tp_target),
    "shared block": Case(
        "declared one block (or one tied weight) at two layers", "wsharding.core.sharding:ShardingError",
        ("layer 2 fc.weight", "rank 0", "same weight as layer 0 fc.weight"),
        "leave one of the layers out (sharded_layers=...) or untie the weights", _shared_block),
    "forward after destroy_process_group": Case(
        "ran a sharded model after torch.distributed.destroy_process_group()", "wsharding.core.comm:CommError",
        ("step 1 on rank 0", "process group of this weight sharding was destroyed", "ws.close()"),
        "close the sharding (ws.close()) before destroying the group; shard a freshly built model to run again",
        _forward_after_destroy),
    "model off the comm's device": Case(
        "sharded a model whose blocks are on another device than the communicator's (built on the CPU, a GPU comm)",
        "wsharding.core.sharding:ShardingError",
        ("rank 0", "block 0's fc1.weight is on cpu", "gathers on meta", "model.to(ctx.device)"),
        "build or move the model to the communicator's device before sharding, or shard over a communicator on "
        "the model's device", _model_off_the_comm_device),
    "torch.export": Case(
        "exported a sharded model (torch.export.export)", "wsharding.core.sharding:ShardingError",
        ("torch.export of a sharded model", "Export the model before it is sharded"),
        "export the model before it is sharded; run the sharded model eagerly (strict=True export wraps this "
        "error in torch's Unsupported)", _export),
    "torch.save(model)": Case(
        "saved or deep-copied a sharded model whole (torch.save(model), copy.deepcopy, pickle)",
        "wsharding.core.sharding:ShardingError",
        ("cannot be copied or saved whole", "WeightSharding.full_state_dict(model)"),
        "save its weights with ws.full_state_dict(model) (or save_checkpoint) on every rank; build and shard "
        "a second copy anew", _pickled),
    "targets beyond the layers": Case(
        "keyed WeightSharding's targets by a layer the list does not have", "wsharding.core.sharding:ShardingError",
        ("targets name layers [5]", "outside the 2 layers given"),
        "key the targets by each layer's index in the list of layers", _targets_beyond_layers),
    "re-parametrized target": Case(
        "declared a weight under weight_norm or another parametrization", "wsharding.core.sharding:ShardingError",
        ("layer 0 fc.weight", "a parametrization", "recomputed from other parameters", "remove_parametrizations"),
        "fold it into a plain weight before sharding (remove_weight_norm / remove_parametrizations(..., "
        "leave_parametrized=True)), or leave it out of the targets", _weight_normed_target),
    "strided target": Case(
        "declared a weight that is not contiguous (a transpose, a strided view)", "wsharding.core.sharding:ShardingError",
        ("layer 0 fc.weight", "not contiguous", "strides (1, 6)", "p.data = p.data.contiguous()"),
        "make the weights contiguous before sharding (sharded, a strided weight would round differently from the "
        "replica): for p in model.parameters(): p.data = p.data.contiguous()", _strided_target),
    "replicas differ": Case(
        "built each rank's weights without one seed, then sharded them as built", "wsharding.core.sharding:ShardingError",
        ("layer 0 fc1.weight on rank 1 differs from layer 0 fc1.weight on rank 0", "torch.manual_seed",
         "verify_replicas=False"),
        "seed every rank the same before building the model, or load one checkpoint on every rank (load_sharded); "
        "every rank raises it at finalize", _replicas_differ),
    "shard_blocks patterns str": Case(
        "gave shard_blocks (or load_sharded) one str as the patterns, \"fc*\"", "wsharding.core.sharding:ShardingError",
        ("patterns", "'fc*'", "character by character", "['fc*']"),
        "pass a list of patterns, [\"fc*\"]: a str would be read character by character", _patterns_glob_str),
    "shard_blocks pattern name str": Case(
        "gave shard_blocks one pattern name as a str, \"fc1\"", "wsharding.core.sharding:ShardingError",
        ("patterns", "'fc1'", "['fc1']"), "pass a list, [\"fc1\"]", _patterns_name_str),
    "shard_blocks blocks list": Case(
        "gave shard_blocks the blocks as a Python list", "wsharding.core.sharding:ShardingError",
        ("blocks", "list of 2 modules", "nn.ModuleList", "'layers'"),
        "pass the nn.ModuleList itself (model.layers) or its attribute name (\"layers\")", _blocks_list),
    "shard_blocks blocks unknown": Case(
        "named blocks that the model does not have", "wsharding.core.sharding:ShardingError",
        ("blocks", "'model.layers'", "its ModuleLists: 'layers'"),
        "name the nn.ModuleList of blocks by its attribute path; the message lists the model's", _blocks_unknown),
    "shard_blocks comm none": Case(
        "gave shard_blocks comm=None", "wsharding.core.sharding:ShardingError",
        ("comm", "None", "not a communicator", _EXAMPLE_COMM, "init_from_env()"),
        f"pass the shard group's communicator: {_EXAMPLE_COMM}, with ctx from wsharding.init_from_env() "
        "(torchrun) or the context a RankCluster task receives", _comm_none),
    "shard_blocks comm str": Case(
        "gave shard_blocks a backend name as comm", "wsharding.core.sharding:ShardingError",
        ("comm", "'gloo'", "not a communicator", _EXAMPLE_COMM), f"pass a communicator, {_EXAMPLE_COMM}", _comm_str),
    "shard_blocks comm context": Case(
        "gave shard_blocks the rank's context as comm", "wsharding.core.sharding:ShardingError",
        ("comm", "RankContext", _EXAMPLE_COMM, "ctx.comm"), f"pass its communicator, {_EXAMPLE_COMM}",
        _comm_context),
    "sharded_layers float": Case(
        "gave sharded_layers an index that is not a whole number", "wsharding.core.sharding:ShardingError",
        ("sharded_layers", "1.5", "not a layer index"), "pass whole numbers: [1, 2] or range(1, 8)",
        _sharded_layers_float),
    "sharded_layers int": Case(
        "gave sharded_layers one int instead of a list", "wsharding.core.sharding:ShardingError",
        ("sharded_layers", "int 1", "[1]"), "pass a list or range: [1], range(1, 8)", _sharded_layers_int),
    "group larger than world": Case(
        "asked shard_comm (or from_context, shard_comm_for) for a shard group larger than the world launched",
        "wsharding.core.errors:InvalidArgument", ("group_size 8", "world of 2", "torchrun --nproc-per-node 8"),
        "launch as many processes as the group size (torchrun --nproc-per-node N) or pass a group size that "
        "divides the world; it is never clipped to the world", _group_larger_than_world),
    "group not dividing world": Case(
        "asked for a shard group size that does not divide the world", "wsharding.core.errors:InvalidArgument",
        ("shard group size 4", "world size 6", "1, 2, 3, 6"), "pass a group size that divides the world size",
        _group_not_dividing_world),
    "model file ranks word": Case(
        "wrote a whole-number field of a model file as a word or a fraction (defaults: {ranks: eight})",
        "wsharding.costmodel:CostModelError", ("toy.defaults.ranks", "'eight'", "expected an integer"),
        "write whole numbers (ranks: 8); a number is never rounded or read from text", _yaml_ranks_word),
    "prefetch depth": Case(
        "gave prefetch_depth=0", "wsharding.core.errors:InvalidArgument",
        ("prefetch_depth", "got 0", "depth + 1 slots"), "pass an int >= 1 (1: the design's two slots); "
        "lookahead=False turns lookahead off", _prefetch_depth_zero),
    "on_miss": Case(
        "gave on_miss a value other than 'gather' or 'raise'", "wsharding.core.sharding:ShardingError",
        ("on_miss", "'skip'"), "pass 'gather' (the default: such a layer is gathered now, warned) or 'raise'",
        _on_miss_unknown),
    "pattern matches nothing": Case(
        "gave shard_blocks (or load_sharded) a pattern that matches no linear (a typo, \"fc_2\")",
        "wsharding.core.declare:UnmatchedPatternWarning", ("patterns", "'fc_2'", "matches no linear", "'fc2'"),
        "a warning: that pattern shards nothing; fix it (the message names the nearest linears) or leave it out",
        _pattern_typo, warning=True),
    "declared name typo": Case(
        "declared a target name that the layer does not have", "wsharding.core.sharding:ShardingError",
        ("layer 0", "'fc_2'", "does not exist", "'fc2'"), "use the attribute path the message suggests",
        _declared_name_typo),
    "load_sharded keep_initial_weights": Case(
        "gave load_sharded keep_initial_weights=True", "wsharding.core.errors:InvalidArgument",
        ("keep_initial_weights=True", "load_sharded", "every row", "shard_blocks(model, blocks, patterns, comm)"),
        "leave it out: every row comes from the checkpoint; to shard the weights as built, call shard_blocks",
        _load_sharded_keep),
    "second thread": Case(
        "ran a sharded model from a second thread while a step of it runs", "wsharding.core.planner:ConcurrentStepError",
        ("another thread runs a step of it", "batching them into one forward"),
        "batch concurrent requests into one forward, or serialise the calls (one lock around model(...))",
        _second_thread),
    "sharded weight read": Case(
        "read a sharded weight's values between steps (p.clone(), p.detach().cpu(), torch.save, deepcopy)",
        "wsharding.core.sharding:ShardingError",
        ("layer 0 fc1.weight on rank 0", "Tensor.clone outside its linear's forward", "full_state_dict(model)"),
        "read or save the weights with ws.full_state_dict(model), on every rank of the shard group; metadata "
        "(shape, numel) still answers", _bound_read),
    "sharded weight data edit": Case(
        "edited a sharded weight in place between steps (w.data.mul_(2), nn.init, an optimizer step)",
        "wsharding.core.sharding:ShardingError",
        ("layer 0 fc1.weight on rank 0", "Tensor.mul_ outside its linear's forward", "the next gather"),
        "change weights before finalize, or in a freshly built model that you shard again", _bound_data_edit),
    "sharded weight converted": Case(
        "converted a sharded model (model.half(), .to(dtype), .cuda())", "wsharding.core.sharding:ShardingError",
        ("layer 0 fc1.weight", "is a view of a weight-sharding slot", "Tensor.half", "torch.float16"),
        "convert dtype and device before WeightSharding declares the model (a no-op .to() still runs)",
        _bound_converted),
    "sharded weight to meta": Case(
        "moved a sharded model to the meta device", "wsharding.core.sharding:ShardingError",
        ("layer 0 fc1.weight", "Tensor.to", "on meta"),
        "move the model before it is sharded (a model built on meta is sharded as it loads: load_sharded)",
        _bound_to_meta),
    "sharded weight replaced": Case(
        "assigned a new Parameter as a sharded linear's weight", "wsharding.core.sharding:ShardingError",
        ("layer 1 fc2.weight on rank 0", "a new Parameter assigned as the weight", "full_state_dict"),
        "assign or load weights before finalize; or change ws.full_state_dict(model) and shard a fresh model",
        _bound_replaced),
    "sharded weight reparametrized": Case(
        "re-parametrized a sharded weight (weight_norm, register_parametrization)",
        "wsharding.core.sharding:ShardingError",
        ("layer 0 fc2.weight on rank 0", "outside its linear's forward"),
        "re-parametrize the model before it is sharded", _bound_weight_norm),
    "sharded weight outside its linear": Case(
        "computed with a sharded weight outside its linear (x @ lin.weight.t())",
        "wsharding.core.sharding:ShardingError",
        ("layer 0 fc1.weight on rank 0", "Tensor.t outside its linear's forward", "call its linear"),
        "call the linear (lin(x)), whose forward reads its own layer's weight; inside its own block's forward, "
        "during a step, a direct read runs", _bound_outside_linear),
    "old nccl": Case(
        "used our NCCL communicator with an NCCL older than 2.28.3", "wsharding.accel.nccl.library:NcclLibraryError",
        ("NCCL >= 2.28.3", "NCCL 2.28.2", "WSHARDING_NCCL_LIBRARY"),
        "install nvidia-nccl-cu12>=2.28.3 or point WSHARDING_NCCL_LIBRARY at a newer libnccl.so.2", _old_nccl),
    "map_own_chunk old nccl": Case(
        "asked for map_own_chunk=True with an NCCL older than 2.30", "wsharding.accel.nccl.library:NcclLibraryError",
        ("map_own_chunk", "NCCL >= 2.30.0", "NCCL 2.28.9"),
        "point WSHARDING_NCCL_LIBRARY at NCCL >= 2.30 (2.28 would share only the first allocation of a mapped "
        "view with the peers), or leave map_own_chunk off", _mapped_old_nccl),
    "gather launch": Case(
        "asked our NCCL communicator for a gather launch it does not have", "wsharding.core.comm:CommError",
        ("gather_launch", "'graph', 'direct'", "'eager'"),
        "use gather_launch='graph' (the default: each gather captured once, launched as a CUDA graph) or "
        "'direct' (ncclAllGather called per layer)", _gather_launch),
    "cta policy": Case(
        "set NCCL_CTA_POLICY to another policy than the communicator asks for", "wsharding.core.comm:CommError",
        ("NCCL_CTA_POLICY=0", "policy 2"), "unset NCCL_CTA_POLICY or set it to the communicator's policy",
        _cta_policy_env),
    "checkpoint missing tensor": Case(
        "loaded a checkpoint that lacks a tensor the model needs", "wsharding.checkpoint:CheckpointError",
        ("layers.2.moe.latent_up.weight", "missing"), "load the checkpoint written for this model or preset",
        _ckpt_missing),
    "checkpoint extra tensor": Case(
        "loaded a checkpoint with a tensor the model does not know", "wsharding.checkpoint:CheckpointError",
        ("layers.9.extra.weight", "strict=False"),
        "check the model matches the checkpoint, or pass strict=False (load_checkpoint, load_sharded) to leave "
        "such tensors unread; every tensor the model has must still be there", _ckpt_extra),
    "checkpoint misshapen tensor": Case(
        "loaded a tensor of the wrong shape", "wsharding.checkpoint:CheckpointError",
        ("layers.1.attn.k_proj.weight", "[48, 95]"), "load the checkpoint written for this model or preset",
        _ckpt_misshapen),
    "checkpoint wrong dtype": Case(
        "loaded a tensor whose dtype does not fit a quantized (FP8/int) weight", "wsharding.checkpoint:CheckpointError",
        ("layers.1.attn.o_proj.weight", "torch.bfloat16", "torch.float8_e4m3fn"),
        "load the checkpoint made for this quant method (a float checkpoint into float weights of another dtype "
        "is converted, as tensor.to(dtype) converts it)", _ckpt_dtype),
    "checkpoint int into float": Case(
        "loaded an integer tensor into a float weight", "wsharding.checkpoint:CheckpointError",
        ("embed.weight", "torch.int32", "torch.bfloat16", "integer values are not converted"),
        "load a float checkpoint, or build the model with the quant method the checkpoint uses", _ckpt_int_into_float),
    "checkpoint scale nan": Case(
        "loaded a quantized checkpoint with a NaN scale (FP8 block, FP8 per-tensor or int8 channel)",
        "wsharding.checkpoint:CheckpointError", ("layers.1.attn.q_proj.weight_scale_inv[1, 1]", "is nan", "finite"),
        "re-export the checkpoint and check the quantizer that wrote it (a scale is amax / qmax: NaN in the weights it "
        "read); unchecked, the requant after loading made the scale 1.0 and its block's codes NaN", _ckpt_scale_nan),
    "checkpoint scale inf": Case(
        "loaded a quantized checkpoint with an inf scale", "wsharding.checkpoint:CheckpointError",
        ("layers.2.moe.latent_up.weight_scale[5]", "is inf", "finite"),
        "re-export the checkpoint and check the quantizer; unchecked, an FP8 block's codes became +-448 and the "
        "output stayed finite, silently wrong", _ckpt_scale_inf),
    "checkpoint scale zero": Case(
        "loaded a checkpoint whose per-tensor scale (input_scale, weight_scale) is 0", "wsharding.checkpoint:CheckpointError",
        ("layers.1.attn.o_proj.input_scale[0]", "is 0", "finite and > 0"),
        "re-export the checkpoint: an input_scale of 0 divides the activations by zero, a weight_scale of 0 zeroes a "
        "whole tensor; a block or channel scale of 0 (a block of zero weights) loads", _ckpt_scale_zero),
    "checkpoint scale negative": Case(
        "loaded a checkpoint with a negative scale", "wsharding.checkpoint:CheckpointError",
        ("layers.1.attn.k_proj.weight_scale", "is -0.5 (negative)"),
        "re-export the checkpoint and check the quantizer (a scale is amax / qmax, never negative; block FP8's "
        "requant dropped the sign)", _ckpt_scale_negative),
    "checkpoint truncated": Case(
        "loaded a truncated (or non-safetensors) file", "wsharding.checkpoint:CheckpointError",
        ("tiny.safetensors", "file ends at byte"), "write the checkpoint again (save_checkpoint)", _ckpt_truncated),
    "checkpoint absent": Case(
        "loaded a checkpoint path that does not exist", "wsharding.checkpoint:CheckpointError",
        ("tiny.safetensors", "No such file or directory"), "check the path", _ckpt_absent),
    "checkpoint fifo": Case(
        "gave a FIFO (named pipe) as the checkpoint, or as a file of its folder or index",
        "wsharding.checkpoint:CheckpointError",
        ("tiny.safetensors", "a FIFO (named pipe)", "not a regular file", "only regular files are read"),
        "pass a regular file: only regular files are read, checked before they are opened (opening a FIFO waited for "
        "a writer, on that rank alone, forever); load_sharded refuses it on every rank", _ckpt_fifo),
    "checkpoint device": Case(
        "gave a device as the checkpoint (/dev/zero, /dev/null)", "wsharding.checkpoint:CheckpointError",
        ("/dev/zero", "a character device", "not a regular file"),
        "pass the .safetensors file or the checkpoint folder", _ckpt_device),
    "checkpoint header length": Case(
        "loaded a file whose header length claims more than safetensors allows (2**40 bytes)",
        "wsharding.checkpoint:CheckpointError",
        ("tiny.safetensors", "header length 1099511627776", "over the format's limit of 100000000 bytes"),
        "the file is damaged or not safetensors: write it again (save_checkpoint); nothing is allocated for the "
        "header it claims", _ckpt_header_length),
    "layout group size": Case(
        "built a layout for a group of 0 ranks", "wsharding.core.layout:LayoutError",
        ("group_size", "got 0"), "the group size is a whole number >= 1", _layout_group),
    "layout group size bool": Case(
        "built a layout with group_size=True", "wsharding.core.layout:LayoutError",
        ("group_size", "got True", "bool"), "a bool is not a number of ranks: pass the group size, an int >= 1",
        _layout_group_bool),
    "layout rank": Case(
        "asked for the chunk of a rank outside the group", "wsharding.core.layout:LayoutError",
        ("rank 2", "[0, 2)"), "ranks of a group of N are 0 .. N-1", _layout_rank),
    "layout buffer": Case(
        "gave a layout a buffer of the wrong size", "wsharding.core.layout:LayoutError",
        ("buffer", "bytes"), "allocate layout.total_bytes (comm.alloc or the slot pool)", _layout_buffer),
    "outside window": Case(
        "gathered from or into a buffer outside a registered window", "wsharding.core.comm:CommError",
        ("layer 3: gather", "chunk", "256 bytes", "registered symmetric window"),
        "allocate it with comm.alloc(...) and call comm.register_all() on every rank", _outside_window),
    "unknown decoder preset": Case(
        "named a decoder preset that does not exist", "wsharding.core.errors:InvalidArgument",
        ("'k4-like'", "tiny", "k3-like"), "use one of the presets the message lists", _unknown_preset),
    "unknown cost preset": Case(
        "named a cost-model preset that does not exist", "wsharding.costmodel:CostModelError",
        ("'kimi-k4'", "kimi-k3-b200-fp8"), "use one of the presets the message lists (wsharding plan --list)",
        _unknown_cost_preset),
    "binary model file": Case(
        "gave wsharding plan --model (load_model_file) a binary file", "wsharding.costmodel:CostModelError",
        ("model.bin", "not a JSON/YAML model description", "binary file"),
        "pass a .json or .yaml file in the format of costmodel.model_from_dict", _binary_model_file),
    "device model file": Case(
        "gave wsharding plan --model (load_model_file) a device or a FIFO, /dev/zero", "wsharding.costmodel:CostModelError",
        ("model file /dev/zero", "a character device", "not a regular file", "only regular files are read"),
        "pass a .json or .yaml file (a regular file of at most 1 MiB); /dev/zero was read until the process was "
        "killed, a FIFO waited for a writer", _device_model_file),
    "yaml alias bomb": Case(
        "gave wsharding plan --model a YAML file whose aliases expand it past 100,000 values",
        "wsharding.costmodel:CostModelError", ("model.yaml", "YAML aliases", "more than 100000 values"),
        "write the repeated parts out, or repeat layers with the sequence's counts (it is read with yaml.safe_load)",
        _yaml_alias_bomb),
    "unknown group": Case(
        "built a linear on a parallel group that does not exist", "wsharding.linear.groups:GroupError",
        ("'dp_attn'", "attn_tp"), "use one of the group names the message lists", _unknown_group),
    "ranks zero": Case(
        "asked for 0 ranks", "wsharding.core.context:ClusterError",
        ("world_size", "got 0"), "ask for 1 rank or more", _ranks_zero),
    "init outside torchrun": Case(
        "called init_from_env() outside torchrun (no RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)",
        "wsharding.core.context:ClusterError", ("missing: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT", "torchrun"),
        "run under torchrun, or set the four variables (or use RankCluster(N))", _init_outside_torchrun),
    "init rank not a number": Case(
        "set RANK=abc", "wsharding.core.context:ClusterError", ("RANK='abc'", "not an integer"),
        "set a whole number, or run under torchrun", _init_rank_not_a_number),
    "init rank outside world": Case(
        "set RANK=3 with WORLD_SIZE=2", "wsharding.core.context:ClusterError", ("RANK=3", "WORLD_SIZE=2"),
        "ranks are 0 .. WORLD_SIZE-1", _init_rank_outside_world),
    "init nccl without gpu": Case(
        "asked init_from_env for backend='nccl' on a machine without a GPU", "wsharding.core.context:ClusterError",
        ("backend='nccl' needs a CUDA GPU",), "use backend='gloo' or 'auto'", _init_nccl_without_gpu),
    "threads per rank zero": Case(
        "asked RankCluster for 0 threads per rank", "wsharding.core.context:ClusterError",
        ("threads_per_rank", "got 0"), "pass an integer >= 1", _threads_per_rank_zero),
    "env value not a string": Case(
        "gave RankCluster an environment value that is not a str", "wsharding.core.context:ClusterError",
        ("env['OMP_NUM_THREADS']", "int"), "pass strings: {'OMP_NUM_THREADS': '4'}", _env_value_not_a_string),
    "ranks per gpu negative": Case(
        "asked for a negative number of ranks per GPU", "wsharding.core.context:ClusterError",
        ("ranks_per_gpu", "got -1"), "ask for 1 rank per GPU or more", _ranks_negative),
}


# ---- the tests -------------------------------------------------------------------------------------
def check_case(case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Do the mistake once: exactly ``case.error`` (or its warning, once), naming every culprit."""
    cls = case.error_class()
    if case.warning:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            case.trigger(tmp_path, monkeypatch)
        found = [w for w in caught if w.category is cls]
        assert len(found) == 1, [str(w.message) for w in caught]
        message = str(found[0].message)
    else:
        with pytest.raises(BaseException) as info:  # noqa: PT011 - the exact class is asserted below
            case.trigger(tmp_path, monkeypatch)
        assert type(info.value) is cls, f"{case.did}: {type(info.value).__name__}: {info.value}"
        message = str(info.value)
    missing = [c for c in case.culprit if c not in message]
    assert not missing, f"{case.did}: the message does not name {missing}: {message}"


@pytest.mark.parametrize("key", list(CASES))
def test_bad_input_gets_its_exact_error_naming_the_culprit(key, tmp_path, monkeypatch):
    check_case(CASES[key], tmp_path, monkeypatch)


def test_load_sharded_refuses_the_same_mistakes_before_reading(tmp_path):
    """load_sharded hands its arguments to shard_blocks' check: each mistake of the table is refused
    before the checkpoint is opened (it does not even exist here) and before any weight is shrunk."""
    from wsharding.checkpoint import load_sharded
    from wsharding.core.sharding import ShardingError

    model = _blocks_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    path = tmp_path / "absent.safetensors"
    for args, kwargs, words in [
        (("layers", "fc*", _CommOfTwo()), {}, "patterns: got the str 'fc*'"),
        ((list(model.layers), ["fc1"], _CommOfTwo()), {}, "blocks: got a list of 2 modules"),
        (("layers", ["fc1"], None), {}, "comm: got None, not a communicator"),
        (("layers", ["fc1"], _CommOfTwo()), {"sharded_layers": [1.5]}, "sharded_layers: 1.5 (a float)"),
    ]:
        with pytest.raises(ShardingError) as info:
            load_sharded(model, path, *args, **kwargs)
        assert words in str(info.value)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_shard_blocks_refuses_what_is_not_a_model_or_a_pattern():
    from wsharding.core.runner import shard_blocks
    from wsharding.core.sharding import ShardingError

    model = _blocks_model()
    with pytest.raises(ShardingError, match=r"patterns: 1 \(of type int\) is not a str"):
        shard_blocks(model, "layers", ["fc1", 1], _CommOfTwo())  # fnmatch's TypeError before
    with pytest.raises(ShardingError, match="model: a OrderedDict is not an nn.Module; pass the model whose blocks"):
        shard_blocks(model.state_dict(), "layers", ["fc1"], _CommOfTwo())  # an AttributeError before
    with pytest.raises(ShardingError, match=r"sharded_layers: True \(a bool\) is not a layer index"):
        shard_blocks(model, "layers", ["fc1"], _CommOfTwo(), sharded_layers=[True])


def test_patterns_given_as_a_generator_reach_every_block():
    """A generator of patterns is read once, into a list: every block is matched against all of them
    (read per block, it was empty from the second block on, which was then left unsharded)."""
    from tests.core.test_library_edges import Loopback
    from wsharding.core.runner import shard_blocks

    ws = shard_blocks(_blocks_model(), "layers", (p for p in ["fc1", "fc2"]), Loopback())
    assert {i: [e.name for e in lay.entries] for i, lay in ws.layouts.items()} == {
        0: ["fc1.weight", "fc2.weight"], 1: ["fc1.weight", "fc2.weight"]}


@pytest.mark.parametrize("layers", [[1.5], 5, [True]])
def test_weight_sharding_built_directly_refuses_what_is_not_a_layer_index(layers):
    # A set of floats or bools matched no layer id: nothing was sharded, without a word.
    from wsharding.core.sharding import ShardingError, WeightSharding

    block = torch.nn.Module()
    block.fc = torch.nn.Linear(4, 4, bias=False)
    with pytest.raises(ShardingError, match="sharded_layers"):
        WeightSharding(_RankOfTwo(), [block], {0: ["fc"]}, sharded_layers=layers)



def _unmatched_warnings(patterns: list[str], comm: object, model: torch.nn.Module | None = None) -> tuple:
    """``shard_blocks`` of ``patterns``: the sharding and the messages of its UnmatchedPatternWarnings."""
    from wsharding.core.declare import UnmatchedPatternWarning
    from wsharding.core.runner import shard_blocks

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ws = shard_blocks(model or _blocks_model(), "layers", patterns, comm)
    return ws, [str(w.message) for w in caught if w.category is UnmatchedPatternWarning]


def test_a_pattern_that_matches_no_linear_is_named_with_its_nearest_linears():
    """A typo shards nothing and used to say nothing: the sharding holds only fc1 (fc2 stays whole,
    0 of its bytes saved), and now one warning names the pattern and what it most likely meant."""
    from tests.core.test_library_edges import Loopback

    ws, said = _unmatched_warnings(["fc1", "fc_2"], Loopback())
    assert {i: [e.name for e in lay.entries] for i, lay in ws.layouts.items()} == {0: ["fc1.weight"], 1: ["fc1.weight"]}
    assert said == ["patterns: 'fc_2' matches no linear in any of the 2 blocks, so it shards nothing and those "
                    "weights stay whole on every rank: no submodule has that name (did you mean 'fc2'?); fix "
                    "the pattern or leave it out"]


def test_a_pattern_of_a_module_that_is_not_a_linear_says_so():
    from tests.core.test_library_edges import Loopback

    model = _blocks_model()
    for block in model.layers:
        block.mlp = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False))
    _, said = _unmatched_warnings(["fc1", "mlp", "zzz_proj"], Loopback(), model)
    assert len(said) == 2, said
    assert "'mlp' matches no linear" in said[0] and "it matches 'mlp', not a linear" in said[0] and "'mlp.*'" in said[0]
    assert "'zzz_proj'" in said[1] and "(the blocks' linears: 'fc1', 'fc2', 'mlp.0')" in said[1], said[1]


def test_a_pattern_matched_in_one_block_only_is_not_warned_and_rank_1_stays_quiet():
    """Matching in some block is enough (blocks differ: a dense block 0 beside MoE blocks); and
    every rank sees the same patterns, so only rank 0 speaks."""
    from tests.core.test_library_edges import Loopback

    model = _blocks_model()
    del model.layers[1].fc2
    assert _unmatched_warnings(["fc1", "fc2"], Loopback(), model)[1] == []

    from wsharding.core.runner import find_targets, warn_unmatched_patterns

    blocks = _blocks_model().layers
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_unmatched_patterns(blocks, ["fc_2"], {i: find_targets(b, ["fc_2"]) for i, b in enumerate(blocks)}, 1)
