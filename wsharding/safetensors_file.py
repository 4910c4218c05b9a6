"""Reading rows of safetensors tensors with ``pread``: no file mapping, every byte read counted.

Why not ``safetensors.safe_open``: it maps the whole file, and every page a rank touches while
slicing stays in its resident set (as file pages) until the file is closed -- on CPU ranks a
rank's row shard would be counted twice, and "this rank read only its rows" could not be shown.
The format is simple enough to read directly: 8 bytes of little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``, then the data, row-major. Rows
``[a, b)`` of a tensor are one contiguous byte range, read straight into the destination tensor.

A checkpoint is one ``.safetensors`` file or a folder holding ``model.safetensors`` or a
``model.safetensors.index.json`` with its ``weight_map`` (as ``save_pretrained`` writes them).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class SafetensorsError(ValueError):
    """A file that is not a readable safetensors file, or a read outside a tensor."""


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
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            head = os.pread(self._fd, 8, 0)
            if len(head) != 8:
                raise SafetensorsError(f"{self.path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", head)
            header = json.loads(os.pread(self._fd, n, 8))
        except (ValueError, OSError) as e:
            os.close(self._fd)
            raise SafetensorsError(f"{self.path}: not a readable safetensors file ({e})") from None
        self.metadata = header.pop("__metadata__", {}) or {}
        self.tensors: dict[str, TensorInfo] = {}
        for name, h in header.items():
            if h["dtype"] not in DTYPES:
                raise SafetensorsError(f"{self.path}: tensor {name!r} has dtype {h['dtype']}, not supported")
            b, e = h["data_offsets"]
            self.tensors[name] = TensorInfo(name, DTYPES[h["dtype"]], tuple(h["shape"]), 8 + n + b, 8 + n + e)

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
    """All tensors of a checkpoint (one file, or a folder with a single file or an index)."""

    def __init__(self, path: str | Path) -> None:
        p = Path(path)
        if p.is_dir():
            index = p / "model.safetensors.index.json"
            if index.exists():
                weight_map = json.loads(index.read_text())["weight_map"]
                names = sorted(set(weight_map.values()))
            elif (p / "model.safetensors").exists():
                names = ["model.safetensors"]
            else:
                raise SafetensorsError(f"{p}: no model.safetensors or model.safetensors.index.json in this folder")
            files = [SafetensorsFile(p / n) for n in names]
        else:
            files = [SafetensorsFile(p)]
        self.path = p
        self.files = files
        self._where = {k: f for f in files for k in f.keys()}

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
