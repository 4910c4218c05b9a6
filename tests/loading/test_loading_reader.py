"""The pread safetensors reader: exact rows, exact bytes counted, index folders, clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from wsharding.safetensors_file import Checkpoint, SafetensorsError


def test_rows_bytes_and_index_folder(tmp_path):
    a = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    b = torch.arange(12, dtype=torch.int8).reshape(3, 4).to(torch.float8_e4m3fn)
    save_file({"a": a}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": b, "s": torch.tensor(0.5)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
        "s": "model-00002-of-00002.safetensors"}}))
    with Checkpoint(tmp_path) as ck:
        assert sorted(ck.keys()) == ["a", "b", "s"]
        rows = ck.get("a").read_rows(3, 7)
        assert torch.equal(rows, a[3:7]) and ck.bytes_read == 4 * 4 * 4  # 4 rows x 4 values x 4 B
        assert torch.equal(ck.get("b").read().view(torch.uint8), b.view(torch.uint8))
        assert ck.get("s").read().item() == 0.5 and ck.get("b").get_dtype() == torch.float8_e4m3fn
        out = torch.empty(2, 4)
        with pytest.raises(SafetensorsError, match=r"a: rows \[9, 11\) outside its 10 rows"):
            ck.get("a").read_rows_into(9, 11, out)
        with pytest.raises(SafetensorsError, match=r"destination is torch.float32 \(2, 4\), rows \[0, 3\)"):
            ck.get("a").read_rows_into(0, 3, out)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SafetensorsError, match="no model.safetensors or model.safetensors.index.json"):
        Checkpoint(tmp_path / "empty")
    (tmp_path / "bad.safetensors").write_bytes(b"\x05")
    with pytest.raises(SafetensorsError, match="not a safetensors file"):
        Checkpoint(tmp_path / "bad.safetensors")
