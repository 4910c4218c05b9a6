"""Loading a safetensors checkpoint into a sharded model: only this rank's rows are read, then
finalize; bad checkpoints give errors that name the tensor."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from wsharding.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from wsharding.core.comm import Communicator
from wsharding.core.sharding import RowShardLoader, WeightSharding
from wsharding.models import PRESETS, ToyDecoder

CFG = PRESETS["tiny"]


def load_sharded_from_checkpoint(ctx, path: str):
    if ctx.rank == 0:
        save_checkpoint(ToyDecoder(CFG, seed=0), path)
    ctx.comm.barrier()
    reference = ToyDecoder(CFG, seed=99).eval()
    load_checkpoint(reference, path)  # replicated, through the linears' own loaders
    ws = WeightSharding(ctx.comm, sharded_layers=range(1, CFG.layers))
    model = ToyDecoder(CFG, seed=123, weight_sharding=ws).eval()  # other weights: loading must overwrite them
    counts = load_checkpoint(model, path)
    rows_read = {f"{i}:{name}": loader.loaded_rows for (i, name), loader in ws.loaders.items()}
    ws.finalize()
    x = torch.randint(0, CFG.vocab, (5 + ctx.rank,), generator=torch.Generator().manual_seed(ctx.rank))
    with torch.no_grad():
        equal = torch.equal(reference(x), model(x))
        original = torch.equal(ToyDecoder(CFG, seed=0).eval()(x), model(x))
    full_rows = {f"{t.layer}:{t.name}": t.rows for ts in ws.targets.values() for t in ts}
    return equal, original, counts, rows_read, full_rows


def test_checkpoint_into_sharded_model(cluster_of, tmp_path):
    n = 3
    results = cluster_of(n).run(load_sharded_from_checkpoint, str(tmp_path / "tiny.safetensors"))
    for equal, original, counts, rows_read, full_rows in results:
        assert equal and original
        assert counts["row_shard_tensors"] == 3 * 9  # 3 layers x (q, k, v, o, down, up, gate, up, down)
        for key, rows in rows_read.items():
            assert rows == full_rows[key] // n, key  # each rank read exactly its 1/N rows


class _OneOfTwo(Communicator):
    """Rank 0 of a group of 2 -- setup and loading do not communicate."""

    rank, world_size, device, mode = 0, 2, torch.device("cpu"), "cpu-gloo"


def _sharded_model():
    ws = WeightSharding(_OneOfTwo(), sharded_layers=range(1, CFG.layers))
    return ToyDecoder(CFG, seed=1, weight_sharding=ws), ws


def test_missing_tensor_is_named(tmp_path):
    path = tmp_path / "c.safetensors"
    save_checkpoint(ToyDecoder(CFG), path)
    tensors = load_file(path)
    del tensors["layers.2.moe.latent_up.weight"]
    save_file(tensors, path)
    model, _ = _sharded_model()
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) \['layers.2.moe.latent_up.weight'\]"):
        load_checkpoint(model, path)


@pytest.mark.parametrize(
    "key, cut, match",
    [
        # a replicated weight (layer 0 is not sharded): the linear's own loader complains
        ("layers.0.attn.o_proj.weight", (slice(0, -2), slice(None)), r"'layers.0.attn.o_proj.weight'.*cannot be loaded"),
        # a sharded weight: the row-shard loader complains
        ("layers.1.attn.k_proj.weight", (slice(None), slice(0, -1)),
         r"'layers.1.attn.k_proj.weight'.*shape \[48, 95\], expected exactly \[48, 96\]"),
    ],
)
def test_misshapen_tensor_is_named(tmp_path, key, cut, match):
    path = tmp_path / "c.safetensors"
    save_checkpoint(ToyDecoder(CFG), path)
    tensors = load_file(path)
    tensors[key] = tensors[key][cut].contiguous()
    save_file(tensors, path)
    model, _ = _sharded_model()
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(model, path)


def test_unexpected_tensor(tmp_path):
    path = tmp_path / "c.safetensors"
    save_checkpoint(ToyDecoder(CFG), path)
    tensors = load_file(path)
    tensors["layers.9.extra.weight"] = torch.zeros(2)
    save_file(tensors, path)
    model, ws = _sharded_model()
    with pytest.raises(CheckpointError, match=r"does not know: \['layers.9.extra.weight'\]"):
        load_checkpoint(model, path)
    assert isinstance(model.layers[1].attn.qkv_proj.weight.weight_loader, RowShardLoader)
