"""The communicator's guards that need no GPU: the CTA policy variable, CUDA required, the
registration order and its cross-rank check, the zero-copy wrapper's interface."""

from __future__ import annotations

import pytest

from wsharding.comm.base import CommError
from wsharding.comm.nccl import communicator as C
from wsharding.comm.nccl import symmetric as S
from wsharding.units import align_up


@pytest.mark.parametrize("value", [None, "", "2", "zero", "ZERO"])
def test_cta_env_accepts_unset_or_same(value):
    env = {} if value is None else {"NCCL_CTA_POLICY": value}
    C.check_cta_policy_env(2, env)


def test_cta_env_mismatch_is_refused():
    with pytest.raises(CommError, match=r"NCCL_CTA_POLICY=0 \(default\) .* overrides the CTA policy 2 \(zero\)"):
        C.check_cta_policy_env(2, {"NCCL_CTA_POLICY": "0"})
    with pytest.raises(CommError, match="unset NCCL_CTA_POLICY or set it to 0"):
        C.check_cta_policy_env(0, {"NCCL_CTA_POLICY": "2"})
    with pytest.raises(CommError, match="is not a CTA policy"):
        C.check_cta_policy_env(2, {"NCCL_CTA_POLICY": "fast"})


def test_constructor_checks_env_then_cuda(monkeypatch):
    monkeypatch.setenv("NCCL_CTA_POLICY", "1")
    with pytest.raises(CommError, match="NCCL_CTA_POLICY=1 \\(efficiency\\)"):
        C.NcclCommunicator()
    monkeypatch.delenv("NCCL_CTA_POLICY")
    with pytest.raises(CommError, match="needs CUDA and this machine has no GPU"):
        C.NcclCommunicator()
    with pytest.raises(CommError, match="cta_policy must be one of"):
        C.NcclCommunicator(cta_policy=3)


def test_mode_labels():
    assert C.mode_of(1, False) == "gpu-nccl-single"
    assert C.mode_of(4, True) == "gpu-nccl-shared"
    assert C.mode_of(8, False) == "gpu-nccl"


def test_registration_order_is_natural_by_tag():
    tags = ["layer.10.chunk", "layer.2.slot", "layer.2.chunk", "slot.1", "layer.1.chunk", "slot.0"]
    assert sorted(tags, key=S.tag_sort_key) == [
        "layer.1.chunk", "layer.2.chunk", "layer.2.slot", "layer.10.chunk", "slot.0", "slot.1"]


def test_registration_mismatch_between_ranks_is_an_error():
    same = [("layer.0", 4096), ("layer.1", 8192)]
    S.check_same_registration([same, list(same), list(same)])
    with pytest.raises(CommError, match=r"position 1: rank 0 has \('layer.1', 8192\), rank 2 has \('layer.1', 12288\)"):
        S.check_same_registration([same, same, [("layer.0", 4096), ("layer.1", 12288)]])
    with pytest.raises(CommError, match=r"position 2: rank 0 has None, rank 1 has \('slot.0', 4096\)"):
        S.check_same_registration([same, same + [("slot.0", 4096)]])


def test_round_up_to_window_alignment():
    assert [align_up(n, S.WINDOW_ALIGN) for n in (1, 4096, 4097, 8192)] == [4096, 4096, 8192, 8192]


def test_device_memory_interface():
    cai = S.DeviceMemory(0x7F0000001000, 12345).__cuda_array_interface__
    assert cai == {"shape": (12345,), "typestr": "|u1", "data": (0x7F0000001000, False), "version": 3,
                   "strides": None, "stream": None}


def test_gloo_group_for_gloo_world_is_the_world():
    class Ctx:
        backend, world_size, store = "gloo", 4, {}

    assert C.gloo_group_for(Ctx()) is None
