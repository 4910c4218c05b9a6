"""The layout panel's pure functions (parse, build, gather + verify) and the panel driven like a
user would drive it. Live gathers use the session's shared 4-rank CPU cluster."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from wsharding.core.layout import FlatLayout, LayoutError
from wsharding.lab.layout_presets import (
    DEMO_LAYER,
    LAYOUT_PRESETS,
    k3_like_moe_peripherals,
    llama31_8b_layer,
    preset_specs,
)
from wsharding.lab.widgets.layout import (
    CUSTOM,
    MAX_CPU_GATHER_BYTES,
    build_layout,
    build_layout_panel,
    parse_custom_specs,
    run_gather,
)

# ---- parsing custom text -------------------------------------------------------------------------


def test_parse_custom_specs_forms():
    text = """
    # comment line
    q   96x64     bf16
    s   (3,)      fp32   # trailing comment
    k   [40, 64]  fp8
    o   64 x 96   float16
    z   ()        int8
    """
    assert parse_custom_specs(text) == [
        ("q", (96, 64), torch.bfloat16),
        ("s", (3,), torch.float32),
        ("k", (40, 64), torch.float8_e4m3fn),
        ("o", (64, 96), torch.float16),
        ("z", (), torch.int8),
    ]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("w bf16", ["line 1", "name shape dtype"]),
        ("ok 2 bf16\nw 3x bf16", ["line 2", "'w'", "96x64"]),  # an empty dimension is a typo, not (3,)
        ("w 2x-3 bf16", ["line 1", "negative"]),
        ("w 2x3 bf17", ["line 1", "'w'", "bf17", "bf16"]),
        ("# nothing\n\n", ["no 'name shape dtype' line"]),
    ],
)
def test_parse_custom_specs_errors_name_the_line(text, words):
    with pytest.raises(LayoutError) as e:
        parse_custom_specs(text)
    for w in words:
        assert w in str(e.value)


# ---- building layouts ------------------------------------------------------------------------------


def test_build_layout_from_presets_and_custom():
    assert build_layout("demo", 4) == FlatLayout(DEMO_LAYER, 4)
    for key in LAYOUT_PRESETS:
        assert build_layout(key, 8) == FlatLayout(preset_specs(key), 8)
    lay = build_layout(CUSTOM, 2, "a 3x5 bf16\nb 4 fp32")
    assert [(e.name, e.offset, e.nbytes) for e in lay.entries] == [("a", 0, 30), ("b", 32, 16)]
    assert (lay.total_bytes, lay.chunk_bytes) == (64, 32)


def test_build_layout_rejects_bad_choices():
    with pytest.raises(LayoutError, match="N .* from 1 to 8"):
        build_layout("demo", 0)
    with pytest.raises(LayoutError, match="N .* from 1 to 8"):
        build_layout("demo", 9)
    with pytest.raises(LayoutError, match="unknown layer preset 'nope'"):
        build_layout("nope", 2)
    with pytest.raises(LayoutError, match="duplicate entry name 'a'"):
        build_layout(CUSTOM, 2, "a 2 bf16\na 3 bf16")


def test_presets_match_their_sources():
    # Llama-3.1-8B: 4096 hidden, 14336 intermediate, 8 kv heads x 128 -> 436,207,616 B in bf16.
    assert FlatLayout(llama31_8b_layer(), 1).payload_bytes == 436_207_616
    # K3-like: the fp8 weights are 183.5 M parameters = the design's 367 MB per layer in BF16.
    fp8 = [FlatLayout([s], 1).entries[0] for s in k3_like_moe_peripherals() if s[2] == torch.float8_e4m3fn]
    assert sum(2 * e.numel for e in fp8) == 367_001_600
    # one fp32 scale per 128 x 128 tile, rounded up
    scaled = dict((n, shape) for n, shape, _ in k3_like_moe_peripherals(32))
    assert scaled["shared_gate_up.weight"] == (384, 224) and scaled["shared_gate_up.scale_inv"] == (3, 2)
    assert FlatLayout(k3_like_moe_peripherals(32), 4).alignment_padding_bytes == 24
    with pytest.raises(LayoutError, match="power of two"):
        k3_like_moe_peripherals(3)


# ---- live gather -----------------------------------------------------------------------------------


def test_run_gather_verifies_every_rank(cluster_of):
    cluster = cluster_of(4)
    lay = build_layout("k3_moe_fp8_small", 4)
    summary = run_gather(cluster, lay)
    assert summary.ok
    assert [r["mismatched_bytes"] for r in summary.reports] == [0, 0, 0, 0]
    assert [r["views_equal"] for r in summary.reports] == [True] * 4
    assert summary.pieces_match == [True] * 4
    assert [row["bytes"] for row in summary.rows()] == [lay.total_bytes] * 4
    assert [row["pieces"] for row in summary.rows()] == [len(lay.pieces(r)) for r in range(4)]
    text = summary.text()
    assert "emulated: CPU processes" in text.splitlines()[0]
    assert text.endswith("byte-exact on every rank: yes")


def test_summary_verdict_can_fail(cluster_of):
    summary = run_gather(cluster_of(4), build_layout("demo", 4))
    assert summary.ok
    bad_bytes = [dict(r) for r in summary.reports]
    bad_bytes[2]["mismatched_bytes"] = 1
    assert not dataclasses.replace(summary, reports=bad_bytes).ok
    bad_view = [dict(r) for r in summary.reports]
    bad_view[0]["views_equal"] = False
    assert not dataclasses.replace(summary, reports=bad_view).ok
    assert not dataclasses.replace(summary, pieces_match=[True, False, True, True]).ok
    assert "byte-exact on every rank: NO" in dataclasses.replace(summary, reports=bad_bytes).text()
    assert not dataclasses.replace(summary, reports=[], pieces_match=[]).ok  # no ranks, no verdict


def test_run_gather_guards(cluster_of):
    cluster = cluster_of(4)
    with pytest.raises(ValueError, match="N=2 ranks but the cluster has 4"):
        run_gather(cluster, build_layout("demo", 2))
    # 416 MiB on CPU-emulated ranks: refused before any rank allocates a byte
    big = build_layout("llama31_8b", 4)
    assert big.total_bytes > MAX_CPU_GATHER_BYTES
    with pytest.raises(ValueError, match="over the 64.0 MiB live-gather limit on CPU-emulated ranks"):
        run_gather(cluster, big)


# ---- the panel -------------------------------------------------------------------------------------


class _RecordingCluster:
    """Hands out the session's real cluster, and records whether the panel closed it."""

    def __init__(self, real):
        self.real, self.closed = real, False
        self.world_size, self.backend = real.world_size, real.backend

    mode = property(lambda self: self.real.mode)
    emulation = property(lambda self: self.real.emulation)

    def run(self, fn, *args, **kwargs):
        return self.real.run(fn, *args, **kwargs)

    def close(self):
        self.closed = True


def test_panel_driven_like_a_user(cluster_of):
    cluster = cluster_of(4)
    panel = build_layout_panel(cluster)
    assert panel.n.value == 4 and panel.layout == FlatLayout(DEMO_LAYER, 4)
    assert [t.name for t in panel.figure.data][-1] == "rank chunks"
    assert "attn.qkv_proj" in panel.table.value

    panel.preset.value = CUSTOM
    panel.custom.value = "w_up 40x24 bf16\nw_scale 3 fp32\nw_down 24x40 fp8"
    assert panel.layout.names == ["w_up", "w_scale", "w_down"]
    panel.gather_button.click()
    assert panel.result is not None and panel.result.ok and panel.error == ""
    assert "byte-exact on every rank" in panel.result_html.value

    panel.custom.value = "w_up 40x24 bf17"
    assert panel.layout is None and panel.result is None and panel.gather_button.disabled
    assert "bf17" in panel.error and "bf17" in panel.status.value

    panel.preset.value = "llama31_8b"
    # 416 MiB on CPU ranks: drawn, the button off, a plain sentence -- not an error in red
    assert panel.layout is not None and panel.figure is not None and panel.gather_button.disabled
    assert "live-gather limit" in panel.error and "live-gather limit" in panel.status.value
    assert "red" not in panel.status.value and "Error" not in panel.status.value
    panel.gather_button.click()
    assert panel.result is None and "live-gather limit" in panel.error
    assert "red" not in panel.result_html.value and "Error" not in panel.result_html.value
    panel.preset.value = "demo"  # a layer that fits: the button is back
    assert not panel.gather_button.disabled and panel.error == ""
    panel.close()
    assert cluster.running  # the cluster passed in belongs to the caller


def test_over_limit_message():
    from wsharding.lab.widgets.layout import over_limit_message

    big, small = build_layout("llama31_8b", 4), build_layout("demo", 4)
    assert over_limit_message(small, "gloo") is None
    note = over_limit_message(big, "gloo")
    assert note is not None and "416" in note and "64.0 MiB live-gather limit on CPU-emulated ranks" in note
    assert over_limit_message(big, "nccl") is None  # GPU ranks take up to 2 GiB


def test_panel_without_a_cluster_of_size_n(cluster_of):
    panel = build_layout_panel(cluster_of(4), start_missing=False)
    panel.n.value = 2
    panel.gather_button.click()
    assert panel.result is None
    assert "no cluster of 2 ranks" in panel.error and "[4]" in panel.error


def test_panel_starts_missing_clusters_and_closes_them(cluster_of):
    started = []

    def start(n):
        started.append(n)
        return _RecordingCluster(cluster_of(4))

    panel = build_layout_panel(None, group_size=4, start_cluster=start)
    assert panel.clusters == {}
    panel.gather_button.click()
    panel.gather_button.click()  # the second click reuses the cluster
    assert started == [4] and panel.result.ok
    made = panel.clusters[4]
    panel.close()
    assert made.closed and panel.clusters == {}


def test_panel_rejects_a_factory_of_the_wrong_size(cluster_of):
    panel = build_layout_panel(None, group_size=2, start_cluster=lambda n: _RecordingCluster(cluster_of(4)))
    panel.gather_button.click()
    assert panel.result is None and "returned a cluster of 4 ranks" in panel.error
