"""Loading that never holds the replicated weights (issue #41): ``load_sharded`` given the function that
builds the model, or a model built inside ``empty_parameters()``, allocates each sharded weight's own
rows and nothing of the rest but the parameters that are not targets -- counted here as exact bytes of
the parameters that have memory, at the moment the checkpoint is about to be read. A model built with
its weights loads the same, but held every target whole first: ``BuiltWholeWarning`` says so."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import wsharding.checkpoint as checkpoint
from wsharding import BuiltWholeWarning, empty_parameters, load_sharded, save_checkpoint
from wsharding.empty_build import materialize, meta_parameter_bytes

D, VOCAB = 16, 32


class TiedModel(nn.Module):
    """An embedding tied to the head, a buffer computed in the constructor (as a rotary embedding's
    ``inv_freq``: not in the checkpoint), and three blocks of ``up`` (a target) and ``down`` (not)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(nn.Module() for _ in range(3))
        for block in self.layers:
            block.up = nn.Linear(D, 2 * D, bias=False)
            block.down = nn.Linear(2 * D, D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.arange(1, D + 1, dtype=torch.float32) / D, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) * self.scale
        for block in self.layers:
            h = h + block.down(torch.relu(block.up(h)))
        return self.head(h)


def _param_bytes_with_memory(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)


def build_on_meta(ctx, path: str, how: str) -> dict:
    """Load ``path`` into a model built by a function (``how="function"``), inside ``empty_parameters``
    (``"context"``) or with its weights (``"whole"``), counting the parameter bytes that have memory
    just before the checkpoint is read."""
    seen = {}
    inner = checkpoint.materialize

    def counting(model, device):  # the moment between setup (own rows) and the checkpoint's read
        seen["before"] = _param_bytes_with_memory(model)
        made = inner(model, device)
        seen["made"], seen["after"] = made, _param_bytes_with_memory(model)
        return made

    checkpoint.materialize = counting
    try:
        comm = ctx.shard_comm(2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if how == "function":
                ws = load_sharded(lambda: TiedModel(seed=ctx.rank + 1), path, "layers", ["up"], comm)
            else:
                if how == "context":
                    with empty_parameters():
                        model = TiedModel(seed=ctx.rank + 1)
                else:
                    model = TiedModel(seed=ctx.rank + 1)
                ws = load_sharded(model, path, "layers", ["up"], comm)
    finally:
        checkpoint.materialize = inner
    model = ws.model
    ref = TiedModel(seed=99)
    ref.load_state_dict(torch.load(Path(path).with_suffix(".pt")))
    tokens = torch.arange(7).remainder(VOCAB).unsqueeze(0) + ctx.rank
    with torch.no_grad():
        equal = torch.equal(model(tokens), ref(tokens))
    rest = sum(p.numel() * p.element_size() for n, p in ref.named_parameters() if ".up." not in n)
    out = {
        "rank": ctx.rank, "equal": equal, **seen, "rest": rest, "replicated": ws.replicated_bytes(),
        "built_whole": ws.built_whole_bytes, "tied": model.head.weight is model.embed.weight,
        "scale": torch.equal(model.scale, ref.scale),
        "warned": [str(w.message) for w in caught if issubclass(w.category, BuiltWholeWarning)],
    }
    ws.close()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("empty") / "model.safetensors"
    model = TiedModel(seed=7)
    save_checkpoint(model, path)
    torch.save(model.state_dict(), path.with_suffix(".pt"))
    return str(path)


@pytest.mark.parametrize("how", ["function", "context"])
def test_built_on_meta_a_rank_holds_its_rows_and_the_rest_never_a_whole_target(cluster_of, saved, how):
    for r in cluster_of(2).run(build_on_meta, saved, how):
        assert r["equal"] and r["tied"] and r["scale"]
        assert r["before"] == r["replicated"] // 2  # its own rows of every target, nothing else
        assert r["made"] == r["rest"] and r["after"] == r["replicated"] // 2 + r["rest"]
        assert r["built_whole"] == 0 and r["warned"] == []


def test_built_with_its_weights_it_held_every_target_whole_and_is_told(cluster_of, saved):
    for r in cluster_of(2).run(build_on_meta, saved, "whole"):
        assert r["equal"] and r["tied"]
        assert r["built_whole"] == r["replicated"]  # what the meta build avoids: R on every rank
        assert r["made"] == 0  # nothing was on meta
        if r["rank"] == 0:
            (msg,) = r["warned"]
            assert "built with its 3 sharded weights whole" in msg and "empty_parameters()" in msg
        else:
            assert r["warned"] == []


def test_empty_parameters_keeps_classes_ties_and_buffers_and_materialize_allocates_exactly_them():
    with empty_parameters():
        model = TiedModel()
    params = list(model.parameters())
    assert all(p.is_meta and type(p) is nn.Parameter for p in params)
    assert model.head.weight is model.embed.weight and not model.scale.is_meta
    want = sum(p.numel() * p.element_size() for p in TiedModel().parameters())
    assert meta_parameter_bytes(model) == want
    assert materialize(model, torch.device("cpu")) == want
    assert model.head.weight is model.embed.weight and not any(p.is_meta for p in model.parameters())
    assert nn.Module.register_parameter is not None and not torch.nn.Linear(2, 2).weight.is_meta  # context closed


def test_a_function_that_builds_no_module_is_refused(tmp_path):
    from tests.core.test_library_edges import Loopback
    from wsharding.core.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="returned int, not a torch.nn.Module"):
        load_sharded(lambda: 3, tmp_path / "x.safetensors", "layers", ["up"], Loopback())
    with pytest.raises(InvalidArgument, match="a torch.nn.Module or a function that builds one, got str"):
        load_sharded("model", tmp_path / "x.safetensors", "layers", ["up"], Loopback())


def test_on_cpu_load_sharded_trims_the_heap_after_each_layer_and_after_finalize(tmp_path, monkeypatch):
    # Without the trim glibc keeps the freed read buffers and row shards resident: on 2 gloo ranks of the
    # cpu-blocks preset the resident set sat 70-120 MiB higher after the load (research/cpu_forward_transient.py).
    from tests.core.test_library_edges import Loopback

    path = tmp_path / "model.safetensors"
    save_checkpoint(TiedModel(seed=7), path)
    calls = []

    def trim() -> int:
        # the moment it runs: the sharding is finalized, so nothing the load freed is still needed
        calls.append(checkpoint.WeightSharding.resident_bytes(seen["ws"]) if "ws" in seen else None)
        return 4096

    seen: dict = {}
    inner = checkpoint.shard_blocks

    def remember(*args, **kwargs):
        seen["ws"] = ws = inner(*args, **kwargs)
        return ws

    monkeypatch.setattr(checkpoint, "trim_host_heap", trim)
    monkeypatch.setattr(checkpoint, "shard_blocks", remember)
    ws = load_sharded(lambda: TiedModel(seed=1), path, "layers", ["up"], Loopback())
    # once per layer as finalize frees its row shards (no sharding to read yet), once at the end
    assert calls == [None, None, None, ws.resident_bytes()] and ws.host_bytes_released == 4096


def _mapped_bytes() -> int | None:
    """glibc's bytes in mappings of their own (``mallinfo2().hblkhd``); None without glibc >= 2.33."""
    import ctypes
    import ctypes.util

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    try:
        f = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    f.restype = MallInfo2
    return f().hblkhd


@pytest.mark.skipif(_mapped_bytes() is None, reason="needs glibc's mallinfo2")
def test_on_cpu_load_sharded_gives_each_large_allocation_a_mapping_of_its_own(tmp_path):
    # glibc raises its mmap threshold each time a mapped block is freed (here to 16 MiB): weights below
    # it then come from the heap and stay resident when freed. cpu-blocks on 2 ranks peaked at 766-834
    # MiB during load_sharded's finalize for a bound of 640 MiB (`bench load`); with a fixed threshold of
    # 64 KiB set by load_sharded, at 474-489 MiB.
    from tests.core.test_library_edges import Loopback

    path = tmp_path / "model.safetensors"
    save_checkpoint(TiedModel(seed=7), path)
    freed = torch.empty(16 << 20, dtype=torch.uint8)
    del freed
    load_sharded(lambda: TiedModel(seed=1), path, "layers", ["up"], Loopback()).close()
    before = _mapped_bytes()
    block = torch.empty(1 << 20, dtype=torch.uint8)
    assert _mapped_bytes() - before >= block.numel()


def test_a_constructor_that_moves_its_weights_gets_the_package_s_error_not_torch_s(tmp_path):
    # ToyDecoder's constructor calls .to(device) on each layer: on meta, torch's "Cannot copy out of meta
    # tensor" came out of load_sharded. The model built with its weights loads.
    from tests.core.test_library_edges import Loopback
    from wsharding.core.errors import InvalidArgument
    from wsharding.models import ToyDecoder, decoder_config

    cfg = decoder_config("tiny")
    save_checkpoint(ToyDecoder(cfg, seed=0), tmp_path / "toy")
    with pytest.raises(InvalidArgument, match=r"^model: test_a_constructor.*<lambda> cannot build the model without "
                                              r"its weights .*\(NotImplementedError: Cannot copy out of meta tensor\)"):
        load_sharded(lambda: ToyDecoder(cfg), tmp_path / "toy", "layers", ["attn.o_proj"], Loopback())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BuiltWholeWarning)
        load_sharded(ToyDecoder(cfg, seed=1), tmp_path / "toy", "layers", ["attn.o_proj"], Loopback()).close()
