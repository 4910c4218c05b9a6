"""The ctypes table and types against nccl.h as documented in ../shared/REFERENCES.md."""

from __future__ import annotations

import ctypes

import pytest

from wsharding.accel.nccl import binding as B
from wsharding.accel.nccl.library import default_library

# Written out from REFERENCES.md (not imported from the module under test).
DOCUMENTED_OFFSETS = {
    "size": 0, "magic": 8, "version": 12, "blocking": 16, "cgaClusterSize": 20, "minCTAs": 24, "maxCTAs": 28,
    "netName": 32, "splitShare": 40, "trafficClass": 44, "commName": 48, "collnetEnable": 56, "CTAPolicy": 60,
    "shrinkShare": 64, "nvlsCTAs": 68, "nChannelsPerNetPeer": 72, "nvlinkCentricSched": 76,
}


@pytest.fixture(scope="module")
def nccl():
    return B.NcclBinding(default_library())


def test_config_size_and_offsets():
    assert ctypes.sizeof(B.NcclConfig) == 80
    assert {name: getattr(B.NcclConfig, name).offset for name, _ in B.NcclConfig._fields_} == DOCUMENTED_OFFSETS
    assert B.CONFIG_LAYOUT == DOCUMENTED_OFFSETS


def test_make_config_bytes():
    cfg = B.make_config(blocking=False, cta_policy=2)
    raw = ctypes.string_at(ctypes.addressof(cfg), 80)
    le = lambda off, n=4: int.from_bytes(raw[off:off + n], "little", signed=True)  # noqa: E731
    assert int.from_bytes(raw[0:8], "little") == 80
    assert int.from_bytes(raw[8:12], "little") == 0xCAFEBEEF
    assert int.from_bytes(raw[12:16], "little") == 22800
    assert le(16) == 0 and le(60) == 2  # non-blocking, CTA policy zero
    for off in (20, 24, 28, 40, 44, 56, 64, 68, 72, 76):  # unset ints are NCCL_CONFIG_UNDEF_INT
        assert le(off) == -(2**31), off
    assert raw[32:40] == b"\0" * 8  # netName NULL
    assert B.make_config(blocking=True, cta_policy=None).CTAPolicy == -(2**31)


def test_every_table_function_is_in_the_wheel(nccl):
    assert nccl.missing == []
    for fn in B.FUNCTIONS:
        assert getattr(nccl, fn.name).argtypes == list(fn.argtypes)


def test_unique_id_on_cpu(nccl):
    a, b = nccl.get_unique_id(), nccl.get_unique_id()
    assert len(a.to_bytes()) == 128 and a.to_bytes() != b.to_bytes()
    assert B.NcclUniqueId.from_bytes(a.to_bytes()).to_bytes() == a.to_bytes()
    with pytest.raises(B.CommError, match="128 bytes, got 5"):
        B.NcclUniqueId.from_bytes(b"short")


def test_check_turns_results_into_errors(nccl):
    assert nccl.check(0, "x") == 0
    assert nccl.check(7, "x", allow_in_progress=True) == 7
    with pytest.raises(B.NcclError, match=r"ncclAllGather failed: ncclInvalidUsage \(5\): invalid usage") as e:
        nccl.check(5, "ncclAllGather")
    assert e.value.result == 5
    with pytest.raises(B.NcclError, match="ncclInProgress"):
        nccl.check(7, "x")  # in-progress is only fine where the caller polls


def test_binding_table_rows():
    rows = B.binding_table()
    assert [r["function"] for r in rows] == [f.name for f in B.FUNCTIONS]
    ag = next(r for r in rows if r["function"] == "ncclAllGather")
    assert ag["arguments"] == "void*, void*, size_t, int, void*, void*" and ag["returns"] == "ncclResult_t"
