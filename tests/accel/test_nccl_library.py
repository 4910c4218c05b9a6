"""Library discovery, version reading and the version gate (CPU: the wheel's libnccl loads
without a GPU)."""

from __future__ import annotations

import dataclasses
import importlib.metadata

import pytest

from wsharding.accel.nccl import library as L
from wsharding.accel.nccl.communicator import NcclCommunicator

WHEEL_VERSION = importlib.metadata.version("nvidia-nccl-cu12")


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(L.ENV_VAR, raising=False)


def test_wheel_is_found_and_version_read(no_env):
    lib = L.default_library()
    assert lib.source == f"nvidia-nccl-cu12 {WHEEL_VERSION} wheel"
    assert lib.path.endswith("nvidia/nccl/lib/libnccl.so.2")
    assert lib.version_str == WHEEL_VERSION
    major, minor, patch = (int(x) for x in WHEEL_VERSION.split("."))
    assert lib.version_code == major * 10000 + minor * 100 + patch


def test_decode_both_version_formats():
    assert L.decode_version(22809) == (2, 28, 9)
    assert L.decode_version(23203) == (2, 32, 3)
    assert L.decode_version(2708) == (2, 7, 8)  # before 2.9: X*1000 + Y*100 + Z


def test_env_var_wins(monkeypatch, no_env):
    wheel = L.find_library().path
    monkeypatch.setenv(L.ENV_VAR, wheel)
    choice = L.find_library()
    assert choice == L.LibraryChoice(wheel, L.ENV_VAR)


def test_wrong_env_path_is_an_error_not_a_fallback(monkeypatch):
    monkeypatch.setenv(L.ENV_VAR, "/nonexistent/libnccl.so.2")
    with pytest.raises(L.NcclLibraryError, match=r"WSHARDING_NCCL_LIBRARY='/nonexistent/libnccl.so.2' does not name a file"):
        L.find_library()


def test_not_a_nccl_library(tmp_path):
    fake = tmp_path / "libnccl.so.2"
    fake.write_bytes(b"not an ELF file")
    with pytest.raises(L.NcclLibraryError, match="could not load NCCL library"):
        L.load_library(str(fake))


def test_too_old_version_names_version_path_and_fix(no_env):
    old = dataclasses.replace(L.default_library(), version_code=22802)
    with pytest.raises(L.NcclLibraryError) as e:
        old.require(L.MIN_SYMMETRIC, "symmetric windows")
    msg = str(e.value)
    assert "needs NCCL >= 2.28.3" in msg and "NCCL 2.28.2" in msg and old.path in msg
    assert "pip install 'nvidia-nccl-cu12>=2.28.3'" in msg and L.ENV_VAR in msg
    # 2.28.3 itself passes the gate.
    dataclasses.replace(old, version_code=22803).require(L.MIN_SYMMETRIC, "symmetric windows")


def test_too_old_for_a_later_feature_names_that_version(no_env):
    """A 2.28.9 asked for a 2.30 feature is told to install 2.30, not the 2.28.3 it already has."""
    lib = dataclasses.replace(L.default_library(), version_code=22809)
    with pytest.raises(L.NcclLibraryError) as e:
        lib.require(L.MIN_MAPPED_VIEW, "map_own_chunk")
    msg = str(e.value)
    assert "needs NCCL >= 2.30.0" in msg and "NCCL 2.28.9" in msg
    assert "'nvidia-nccl-cu12>=2.30.0'" in msg and "version 2.30.0 or later" in msg and "2.28.3" not in msg


def test_communicator_refuses_old_library_before_touching_cuda(no_env):
    old = dataclasses.replace(L.default_library(), version_code=22709)
    with pytest.raises(L.NcclLibraryError, match=r"copy-engine AllGather needs NCCL >= 2.28.3, but the library loaded is NCCL 2.27.9"):
        NcclCommunicator(library=old)


def test_multi_rank_gate():
    lib = L.default_library()
    assert dataclasses.replace(lib, version_code=22809).supports(L.MIN_MULTI_RANK_GPU) is False
    assert dataclasses.replace(lib, version_code=23000).supports(L.MIN_MULTI_RANK_GPU) is True


def test_the_wheel_of_torchs_cuda_major_is_tried_first():
    from wsharding.accel.nccl.library import wheels_for

    assert wheels_for("13.0") == ("nvidia-nccl-cu13", "nvidia-nccl-cu12")
    assert wheels_for("12.8") == ("nvidia-nccl-cu12", "nvidia-nccl-cu13")
    assert wheels_for(None) == ("nvidia-nccl-cu12", "nvidia-nccl-cu13")  # a CPU torch: the declared cu12 first
