"""How many ranks the demo runs by default: on one GPU, two ranks where NCCL lets them share it (so the
first command shows the saving), one rank with a line saying what to install where it does not."""

from __future__ import annotations

import dataclasses

import pytest

from wsharding.accel.nccl import library as nccl_library
from wsharding.lab import demo

WHEEL = nccl_library.NcclLibrary("/opt/nccl/libnccl.so.2", "nvidia-nccl-cu12 wheel", 23203, None)


@pytest.fixture
def nccl(monkeypatch):
    def use(version_code: int | None) -> None:
        if version_code is None:
            def missing():
                raise nccl_library.NcclLibraryError("no libnccl found")
            monkeypatch.setattr(nccl_library, "default_library", missing)
        else:
            lib = dataclasses.replace(WHEEL, version_code=version_code)
            monkeypatch.setattr(nccl_library, "default_library", lambda: lib)
        monkeypatch.setattr(demo, "ours_supported", lambda: version_code is not None and version_code >= 22803)
    return use


def test_cpu_ranks_and_several_gpus_are_unchanged(nccl):
    nccl(23203)
    assert demo.default_ranks("gloo", 0) == (4, "")
    assert demo.default_ranks("nccl", 8) == (8, "")


def test_one_gpu_with_nccl_that_shares_it_runs_two_ranks(nccl):
    nccl(23203)
    n, note = demo.default_ranks("nccl", 1)
    assert n == 2 and note.startswith("one GPU: running 2 ranks on it (NCCL 2.32.3 shares a GPU")
    assert "time-sliced" in note


@pytest.mark.parametrize("code", [22809, None])
def test_one_gpu_with_an_older_or_no_nccl_runs_one_rank_and_says_what_to_install(nccl, code):
    nccl(code)
    n, note = demo.default_ranks("nccl", 1)
    assert n == 1 and "pip install 'nvidia-nccl-cu12>=2.30'" in note
    assert ("NCCL 2.28.9" if code else "no usable libnccl") in note
