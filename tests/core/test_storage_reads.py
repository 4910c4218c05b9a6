"""Every way to read a sharded weight's bytes gives the weight or a refusal, never the slot's bytes
([Note: storage-level reads of a bound weight] in ``wsharding/core/bound.py``). ``untyped_storage()``
used to hand out the slot's storage, whose ``tolist``, indexing, ``cpu``, ``clone``, pickling and
``set_`` read whichever layer was gathered last; ``storage()`` and ``_typed_storage()`` likewise."""

from __future__ import annotations

import io
import pickle

import numpy as np
import pytest
import torch
from torch import nn

from tests.core.test_library_edges import Loopback
from wsharding.core.errors import ShardingError
from wsharding.core.runner import shard_blocks


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Module() for _ in range(2))
        for b in self.layers:
            b.fc = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.layers:
            x = b.fc(x)
        return x


READS = {
    "untyped_storage().tolist()": lambda w: w.untyped_storage().tolist(),
    "untyped_storage()[0]": lambda w: w.untyped_storage()[0],
    "untyped_storage()[0:4]": lambda w: w.untyped_storage()[0:4],
    "untyped_storage().cpu()": lambda w: w.untyped_storage().cpu(),
    "untyped_storage().clone()": lambda w: w.untyped_storage().clone(),
    "untyped_storage().float()": lambda w: w.untyped_storage().float(),
    "untyped_storage().to('cpu')": lambda w: w.untyped_storage().to(device="cpu"),
    "iter(untyped_storage())": lambda w: list(w.untyped_storage()),
    "bytes(untyped_storage())": lambda w: bytes(w.untyped_storage()),
    "torch.tensor(untyped_storage())": lambda w: torch.tensor(w.untyped_storage()),
    "set_(untyped_storage())": lambda w: torch.empty(0, dtype=torch.uint8).set_(w.untyped_storage()),
    "pickle untyped_storage()": lambda w: pickle.dumps(w.untyped_storage()),
    "torch.save untyped_storage()": lambda w: torch.save(w.untyped_storage(), io.BytesIO()),
    "untyped_storage().fill_(0)": lambda w: w.untyped_storage().fill_(0),
    "storage()": lambda w: w.storage().tolist(),
    "_typed_storage()": lambda w: w._typed_storage().tolist(),
    "data.untyped_storage().tolist()": lambda w: w.data.untyped_storage().tolist(),
    "data._typed_storage()": lambda w: w.data._typed_storage()[0],
    "as_strided": lambda w: w.as_strided((64,), (1,)),
    "numpy()": lambda w: w.numpy(),
    "np.asarray": lambda w: np.asarray(w),
    "__array__": lambda w: w.__array__(),
    "tolist()": lambda w: w.tolist(),
    "data.numpy()": lambda w: w.data.numpy(),
    "from_dlpack": lambda w: torch.utils.dlpack.from_dlpack(w),
}


#: The reads torch itself cannot make of a slot's storage, and torch's error: every other read is refused
#: by the package (a ShardingError that names the weight or its storage).
TORCH_CANNOT = {"torch.tensor(untyped_storage())": "could not determine the shape of object type 'SlotStorage'"}


@pytest.mark.parametrize("read", sorted(READS))
def test_a_read_of_a_sharded_weight_s_bytes_is_refused(read):
    m = Two()
    ws = shard_blocks(m, "layers", ["fc"], Loopback())
    with torch.no_grad():
        m(torch.randn(2, 8))  # the slots hold layers now
    with pytest.raises(Exception) as info:  # noqa: PT011 - the exact class is asserted below
        READS[read](m.layers[0].fc.weight)
    if read in TORCH_CANNOT:  # torch cannot read the storage at all: no bytes come out, and its own error says so
        assert type(info.value) is ValueError and str(info.value) == TORCH_CANNOT[read]
    else:
        assert type(info.value) is ShardingError, f"{read}: {type(info.value).__name__}: {info.value}"
        assert "outside its linear's forward" in str(info.value), info.value
    ws.close()


def test_the_storage_s_metadata_answers_and_the_model_still_runs():
    m, ref = Two(), Two()
    ws = shard_blocks(m, "layers", ["fc"], Loopback())
    w = m.layers[0].fc.weight
    st = w.untyped_storage()
    assert st.data_ptr() <= w.data_ptr() < st.data_ptr() + st.nbytes()
    assert st.nbytes() >= 8 * 8 * 4 and len(st) == st.nbytes() and st.device == torch.device("cpu")
    assert "weight-sharding slot" in repr(st)
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(m(x), ref(x))
    assert not w.is_shared()
    ws.close()
