"""``wsharding info [--json]`` on the CPU machine."""

from __future__ import annotations

import importlib.metadata
import json

from wsharding.lab.cli import main


def test_info_json_reports_the_wheel_library(capsys, monkeypatch):
    monkeypatch.delenv("WSHARDING_NCCL_LIBRARY", raising=False)
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    v = importlib.metadata.version("nvidia-nccl-cu12")
    assert info["nccl"]["version"] == v
    assert info["nccl"]["source"] == f"nvidia-nccl-cu12 {v} wheel"
    assert info["nccl"]["path"].endswith("nvidia/nccl/lib/libnccl.so.2")
    # No GPU here: nothing is usable, whatever the library offers -- one boolean per feature.
    assert info["supports"] == {"symmetric_windows": False, "copy_engine_allgather": False, "multi_rank_per_gpu": False,
                                "mapped_layer_views": False}
    # the wheel here is NCCL >= 2.30: it offers every feature, layer views mapped over chunks included
    assert info["library_offers"] == ["symmetric_windows", "copy_engine_allgather", "multi_rank_per_gpu",
                                      "mapped_layer_views"]
    assert "copy_engine_allgather" not in info["nccl"] and info["why"].startswith("no CUDA GPU")
    assert info["gpus"] == [] and info["auto"]["cluster_backend"] == "gloo"
    assert "emulated" in info["auto"]["gather_backend"]


def test_info_text_and_bad_library(capsys, monkeypatch):
    monkeypatch.setenv("WSHARDING_NCCL_LIBRARY", "/no/such/libnccl.so.2")
    assert main(["info"]) == 1
    out = capsys.readouterr().out
    assert "NCCL library: not usable -- WSHARDING_NCCL_LIBRARY='/no/such/libnccl.so.2' does not name a file" in out


def test_info_without_any_nccl_says_how_to_install_and_succeeds(capsys, monkeypatch):
    # The library alone (no `nccl` extra) is a valid install for CPU ranks: info reports it, exit 0.
    from wsharding.accel.nccl import library

    def no_library():
        raise library.NcclLibraryMissing("no libnccl found: (pip install 'wsharding[nccl]', ...)")

    monkeypatch.delenv("WSHARDING_NCCL_LIBRARY", raising=False)
    monkeypatch.setattr(library, "find_library", no_library)
    assert main(["info"]) == 0
    assert "wsharding[nccl]" in capsys.readouterr().out
