"""Everything a model's ``state_dict()`` holds survives a checkpoint: persistent buffers are saved and
loaded (with ``strict`` or not, into a sharded model or not), and a tied tensor's other name in a
checkpoint is read and must agree with its first, never ignored."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tests.core.test_library_edges import Loopback
from wsharding.checkpoint import CheckpointError, load_checkpoint, load_sharded, save_checkpoint
from wsharding.core.runner import shard_blocks

D = 16


class Buffered(nn.Module):
    """A persistent float buffer and a persistent int buffer (both in state_dict), a non-persistent one
    (not), a head tied to the embedding, and two blocks whose ``up`` is a target."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(32, D)
        self.layers = nn.ModuleList(nn.Module() for _ in range(2))
        for b in self.layers:
            b.up = nn.Linear(D, D, bias=False)
        self.head = nn.Linear(D, 32, bias=False)
        self.head.weight = self.embed.weight
        for p in self.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g))
        self.register_buffer("gain", torch.rand(D, generator=g) + 0.5)
        self.register_buffer("order", torch.randperm(D, generator=g))
        self.register_buffer("cache", torch.zeros(D), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)[:, self.order] * self.gain
        for b in self.layers:
            h = h + b.up(h)
        return self.head(h)


TOKENS = torch.arange(6)


def _out(m: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return m(TOKENS)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def test_save_checkpoint_writes_persistent_buffers_and_tied_tensors_once(tmp_path):
    save_checkpoint(Buffered(seed=1), tmp_path / "m.safetensors")
    keys = set(load_file(tmp_path / "m.safetensors"))
    assert keys == {"embed.weight", "layers.0.up.weight", "layers.1.up.weight", "gain", "order"}


@pytest.mark.parametrize("strict", [True, False])
def test_load_checkpoint_loads_the_buffers_bit_for_bit(tmp_path, strict):
    # Before: strict=False skipped them (the output was off), strict=True said the model "does not know" them.
    src = Buffered(seed=1)
    save_checkpoint(src, tmp_path / "m.safetensors")
    dst = Buffered(seed=2)
    counts = load_checkpoint(dst, tmp_path / "m.safetensors", strict=strict)
    assert counts["buffers"] == 2 and counts["skipped_tensors"] == 0 and counts["buffers_kept"] == 0
    assert torch.equal(_bits(dst.gain), _bits(src.gain)) and torch.equal(dst.order, src.order)
    assert torch.equal(_out(dst), _out(src))


@pytest.mark.parametrize("strict", [True, False])
def test_load_sharded_loads_the_buffers(tmp_path, strict):
    src = Buffered(seed=1)
    save_checkpoint(src, tmp_path / "m.safetensors")
    ws = load_sharded(lambda: Buffered(seed=2), tmp_path / "m.safetensors", "layers", ["up"], Loopback(), strict=strict)
    assert ws.load_result["buffers"] == 2
    assert torch.equal(_out(ws.model), _out(src))
    ws.close()


def test_a_checkpoint_without_the_buffers_is_refused_with_strict_and_kept_as_built_without(tmp_path):
    src = Buffered(seed=1)
    state = {k: v for k, v in load_file_of(src, tmp_path).items() if k not in ("gain", "order")}
    save_file(state, str(tmp_path / "old.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing persistent buffer\(s\) \['gain', 'order'\] .*strict=False"):
        load_checkpoint(Buffered(seed=2), tmp_path / "old.safetensors")
    dst, built = Buffered(seed=2), Buffered(seed=2)
    counts = load_checkpoint(dst, tmp_path / "old.safetensors", strict=False)
    assert counts["buffers_kept"] == 2 and torch.equal(_bits(dst.gain), _bits(built.gain))


def load_file_of(model: nn.Module, tmp_path) -> dict[str, torch.Tensor]:
    save_checkpoint(model, tmp_path / "full.safetensors")
    return load_file(tmp_path / "full.safetensors")


def test_a_sharded_model_saved_from_full_state_dict_round_trips_bit_for_bit(tmp_path):
    # Before: save_checkpoint(state_dict=ws.full_state_dict(m)) dropped the buffers, so the reloaded
    # model was another one although the docstring says the save loses nothing.
    src = Buffered(seed=1)
    ref = Buffered(seed=1)
    ws = shard_blocks(src, "layers", ["up"], Loopback())
    save_checkpoint(src, tmp_path / "m.safetensors", state_dict=ws.full_state_dict(src))
    ws.close()
    back = Buffered(seed=3)
    load_checkpoint(back, tmp_path / "m.safetensors")
    assert set(back.state_dict()) == set(ref.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.equal(_bits(back.state_dict()[k]), _bits(v)), k
    assert torch.equal(_out(back), _out(ref))


def test_a_buffer_of_another_shape_or_an_int_buffer_of_another_dtype_is_refused(tmp_path):
    state = load_file_of(Buffered(seed=1), tmp_path)
    for name, value, said in [("gain", torch.ones(D + 1), r"buffer gain: shape \[17\]"),
                              ("order", torch.arange(D, dtype=torch.int32), "buffer order: .*torch.int32.*torch.int64"),
                              ("order", torch.arange(D, dtype=torch.float32), "only float to float")]:
        save_file({**state, name: value}, str(tmp_path / "bad.safetensors"))
        with pytest.raises(CheckpointError, match=said):
            load_checkpoint(Buffered(seed=2), tmp_path / "bad.safetensors")


# ---- tied tensors -----------------------------------------------------------------------------------
@pytest.mark.parametrize("strict", [True, False])
def test_a_tied_tensor_s_other_name_that_differs_is_refused_not_ignored(tmp_path, strict):
    # The model uses head.weight (tied to embed.weight). Before: strict=False left the checkpoint's
    # head.weight unread without a word, strict=True called it unknown.
    state = load_file_of(Buffered(seed=1), tmp_path)
    save_file({**state, "head.weight": state["embed.weight"] * 2}, str(tmp_path / "tied.safetensors"))
    with pytest.raises(CheckpointError, match=r"'head.weight' and 'embed.weight' are one tensor in the model \(tied\)"):
        load_checkpoint(Buffered(seed=2), tmp_path / "tied.safetensors", strict=strict)
    with pytest.raises(CheckpointError, match="'head.weight' and 'embed.weight' are one tensor"):
        load_sharded(lambda: Buffered(seed=2), tmp_path / "tied.safetensors", "layers", ["up"], Loopback(),
                     strict=strict)


@pytest.mark.parametrize("strict", [True, False])
def test_a_tied_tensor_saved_under_both_names_with_the_same_bytes_loads(tmp_path, strict):
    src = Buffered(seed=1)
    state = load_file_of(src, tmp_path)
    save_file({**state, "head.weight": state["embed.weight"].clone()}, str(tmp_path / "both.safetensors"))
    dst = Buffered(seed=2)
    counts = load_checkpoint(dst, tmp_path / "both.safetensors", strict=strict)
    assert counts["tied_tensors"] == 1 and counts["skipped_tensors"] == 0
    assert torch.equal(_out(dst), _out(src))


# ---- a folder with both an index and model.safetensors ----------------------------------------------
def test_a_folder_with_an_index_and_model_safetensors_is_read_as_transformers_reads_it(tmp_path):
    # transformers' from_pretrained takes model.safetensors before model.safetensors.index.json; the index
    # (with its shard) used to win here, so the same folder loaded another model than there.
    import json

    single, sharded = Buffered(seed=1), Buffered(seed=4)
    save_checkpoint(single, tmp_path / "model.safetensors")
    save_checkpoint(sharded, tmp_path / "model-00001-of-00001.safetensors")
    keys = load_file(tmp_path / "model-00001-of-00001.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": dict.fromkeys(keys, "model-00001-of-00001.safetensors")}))
    dst = Buffered(seed=2)
    load_checkpoint(dst, tmp_path)
    assert torch.equal(_out(dst), _out(single)) and not torch.equal(_out(dst), _out(sharded))
    (tmp_path / "model.safetensors").unlink()  # the index alone: its files
    load_checkpoint(dst, tmp_path)
    assert torch.equal(_out(dst), _out(sharded))
