"""The cost model: hand-computed bills, the design's numbers, timing, bad input (its figures and panel:
tests/lab/test_viz_costmodel.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from wsharding.core.layout import FlatLayout
from wsharding.costmodel import (
    CostModelError,
    Deployment,
    Device,
    GiB,
    bill_for_layouts,
    breakeven,
    estimate,
    get_device,
    load_model_file,
    model_from_dict,
    plan_table,
)
from wsharding.presets import list_presets, load_preset, preset_dict

#: A device with round numbers so that every time below can be computed by hand.
TOY = Device("toy", {"fp8": 2e12, "bf16": 1e12, "tf32": 0.5e12}, link_bandwidth=1e9, hbm_bytes=10**12, source="test")


def toy_model(sizes: list[int], dtype: str = "bf16") -> dict:
    """One kind per distinct size, each layer a single group of ``size`` bytes, in ``sizes`` order."""
    kinds = {f"k{s}": {"groups": [{"name": "w", "dtype": dtype, "bytes": s}]} for s in sizes}
    return {"name": "toy", "kinds": kinds, "sequence": [[f"k{s}", 1] for s in sizes]}


def dep(ranks: int, tokens: int = 0, **kw) -> Deployment:
    return Deployment(ranks=ranks, device=TOY, tokens=tokens, **kw)


# ---- the memory bill, by hand ------------------------------------------------------------
def test_bill_by_hand_one_layer_larger_than_the_others():
    # 9 layers of 10 000 B and one of 30 000 B in the middle, N = 4: each total is padded to a
    # multiple of 16*4 = 64 B: 10 000 -> 10 048, 30 000 -> 30 016.
    sizes = [10_000] * 4 + [30_000] + [10_000] * 5
    model = model_from_dict({
        "name": "toy",
        "kinds": {"small": {"groups": [{"name": "w", "dtype": "bf16", "bytes": 10_000}]},
                  "big": {"groups": [{"name": "w", "dtype": "bf16", "bytes": 30_000}]}},
        "sequence": [["small", 4], ["big", 1], ["small", 5]],
    })
    assert [layer.payload_bytes for layer in model.layers] == sizes
    b = estimate(model, dep(4)).bill
    assert b.replicated_bytes == 120_000
    assert b.resident_shard_bytes == 9 * 10_048 // 4 + 30_016 // 4 == 30_112
    # Slots are sized by the largest layer, wherever it sits -- not by the first or the average.
    assert b.largest_layer_bytes == 30_016
    assert b.slot_bytes == 2 * 30_016 == 60_032
    assert b.sharded_resident_bytes == 90_144
    assert b.padding_bytes == 9 * 48 + 16
    assert b.gross_saving_bytes == 120_000
    assert b.shard_saving_bytes == 120_000 - 30_112
    assert b.net_saving_bytes == 120_000 - 90_144 == 29_856


def test_n1_gives_no_saving_only_the_slots_cost():
    b = estimate(model_from_dict(toy_model([1000, 3000])), dep(1)).bill
    # N = 1: totals padded to 16 B only; each "shard" is the whole layer.
    assert b.resident_shard_bytes == 1008 + 3008
    assert b.shard_saving_bytes == -(8 + 8)
    assert b.net_saving_bytes == -(16 + 2 * 3008)
    assert b.net_saving_bytes < 0


def test_n1_has_no_traffic():
    plan = estimate(model_from_dict(toy_model([1000, 3000])), dep(1, tokens=7, collective_latency=1e-3))
    assert [c.gather_bytes_per_rank for c in plan.layers] == [0, 0]
    # No collective at all: the fixed latency is not paid either.
    assert [c.gather_seconds for c in plan.layers] == [0.0, 0.0]
    assert plan.breakeven_tokens == 0
    assert plan.exposed_seconds_per_step == 0.0


def test_net_saving_formula_for_equal_layers():
    # L equal layers whose size is a multiple of 16*N: net = (1 - 1/N) R - 2|T| exactly.
    L, S, N = 12, 16 * 8 * 1000, 8
    b = estimate(model_from_dict({"name": "eq", "kinds": {"a": {"groups": [{"name": "w", "dtype": "fp8", "bytes": S}]}},
                                  "sequence": [["a", L]]}), dep(N)).bill
    R = L * S
    assert b.padding_bytes == 0
    assert b.net_saving_bytes == R - R // N - 2 * S


# ---- the design's numbers ------------------------------------------------------------------
def test_kimi_k3_fp8_replicated_48_79_gib():
    plan = estimate(load_preset("kimi-k3-b200-fp8"), dep(8))
    kda, mla, moe = 30_601_641_984, 4_907_000_136, 92 * 183_500_000
    assert plan.bill.replicated_bytes == kda + mla + moe
    assert round(plan.bill.replicated_bytes / GiB, 2) == 48.79
    groups = {name: round(n / GiB, 2) for name, _, n in plan.groups}
    assert groups == {"kda_projections": 28.50, "mla_projections": 4.57, "moe_peripherals": 15.72}
    assert plan.bill.layers == 92
    assert [c.index for c in plan.layers] == list(range(1, 93))
    assert [c.kind for c in plan.layers].count("mla") == 23
    # The seed's "~42.7 GiB per GPU saved" is (1 - 1/N) R before the slots, not the net figure.
    assert round(plan.bill.shard_saving_bytes / GiB, 1) == 42.7
    assert plan.bill.net_saving_bytes < plan.bill.shard_saving_bytes < plan.bill.gross_saving_bytes


def test_kimi_k3_moe_bf16_net_saving_exact():
    plan = estimate(load_preset("kimi-k3-b200-moe-bf16"), dep(8))
    b = plan.bill
    R = 367_000_000 * 92
    assert b.replicated_bytes == R == 33_764_000_000
    assert round(R / GiB, 2) == 31.45
    # 367e6 is not a multiple of 16*8 = 128: each layer's T is padded by 64 bytes.
    assert 367_000_000 % 128 == 64
    T = 367_000_064
    assert b.largest_layer_bytes == T
    assert R % 8 == 0
    # net = 7/8 R - 2|T| - the tail padding each rank stores (64 B per layer over 8 ranks).
    assert b.net_saving_bytes == 7 * R // 8 - 92 * 64 // 8 - 2 * T == 28_809_499_136
    assert plan.to_dict()["allgather_bytes_per_rank_per_layer"] == 7 * T // 8 == 321_125_056


def test_presets_all_load_and_say_where_numbers_come_from():
    names = list_presets()
    assert {"kimi-k3-b200-fp8", "kimi-k3-b200-moe-bf16"} <= set(names)
    for name in names:
        m = load_preset(name)
        assert m.name == name and m.source and m.layers
        assert estimate(m, dep(8)).bill.net_saving_bytes > 0


def test_weight_shapes_give_the_exact_flat_layout():
    m = load_preset("llama-3.1-8b-dp8-bf16")
    assert m.layers[0].layout(8) == FlatLayout(
        [("attention.q_proj", (4096, 4096), torch.bfloat16), ("attention.k_proj", (1024, 4096), torch.bfloat16),
         ("attention.v_proj", (1024, 4096), torch.bfloat16), ("attention.o_proj", (4096, 4096), torch.bfloat16),
         ("mlp.gate_proj", (14336, 4096), torch.bfloat16), ("mlp.up_proj", (14336, 4096), torch.bfloat16),
         ("mlp.down_proj", (4096, 14336), torch.bfloat16)], 8)
    assert m.replicated_bytes == 32 * 2 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096)


def test_total_bytes_split_keeps_the_total():
    d = {"name": "t", "kinds": {"a": {"groups": [{"name": "w", "dtype": "fp8", "total_bytes": 1003}]}},
         "sequence": [["a", 4]]}
    m = model_from_dict(d)
    assert [layer.payload_bytes for layer in m.layers] == [251, 251, 251, 250]
    assert m.replicated_bytes == 1003


def test_with_dtype_keeps_params():
    m = load_preset("kimi-k3-b200-moe-bf16")
    m8 = m.with_dtype("fp8_e4m3")
    assert m8.replicated_bytes * 2 == m.replicated_bytes
    assert [g.params for layer in m8.layers for g in layer.groups] == [g.params for layer in m.layers for g in layer.groups]


# ---- bill from layouts (for measured runs) -----------------------------------------------
def test_bill_for_layouts_matches_the_model_and_cycles():
    a = FlatLayout([("x", (33, 5), torch.bfloat16), ("y", (7,), torch.float32)], 4)
    b = FlatLayout([("x", (100, 3), torch.float8_e4m3fn)], 4)
    bill = bill_for_layouts([a, b], n_layers_total=5)  # a b a b a
    assert bill.layers == 5
    assert bill.replicated_bytes == 3 * (330 + 28) + 2 * 300
    assert bill.resident_shard_bytes == 3 * a.chunk_bytes + 2 * b.chunk_bytes
    assert bill.slot_bytes == 2 * max(a.total_bytes, b.total_bytes)
    assert bill_for_layouts([a, b, a, b, a]) == bill
    with pytest.raises(CostModelError, match="group sizes differ"):
        bill_for_layouts([a, FlatLayout([("x", (4,), torch.float32)], 2)])
    with pytest.raises(CostModelError, match="ranks: 8 does not match"):
        bill_for_layouts([a], ranks=8)
    with pytest.raises(CostModelError, match="n_layers_total"):
        bill_for_layouts([a, b], n_layers_total=1)


# ---- traffic and time --------------------------------------------------------------------
def test_gather_bytes_time_and_breakeven_by_hand():
    # Layer 0: 10 000 B bf16 = 5000 params; layer 1: 30 000 B (T = 30 016 at N = 4).
    plan = estimate(model_from_dict(toy_model([10_000, 30_000])), dep(4, tokens=1000))
    c0, c1 = plan.layers
    assert c1.gather_bytes_per_rank == 3 * 30_016 // 4 == 22_512
    assert c1.gather_seconds == pytest.approx(22_512 / 1e9, rel=1e-15)
    assert c0.compute_seconds_per_token == pytest.approx(2 * 5000 / 1e12, rel=1e-15)
    assert c0.compute_seconds == pytest.approx(1000 * 1e-8, rel=1e-12)
    assert c1.hide_ratio == pytest.approx(22_512e-9 / 1e-5, rel=1e-12)
    # 22.512 us of gather behind 10 ns per token: 2252 tokens (2251 leave 2 ns exposed).
    assert c1.breakeven_tokens == 2252 and c0.breakeven_tokens is None
    assert plan.breakeven_tokens == 2252
    assert plan.exposed_seconds_per_step == pytest.approx(c0.gather_seconds + c1.gather_seconds - 1e-5, rel=1e-12)


def test_fp8_weights_use_the_fp8_peak_and_latency_adds_to_each_gather():
    plan = estimate(model_from_dict(toy_model([6400, 6400], "fp8")), dep(2, tokens=10, collective_latency=5e-6))
    assert plan.layers[0].compute_seconds_per_token == pytest.approx(2 * 6400 / 2e12, rel=1e-15)
    assert plan.layers[1].gather_seconds == pytest.approx(5e-6 + 3200 / 1e9, rel=1e-15)


def test_bandwidth_overrides_the_device_link():
    plan = estimate(model_from_dict(toy_model([6400, 6400])), dep(2, link_bandwidth=2e9))
    assert plan.layers[1].gather_seconds == pytest.approx(3200 / 2e9, rel=1e-15)


@given(st.floats(1e-9, 1.0), st.floats(1e-12, 1e-3))
def test_breakeven_is_the_smallest_sufficient_batch(gather, per_token):
    t = breakeven(gather, per_token)
    assert t * per_token >= gather
    assert (t - 1) * per_token < gather


def test_breakeven_float_quotient_guard():
    # A plain ceil(gather / per_token) is off by one in both directions for these float inputs;
    # the fix-up loops in breakeven() are what make the answer the exact boundary.
    g, p = 1312.5, 0.7  # 1875 * 0.7 == 1312.5 in floating point, but 1312.5 / 0.7 > 1875
    assert math.ceil(g / p) == 1876 and 1875 * p >= g
    assert breakeven(g, p) == 1875
    g, p = 2.6090000000000003e-05, 1e-08  # the quotient rounds down to exactly 2609.0
    assert math.ceil(g / p) == 2609 and 2609 * p < g
    assert breakeven(g, p) == 2610
    assert breakeven(0.0, 1e-9) == 0


def test_kv_tokens_and_requests():
    m = model_from_dict(toy_model([16_000] * 10))
    plan = estimate(m, dep(8, kv_bytes_per_token=100, context=7))
    net = plan.bill.net_saving_bytes
    assert net == 160_000 - 20_000 - 32_000
    assert plan.extra_kv_tokens == net // 100 == 1080
    assert plan.extra_requests == 1080 // 7
    assert estimate(m, dep(8)).extra_kv_tokens is None


# ---- bad input ---------------------------------------------------------------------------
@pytest.mark.parametrize(("field", "kwargs"), [
    ("ranks", {"ranks": 0}),
    ("ranks", {"ranks": -3}),
    ("tokens", {"tokens": -1}),
    ("bandwidth", {"link_bandwidth": 0.0}),
    ("bandwidth", {"link_bandwidth": -5e9}),
    ("efficiency", {"efficiency": 0.0}),
    ("latency", {"collective_latency": -1.0}),
    ("kv_bytes_per_token", {"kv_bytes_per_token": 0}),
])
def test_bad_deployment_names_the_field(field, kwargs):
    args = {"ranks": 8, "device": TOY, "tokens": 1} | kwargs
    with pytest.raises(CostModelError, match=f"^{field}:"):
        Deployment(**args)


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: d["kinds"]["k10"]["groups"][0].update(bytes=-10), r"toy.kinds.k10.w.bytes: must be >= 1"),
    (lambda d: d["kinds"]["k10"]["groups"][0].update(bytes=True), r"toy.kinds.k10.w.bytes: expected an integer"),
    (lambda d: d["kinds"]["k10"]["groups"][0].update(dtype="fp7"), r"toy.kinds.k10.w.dtype: unknown dtype 'fp7'"),
    (lambda d: d["kinds"]["k10"]["groups"][0].update(bytes=11), r"toy.kinds.k10.w.bytes: 11 B is not a whole number"),
    (lambda d: d["kinds"]["k10"]["groups"][0].pop("dtype"), r"toy.kinds.k10.w.dtype: missing"),
    (lambda d: d["kinds"]["k10"]["groups"][0].update(weights=[]), r"give exactly one of bytes, total_bytes, weights"),
    (lambda d: d["kinds"]["k10"]["groups"][0].pop("bytes"), r"give exactly one of .*got none"),
    (lambda d: d.update(sequence=[["nope", 1]]), r"toy.sequence\[0\]: unknown kind 'nope'"),
    (lambda d: d.update(sequence=[["k10", 0]]), r"toy.sequence\[0\].count: must be >= 1"),
    (lambda d: d.pop("name"), r"^name:"),
    (lambda d: d.update(kinds={}), r"toy.kinds:"),
])
def test_bad_model_names_the_field(mutate, message):
    d = toy_model([10])
    mutate(d)
    with pytest.raises(CostModelError, match=message):
        model_from_dict(d)


def test_bad_weight_shape_names_the_weight():
    d = {"name": "m", "kinds": {"a": {"groups": [{"name": "attn", "dtype": "bf16",
                                                  "weights": [{"name": "q", "shape": [4, -1]}]}]}},
         "sequence": [["a", 1]]}
    with pytest.raises(CostModelError, match=r"m.kinds.a.attn.weights.q.shape: must be >= 1"):
        model_from_dict(d)


def test_unknown_preset_and_device():
    with pytest.raises(CostModelError, match=r"preset: unknown preset 'nope'; known: .*kimi-k3-b200-fp8"):
        load_preset("nope")
    with pytest.raises(CostModelError, match=r"device: unknown device 'a100'"):
        get_device("a100")


def test_model_files_yaml_json_and_malformed(tmp_path):
    yml = tmp_path / "m.yaml"
    yml.write_text("name: tiny\nkinds:\n  a:\n    groups:\n      - {name: w, dtype: bf16, bytes: 4096}\n"
                   "sequence: [[a, 3]]\n")
    assert load_model_file(yml).replicated_bytes == 3 * 4096
    js = tmp_path / "m.json"
    js.write_text(json.dumps(preset_dict("kimi-k3-b200-moe-bf16")))
    assert load_model_file(js).replicated_bytes == 92 * 367_000_000
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(CostModelError, match=r"model file .*bad.json: not valid json"):
        load_model_file(bad)
    with pytest.raises(CostModelError, match=r"model file .*missing.json does not exist"):
        load_model_file(tmp_path / "missing.json")
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(CostModelError, match=r"model: expected a mapping"):
        load_model_file(lst)


def test_plan_json_is_integral_and_complete():
    d = estimate(load_preset("kimi-k3-b200-fp8"), dep(8, tokens=64)).to_dict()
    for key in ("preset", "ranks", "layers", "replicated_bytes", "sharded_resident_bytes", "slot_bytes",
                "net_saving_bytes", "allgather_bytes_per_rank_per_layer", "breakeven_tokens", "groups"):
        assert key in d
    for key in ("replicated_bytes", "sharded_resident_bytes", "slot_bytes", "net_saving_bytes",
                "allgather_bytes_per_rank_per_layer"):
        assert type(d[key]) is int
    assert all(type(g["replicated_bytes"]) is int and g["dtype"] == "fp8_e4m3" for g in d["groups"])
    assert json.loads(json.dumps(d)) == d
    assert math.isfinite(d["exposed_seconds_per_step"])


def test_mapped_bill_is_the_measured_resident_bytes_of_the_8_block_model():
    """``map_own_chunk``: chunks in 2 MiB pages, and after finalize a slot keeps only the peers' pages.
    The 8-block model (Llama-3.1-8B shapes, BF16) at N = 2 held 2,181,038,080 B per rank on an H200
    (``bench step --mapped``, docs/measurements/h200-2026-12-01/bench_step_h200_2ranks-1gpu_..._mapped-trimmed.json)."""
    from wsharding.costmodel import MAPPED_PAGE_BYTES

    block = [("q", (4096, 4096)), ("k", (1024, 4096)), ("v", (1024, 4096)), ("o", (4096, 4096)),
             ("gate_up", (2 * 14336, 4096)), ("down", (4096, 14336))]
    entries = [(name, shape, torch.bfloat16) for name, shape in block]
    plain = bill_for_layouts([FlatLayout(entries, 2)], n_layers_total=8)
    mapped = bill_for_layouts([FlatLayout(entries, 2, chunk_alignment=MAPPED_PAGE_BYTES)], n_layers_total=8,
                              map_own_chunk=True)
    assert plain.sharded_resident_bytes == 2_617_245_696  # measured with plain slots, same run
    assert mapped.sharded_resident_bytes == 2_181_038_080
    assert mapped.slot_bytes == 2 * (2 - 1) * 218_103_808 and mapped.finalize_slot_bytes == plain.slot_bytes


def test_plan_prices_map_own_chunk_with_paged_chunks_and_whole_slots_at_finalize():
    from wsharding.costmodel import MAPPED_PAGE_BYTES

    model = load_preset("kimi-k3-b200-fp8")
    dep = dict(ranks=8, device=get_device("b200"), tokens=256)
    plain, mapped = estimate(model, Deployment(**dep)), estimate(model, Deployment(**dep, map_own_chunk=True))
    layouts = model.layouts(8, MAPPED_PAGE_BYTES)
    assert all(lay.chunk_bytes % MAPPED_PAGE_BYTES == 0 for lay in layouts)
    assert mapped.bill.resident_shard_bytes == sum(lay.chunk_bytes for lay in layouts)
    assert mapped.bill.slot_bytes == 2 * 7 * max(lay.chunk_bytes for lay in layouts)
    # finalize still rebuilds weights in whole slots: the load peak keeps them
    assert mapped.load_peaks()["device_rows"] == (mapped.bill.resident_shard_bytes + mapped.bill.finalize_slot_bytes
                                                  + mapped.largest_weight_bytes)
    assert mapped.to_dict()["map_own_chunk"] is True and plain.to_dict()["map_own_chunk"] is False
    assert "mapped slots 2(N-1)/N max|T|" in plan_table(mapped)
