"""Calls the README documents, made as documented (issue #38, "documented calls that fail"):
``load_sharded(..., strict=False)`` leaves the checkpoint's extra tensors unread and loads every
tensor of the model; a float checkpoint of another dtype (F16, BF16 into F32 weights, F32 into
BF16) loads converted as ``tensor.to(dtype)`` converts it -- targets, replicated linears, embeddings
and norms alike -- bit for bit what ``load_state_dict`` of the converted tensors gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tests.core.test_library_edges import Loopback
from wsharding.checkpoint import CheckpointError, load_checkpoint, load_sharded, save_checkpoint
from wsharding.core.sharding import WeightSharding
from wsharding.models import PRESETS, ToyDecoder


class _Model(nn.Module):
    """An embedding, a norm, and two blocks of an ``fc1`` (the target) and an ``fc2`` (left replicated,
    a plain ``nn.Linear``: the loader of a parameter without a weight loader)."""

    def __init__(self, dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(nn.Module() for _ in range(2))
        for block in self.layers:
            block.fc1 = nn.Linear(8, 8, bias=False)
            block.fc2 = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.to(dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.layers:
            h = h + block.fc2(torch.relu(block.fc1(h)))
        return self.norm(h)


def _saved(tmp: Path, dtype: torch.dtype, extra: dict[str, torch.Tensor] | None = None) -> Path:
    """A checkpoint of ``_Model(seed=7)`` in ``dtype`` (plus ``extra`` tensors the model does not know)."""
    path = tmp / f"model-{str(dtype).removeprefix('torch.')}.safetensors"
    tensors = {k: v.contiguous() for k, v in _Model(dtype, seed=7).state_dict().items()}
    save_file({**tensors, **(extra or {})}, str(path))
    return path


def _full(model: nn.Module, ws: WeightSharding) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in ws.full_state_dict(model).items()}


def test_load_sharded_strict_false_leaves_the_extra_tensors_unread(tmp_path):
    """``strict=False`` (the README's advice for a checkpoint with tensors the model does not know)
    ended in ``TypeError: shard_blocks() got an unexpected keyword argument 'strict'``."""
    extra = {"lm_head.weight": torch.ones(16, 8), "layers.0.fc3.weight": torch.ones(8, 8)}
    path = _saved(tmp_path, torch.float32, extra)
    with pytest.raises(CheckpointError, match=r"does not know: \['layers.0.fc3.weight', 'lm_head.weight'\].*"
                                              "strict=False"):
        load_sharded(_Model(seed=1), path, "layers", ["fc1"], Loopback())
    model = _Model(seed=1)
    ws = load_sharded(model, path, "layers", ["fc1"], Loopback(), strict=False)
    assert ws.load_result["skipped_tensors"] == 2
    assert ws.load_result["tensors"] == len(list(model.parameters()))  # every tensor of the model, no extra
    assert not hasattr(model, "lm_head") and not hasattr(model.layers[0], "fc3")
    want = load_file(path)
    got = _full(model, ws)
    assert sorted(got) == sorted(set(want) - set(extra))
    assert all(torch.equal(got[k], want[k]) for k in got), [k for k in got if not torch.equal(got[k], want[k])]


def test_load_sharded_strict_false_still_needs_every_tensor_of_the_model(tmp_path):
    """Unlike ``load_state_dict(strict=False)``, nothing of the model is left as built: a sharded
    weight's rows would be zeros."""
    path = _saved(tmp_path, torch.float32)
    tensors = load_file(path)
    del tensors["layers.1.fc1.weight"]
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) \['layers.1.fc1.weight'\].*strict=False skips "
                                              "only the checkpoint's extra tensors"):
        load_sharded(_Model(seed=1), path, "layers", ["fc1"], Loopback(), strict=False)


@pytest.mark.parametrize(("stored", "target"), [(torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                                                (torch.float32, torch.bfloat16), (torch.float16, torch.bfloat16)])
def test_a_float_checkpoint_of_another_dtype_loads_converted_bit_for_bit(tmp_path, stored, target):
    """An F16/BF16 checkpoint into F32 weights was refused (``destination is torch.float32``) for the
    targets, while the README says float dtypes are converted: now every tensor -- the targets' rows,
    the replicated linears, the embedding and the norm -- holds what ``load_state_dict`` of the
    tensors converted with ``.to(target)`` holds, and the outputs are equal bit for bit."""
    path = _saved(tmp_path, stored)
    reference = _Model(target, seed=1)
    reference.load_state_dict({k: v.to(target) for k, v in load_file(path).items()})
    model = _Model(target, seed=1)
    ws = load_sharded(model, path, "layers", ["fc1"], Loopback())
    assert [t.name for ts in ws.targets.values() for t in ts] == ["fc1", "fc1"]
    got, want = _full(model, ws), reference.state_dict()
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == target and torch.equal(got[k], want[k]), k
    tokens = torch.arange(10) % 16
    with torch.no_grad():
        assert torch.equal(model(tokens), reference(tokens))


def test_a_float_checkpoint_converts_into_the_package_linears_and_merged_rows(tmp_path):
    """The decoder's merged (qkv, gate_up) targets read their rows per shard id, converted; its
    replicated layer 0 goes through the linears' own loaders: the sharded F32 decoder loaded from a
    BF16 checkpoint computes what the replicated F32 decoder loaded from the converted file does."""
    bf16, f32 = PRESETS["tiny"], PRESETS["tiny"].with_(dtype="float32")
    stored = tmp_path / "bf16.safetensors"
    save_checkpoint(ToyDecoder(bf16, seed=0), stored)
    converted = tmp_path / "f32.safetensors"
    save_file({k: v.to(torch.float32) for k, v in load_file(stored).items()}, str(converted))
    reference = ToyDecoder(f32, seed=5).eval()
    load_checkpoint(reference, converted)
    ws = WeightSharding(Loopback(), sharded_layers=range(1, f32.layers))
    model = ToyDecoder(f32, seed=5, weight_sharding=ws).eval()
    counts = load_checkpoint(model, stored)
    assert counts["row_shard_tensors"] > 0
    ws.finalize()
    tokens = torch.arange(7) % f32.vocab
    with torch.no_grad():
        assert torch.equal(model(tokens), reference(tokens))
