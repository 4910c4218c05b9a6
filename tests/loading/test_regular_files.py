"""A path the package reads that is not a regular file -- a FIFO, a device, a folder, a symlink to
one of them -- is refused before it is opened, naming the path and what it is; a file of a parsed
format is refused past its size limit.

Before: a FIFO given as a checkpoint blocked ``os.open`` on that rank forever (no collective timeout
runs inside ``open()``), and ``/dev/zero`` as a model file was read until the process was killed.
Each case here runs under :func:`~tests.core.test_bad_input.refuse_opening`, so a regression fails
at once instead of hanging; the rank cases run under the cluster's task timeout.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import save_file

from tests.core.test_bad_input import refuse_opening
from tests.loading.test_checkpoint_validation import INDEX, SHARD1, SHARD2, WEIGHTS, _Stack, load_sharded_outcome
from wsharding import io_checks
from wsharding.checkpoint import CheckpointError, load_checkpoint
from wsharding.core.errors import InvalidArgument
from wsharding.io_checks import open_regular_file, read_regular_file, require_regular_file
from wsharding.safetensors_file import Checkpoint, SafetensorsError

#: Every refusal comes from os.stat: far under this.
PROMPT_S = 2.0


def test_without_the_check_opening_a_fifo_blocks():
    """What the check prevents: ``open()`` of a FIFO with no writer does not return (here for 0.5 s,
    then a writer is opened to let it go)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        fifo = Path(tmp) / "fifo"
        os.mkfifo(fifo)
        done = threading.Event()
        reader = threading.Thread(target=lambda: (os.close(os.open(fifo, os.O_RDONLY)), done.set()), daemon=True)
        reader.start()
        assert not done.wait(0.5), "open() of a FIFO returned without a writer"
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a reader is waiting: this succeeds, and frees it
        assert done.wait(10)
        reader.join(10)


def _kinds(tmp: Path) -> dict[str, tuple[Path | str, str]]:
    """name -> (path, the words that say what it is)."""
    fifo = tmp / "fifo"
    os.mkfifo(fifo)
    (tmp / "folder").mkdir()
    (tmp / "link").symlink_to(fifo)
    return {
        "fifo": (fifo, "a FIFO (named pipe), not a regular file"),
        "/dev/zero": ("/dev/zero", "a character device, not a regular file"),
        "/dev/null": ("/dev/null", "a character device, not a regular file"),
        "folder": (tmp / "folder", "a folder, not a regular file"),
        "symlink to a fifo": (tmp / "link", f"(a symlink to {fifo}): a FIFO (named pipe)"),
        "missing": (tmp / "missing", "does not exist (No such file or directory)"),
    }


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "/dev/null", "folder", "symlink to a fifo", "missing"])
def test_what_is_not_a_regular_file_is_refused_before_it_is_opened(tmp_path, monkeypatch, kind):
    path, words = _kinds(tmp_path)[kind]
    refuse_opening(monkeypatch, path)
    for fn in (require_regular_file, open_regular_file, read_regular_file):
        start = time.monotonic()
        with pytest.raises(InvalidArgument) as info:
            fn(path, "test input", max_bytes=1 << 20, todo="pass a regular file")
        assert time.monotonic() - start < PROMPT_S
        message = str(info.value)
        assert message.startswith(f"test input {path}") and words in message and message.endswith("pass a regular file")
        if kind != "missing":
            assert io_checks.RULE in message


def test_a_symlink_to_a_regular_file_is_read(tmp_path):
    (tmp_path / "real.json").write_text("{}")
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    assert read_regular_file(tmp_path / "link.json", "x", max_bytes=2, todo="") == b"{}"


def test_a_file_over_its_limit_is_refused_by_its_size_and_never_read_past_it(tmp_path):
    (tmp_path / "big.json").write_bytes(b"x" * 100)
    with pytest.raises(InvalidArgument, match=r"big.json: 100 bytes, over the 99 bytes it may take"):
        read_regular_file(tmp_path / "big.json", "x", max_bytes=99, todo="")
    # a /proc file says 0 bytes: it is read up to the limit, and refused there
    with pytest.raises(InvalidArgument, match=r"/proc/self/status: more than 16 bytes"):
        read_regular_file("/proc/self/status", "x", max_bytes=16, todo="")


def test_a_path_turned_into_a_fifo_after_the_stat_is_refused_not_waited_on(tmp_path, monkeypatch):
    """The stat said regular file; by the open it is a FIFO: O_NONBLOCK returns, fstat refuses."""
    (tmp_path / "regular").write_text("{}")
    os.mkfifo(tmp_path / "fifo")
    monkeypatch.setattr(io_checks, "require_regular_file", lambda *a, **k: os.stat(tmp_path / "regular"))
    start = time.monotonic()
    with pytest.raises(InvalidArgument, match=r"fifo: replaced while it was opened, now a FIFO \(named pipe\)"):
        open_regular_file(tmp_path / "fifo", "x", max_bytes=None, todo="")
    assert time.monotonic() - start < PROMPT_S


# ---- checkpoints: the file, the folder's model.safetensors, the index and the files it names -------
def _checkpoint_cases(tmp: Path) -> dict[str, tuple[Path, Path, str]]:
    """name -> (the path given, the path refused, what it is)."""
    out = {}
    for name in ("file", "folder", "index", "index names", "link"):
        (tmp / name).mkdir()
    os.mkfifo(tmp / "file" / "c.safetensors")
    out["a fifo as the file"] = (tmp / "file" / "c.safetensors", tmp / "file" / "c.safetensors", "a FIFO")
    os.mkfifo(tmp / "folder" / "model.safetensors")
    out["a fifo as model.safetensors"] = (tmp / "folder", tmp / "folder" / "model.safetensors", "a FIFO")
    save_file(dict(WEIGHTS), str(tmp / "index" / SHARD1))
    os.mkfifo(tmp / "index" / INDEX)
    out["a fifo as the index"] = (tmp / "index", tmp / "index" / INDEX, "a FIFO")
    keys = list(WEIGHTS)
    save_file({keys[0]: WEIGHTS[keys[0]]}, str(tmp / "index names" / SHARD1))
    os.mkfifo(tmp / "index names" / SHARD2)
    (tmp / "index names" / INDEX).write_text(json.dumps({"weight_map": {k: SHARD1 if k == keys[0] else SHARD2
                                                                        for k in keys}}))
    out["a fifo the index names"] = (tmp / "index names", tmp / "index names" / SHARD2, "a FIFO")
    (tmp / "link" / "c.safetensors").symlink_to(tmp / "file" / "c.safetensors")
    out["a symlink to a fifo"] = (tmp / "link" / "c.safetensors", tmp / "file" / "c.safetensors", "a FIFO")
    out["a device"] = (Path("/dev/zero"), Path("/dev/zero"), "a character device")
    (tmp / "folder model").mkdir()
    (tmp / "folder model" / "model.safetensors").mkdir()
    out["a folder as model.safetensors"] = (tmp / "folder model", tmp / "folder model" / "model.safetensors",
                                            "a folder")
    return out


CHECKPOINT_CASES = ["a fifo as the file", "a fifo as model.safetensors", "a fifo as the index",
                    "a fifo the index names", "a symlink to a fifo", "a device", "a folder as model.safetensors"]


@pytest.mark.parametrize("case", CHECKPOINT_CASES)
def test_a_checkpoint_path_that_is_not_a_regular_file_is_refused(tmp_path, monkeypatch, case):
    given, refused, kind = _checkpoint_cases(tmp_path)[case]
    refuse_opening(monkeypatch, refused)
    start = time.monotonic()
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(_Stack(), given)
    assert time.monotonic() - start < PROMPT_S
    assert isinstance(info.value.__cause__, SafetensorsError)
    message = str(info.value)
    assert str(given) in message and f"{kind}" in message and "not a regular file" in message, message
    assert "pass a .safetensors file, or a folder holding model.safetensors" in message


def test_an_index_over_its_limit_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    from wsharding import safetensors_file

    save_file(dict(WEIGHTS), str(tmp_path / SHARD1))
    (tmp_path / INDEX).write_text('{"weight_map": {}}' + " " * 100)
    monkeypatch.setattr(safetensors_file, "MAX_HEADER_BYTES", 64)
    with pytest.raises(SafetensorsError, match=rf"checkpoint index {tmp_path / INDEX}: 118 bytes, over the 64 bytes"):
        Checkpoint(tmp_path)


def test_a_model_file_over_its_limit_is_refused(tmp_path, monkeypatch):
    from wsharding.costmodel import CostModelError, load_model_file, spec

    (tmp_path / "m.json").write_text("{}" + " " * 100)
    monkeypatch.setattr(spec, "MAX_MODEL_FILE_BYTES", 64)
    with pytest.raises(CostModelError, match=r"model file .*m.json: 102 bytes, over the 64 bytes it may take"):
        load_model_file(tmp_path / "m.json")


def test_a_yaml_anchor_inside_itself_is_refused_not_walked_forever(tmp_path):
    from wsharding.costmodel import CostModelError, load_model_file

    (tmp_path / "m.yaml").write_text("name: loop\nkinds: &k {a: {groups: [*k]}}\nsequence: [[a, 1]]\n")
    with pytest.raises(CostModelError, match="YAML aliases"):
        load_model_file(tmp_path / "m.yaml")


def test_the_nccl_library_path_and_log_file_are_checked(tmp_path, monkeypatch):
    from wsharding.accel.nccl import library, probe

    os.mkfifo(tmp_path / "libnccl.so.2")
    refuse_opening(monkeypatch, tmp_path / "libnccl.so.2")
    with pytest.raises(library.NcclLibraryError, match=r"NCCL library .*libnccl.so.2: a FIFO \(named pipe\)"):
        library.load_library(str(tmp_path / "libnccl.so.2"))
    os.mkfifo(tmp_path / "nccl.log")  # NCCL_DEBUG_FILE streaming the log elsewhere: nothing to read back
    monkeypatch.setenv("NCCL_DEBUG_FILE", str(tmp_path / "nccl.log"))
    assert probe.own_log_text() == ""


# ---- load_sharded: every rank refuses, none waits in a collective ----------------------------------
def load_sharded_own_path(ctx, paths: list[str]) -> tuple[str, object]:
    """:func:`load_sharded_outcome` of the checkpoint at ``paths[rank]``."""
    return load_sharded_outcome(ctx, paths[ctx.rank])


def test_a_fifo_checkpoint_stops_every_rank_of_load_sharded(cluster_of, tmp_path):
    os.mkfifo(tmp_path / "c.safetensors")
    start = time.monotonic()
    outcomes = cluster_of(2).run(load_sharded_own_path, [str(tmp_path / "c.safetensors")] * 2)
    assert time.monotonic() - start < 60
    for rank, (kind, detail) in enumerate(outcomes):
        assert kind == "CheckpointError", f"rank {rank}: {kind}: {detail}"
        assert "a FIFO (named pipe), not a regular file" in detail
    assert outcomes[0] == outcomes[1]


def test_a_fifo_on_one_rank_only_is_named_on_the_other(cluster_of, tmp_path):
    """Rank 1's path (a node-local copy, say) is a FIFO, rank 0's a good checkpoint: rank 1 refuses
    before it shrinks anything and joins finalize's agreement with its problem, so rank 0 raises
    naming rank 1 instead of waiting for its gathers."""
    save_file(dict(WEIGHTS), str(tmp_path / "good.safetensors"))
    os.mkfifo(tmp_path / "fifo.safetensors")
    outcomes = cluster_of(2).run(load_sharded_own_path, [str(tmp_path / "good.safetensors"),
                                                         str(tmp_path / "fifo.safetensors")])
    (kind0, detail0), (kind1, detail1) = outcomes
    assert kind1 == "CheckpointError" and "a FIFO (named pipe)" in detail1, detail1
    assert kind0 == "ShardingError" and "rank(s) [1] cannot finalize" in detail0, detail0
