"""Sharded weights stay nn.Parameters after finalize; full_state_dict() gives the real full weights
(saving a sharded model loses nothing); converting or loading into slot-bound weights is refused --
and without the guards the model silently computes with the wrong weights."""

from __future__ import annotations

import pytest
import torch

from wsharding.checkpoint import load_checkpoint, save_checkpoint
from wsharding.core.rowloaders import RowShardLoader
from wsharding.core.sharding import ShardingError
from wsharding.models import PRESETS, ToyDecoder, build_pair

CFG = PRESETS["tiny"]


def parameters_after_finalize(ctx, path: str):
    replicated, sharded = build_pair(CFG, ctx.comm)
    ws = sharded.weight_sharding
    names = [n for n, _ in sharded.named_parameters()]
    targets = {f"layers.{t.layer}.{t.entry}" for ts in ws.targets.values() for t in ts}
    params = dict(sharded.named_parameters())
    kept = all(isinstance(params[n], torch.nn.Parameter) for n in targets)
    loaders = all(isinstance(params[n].weight_loader, RowShardLoader) for n in targets)
    in_slots = all(params[n].untyped_storage().data_ptr() in {b.untyped_storage().data_ptr() for b in ws.slots.buffers}
                   for n in targets)
    full = ws.full_state_dict(sharded)
    same_keys = set(full) == set(replicated.state_dict())
    exact = all(torch.equal(full[k], v.cpu()) for k, v in replicated.state_dict().items())
    if ctx.rank == 0:
        save_checkpoint(sharded, path, state_dict=full)
    ctx.comm.barrier()
    reloaded = ToyDecoder(CFG, seed=5).eval()
    load_checkpoint(reloaded, path)
    x = torch.randint(0, CFG.vocab, (6,), generator=torch.Generator().manual_seed(ctx.rank))
    with torch.no_grad():
        equal = torch.equal(reloaded(x), replicated(x)) and torch.equal(sharded(x), replicated(x))
    return {"n_params": len(names), "n_replicated": len(list(replicated.parameters())), "targets": len(targets),
            "kept": kept, "loaders": loaders, "in_slots": in_slots, "same_keys": same_keys, "exact": exact,
            "equal": equal, "only_sharded": len(ws.full_state_dict())}


def test_parameters_kept_and_full_state_dict_round_trip(cluster_of, tmp_path):
    for r in cluster_of(2).run(parameters_after_finalize, str(tmp_path / "saved.safetensors")):
        assert r["n_params"] == r["n_replicated"]  # model.parameters() still sees every sharded weight
        assert r["kept"] and r["loaders"] and r["in_slots"]
        assert r["same_keys"] and r["exact"]  # the full weights, bit for bit
        assert r["equal"]  # a model loaded from the saved sharded model == the original
        assert r["only_sharded"] == r["targets"] == 6 * (CFG.layers - 1)


def conversion_after_finalize(ctx, guarded: bool):
    replicated, sharded = build_pair(CFG, ctx.comm)
    layer = sharded.layers[1].attn.qkv_proj
    if not guarded:  # what the guard prevents: drop it and convert anyway
        layer.weight.__class__ = torch.nn.Parameter
        layer._load_state_dict_pre_hooks.clear()
    x = torch.randint(0, CFG.vocab, (5,), generator=torch.Generator().manual_seed(1))
    out = {}
    try:
        layer.float()  # (a whole model would be left half converted: torch's .to() is not transactional)
        out["converted"] = True
    except ShardingError as e:
        out["converted"] = str(e)
    try:
        sharded.load_state_dict({"layers.1.attn.qkv_proj.weight": torch.zeros(192, 96, dtype=torch.bfloat16)},
                                strict=False)
        out["loaded"] = True
    except ShardingError as e:
        out["loaded"] = str(e)
    with torch.no_grad():
        if guarded:
            out["equal"] = torch.equal(sharded(x), replicated(x))
        else:
            ptr = layer.weight.untyped_storage().data_ptr()
            out["detached"] = ptr not in {b.untyped_storage().data_ptr() for b in sharded.weight_sharding.slots.buffers}
    return out


def test_conversion_and_state_dict_into_bound_weights_are_refused(cluster_of):
    for r in cluster_of(2).run(conversion_after_finalize, True):
        assert "layer 1 attn.qkv_proj.weight is a view of a weight-sharding slot after finalize" in r["converted"]
        assert "load_state_dict: layers.1.attn.qkv_proj.weight (layer 1 attn.qkv_proj.weight) is sharded" in r["loaded"]
        assert r["equal"]
    for r in cluster_of(2).run(conversion_after_finalize, False):
        # without the guards: both go through, and the weight is no longer the slot the gathers fill
        assert r["converted"] is True and r["loaded"] is True and r["detached"]


def test_guard_allows_a_no_op_move():
    from wsharding.core.bound import guarded_class

    p = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    p.__class__ = guarded_class(torch.nn.Parameter)
    p.data = p.data  # the same tensor: allowed (e.g. .to() to where it already is)
    with pytest.raises(ShardingError):
        p.data = torch.ones(3)
    assert isinstance(p, torch.nn.Parameter)
