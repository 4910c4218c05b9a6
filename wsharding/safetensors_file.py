"""Reading rows of safetensors tensors with ``pread``: no file mapping, every byte read counted.

Why not ``safetensors.safe_open``: it maps the whole file, and every page a rank touches while
slicing stays in its resident set (as file pages) until the file is closed -- on CPU ranks a
rank's row shard would be counted twice, and "this rank read only its rows" could not be shown.
The format is simple enough to read directly: 8 bytes of little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``, then the data, row-major. Rows
``[a, b)`` of a tensor are one contiguous byte range, read straight into the destination tensor.

A checkpoint is one ``.safetensors`` file or a folder holding ``model.safetensors`` or a
``model.safetensors.index.json`` with its ``weight_map`` (as ``save_pretrained`` writes them).

Nothing in a header is trusted: a row is read at the offset the header gives, so a header that lets
two tensors share bytes, or a tensor run past its end, loads wrong weights without a word. A file is
opened only when its header passes every check of the ``safetensors`` library's own reader (and a
few more, see :func:`parse_header`), and a folder only when its index and its files agree (see
:class:`Checkpoint`). Every refusal is a :class:`SafetensorsError` naming the file, the tensor and
the rule, raised when the file is opened -- before any row is read, the same on every rank that
opens the same bytes.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

import torch

from wsharding.core.errors import InvalidArgument, WshardingError
from wsharding.io_checks import open_regular_file, read_regular_file

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


#: Every dtype the safetensors format defines, with its bits per element. A name outside it makes a
#: broken header; a name inside it but not in :data:`DTYPES`, a valid file this reader cannot hold.
FORMAT_DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "F64": 64, "I64": 64, "U64": 64,
    "C64": 64,
}
#: The fields of a tensor's header entry, and the only ones: a field this reader does not know might
#: change how the bytes are meant (another reader might honour it), so it is refused, not ignored.
ENTRY_FIELDS = ("dtype", "shape", "data_offsets")
#: The safetensors library refuses a longer header (its ``MAX_HEADER_SIZE``) before allocating it;
#: an index that long is refused too (a real one lists a few thousand names).
MAX_HEADER_BYTES = 100_000_000
INDEX_NAME = "model.safetensors.index.json"
#: What to do about a file that breaks the format.
REMEDY = ("the file is damaged, or was not written by safetensors: copy or download it again, or write it again "
          "from its source with safetensors.torch.save_file (save_pretrained writes the same format)")
#: What to pass instead of a path that is not a regular file ([Note: only regular files] in
#: :mod:`wsharding.io_checks`).
PATH_REMEDY = ("pass a .safetensors file, or a folder holding model.safetensors or a model.safetensors.index.json "
               "and the files it names (as save_pretrained writes them)")
#: What to do about an index that does not match its files.
INDEX_REMEDY = ("the index and the files do not belong together: download or copy the whole checkpoint folder "
                "again, or write it again with save_pretrained")


class SafetensorsError(WshardingError, ValueError):
    """A file that is not a readable safetensors file, a checkpoint folder whose index and files
    disagree, or a read outside a tensor. :func:`wsharding.checkpoint.load_checkpoint` raises it as
    a ``CheckpointError`` (its ``__cause__``), like every other problem of a checkpoint."""


@dataclass
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    end: int

    @property
    def row_bytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape[1:]:
            n *= d
        return n


class TensorRows:
    """A lazy handle on one tensor of a file: read all of it, or only rows ``[a, b)``.

    Offers ``get_shape()`` / ``get_dtype()`` like a safetensors slice, so a loader can ask for the
    shape before it reads anything.
    """

    def __init__(self, file: SafetensorsFile, info: TensorInfo) -> None:
        self.file, self.info = file, info

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.info.dtype

    def get_shape(self) -> list[int]:
        return list(self.info.shape)

    def get_dtype(self) -> torch.dtype:
        return self.info.dtype

    def read_rows_into(self, start: int, stop: int, out: torch.Tensor) -> None:
        """Read rows ``[start, stop)`` into ``out`` (any device; a CPU destination is read into directly)."""
        rows = self.info.shape[0] if self.info.shape else 1
        if not 0 <= start <= stop <= rows:
            raise SafetensorsError(f"{self.info.name}: rows [{start}, {stop}) outside its {rows} rows")
        want = (stop - start, *self.info.shape[1:]) if self.info.shape else ()
        if tuple(out.shape) != tuple(want) or out.dtype != self.info.dtype:
            raise SafetensorsError(f"{self.info.name}: destination is {out.dtype} {tuple(out.shape)}, rows "
                                   f"[{start}, {stop}) are {self.info.dtype} {want}")
        host = out if out.device.type == "cpu" and out.is_contiguous() else torch.empty_like(out, device="cpu")
        self.file.pread_into(host, self.info.begin + start * self.info.row_bytes)
        if host is not out:
            out.copy_(host)

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        out = torch.empty((stop - start, *self.info.shape[1:]), dtype=self.info.dtype)
        self.read_rows_into(start, stop, out)
        return out

    def read(self) -> torch.Tensor:
        """The whole tensor (a fresh CPU tensor)."""
        out = torch.empty(self.info.shape, dtype=self.info.dtype)
        if self.info.shape and self.info.shape[0]:
            self.read_rows_into(0, self.info.shape[0], out)
        elif not self.info.shape:
            self.file.pread_into(out.reshape(1), self.info.begin)
        return out


class SafetensorsFile:
    """One safetensors file: its header, and ``pread`` of byte ranges (``bytes_read`` counts them)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.bytes_read = 0
        # Checked before it is opened: a FIFO or a device given as a checkpoint blocked os.open (or
        # never ended) on this rank, outside every collective timeout ([Note: only regular files]).
        # No size limit: the file holds the weights; parse_header bounds what the header may cost.
        self._fd = open_regular_file(self.path, "checkpoint file", max_bytes=None, todo=PATH_REMEDY,
                                     error=SafetensorsError)
        try:
            self.metadata, infos = parse_header(self.path, self._fd)
        except BaseException:
            os.close(self._fd)
            raise
        self.tensors: dict[str, TensorInfo] = {t.name: t for t in infos}

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get(self, name: str) -> TensorRows:
        return TensorRows(self, self.tensors[name])

    def pread_into(self, out: torch.Tensor, offset: int) -> None:
        buf = memoryview(out.view(torch.uint8).reshape(-1).numpy())
        done = 0
        while done < len(buf):
            n = os.preadv(self._fd, [buf[done:]], offset + done)
            if n <= 0:
                raise SafetensorsError(f"{self.path}: file ends at byte {offset + done}")
            done += n
        self.bytes_read += done

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Checkpoint:
    """All tensors of a checkpoint (one file, or a folder with a single file or an index).

    With an index, its ``weight_map`` says which file holds each tensor, and the files must say the
    same: every tensor it lists is in the file it names, and every tensor of those files is listed --
    for that file. A tensor held by two files is refused as ambiguous rather than read from either:
    which copy a loader reads depends on the loader (the index's file, or the last file read), so
    the same folder would load differently elsewhere. A folder's ``model.safetensors`` is read alone,
    whether or not an index is there too: transformers' ``from_pretrained`` takes that file before
    the index (``modeling_utils``: ``SAFE_WEIGHTS_NAME`` is tried first), and a folder must load here
    as it loads there -- with the index, the two could hold different models.
    """

    def __init__(self, path: str | Path) -> None:
        p = Path(path)
        files: list[SafetensorsFile] = []
        try:
            if p.is_dir():
                index = p / INDEX_NAME
                single = p / "model.safetensors"
                if single.exists():  # before the index, as transformers' from_pretrained reads a folder
                    files.append(SafetensorsFile(single))
                    where = dict.fromkeys(files[0].keys(), files[0])  # one header: its names are unique
                elif index.exists():  # os.stat: answers for a FIFO too, which read_index then refuses
                    weight_map = read_index(index)
                    names = sorted(set(weight_map.values()))
                    for name in names:
                        if not (p / name).exists():  # there but not a regular file: SafetensorsFile says so
                            keys = sorted(k for k, v in weight_map.items() if v == name)
                            raise SafetensorsError(
                                f"{index} names {name} for tensor(s) {_few(keys)}, but {p / name} does not exist; "
                                "download or copy every file the index names (or the whole folder) again")
                    for name in names:
                        files.append(SafetensorsFile(p / name))
                    where = _agree_with_index(index, weight_map, dict(zip(names, files, strict=True)))
                else:
                    raise SafetensorsError(f"{p}: no model.safetensors or {INDEX_NAME} in this folder")
            else:
                files.append(SafetensorsFile(p))
                where = dict.fromkeys(files[0].keys(), files[0])
        except BaseException:
            for f in files:
                f.close()
            raise
        self.path = p
        self.files = files
        self._where = where

    def keys(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> TensorRows:
        return self._where[name].get(name)

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes_read for f in self.files)

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- the checks ---------------------------------------------------------------------------------
def parse_header(path: Path, fd: int) -> tuple[dict[str, str], list[TensorInfo]]:
    """The ``__metadata__`` and the tensors of the safetensors file open as ``fd``, each tensor with
    its absolute byte range, after the checks of the safetensors library's reader:

    * the header length is at most :data:`MAX_HEADER_BYTES` and fits in the file;
    * the header is UTF-8 JSON (no NaN/Infinity), an object; ``__metadata__``, when present, maps
      strings to strings;
    * every entry is an object with ``dtype`` (a name of the format), ``shape`` (a list of integers
      >= 0) and ``data_offsets`` (two integers ``0 <= begin <= end``), and ``end - begin`` is exactly
      what the shape and dtype need;
    * sorted by offset, the tensors fill the data from its first byte to the end of the file, without
      a gap or an overlap;

    and, stricter than the library (which keeps the last of two entries of one name, and ignores
    fields it does not know): no name twice in one JSON object, no entry field besides
    :data:`ENTRY_FIELDS`, no dimension over 2**63 - 1 (torch's limit).
    """
    def bad(what: str) -> SafetensorsError:
        return SafetensorsError(f"{path}: {what}; {REMEDY}")

    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        if len(head) != 8:
            raise SafetensorsError(f"{path}: not a safetensors file (shorter than 8 bytes); {REMEDY}")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise bad(f"header length {n} is over the format's limit of {MAX_HEADER_BYTES} bytes")
        if 8 + n > size:
            raise bad(f"header length {n} does not fit in the file of {size} bytes")
        raw = os.pread(fd, n, 8)
    except OSError as e:
        raise SafetensorsError(f"{path}: not a readable safetensors file ({e})") from None
    if len(raw) != n:
        raise bad(f"file ends at byte {8 + len(raw)}, inside its header of {n} bytes")
    header = _json_object(raw, "the header", bad)

    meta = header.pop("__metadata__", None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise bad(f"__metadata__ must map strings to strings, got {_short(meta)}")

    entries = []  # (begin, end, name, dtype, shape), offsets relative to the data
    for name, h in header.items():
        entries.append((*_entry_offsets(name, h, bad), name, h["dtype"], tuple(h["shape"])))

    entries.sort()
    pos, last = 0, None
    for begin, end, name, _, _ in entries:
        if begin < pos:
            raise bad(f"tensor {_short(name)}: data_offsets [{begin}, {end}] overlap tensor {_short(last[2])} at "
                      f"[{last[0]}, {last[1]}]; the tensors must fill the data without gaps or overlaps")
        if begin > pos:
            after = f"the end of tensor {_short(last[2])}" if last else "the start of the data"
            raise bad(f"tensor {_short(name)} begins at byte {begin} of the data, {begin - pos} bytes after {after}, "
                      "bytes no tensor holds; the tensors must fill the data without gaps or overlaps")
        pos, last = end, (begin, end, name)
    data_end = 8 + n + pos
    final = f"tensor {_short(last[2])} (the last one)" if last else "the header (which lists no tensor)"
    if data_end > size:
        raise bad(f"file ends at byte {size}, but {final} ends at byte {data_end}: the file is cut short")
    if data_end < size:
        raise bad(f"{size - data_end} bytes after the end of {final} that no tensor holds: the data must end "
                  "where the file ends")
    infos = []
    for begin, end, name, dtype, shape in entries:
        if dtype not in DTYPES:
            raise SafetensorsError(f"{path}: tensor {_short(name)}: dtype {dtype} is not supported by this reader "
                                   f"(it reads {', '.join(DTYPES)}); convert the tensor to one of them")
        infos.append(TensorInfo(name, DTYPES[dtype], shape, 8 + n + begin, 8 + n + end))
    return meta, infos


def _entry_offsets(name: str, h: Any, bad) -> tuple[int, int]:
    """``(begin, end)`` of header entry ``h`` of tensor ``name``, once its fields are checked."""
    what = f"tensor {_short(name)}"
    if not isinstance(h, dict):
        raise bad(f"{what}: its entry is a JSON {_json_type(h)}, not an object {{dtype, shape, data_offsets}}")
    for field in ENTRY_FIELDS:
        if field not in h:
            raise bad(f"{what}: its entry has no {field!r}")
    unknown = sorted(set(h) - set(ENTRY_FIELDS))
    if unknown:
        raise bad(f"{what}: its entry has field(s) {_short(unknown)} the format does not define (only "
                  f"{', '.join(ENTRY_FIELDS)})")
    dtype, shape, offsets = h["dtype"], h["shape"], h["data_offsets"]
    if not isinstance(dtype, str) or dtype not in FORMAT_DTYPE_BITS:
        raise bad(f"{what}: dtype {_short(dtype)} is not a safetensors dtype ({', '.join(FORMAT_DTYPE_BITS)})")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise bad(f"{what}: shape must be a list of integers >= 0, got {_short(shape)}")
    if any(d >= 2**63 for d in shape):
        raise bad(f"{what}: shape {_short(shape)} has a dimension over 2**63 - 1")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise bad(f"{what}: data_offsets must be [begin, end] with two integers >= 0, got {_short(offsets)}")
    begin, end = offsets
    if end < begin:
        raise bad(f"{what}: data_offsets [{begin}, {end}] end before they begin")
    numel = 0 if 0 in shape else 1
    for d in shape if numel else ():
        numel *= d
        if numel >= 2**64:  # the library's checked multiply refuses it too; stopping here keeps it cheap
            raise bad(f"{what}: shape {_short(shape)} has 2**64 elements or more")
    bits = numel * FORMAT_DTYPE_BITS[dtype]
    if bits % 8:
        raise bad(f"{what}: dtype {dtype} and shape {_short(shape)} make {bits} bits, not a whole number of bytes")
    need = bits // 8
    if end - begin != need:
        raise bad(f"{what}: data_offsets [{begin}, {end}] hold {end - begin} bytes, its dtype {dtype} and shape "
                  f"{_short(shape)} need {need}")
    return begin, end


def read_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` of ``index``: a JSON object whose ``weight_map`` maps each tensor name to a
    file of the checkpoint folder (a relative name, no ``..``), no name twice."""
    def bad(what: str) -> SafetensorsError:
        return SafetensorsError(f"{index}: {what}; {INDEX_REMEDY}")

    # A regular file of at most MAX_HEADER_BYTES, checked before it is opened: a FIFO named like the
    # index blocked here, and an index of gigabytes would be parsed whole.
    raw = read_regular_file(index, "checkpoint index", max_bytes=MAX_HEADER_BYTES, todo=PATH_REMEDY,
                            error=SafetensorsError)
    doc = _json_object(raw, "the index", bad)
    if "weight_map" not in doc:
        raise bad("has no 'weight_map' (the tensor name -> file name map save_pretrained writes)")
    weight_map = doc["weight_map"]
    if not isinstance(weight_map, dict):
        raise bad(f"'weight_map' must be an object {{tensor name: file name}}, got a JSON {_json_type(weight_map)}")
    if not weight_map:
        raise bad("'weight_map' is empty: the index names no tensor")
    for key, name in weight_map.items():
        if not isinstance(name, str):
            raise bad(f"'weight_map' maps tensor {_short(key)} to {_short(name)}, not to a file name")
        if not name or PurePath(name).is_absolute() or ".." in PurePath(name).parts:
            raise bad(f"'weight_map' maps tensor {_short(key)} to {_short(name)}, which is not a file of the checkpoint "
                      "folder (a name relative to it, without '..')")
    return weight_map


def _agree_with_index(index: Path, weight_map: dict[str, str],
                      files: dict[str, SafetensorsFile]) -> dict[str, SafetensorsFile]:
    """Tensor name -> the file to read it from, once the index and the files say the same."""
    for key, name in weight_map.items():
        if key not in files[name].tensors:
            holders = [n for n, f in files.items() if key in f.tensors]
            where = f" ({holders[0]} does)" if holders else ""
            raise SafetensorsError(f"{index}: its weight_map maps tensor {_short(key)} to {name}, which does not hold "
                                   f"it{where}; {INDEX_REMEDY}")
    for name, f in files.items():
        for key in f.tensors:
            named = weight_map.get(key)
            if named is None:
                raise SafetensorsError(f"{index.parent}: {name} holds tensor {_short(key)}, which the index does not "
                                       f"list; {INDEX_REMEDY}")
            if named != name:
                a, b = sorted((name, named))
                raise SafetensorsError(f"{index.parent}: tensor {_short(key)} is in both {a} and {b} (the index names "
                                       f"{named}): which copy to read is ambiguous; remove it from {name}, or "
                                       f"{INDEX_REMEDY}")
    return {key: files[name] for key, name in weight_map.items()}


class _DuplicateName(WshardingError, ValueError):
    pass


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateName(k)
        out[k] = v
    return out


def _not_json(constant: str) -> None:
    raise InvalidArgument(f"{constant} is not JSON")


def _json_object(raw: bytes, what: str, bad) -> dict[str, Any]:
    """``raw`` parsed as strictly as serde_json parses it: UTF-8, standard JSON, an object -- and no
    name twice in one object (serde and Python's json would both keep the last)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        doc = json.loads(text, object_pairs_hook=_unique_pairs, parse_constant=_not_json)
    except _DuplicateName as e:
        raise bad(f"{_short(e.args[0])} appears twice in {what} (readers differ on which entry counts)") from None
    except RecursionError:
        raise bad(f"{what} is not valid JSON (nested too deep)") from None
    except ValueError as e:
        raise bad(f"{what} is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise bad(f"{what} is a JSON {_json_type(doc)}, not an object")
    return doc


def _is_count(x: Any) -> bool:
    return type(x) is int and x >= 0  # bool is an int in Python, not in JSON


def _json_type(x: Any) -> str:
    return {dict: "object", list: "list", str: "string", int: "int", float: "float", bool: "bool",
            type(None): "null"}.get(type(x), type(x).__name__)


def _short(x: Any, limit: int = 120) -> str:
    """``repr(x)``, cut to ``limit`` characters: names and values in messages come from the file."""
    r = repr(x)
    return r if len(r) <= limit else r[:limit] + "..."


def _few(keys: list[str]) -> str:
    return f"{keys[:3]}" + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
