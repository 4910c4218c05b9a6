"""A checkpoint is read only when its headers and its index are what the safetensors format allows.

Every file the ``safetensors`` library refuses, the pread reader refuses too, with a
:class:`SafetensorsError` naming the file, the tensor and the broken rule, and saying what to do
(:func:`load_checkpoint` / :func:`load_sharded` raise it as a :class:`CheckpointError`, on every
rank). Before these checks a header with overlapping, negative or short offsets, or a tensor held by
two shards of an index, loaded wrong weights without a word; the files are written byte by byte
here: 8 bytes of little-endian header length, the JSON header, the data.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from wsharding.checkpoint import CheckpointError, load_checkpoint, load_sharded
from wsharding.safetensors_file import Checkpoint, SafetensorsError, SafetensorsFile

INDEX = "model.safetensors.index.json"
SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def _raw(path: Path, header: object, data: bytes = b"", *, length: int | None = None) -> Path:
    """Write ``header`` (JSON-encoded, or raw bytes as given) and ``data`` as a safetensors file;
    ``length`` replaces the true header length in the first 8 bytes."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return path


def _t(dtype: str = "F32", shape: object = (2, 2), offsets: object = (0, 16)) -> dict:
    return {"dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape,
            "data_offsets": list(offsets) if isinstance(offsets, tuple) else offsets}


A = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
B = torch.tensor([[5.0, 6.0], [7.0, 8.0]])
AB = A.numpy().tobytes() + B.numpy().tobytes()  # 16 + 16 bytes

# (header, data, header length written or None, what the message must say, the safetensors library
# refuses it too); every message also names the file and says to re-save it.
FILE_CASES = [
    pytest.param({"a": _t(), "b": _t(offsets=(8, 24))}, AB[:24], None,
                 r"tensor 'b': data_offsets \[8, 24\] overlap tensor 'a' at \[0, 16\]", True, id="overlapping offsets"),
    pytest.param({"a": _t(offsets=(-16, 0)), "b": _t(offsets=(0, 16))}, B.numpy().tobytes(), None,
                 r"tensor 'a': data_offsets must be \[begin, end\] with two integers >= 0, got \[-16, 0\]", True,
                 id="negative offsets"),
    pytest.param({"a": _t(offsets=(0, 8)), "b": _t(offsets=(8, 24))}, AB[:24], None,
                 r"tensor 'a': data_offsets \[0, 8\] hold 8 bytes, its dtype F32 and shape \[2, 2\] need 16", True,
                 id="end offset short for the shape"),
    pytest.param({"a": _t(offsets=(0, 24)), "b": _t(offsets=(24, 40))}, AB + bytes(8), None,
                 r"tensor 'a': data_offsets \[0, 24\] hold 24 bytes, its dtype F32 and shape \[2, 2\] need 16", True,
                 id="end offset long for the shape"),
    pytest.param({"a": _t(offsets=(16, 0))}, bytes(16), None,
                 r"tensor 'a': data_offsets \[16, 0\] end before they begin", True, id="end before begin"),
    pytest.param({"a": _t(), "b": _t(offsets=(24, 40))}, AB[:16] + bytes(8) + AB[16:], None,
                 r"tensor 'b' begins at byte 24 of the data, 8 bytes after the end of tensor 'a'", True,
                 id="gap between tensors"),
    pytest.param({"a": _t(), "b": _t(offsets=(16, 32))}, AB + bytes(8), None,
                 r"8 bytes after the end of tensor 'b' \(the last one\) that no tensor holds", True,
                 id="file longer than its tensors"),
    pytest.param({"a": _t(), "b": _t(offsets=(16, 32))}, AB[:24], None,
                 r"file ends at byte \d+, but tensor 'b' \(the last one\) ends at byte \d+", True,
                 id="file shorter than its tensors"),
    pytest.param({"a": _t()}, AB[:16], 2**62,
                 r"header length 4611686018427387904 is over the format's limit of 100000000 bytes", True,
                 id="header length 2**62"),
    pytest.param({"a": _t()}, AB[:16], 4096,
                 r"header length 4096 does not fit in the file of \d+ bytes", True,
                 id="header length beyond the file"),
    pytest.param([{"a": _t()}], b"", None, r"header is a JSON list, not an object", True, id="header a JSON list"),
    pytest.param(b'{"a\xff": ' + json.dumps(_t()).encode() + b"}", AB[:16], None,
                 r"header is not valid UTF-8", True, id="header invalid UTF-8"),
    pytest.param(b'{"a": {"dtype": "F32", ', AB[:16], None, r"header is not valid JSON", True,
                 id="header invalid JSON"),
    pytest.param(b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"", None,
                 r"header is not valid JSON", True, id="header nested 100000 deep"),
    pytest.param({"a": {"shape": [2, 2], "data_offsets": [0, 16]}}, AB[:16], None,
                 r"tensor 'a': its entry has no 'dtype'", True, id="entry without dtype"),
    pytest.param({"a": _t(dtype="F17")}, AB[:16], None,
                 r"tensor 'a': dtype 'F17' is not a safetensors dtype", True, id="unknown dtype"),
    pytest.param({"a": _t(shape=[-2, 2])}, AB[:16], None,
                 r"tensor 'a': shape must be a list of integers >= 0, got \[-2, 2\]", True, id="shape negative"),
    pytest.param({"a": _t(shape=[2.0, 2])}, AB[:16], None,
                 r"tensor 'a': shape must be a list of integers >= 0, got \[2.0, 2\]", True, id="shape float"),
    pytest.param({"a": _t(shape=[True, 4])}, AB[:16], None,
                 r"tensor 'a': shape must be a list of integers >= 0, got \[True, 4\]", True, id="shape bool"),
    pytest.param({"a": _t(shape=4)}, AB[:16], None,
                 r"tensor 'a': shape must be a list of integers >= 0, got 4", True, id="shape not a list"),
    pytest.param({"a": _t(shape=[2**62, 2**62], offsets=(0, 16))}, AB[:16], None,
                 r"tensor 'a': shape \[4611686018427387904, 4611686018427387904\] has 2\*\*64 elements or more", True,
                 id="shape overflows 64 bits"),
    pytest.param({"a": _t(dtype="F4", shape=[3], offsets=(0, 2))}, AB[:2], None,
                 r"tensor 'a': dtype F4 and shape \[3\] make 12 bits, not a whole number of bytes", True,
                 id="sub-byte dtype not whole bytes"),
    pytest.param({"a": _t(offsets=[0])}, AB[:16], None,
                 r"tensor 'a': data_offsets must be \[begin, end\] with two integers >= 0, got \[0\]", True,
                 id="data_offsets one int"),
    pytest.param({"a": _t(offsets=[0, 16, 16])}, AB[:16], None,
                 r"data_offsets must be \[begin, end\] with two integers >= 0, got \[0, 16, 16\]", True,
                 id="data_offsets three ints"),
    pytest.param({"a": _t(offsets=["0", "16"])}, AB[:16], None,
                 r"data_offsets must be \[begin, end\] with two integers >= 0, got \['0', '16'\]", True,
                 id="data_offsets strings"),
    pytest.param({"a": _t(offsets=[0.0, 16.0])}, AB[:16], None,
                 r"data_offsets must be \[begin, end\] with two integers >= 0, got \[0.0, 16.0\]", True,
                 id="data_offsets floats"),
    pytest.param({"a": 5}, b"", None, r"tensor 'a': its entry is a JSON int, not an object", True,
                 id="entry not an object"),
    pytest.param({"__metadata__": {"format": 1}, "a": _t()}, AB[:16], None,
                 r"__metadata__ must map strings to strings, got \{'format': 1\}", True, id="metadata not str to str"),
    # stricter than the library: it keeps the last of two entries of one name, and ignores fields it
    # does not know -- either could make another reader see other weights than this one
    pytest.param(b'{"a": ' + json.dumps(_t()).encode() + b', "a": ' + json.dumps(_t(shape=[4])).encode() + b"}",
                 AB[:16], None, r"'a' appears twice in the header", False, id="one name listed twice"),
    pytest.param({"a": dict(_t(), byte_order="big")}, AB[:16], None,
                 r"tensor 'a': its entry has field\(s\) \['byte_order'\] the format does not define", False,
                 id="unknown entry field"),
]


@pytest.mark.parametrize("header, data, length, match, library_refuses", FILE_CASES)
def test_bad_file_is_refused_naming_file_tensor_and_rule(tmp_path, header, data, length, match, library_refuses):
    path = _raw(tmp_path / "bad.safetensors", header, data, length=length)
    with pytest.raises(SafetensorsError, match=match) as info:
        SafetensorsFile(path)
    assert type(info.value) is SafetensorsError
    assert str(path) in str(info.value) and "safetensors.torch.save_file" in str(info.value)
    if library_refuses:  # the reference: the Rust reader refuses the same bytes
        with pytest.raises(SafetensorError):
            load_file(path)


def test_files_the_library_writes_are_read_exactly(tmp_path):
    """The checks refuse nothing safetensors writes: metadata, scalars, empty and zero-size tensors."""
    tensors = {"a": A, "s": torch.tensor(0.5, dtype=torch.bfloat16), "e": torch.zeros(0, 3), "i": torch.arange(5)}
    save_file(tensors, str(tmp_path / "ok.safetensors"), metadata={"format": "pt"})
    save_file({}, str(tmp_path / "empty.safetensors"))
    with SafetensorsFile(tmp_path / "ok.safetensors") as f:
        assert f.metadata == {"format": "pt"} and sorted(f.keys()) == ["a", "e", "i", "s"]
        for k, v in tensors.items():
            assert torch.equal(f.get(k).read(), v), k
    with SafetensorsFile(tmp_path / "empty.safetensors") as f:
        assert f.keys() == []


def test_a_dtype_of_the_format_this_reader_does_not_hold_is_named(tmp_path):
    path = _raw(tmp_path / "u16.safetensors", {"a": _t(dtype="U16", shape=[8])}, bytes(16))
    load_file(path)  # a valid file ...
    with pytest.raises(SafetensorsError, match=r"tensor 'a': dtype U16 is not supported by this reader"):
        SafetensorsFile(path)  # ... that this reader cannot hold


# ---- the index of a sharded checkpoint -----------------------------------------------------------
def _sharded_folder(tmp_path: Path, weight_map: dict | None = None) -> Path:
    """``a`` in shard 1, ``b`` and ``c`` in shard 2, with their index (or ``weight_map``)."""
    save_file({"a": A}, str(tmp_path / SHARD1))
    save_file({"b": B, "c": -B}, str(tmp_path / SHARD2))
    wm = weight_map if weight_map is not None else {"a": SHARD1, "b": SHARD2, "c": SHARD2}
    (tmp_path / INDEX).write_text(json.dumps({"metadata": {"total_size": 48}, "weight_map": wm}))
    return tmp_path


INDEX_CASES = [
    pytest.param(b'{"weight_map": {"a": ', r"is not valid JSON", id="index not JSON"),
    pytest.param(b'{"weight_map": {"a\xff": "x"}}', r"is not valid UTF-8", id="index invalid UTF-8"),
    pytest.param(b"[]", r"is a JSON list, not an object", id="index a JSON list"),
    pytest.param(b'{"metadata": {}}', r"has no 'weight_map'", id="index without weight_map"),
    pytest.param(b'{"weight_map": ["a"]}', r"'weight_map' must be an object \{tensor name: file name\}, got a JSON list",
                 id="weight_map not a dict"),
    pytest.param(b'{"weight_map": {"a": 1}}', r"'weight_map' maps tensor 'a' to 1, not to a file name",
                 id="weight_map value not a string"),
    pytest.param(b'{"weight_map": {}}', r"'weight_map' is empty", id="weight_map empty"),
    pytest.param(b'{"weight_map": {"a": "../model-00001-of-00002.safetensors"}}',
                 r"'weight_map' maps tensor 'a' to '../model-00001-of-00002.safetensors', which is not a file "
                 r"of the checkpoint folder", id="file outside the folder"),
    pytest.param(b'{"weight_map": {"a": "model-00001-of-00002.safetensors", "a": "model-00002-of-00002.safetensors"}}',
                 r"'a' appears twice", id="tensor listed twice"),
]


@pytest.mark.parametrize("text, match", INDEX_CASES)
def test_bad_index_is_refused_naming_the_index_and_rule(tmp_path, text, match):
    folder = _sharded_folder(tmp_path)
    (folder / INDEX).write_bytes(text)
    with pytest.raises(SafetensorsError, match=match) as info:
        Checkpoint(folder)
    assert type(info.value) is SafetensorsError and str(folder / INDEX) in str(info.value)


def test_index_naming_a_missing_file_names_the_file_and_its_tensors(tmp_path):
    folder = _sharded_folder(tmp_path)
    (folder / SHARD2).unlink()
    with pytest.raises(SafetensorsError, match=rf"{INDEX} names {SHARD2} for tensor\(s\) \['b', 'c'\], but "
                                               rf"{folder / SHARD2} does not exist") as info:
        Checkpoint(folder)
    assert "download" in str(info.value)


def test_tensor_in_two_shards_is_refused_not_read_from_the_last(tmp_path):
    """The index says ``c`` is in shard 2; shard 1 holds another ``c`` too. Which one a loader reads
    depends on the loader (file order, or the index), so the checkpoint is refused as ambiguous."""
    folder = _sharded_folder(tmp_path)
    save_file({"a": A, "c": B}, str(folder / SHARD1))
    with pytest.raises(SafetensorsError, match=rf"tensor 'c' is in both {SHARD1} and {SHARD2} \(the index names "
                                               rf"{SHARD2}\)"):
        Checkpoint(folder)


def test_tensor_the_index_maps_to_a_file_without_it_is_named(tmp_path):
    folder = _sharded_folder(tmp_path, {"a": SHARD1, "b": SHARD1, "c": SHARD2})
    with pytest.raises(SafetensorsError, match=rf"maps tensor 'b' to {SHARD1}, which does not hold it"):
        Checkpoint(folder)


def test_tensor_a_shard_holds_but_the_index_does_not_list_is_named(tmp_path):
    folder = _sharded_folder(tmp_path, {"a": SHARD1, "b": SHARD2})
    with pytest.raises(SafetensorsError, match=rf"{SHARD2} holds tensor 'c', which the index does not list"):
        Checkpoint(folder)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_bad_shard_of_an_index_is_named_and_no_file_is_left_open(tmp_path):
    folder = _sharded_folder(tmp_path)
    _raw(folder / SHARD2, {"b": _t(), "c": _t(offsets=(8, 24))}, AB[:24])
    before = _open_fds()
    with pytest.raises(SafetensorsError, match=rf"{folder / SHARD2}: tensor 'c': data_offsets \[8, 24\] overlap"):
        Checkpoint(folder)
    assert _open_fds() == before


def test_good_index_reads_each_tensor_from_its_file(tmp_path):
    with Checkpoint(_sharded_folder(tmp_path)) as ck:
        assert sorted(ck.keys()) == ["a", "b", "c"]
        assert torch.equal(ck.get("a").read(), A) and torch.equal(ck.get("c").read(), -B)


# ---- through load_checkpoint and load_sharded, on every rank ---------------------------------------
class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4, bias=False)


class _Stack(nn.Module):
    """Three blocks of one 4x4 float32 linear: checkpoint keys ``blocks.{i}.fc.weight``, 64 bytes each."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))


KEYS = [f"blocks.{i}.fc.weight" for i in range(3)]
WEIGHTS = {k: torch.arange(16, dtype=torch.float32).reshape(4, 4) + 16 * i + 1 for i, k in enumerate(KEYS)}
W = [WEIGHTS[k].numpy().tobytes() for k in KEYS]


def _w(begin: int, end: int) -> dict:
    return _t(shape=(4, 4), offsets=(begin, end))


def _bad_checkpoint(tmp_path: Path, case: str) -> tuple[Path, str]:
    """A checkpoint of :class:`_Stack` that the unchecked reader loaded wrong (or, ``rank-dependent``,
    that failed on rank 1 only), and what the refusal must say."""
    k0, k1, k2 = KEYS
    if case == "overlapping offsets":  # blocks.1 reads the second half of blocks.0
        hdr = {k0: _w(0, 64), k1: _w(32, 96), k2: _w(96, 160)}
        return _raw(tmp_path / "c.safetensors", hdr, W[0] + W[1][32:] + W[2]), rf"tensor '{k1}'.* overlap"
    if case == "negative offsets":  # blocks.0 reads the end of the header as weights
        hdr = {k0: _w(-64, 0), k1: _w(0, 64), k2: _w(64, 128)}
        return _raw(tmp_path / "c.safetensors", hdr, W[1] + W[2]), rf"tensor '{k0}'.* got \[-64, 0\]"
    if case == "end offset short":  # blocks.0 runs on into blocks.1
        hdr = {k0: _w(0, 32), k1: _w(32, 96), k2: _w(96, 160)}
        return _raw(tmp_path / "c.safetensors", hdr, W[0][:32] + W[1] + W[2]), rf"tensor '{k0}'.* hold 32 bytes"
    if case == "rank-dependent":  # the last tensor is cut short: only rank 1's rows lie past the end of the file
        hdr = {k0: _w(0, 64), k1: _w(64, 128), k2: _w(128, 160)}
        return _raw(tmp_path / "c.safetensors", hdr, W[0] + W[1] + W[2][:32]), rf"tensor '{k2}'.* hold 32 bytes"
    assert case == "tensor in two shards"  # the index says shard 1; shard 2, read last, holds another copy
    save_file({k0: WEIGHTS[k0], k1: WEIGHTS[k1]}, str(tmp_path / SHARD1))
    save_file({k1: -WEIGHTS[k1], k2: WEIGHTS[k2]}, str(tmp_path / SHARD2))
    (tmp_path / INDEX).write_text(json.dumps({"weight_map": {k0: SHARD1, k1: SHARD1, k2: SHARD2}}))
    return tmp_path, rf"tensor '{k1}' is in both"


SILENT = ["overlapping offsets", "negative offsets", "end offset short", "tensor in two shards"]


@pytest.mark.parametrize("case", SILENT)
def test_load_checkpoint_refuses_what_loaded_wrong_weights(tmp_path, case):
    path, match = _bad_checkpoint(tmp_path, case)
    model = _Stack()
    try:
        load_checkpoint(model, path)
    except CheckpointError as e:
        assert isinstance(e.__cause__, SafetensorsError)
        assert str(path if path.is_file() else path / SHARD1) in str(e) or case == "tensor in two shards"
        with pytest.raises(CheckpointError, match=match):
            raise e
        return
    diff = max((model.get_parameter(k) - w).abs().max().item() for k, w in WEIGHTS.items())
    pytest.fail(f"loaded without an error, weights off by up to {diff}")


def load_sharded_outcome(ctx, path: str) -> tuple[str, object]:
    """``load_sharded`` of :class:`_Stack` (every linear sharded): the error class and message, or
    ``("loaded", largest difference from the true weights)``."""
    model = _Stack()
    try:
        ws = load_sharded(model, path, "blocks", ["fc"], ctx.comm)
    except Exception as e:  # noqa: BLE001 - the class is what the test checks
        return type(e).__name__, str(e)
    full = ws.full_state_dict(model)
    return "loaded", max((full[k] - w).abs().max().item() for k, w in WEIGHTS.items())


@pytest.mark.parametrize("case", [*SILENT, "rank-dependent"])
def test_bad_checkpoint_stops_every_rank_of_load_sharded(cluster_of, tmp_path, case):
    """Every rank checks the same headers before it reads a row, so every rank raises the same error
    and none is left waiting in finalize's collectives for a peer that failed."""
    path, match = _bad_checkpoint(tmp_path, case)
    outcomes = cluster_of(2).run(load_sharded_outcome, str(path))
    for rank, (kind, detail) in enumerate(outcomes):
        assert kind == "CheckpointError", f"rank {rank}: {kind}: {detail}"
        assert re.search(match, detail), f"rank {rank}: {detail}"
    assert outcomes[0] == outcomes[1]
