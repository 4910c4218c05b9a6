"""FlatLayout: alignment, padding, ownership and zero-copy views (no ranks involved)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from wsharding.core.layout import ALIGNMENT, FlatLayout, LayoutEntry, LayoutError

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int8, torch.uint8]

specs_strategy = st.lists(
    st.tuples(
        st.lists(st.integers(0, 9), min_size=1, max_size=3),
        st.sampled_from(DTYPES),
    ),
    min_size=1,
    max_size=7,
)


def _specs(raw):
    return [(f"w{i}", tuple(shape), dtype) for i, (shape, dtype) in enumerate(raw)]


def _random_tensors(layout: FlatLayout, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        e.name: torch.randint(0, 256, (e.nbytes,), dtype=torch.uint8, generator=g).view(e.dtype).view(e.shape)
        for e in layout.entries
    }


def test_hand_computed_layout():
    lay = FlatLayout([("a", (3, 5), torch.bfloat16), ("b", (4,), torch.float32), ("c", (7,), torch.int8)], 3)
    assert [(e.offset, e.nbytes) for e in lay.entries] == [(0, 30), (32, 16), (48, 7)]
    assert lay.used_bytes == 55
    assert lay.total_bytes == 96  # next multiple of 16*3
    assert lay.chunk_bytes == 32
    assert lay.alignment_padding_bytes == 2 and lay.tail_padding_bytes == 41
    # rank 1's chunk [32, 64) holds all of b and all of c; rank 0 holds a (+2 padding bytes)
    assert [(p.name, p.entry_start, p.entry_stop, p.chunk_start, p.chunk_stop) for p in lay.pieces(0)] == [
        ("a", 0, 30, 0, 30)
    ]
    assert [(p.name, p.entry_start, p.entry_stop, p.chunk_start, p.chunk_stop) for p in lay.pieces(1)] == [
        ("b", 0, 16, 0, 16),
        ("c", 0, 7, 16, 23),
    ]
    assert lay.pieces(2) == []


def test_chunk_crosses_weight_border():
    lay = FlatLayout([("a", (40,), torch.float32), ("b", (40,), torch.float32)], 4)
    # |T| = 320, C = 80: chunk borders fall on weight borders here (a = ranks 0-1, b = ranks 2-3)
    assert lay.chunk_bytes == 80
    assert [(x.name, x.entry_start, x.entry_stop) for x in lay.pieces(1)] == [("a", 80, 160)]
    assert [(x.name, x.entry_start, x.entry_stop) for x in lay.pieces(2)] == [("b", 0, 80)]
    lay3 = FlatLayout([("a", (40,), torch.float32), ("b", (40,), torch.float32)], 3)
    # |T| = 336, C = 112: rank 1 owns [112, 224) = a[112:160] + b[0:64]
    assert [(x.name, x.entry_start, x.entry_stop, x.chunk_start, x.chunk_stop) for x in lay3.pieces(1)] == [
        ("a", 112, 160, 0, 48),
        ("b", 0, 64, 48, 112),
    ]


@given(specs_strategy, st.integers(1, 9))
def test_layout_invariants(raw, n):
    lay = FlatLayout(_specs(raw), n)
    prev_end = 0
    for e in lay.entries:
        assert e.offset % ALIGNMENT == 0
        assert e.offset >= prev_end  # no overlap
        assert e.offset - prev_end < ALIGNMENT  # padding holes are smaller than the alignment
        prev_end = e.end
    assert lay.total_bytes % (ALIGNMENT * n) == 0
    assert lay.total_bytes - lay.used_bytes < ALIGNMENT * n or lay.used_bytes == 0
    assert lay.chunk_bytes * n == lay.total_bytes
    assert lay.chunk_bytes % ALIGNMENT == 0


@given(specs_strategy, st.integers(1, 9), st.integers(0, 2**16))
def test_pieces_of_all_ranks_reassemble_the_full_buffer(raw, n, seed):
    lay = FlatLayout(_specs(raw), n)
    tensors = _random_tensors(lay, seed)
    expected = lay.pack(tensors)
    rebuilt = torch.zeros(lay.total_bytes, dtype=torch.uint8)
    covered = torch.zeros(lay.total_bytes, dtype=torch.int32)
    for r in range(n):
        chunk = torch.full((lay.chunk_bytes,), 0xEE, dtype=torch.uint8)
        lay.fill_chunk(r, tensors, chunk)
        lo, hi = lay.chunk_range(r)
        rebuilt[lo:hi] = chunk
        for p in lay.pieces(r):
            covered[lo + p.chunk_start : lo + p.chunk_stop] += 1
            assert p.chunk_stop - p.chunk_start == p.entry_stop - p.entry_start
    assert torch.equal(rebuilt, expected)
    # every payload byte is owned exactly once, padding bytes by nobody
    for e in lay.entries:
        assert torch.all(covered[e.offset : e.end] == 1)
    assert int(covered.sum()) == lay.payload_bytes


@given(specs_strategy, st.integers(1, 6))
def test_views_share_storage_and_round_trip(raw, n):
    lay = FlatLayout(_specs(raw), n)
    tensors = _random_tensors(lay, 1)
    buf = lay.pack(tensors)
    views = lay.views(buf)
    base = buf.untyped_storage().data_ptr()
    for e in lay.entries:
        v = views[e.name]
        assert v.untyped_storage().data_ptr() == base  # a view, not a copy
        if e.nbytes:  # torch reports data_ptr 0 for empty tensors
            assert v.data_ptr() == buf.data_ptr() + e.offset
        assert v.dtype == e.dtype and tuple(v.shape) == e.shape
        assert torch.equal(v.view(torch.uint8), tensors[e.name].view(torch.uint8))
    for r in range(n):
        c = lay.chunk(buf, r)
        assert c.data_ptr() == buf.data_ptr() + r * lay.chunk_bytes
    # writing through a view writes the buffer
    e0 = lay.entries[0]
    if e0.nbytes:
        views[e0.name].view(torch.uint8).view(-1)[0] = 7
        assert int(buf[e0.offset]) == 7


def test_misaligned_layout_is_caught():
    good = FlatLayout([("a", (3,), torch.int8), ("b", (2,), torch.float32)], 2)
    assert good.entry("b").offset == 16
    bad_entries = [good.entry("a"), LayoutEntry("b", (2,), torch.float32, 3, 8)]
    with pytest.raises(LayoutError, match="'b' starts at byte 3, not a multiple of the 16-byte alignment"):
        FlatLayout.from_entries(bad_entries, 2)
    # What the rule protects: an fp32 view at byte offset 3 is impossible without a copy.
    buf = torch.zeros(32, dtype=torch.uint8)
    with pytest.raises(RuntimeError):
        buf.narrow(0, 3, 8).view(torch.float32)
    overlapping = [good.entry("a"), LayoutEntry("b", (2,), torch.float32, 0, 8)]
    with pytest.raises(LayoutError, match="overlaps"):
        FlatLayout.from_entries(overlapping, 2)
    assert FlatLayout.from_entries(list(good.entries), 2) == good


@pytest.mark.parametrize(
    "specs, n, match",
    [
        ([("a", (2,), torch.float32)], 0, "group_size: must be >= 1, got 0"),
        ([], 2, "at least one entry"),
        ([("a", (2,), torch.float32), ("a", (3,), torch.float16)], 2, "duplicate entry name 'a'"),
        ([("a", (2,), torch.float64)], 2, "entry 'a': unsupported dtype torch.float64"),
        ([("a", (2,), "fp64")], 2, "entry 'a': unknown dtype 'fp64'"),
        ([("a", (-1, 2), torch.float32)], 2, r"entry 'a': shape \(-1, 2\): dimension: must be >= 0, got -1"),
        ([("a", (2.5, 2), torch.float32)], 2, r"entry 'a': shape \(2.5, 2\): dimension: expected an integer, got 2.5"),
        ([("", (2,), torch.float32)], 2, "non-empty string"),
    ],
)
def test_bad_layouts(specs, n, match):
    with pytest.raises(LayoutError, match=match):
        FlatLayout(specs, n)


def test_bad_buffers():
    lay = FlatLayout([("a", (4,), torch.float32)], 2)
    with pytest.raises(LayoutError, match="exactly 32"):
        lay.views(torch.zeros(31, dtype=torch.uint8))
    with pytest.raises(LayoutError, match="dtype torch.uint8"):
        lay.views(torch.zeros(32, dtype=torch.int8))
    with pytest.raises(LayoutError, match="1-D"):
        lay.views(torch.zeros(2, 16, dtype=torch.uint8))
    with pytest.raises(LayoutError, match="is on cpu, expected meta"):
        lay.check_buffer(torch.zeros(32, dtype=torch.uint8), device="meta")
    with pytest.raises(LayoutError, match="rank 2 is outside the group"):
        lay.pieces(2)
    with pytest.raises(LayoutError, match="entry 'a' is torch.float16"):
        lay.pack({"a": torch.zeros(4, dtype=torch.float16)})
    with pytest.raises(LayoutError, match="missing tensor for entry 'a'"):
        lay.pack({})


def test_mixed_dtypes_and_table():
    specs = [(f"w_{d}".replace("torch.", ""), (3, 5), d) for d in DTYPES]
    lay = FlatLayout(specs, 4)
    tensors = _random_tensors(lay)
    views = lay.views(lay.pack(tensors))
    for name, t in tensors.items():
        assert torch.equal(views[name].view(torch.uint8), t.view(torch.uint8))
    text = repr(lay)
    assert "N=4" in text and "fp8_e4m3" in text and "rank 3" in text


def test_chunk_alignment_pads_every_chunk_to_whole_pages():
    """A chunk mapped into a layer's view must be whole pages of the GPU's allocation granularity
    ([Note: the own chunk mapped, not copied]); entry offsets keep their 16-byte rule."""
    page = 2 << 20
    specs = [("a", (1000, 300), torch.bfloat16), ("b", (7,), torch.float32)]
    plain = FlatLayout(specs, 2)
    mapped = FlatLayout(specs, 2, chunk_alignment=page)
    assert [e.offset for e in mapped.entries] == [e.offset for e in plain.entries] == [0, 600000]
    assert plain.total_bytes == 600032 and mapped.total_bytes == 2 * page and mapped.chunk_bytes == page
    assert mapped.tail_padding_bytes == 2 * page - 600028 and mapped != plain
    assert FlatLayout.from_entries(mapped.entries, 2, chunk_alignment=page) == mapped
    bad = FlatLayout.from_entries(mapped.entries, 2, chunk_alignment=page)
    bad.total_bytes += 16  # a chunk that is not whole pages could not be mapped
    with pytest.raises(LayoutError, match=r"not a multiple of chunk_alignment\*N = 4194304"):
        bad.validate()
    for wrong in (8, 3 << 20, "2M"):
        with pytest.raises(LayoutError, match="chunk_alignment.* a power of two >= alignment"):
            FlatLayout(specs, 2, chunk_alignment=wrong)


@pytest.mark.parametrize("n", [8, 9, 10**6, 10**8])
def test_repr_is_bounded_whatever_the_group_size(n):
    # One line per rank: 18 s at N = 10**6, no answer at 10**8. Now the first and last four ranks.
    lay = FlatLayout([("a", (n, 2), torch.float32), ("b", (n,), torch.bfloat16)], n)
    text = repr(lay)
    lines = text.splitlines()
    assert len(lines) == 2 + 2 + 8 + (n > 8)
    assert lines[4].startswith("  rank 0: bytes [0, ") and lines[-1].startswith(f"  rank {n - 1}: ")
    assert len(text) < 1200
    if n > 8:
        assert f"... ranks 4 to {n - 5} ({n - 8} more)" in text
