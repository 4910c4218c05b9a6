"""Strict row loaders: exact rows, fused merged tensors, quantized dtypes must match, and finalize
refuses a weight whose rows were never all loaded -- on every rank, naming the weight and rows."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from wsharding.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from wsharding.core.comm import Communicator
from wsharding.core.sharding import ShardingError, WeightSharding
from wsharding.models import PRESETS, ToyDecoder

CFG = PRESETS["tiny"]


class _Rank(Communicator):
    """Rank ``rank`` of a group of 2 -- setup and loading do not communicate."""

    world_size, device, mode = 2, torch.device("cpu"), "cpu-gloo"

    def __init__(self, rank: int) -> None:
        self.rank = rank


def _sharded(rank: int = 0, cfg=CFG, keep: bool = True):
    ws = WeightSharding(_Rank(rank), sharded_layers=range(1, cfg.layers), keep_initial_weights=keep)
    return ToyDecoder(cfg, seed=1, weight_sharding=ws), ws


def test_more_rows_than_the_weight_is_an_error(tmp_path):
    path = tmp_path / "c.safetensors"
    save_checkpoint(ToyDecoder(CFG), path)
    tensors = load_file(path)
    w = tensors["layers.1.moe.latent_up.weight"]
    tensors["layers.1.moe.latent_up.weight"] = torch.cat([w, w[:2]])  # 98 rows for a 96-row weight
    save_file(tensors, path)
    model, _ = _sharded()
    with pytest.raises(CheckpointError, match=r"'layers.1.moe.latent_up.weight'.*layer 1 moe.latent_up.weight "
                                              r"\(whole weight\): checkpoint tensor has shape \[98, 48\], expected "
                                              r"exactly \[96, 48\] -- more rows"):
        load_checkpoint(model, path)


@pytest.mark.parametrize("rank", [0, 1])
def test_fused_merged_tensor_loads_like_its_parts(tmp_path, rank):
    path = tmp_path / "c.safetensors"
    save_checkpoint(ToyDecoder(CFG, seed=0), path)
    parts, _ = _sharded(rank)
    load_checkpoint(parts, path)
    tensors = load_file(path)
    fused_model, ws = _sharded(rank)
    qkv = fused_model.layers[2].attn.qkv_proj.weight
    fused = torch.cat([tensors[f"layers.2.attn.{k}_proj.weight"] for k in "qkv"])
    qkv.weight_loader(qkv, fused, None)
    assert torch.equal(qkv, parts.layers[2].attn.qkv_proj.weight)
    assert ws.loaders[(2, "attn.qkv_proj")].loaded_rows == qkv.shape[0] == fused.shape[0] // 2
    with pytest.raises(ShardingError, match=r"shape \[144, 96\], expected exactly \[192, 96\]"):
        qkv.weight_loader(qkv, fused[:144], None)


@pytest.mark.parametrize("key", ["layers.1.attn.o_proj.weight", "layers.0.attn.o_proj.weight"])
def test_checkpoint_dtype_must_match_a_quantized_weight(tmp_path, key):
    """A BF16 tensor where the FP8 model expects e4m3: copy_ would convert numbers, not formats."""
    fp8 = CFG.with_(quant="fp8")
    path = tmp_path / "fp8.safetensors"
    save_checkpoint(ToyDecoder(fp8), path)
    tensors = load_file(path)
    tensors[key] = ToyDecoder(CFG).state_dict()[key]  # sharded (layer 1) and replicated (layer 0) loaders
    save_file(tensors, path)
    model, _ = _sharded(cfg=fp8)
    with pytest.raises(CheckpointError, match=rf"'{key}'.*is torch.bfloat16, the parameter is torch.float8_e4m3fn: "
                                              "the checkpoint was made for another quant method"):
        load_checkpoint(model, path)


def test_weight_changed_after_declare_is_refused(cluster_of):
    for msg in cluster_of(2).run(finalize_after_float):
        assert "layer 1 attn.qkv_proj.weight is torch.float32 [96, 96], expected torch.bfloat16 [96, 96]" in msg
        assert "Convert dtype and device before sharding" in msg


def finalize_after_float(ctx):
    ws = WeightSharding(ctx.comm, sharded_layers=range(1, CFG.layers))
    model = ToyDecoder(CFG, seed=0, weight_sharding=ws)
    model.float()  # too late: the layout was fixed for bf16
    try:
        ws.finalize()
    except ShardingError as e:
        return str(e)
    return "finalized"


def partial_load_then_finalize(ctx, path: str, skip_rank: int):
    """Every rank loads the checkpoint; ``skip_rank`` then 'forgets' rows 12..24 of one weight."""
    ws = WeightSharding(ctx.comm, sharded_layers=range(1, CFG.layers), keep_initial_weights=False)
    model = ToyDecoder(CFG, seed=0, weight_sharding=ws)
    if ctx.rank == 0:
        save_checkpoint(ToyDecoder(CFG, seed=0), path)
    ctx.comm.barrier()
    load_checkpoint(model, path)
    if ctx.rank == skip_rank:
        cov = ws.loaders[(2, "moe.latent_down")].coverage
        lo, hi = cov.lo, cov.hi
        cov.arrived = [(lo, lo + 12), (lo + 24, hi)]
    try:
        ws.finalize()
    except ShardingError as e:
        return str(e)
    return "finalized"


def test_finalize_refuses_rows_never_loaded_on_every_rank(cluster_of, tmp_path):
    msgs = cluster_of(2).run(partial_load_then_finalize, str(tmp_path / "c.safetensors"), 1)
    # rank 1 names the weight and its missing rows; rank 0 stops too instead of waiting in a gather
    assert "finalize refused on rank 1: layer 2 moe.latent_down.weight: rows [36, 48) (of this rank's rows " \
           "[24, 48) of 48) were never loaded" in msgs[1]
    assert "rank(s) [1] cannot finalize" in msgs[0]


def unloaded_meta_weights(ctx):
    """A model whose sharded rows were never loaded (keep_initial_weights=False, no checkpoint)."""
    ws = WeightSharding(ctx.comm, sharded_layers=[1], keep_initial_weights=False)
    ToyDecoder(CFG.with_(layers=2), seed=0, weight_sharding=ws)
    try:
        ws.finalize()
    except ShardingError as e:
        return str(e)
    return "finalized"


def test_finalize_without_any_load_names_every_weight(cluster_of):
    msg = cluster_of(2).run(unloaded_meta_weights)[0]
    for name in ("attn.qkv_proj", "attn.o_proj", "moe.latent_down", "moe.latent_up", "moe.shared_expert.gate_up_proj",
                 "moe.shared_expert.down_proj"):
        assert f"layer 1 {name}.weight: rows" in msg


def finalize_unloaded_bypassing_the_check(ctx):
    """What the coverage check prevents: mark never-loaded rows as loaded and finalize goes through,
    sharding the zeros that stand in for the weights -- the model silently computes garbage."""
    cfg = CFG.with_(layers=2)
    ws = WeightSharding(ctx.comm, sharded_layers=[1], keep_initial_weights=False)
    model = ToyDecoder(cfg, seed=0, weight_sharding=ws).eval()
    for loader in ws.loaders.values():
        loader.coverage.mark_all()
    ws.finalize()
    x = torch.arange(4)
    with torch.no_grad():
        return torch.equal(model(x), ToyDecoder(cfg, seed=0).eval()(x))


def test_without_the_coverage_check_unloaded_rows_are_sharded_silently(cluster_of):
    assert cluster_of(2).run(finalize_unloaded_bypassing_the_check) == [False, False]
