"""Targets decided by the Linear contract: a package linear of tp size 1 is sharded, one split by
tensor parallelism is left alone with its reason; fusions that need the full shape are decided
before the shrink."""

from __future__ import annotations

import pytest
import torch

from wsharding.core.comm import Communicator
from wsharding.core.sharding import ShardingError, WeightSharding
from wsharding.linear import ParallelState, ReplicatedLinear, parallel_state
from wsharding.models import PRESETS, ToyDecoder
from wsharding.models.decoder import SHARD_TARGETS, DecoderLayer, qkv_gemm_plan


class FakeComm(Communicator):
    """Only what the declare stage reads: no collective runs before setup."""

    rank, world_size, device, mode = 0, 2, torch.device("cpu"), "cpu-gloo"


ATTN = ["attn.qkv_proj", "attn.o_proj"]
LATENT = ["moe.latent_down", "moe.latent_up"]
SHARED = ["moe.shared_expert.gate_up_proj", "moe.shared_expert.down_proj"]


def decide(tp: int, attn_dp: int, shared_tp: int | None, attn_group: str, moe_group: str) -> WeightSharding:
    cfg = PRESETS["tiny"].with_(attn_group=attn_group, moe_group=moe_group)
    with parallel_state(ParallelState.logical(tp, tp - 1, attn_dp_size=attn_dp, shared_experts_tp_size=shared_tp)):
        layer = DecoderLayer(cfg, 1)
    ws = WeightSharding(FakeComm())
    ws.declare(1, layer)
    return ws


def sharded_names(ws: WeightSharding) -> list[str]:
    return [d.name for d in ws.decisions if d.sharded]


def test_dp_attention_plus_tp_moe_shards_what_the_seed_shards():
    # TP 4 with attention DP 4 (attn_tp size 1) and the shared expert split over 4 ranks (TP MoE)
    ws = decide(4, 4, 4, "attn_tp", "shared_experts_tp")
    assert sharded_names(ws) == ATTN + LATENT   # attention (attn_tp 1) and the replicated latent projections
    assert [t.name for t in ws.targets[1]] == ATTN + LATENT
    lines = ws.report().splitlines()
    assert lines[0] == "layer 1: attn.qkv_proj: sharded -- group 'attn_tp', tp size 1: the same bytes on every rank"
    assert lines[2] == ("layer 1: moe.latent_down: sharded -- group 'replicated', tp size 1: the same bytes on every rank")
    assert lines[4] == ("layer 1: moe.shared_expert.gate_up_proj: left alone -- group 'shared_experts_tp', tp size 4: "
                        "tensor parallelism already splits it, its bytes differ between ranks")
    assert len(lines) == 6


def test_tp_attention_is_left_alone_replicated_moe_sharded():
    ws = decide(4, 1, None, "attn_tp", "replicated")  # attention TP 4: the design adds attention only when attn_tp == 1
    assert sharded_names(ws) == LATENT + SHARED
    assert [d.name for d in ws.decisions if not d.sharded] == ATTN
    assert "group 'attn_tp', tp size 4: tensor parallelism already splits it" in ws.report()


def test_default_build_shards_all_six():
    assert sharded_names(decide(1, 1, None, "replicated", "replicated")) == list(SHARD_TARGETS)


def test_linears_themselves_as_targets():
    layer = DecoderLayer(PRESETS["tiny"], 1)
    ws = WeightSharding(FakeComm(), [layer], {0: [layer.attn.o_proj, layer.moe.latent_up]})
    assert [t.name for t in ws.targets[0]] == ["attn.o_proj", "moe.latent_up"]
    with pytest.raises(ShardingError, match="a declared ReplicatedLinear is not a submodule of the layer"):
        WeightSharding(FakeComm(), [layer], {0: [ReplicatedLinear(4, 4)]})


# ---- fusions are decided before the shrink --------------------------------------------------------
def test_fusion_decisions_need_the_full_shape():
    cfg = PRESETS["tiny"].with_(merge_front=True)
    layer = DecoderLayer(cfg, 1)
    full_rows = (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim
    assert qkv_gemm_plan(layer.attn.qkv_proj)["rows"] == full_rows
    ws = WeightSharding(FakeComm())
    ws.declare(1, layer)
    ws.setup_layer(1)  # the shrink: every target keeps 1/2 of its rows
    assert layer.attn.qkv_proj.weight.shape[0] == full_rows // 2
    # decided now, after the shrink, both fusions would be planned for the wrong shape: they refuse
    with pytest.raises(ValueError, match="layers.1.attn.qkv_proj.weight has 96 rows, its partition has 192: weight sharding"):
        qkv_gemm_plan(layer.attn.qkv_proj)
    with pytest.raises(ValueError, match="decide the front merge before weight sharding shrinks the layer"):
        layer.moe.plan_front_merge(True, set())
    with pytest.raises(ShardingError, match="layer 1: declare\\(\\) after setup_layer\\(\\)"):
        ws.declare(1, layer)


def test_model_takes_its_fusion_decisions_before_the_shrink(cluster_of):
    # ToyDecoder: declare, plan_fusions, setup_layer -- in that order; a model that shrank first fails
    # to build (the refusals above), and one that planned with shrunk shapes would record half the rows.
    res = cluster_of(2).run(_fusions_of_a_sharded_model)
    cfg = PRESETS["tiny"]
    for r in res:
        assert r["qkv_rows"] == [(cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim] * cfg.layers
        assert r["weight_rows"][0] == r["qkv_rows"][0]       # layer 0 not sharded: full weight
        assert r["front_merge"][0] is None                    # the dense layer has no MoE
        for i in range(1, cfg.layers):                        # sharded: the storage-changing merge is skipped
            assert r["front_merge"][i].startswith("skipped: latent_down, shared_expert.gate_up_proj sharded")
        assert r["reference_front_merge"][1] == "merged: one GEMM of [144, 96]"  # 48 latent + 2 x 48, hidden 96


def _fusions_of_a_sharded_model(ctx):
    cfg = PRESETS["tiny"].with_(merge_front=True)
    ws = WeightSharding(ctx.comm, sharded_layers=range(1, cfg.layers))
    model = ToyDecoder(cfg, weight_sharding=ws)
    ws.finalize()
    ref = ToyDecoder(cfg)
    return {"qkv_rows": [layer.attn.qkv_gemm["rows"] for layer in model.layers],
            "weight_rows": [layer.attn.qkv_proj.weight.shape[0] for layer in model.layers],
            "front_merge": [layer.fusions.get("front_merge") for layer in model.layers],
            "reference_front_merge": [layer.fusions.get("front_merge") for layer in ref.layers]}


# ---- on ranks: DP attention + TP MoE, sharded vs unsharded -----------------------------------------
COUNTS = [[3, 5], [6, 0], [1, 4]]


@pytest.mark.parametrize("merge_front", [False, True])
def test_dp_attention_tp_moe_model_on_ranks(cluster_of, merge_front):
    from tests.ranktasks import parallel_model_equality

    cfg = PRESETS["tiny"]
    res = cluster_of(2).run(parallel_model_equality, "tiny", COUNTS, merge_front=merge_front)
    for r in res:
        assert r["attn_tp_size"] == 1
        assert r["equal"] == [None if COUNTS[s][r["rank"]] == 0 else True for s in range(3)], r["equal"]
        assert r["max_abs_diff"] == 0.0
        assert r["targets"] == {i: ATTN + LATENT for i in range(1, cfg.layers)}
        # the TP shared expert keeps its own split: half of gate and up on each of the 2 ranks, not a slot view
        assert r["shared_gate_up_shape"] == [cfg.shared_inter, cfg.hidden]
        assert "moe.shared_expert.down_proj: left alone -- group 'shared_experts_tp', tp size 2" in r["report"]
        h, q, kv = cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        per_layer = ((q + 2 * kv) * h + q * h + 2 * cfg.latent * h) * 2  # bf16
        assert r["replicated_bytes"] == per_layer * (cfg.layers - 1)
        assert r["resident_bytes"] == r["formula_bytes"]
        if merge_front:  # the shared expert is split: nothing to merge with, in either model
            assert r["fusions"][1]["front_merge"].startswith("skipped: latent_down sharded")
            assert r["reference_fusions"][1]["front_merge"] == "off"


def test_front_merge_computes_the_same_block():
    cfg = PRESETS["tiny"]
    merged, plain = ToyDecoder(cfg.with_(merge_front=True)).eval(), ToyDecoder(cfg).eval()
    assert merged.layers[1].fusions["front_merge"] == "merged: one GEMM of [144, 96]"
    assert plain.layers[1].fusions["front_merge"] == "off"
    x = torch.randint(0, cfg.vocab, (7,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = merged(x), plain(x)
    # one GEMM over stacked rows or two GEMMs: the same dot products over the same K, reduced in the same
    # order by the CPU's GEMM: bitwise equal, so any error of the merge shows (a GPU's GEMM may pick
    # another kernel for the stacked shape; not tested here)
    assert torch.equal(a, b)
