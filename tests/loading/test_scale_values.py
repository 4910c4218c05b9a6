"""Checkpoint scales are finite: a quantization scale that is NaN, +-inf, negative, or 0 where its
format has no zero is refused by :func:`load_checkpoint` with a :class:`CheckpointError` naming the
checkpoint tensor and the index of the first bad value ([Note: checkpoint scales are finite] in
``wsharding/linear/loading.py``). Each case also loads the same file with the check turned off, to
show what it did before: the after-loading requant made a NaN scale 1.0 and its codes NaN, an inf one
1.0 and its codes +-448 (a finite output, silently wrong), one NaN k scale every q, k and v code NaN.

Weights are not checked: a NaN float weight (or FP8 code) loads as it is (the README says so).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import wsharding.checkpoint
from wsharding.checkpoint import CheckpointError, load_checkpoint, load_sharded, save_checkpoint
from wsharding.core.comm import Communicator
from wsharding.core.sharding import WeightSharding
from wsharding.linear.fp8 import FP8_MAX
from wsharding.linear.loading import check_scale_values
from wsharding.models import PRESETS, ToyDecoder, variant_config

NAN, INF = float("nan"), float("inf")
TOKENS = torch.arange(7) % PRESETS["tiny"].vocab


def _checkpoint(tmp: Path, variant: str, key: str, index: tuple[int, ...], value: float) -> tuple[Path, object]:
    """The tiny decoder quantized as ``variant``, written with ``value`` at ``key[index]``; and its config."""
    cfg = variant_config("tiny", variant)
    path = tmp / f"{variant}.safetensors"
    save_checkpoint(ToyDecoder(cfg, seed=0), path)
    tensors = load_file(path)
    scale = tensors[key].clone()
    scale[index] = value
    tensors[key] = scale
    save_file(tensors, path)
    return path, cfg


def _load_unchecked(mp: pytest.MonkeyPatch, cfg: object, path: Path) -> nn.Module:
    """The model as it loaded before the check: ``check_scale_values`` turned off for this load."""
    mp.setattr(wsharding.checkpoint, "check_scale_values", lambda *a, **k: None)
    model = ToyDecoder(cfg, seed=1).eval()
    load_checkpoint(model, path)
    mp.undo()
    return model


def _nan_block(m: nn.Module) -> None:
    qkv = m.layers[1].attn.qkv_proj  # q's block [1, 1] is the merged weight's rows 48..95, columns 48..95
    assert qkv.weight_scale_inv[1, 1] == 1.0  # the UE8M0 requant made the NaN scale 1.0 ...
    assert torch.isnan(qkv.weight[48:96, 48:96].float()).all()  # ... and every code of its block NaN


def _inf_block(m: nn.Module) -> None:
    qkv = m.layers[1].attn.qkv_proj
    assert qkv.weight_scale_inv[1, 1] == 1.0
    codes = qkv.weight[48:96, 48:96].float()
    assert (codes[torch.isfinite(codes)].abs() == FP8_MAX).all()  # saturated, +-448 (NaN where the code was 0)
    assert torch.isfinite(m(TOKENS)).all()  # and the output says nothing: finite, and wrong


def _nan_k_scale(m: nn.Module) -> None:
    qkv = m.layers[1].attn.qkv_proj  # requantized to the largest of the q, k, v scales: the max of a NaN
    assert torch.isnan(qkv.weight_scale).all() and torch.isnan(qkv.weight.float()).all()


def _zero_input_scale(m: nn.Module) -> None:
    o = m.layers[1].attn.o_proj
    x = torch.randn(3, o.input_size, dtype=o.params_dtype)
    x[0] = 0.0
    out = o(x)
    assert torch.isnan(out[0]).all() and (out[1:] == 0).all()  # 0 / 0 is NaN; every other input gives 0


def _zero_weight_scale(m: nn.Module) -> None:
    o = m.layers[1].attn.o_proj
    assert (o(torch.randn(3, o.input_size, dtype=o.params_dtype)) == 0).all()  # a projection of zeros


def _inf_channel(m: nn.Module) -> None:
    lin = m.layers[2].moe.latent_up
    assert not torch.isfinite(lin.quant_method.dequantized_weight(lin)[5]).any()
    assert not torch.isfinite(m(TOKENS)).all()


def _negative_block(m: nn.Module) -> None:
    o = m.layers[1].attn.o_proj
    assert o.weight_scale_inv[0, 0] == 2.0**-6  # the requant dropped the sign: -0.01 came out as +1/64


# (variant, checkpoint key, index, value, what the message says it is, the rule's words, what the unchecked load did)
REFUSED = [
    pytest.param("fp8_block", "layers.1.attn.q_proj.weight_scale_inv", (1, 1), NAN, "nan", "block or channel",
                 _nan_block, id="fp8 block nan"),
    pytest.param("fp8_block", "layers.1.attn.q_proj.weight_scale_inv", (1, 1), INF, "inf", "block or channel",
                 _inf_block, id="fp8 block inf"),
    pytest.param("fp8_block", "layers.1.attn.o_proj.weight_scale_inv", (0, 0), -0.01, "-0.01 (negative)",
                 "finite and >= 0", _negative_block, id="fp8 block negative"),
    pytest.param("fp8", "layers.1.attn.k_proj.weight_scale", (), NAN, "nan", "per-tensor", _nan_k_scale,
                 id="fp8 per-tensor nan"),
    pytest.param("fp8", "layers.1.attn.o_proj.input_scale", (0,), 0.0, "0", "input_scale of 0",
                 _zero_input_scale, id="fp8 input scale zero"),
    pytest.param("fp8", "layers.1.attn.o_proj.weight_scale", (0,), 0.0, "0", "weight_scale of 0",
                 _zero_weight_scale, id="fp8 weight scale zero"),
    pytest.param("int8", "layers.2.moe.latent_up.weight_scale", (5,), INF, "inf", "block or channel",
                 _inf_channel, id="int8 channel inf"),
]


@pytest.mark.parametrize("variant, key, index, value, said, rule, unchecked", REFUSED)
def test_a_bad_scale_is_refused_naming_the_tensor_and_index(tmp_path, monkeypatch, variant, key, index, value, said,
                                                             rule, unchecked: Callable[[nn.Module], None]):
    path, cfg = _checkpoint(tmp_path, variant, key, index, value)
    where = f"[{', '.join(map(str, index))}]" if index else ""
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(ToyDecoder(cfg, seed=1), path)
    message = str(info.value)
    assert message.startswith(f"{key}{where} is {said}: "), message
    assert rule in message and "Re-export the checkpoint, and check the quantizer" in message, message
    unchecked(_load_unchecked(monkeypatch, cfg, path))


@pytest.mark.parametrize("variant, key", [("fp8_block", "layers.1.attn.o_proj.weight_scale_inv"),
                                          ("int8", "layers.1.attn.o_proj.weight_scale")])
def test_a_zero_block_or_channel_scale_loads_as_a_block_of_zeros(tmp_path, variant, key):
    """A block or channel scale of 0 is what a quantizer without a clamp writes for an all-zero block:
    it dequantizes to zeros, and the UE8M0 requant keeps them zero, so it is not refused."""
    path, cfg = _checkpoint(tmp_path, variant, key, (1, 0) if variant == "fp8_block" else (50,), 0.0)
    model = ToyDecoder(cfg, seed=1).eval()
    load_checkpoint(model, path)
    o = model.layers[1].attn.o_proj
    w = o.quant_method.dequantized_weight(o)
    zero = w[48:96, 0:48] if variant == "fp8_block" else w[50]
    assert (zero == 0).all() and torch.isfinite(w).all() and (w != 0).any()


def test_every_bad_value_is_counted_and_a_converted_scale_is_checked_as_the_model_holds_it(tmp_path):
    path, cfg = _checkpoint(tmp_path, "int8", "layers.2.moe.latent_up.weight_scale", (7,), NAN)
    tensors = load_file(path)
    scale = tensors["layers.2.moe.latent_up.weight_scale"].double()
    scale[3] = 1e300  # finite in float64, inf in the float32 parameter it loads into
    tensors["layers.2.moe.latent_up.weight_scale"] = scale
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=re.escape(
            "layers.2.moe.latent_up.weight_scale[3] is inf as torch.float32 (1e+300 in the checkpoint's "
            "torch.float64): a block or channel scale must be finite and >= 0 (0 only for a block of zero weights); "
            "1 more of its 96 values break the rule too.")):
        load_checkpoint(ToyDecoder(cfg, seed=1), path)


def test_the_check_is_one_pass_and_ignores_integer_scales():
    check_scale_values(torch.tensor([1, 0, -3]), "codes", zero_allowed=False)  # integers have no NaN: not scales
    check_scale_values(torch.tensor([0.5, 0.0]), "s", zero_allowed=True)
    with pytest.raises(ValueError, match=r"^s\[1\] is 0: a per-tensor scale must be finite and > 0"):
        check_scale_values(torch.tensor([0.5, 0.0]), "s", zero_allowed=False)
    with pytest.raises(ValueError, match=r"^s\[0, 1\] is -inf: "):
        check_scale_values(torch.tensor([[1.0, -INF], [NAN, 1.0]]), "s", zero_allowed=True)


# ---- weights are not checked -----------------------------------------------------------------------
class _OneOfTwo(Communicator):
    """Rank 0 of a group of 2: setup and loading do not communicate."""

    rank, world_size, device, mode = 0, 2, torch.device("cpu"), "cpu-gloo"


def test_a_nan_weight_loads_as_it_is(tmp_path):
    """What the README says of weights: a NaN float weight (replicated, or a sharded one's rows) and a
    NaN FP8 code load as they are; only the outputs show it."""
    path = tmp_path / "float.safetensors"
    save_checkpoint(ToyDecoder(PRESETS["tiny"], seed=0), path)
    tensors = load_file(path)
    for key in ("layers.0.attn.q_proj.weight", "layers.1.attn.q_proj.weight"):
        tensors[key][3, 5] = NAN
    save_file(tensors, path)
    model = ToyDecoder(PRESETS["tiny"], seed=1).eval()
    load_checkpoint(model, path)
    assert torch.isnan(model.layers[0].attn.qkv_proj.weight[3, 5]) and not torch.isfinite(model(TOKENS)).all()
    ws = WeightSharding(_OneOfTwo(), sharded_layers=range(1, 4))
    sharded = ToyDecoder(PRESETS["tiny"], seed=1, weight_sharding=ws)
    load_checkpoint(sharded, path)  # rank 0 keeps rows [0, 96) of layer 1's qkv: row 3 among them
    assert torch.isnan(sharded.layers[1].attn.qkv_proj.weight.data[3, 5])

    cfg = variant_config("tiny", "fp8")
    save_checkpoint(ToyDecoder(cfg, seed=0), path)
    tensors = load_file(path)
    tensors["layers.1.attn.o_proj.weight"].view(torch.uint8)[0, 0] = 0x7F  # e4m3's NaN
    save_file(tensors, path)
    model = ToyDecoder(cfg, seed=1).eval()
    load_checkpoint(model, path)
    assert torch.isnan(model.layers[1].attn.o_proj.weight[0, 0].float())


# ---- load_sharded: every rank refuses, none waits -------------------------------------------------
def load_sharded_fp8_block(ctx, paths: list[str]) -> tuple[str, str]:
    """``load_sharded`` of the tiny block-FP8 decoder from ``paths[rank]``: the error class and
    message, or ``("loaded", "")``."""
    model = ToyDecoder(variant_config("tiny", "fp8_block"), seed=1)
    try:
        load_sharded(model, paths[ctx.rank], "layers", ["attn.qkv_proj", "attn.o_proj"], ctx.comm,
                     sharded_layers=range(1, 4))
    except Exception as e:  # noqa: BLE001 - the class is what the test checks
        return type(e).__name__, str(e)
    return "loaded", ""


def test_a_bad_scale_stops_every_rank_of_load_sharded(cluster_of, tmp_path):
    path, _ = _checkpoint(tmp_path, "fp8_block", "layers.2.attn.q_proj.weight_scale_inv", (0, 1), NAN)
    start = time.monotonic()
    outcomes = cluster_of(2).run(load_sharded_fp8_block, [str(path)] * 2)
    assert time.monotonic() - start < 60
    for rank, (kind, detail) in enumerate(outcomes):
        assert kind == "CheckpointError", f"rank {rank}: {kind}: {detail}"
        assert detail.startswith("layers.2.attn.q_proj.weight_scale_inv[0, 1] is nan: "), detail
    assert outcomes[0] == outcomes[1]


def test_a_bad_scale_in_one_rank_s_copy_is_named_on_the_other(cluster_of, tmp_path):
    """Rank 1 reads a node-local copy with an inf scale, rank 0 a good file: rank 1 refuses and joins
    finalize's agreement with its problem (abandon_sharding), so rank 0 raises naming rank 1 rather
    than waiting for its gathers (the agreement names the rank, not its error: rank 1's own says it)."""
    good = tmp_path / "good.safetensors"
    save_checkpoint(ToyDecoder(variant_config("tiny", "fp8_block"), seed=0), good)
    (tmp_path / "bad").mkdir()
    bad, _ = _checkpoint(tmp_path / "bad", "fp8_block", "layers.3.attn.o_proj.weight_scale_inv", (1, 0), INF)
    start = time.monotonic()
    (kind0, detail0), (kind1, detail1) = cluster_of(2).run(load_sharded_fp8_block, [str(good), str(bad)])
    assert time.monotonic() - start < 60
    assert kind1 == "CheckpointError" and "layers.3.attn.o_proj.weight_scale_inv[1, 0] is inf" in detail1, detail1
    assert kind0 == "ShardingError" and "rank(s) [1] cannot finalize" in detail0, detail0


@pytest.mark.parametrize("variant, key, index", [
    ("fp8_block", "layers.1.attn.q_proj.weight_scale_inv", (1, 1)),
    ("fp8", "layers.1.attn.k_proj.weight_scale", ()),
    ("fp8", "layers.1.attn.o_proj.input_scale", (0,)),
])
def test_a_finite_fp8_scale_that_overflows_when_applied_is_refused_like_an_infinite_one(tmp_path, monkeypatch,
                                                                                         variant, key, index):
    # 1e36 is a finite float32, but times an e4m3 code of 448 it is ~4.5e38: inf in float32 and bf16.
    path, cfg = _checkpoint(tmp_path, variant, key, index, 1e36)
    where = f"[{', '.join(map(str, index))}]" if index else ""
    with pytest.raises(CheckpointError, match=re.escape(f"{key}{where} is 1e+36: finite, but applied to "
                                                        "torch.float8_e4m3fn values (up to 448)")):
        load_checkpoint(ToyDecoder(cfg, seed=1), path)
    unchecked = _load_unchecked(monkeypatch, cfg, path)
    if key.endswith("input_scale"):
        o = unchecked.layers[1].attn.o_proj  # every activation x / 1e36 rounds to the code 0: a projection of zeros
        assert (o(torch.randn(3, o.input_size, dtype=o.params_dtype)) == 0).all()
    else:
        lin = unchecked.layers[1].attn.qkv_proj
        assert not torch.isfinite(lin.quant_method.dequantized_weight(lin)).all()


def test_a_large_fp8_scale_that_fits_loads(tmp_path):
    path, cfg = _checkpoint(tmp_path, "fp8", "layers.1.attn.k_proj.weight_scale", (), 1e30)
    load_checkpoint(ToyDecoder(cfg, seed=1), path)


def test_the_overflow_rule_in_the_compute_dtype():
    # A per-tensor weight scale of 200: 200 * 448 = 89600 is more than float16 holds (65504), not bfloat16.
    s = torch.tensor(200.0)
    check_scale_values(s, "w", zero_allowed=False, codes=torch.float8_e4m3fn, into=torch.bfloat16)
    with pytest.raises(Exception, match=r"w is 2e\+02: finite, but .* more than torch.float16 holds \(6.55e\+04\)"):
        check_scale_values(s, "w", zero_allowed=False, codes=torch.float8_e4m3fn, into=torch.float16)
    check_scale_values(torch.tensor(1e36), "int codes", zero_allowed=False, codes=torch.int8)  # not FP8: no rule
