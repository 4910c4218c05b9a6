"""The communicator protocol is a base class: the optional parts have defaults there, which are what
the torch.distributed backend uses, and the library reads them plainly -- no ``getattr`` probe on a
communicator anywhere in ``wsharding/``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from wsharding.accel.mapped_slots import mapping_unavailable
from wsharding.accel.nccl.communicator import NcclCommunicator
from wsharding.accel.nccl.symmetric import WINDOW_ALIGN
from wsharding.core.comm import Communicator
from wsharding.core.torch_backend import TorchDistComm

PKG = Path(__file__).resolve().parents[2] / "wsharding"

#: The optional part of the protocol: each has a default on the base class.
OPTIONAL_METHODS = ("register_all", "release", "on_close")
OPTIONAL_ATTRIBUTES = {"alloc_granularity": 1, "copy_stream": None, "pool": None, "library": None, "emulation": ""}
REQUIRED_METHODS = ("all_gather_into", "prepare_gather", "fork", "alloc", "raise_if_failed", "barrier")


class _Minimal(Communicator):
    rank, world_size, device, mode = 0, 2, torch.device("cpu"), "cpu-test"


def test_the_torch_backend_uses_the_base_defaults():
    assert issubclass(TorchDistComm, Communicator)
    for name in (*OPTIONAL_METHODS, *OPTIONAL_ATTRIBUTES):
        assert name not in vars(TorchDistComm), f"TorchDistComm repeats the default {name}"
    assert TorchDistComm.register_all is Communicator.register_all
    for name, value in OPTIONAL_ATTRIBUTES.items():
        assert getattr(TorchDistComm, name) == value
    assert TorchDistComm.alloc_granularity == 1
    for name in REQUIRED_METHODS:
        assert name in vars(TorchDistComm), f"TorchDistComm leaves {name} to the base class, which only raises"


def test_our_nccl_communicator_overrides_what_symmetric_memory_needs():
    assert issubclass(NcclCommunicator, Communicator)
    for name in (*OPTIONAL_METHODS, *REQUIRED_METHODS, "alloc_granularity"):
        # its own or a base of its own (its waits, raise_if_failed among them, are NcclWaits'): not the default
        assert getattr(NcclCommunicator, name) is not getattr(Communicator, name, None), name
    assert NcclCommunicator.alloc_granularity == WINDOW_ALIGN


def test_the_defaults_do_nothing_and_say_why_a_backend_overrides_them():
    comm, called = _Minimal(), []
    buf = torch.arange(8, dtype=torch.uint8)
    assert comm.register_all() == 0
    assert comm.release([buf]) is None and buf.tolist() == list(range(8))  # tensors are freed by dropping them
    comm.on_close(lambda: called.append(1))
    assert called == []  # nothing is freed under a sharding, so nothing to close first
    for name in OPTIONAL_METHODS:
        doc = getattr(Communicator, name).__doc__ or ""
        assert doc.strip() and "\n" not in doc.strip(), f"{name}: one line on what a backend overrides it for"
    # the mapped slots' check reads the defaults: a plain-tensor backend gathers into plain buffers
    assert mapping_unavailable(comm) == ("_Minimal gathers into plain buffers (mapping needs comm='nccl', our NCCL "
                                         "communicator)")


def test_the_required_part_raises_naming_the_backend():
    comm = _Minimal()
    with pytest.raises(NotImplementedError, match="_Minimal implements no barrier"):
        comm.barrier()
    with pytest.raises(NotImplementedError, match="_Minimal implements no all_gather_into"):
        comm.all_gather_into(torch.empty(2, dtype=torch.uint8), torch.empty(1, dtype=torch.uint8))


# ---- no probing: every part of the protocol is read plainly -----------------------------------------
_COMM_NAME = re.compile(r"_?comm_?")


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def comm_probes(source: str, filename: str = "<snippet>") -> list[str]:
    """``file:line getattr(...)`` for every ``getattr`` on a communicator by its name (``comm``,
    ``comm_``, ``self.comm``): the protocol's base class has a default for what such a call would
    probe for."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and node.args):
            continue
        name = _dotted(node.args[0])
        if name is not None and _COMM_NAME.fullmatch(name.rpartition(".")[2]):
            out.append((node.lineno, f"{filename}:{node.lineno} {ast.unparse(node)}"))
    return [text for _, text in sorted(out)]


def test_no_getattr_probe_on_a_communicator_in_the_library():
    found = [p for f in sorted(PKG.rglob("*.py")) for p in comm_probes(f.read_text(), str(f.relative_to(PKG.parent)))]
    assert found == [], "use the attribute (Communicator in wsharding/core/comm.py has its default):\n" + "\n".join(found)


def test_the_probe_check_sees_one():
    snippet = '''
def f(comm, self, module):
    a = getattr(comm, "register_all", None)
    b = getattr(self.comm, "copy_stream", None) is not None
    c = getattr(comm_, "emulation", "")
    d = getattr(module, "tp_size", 1)  # not a communicator
    e = getattr(command, "bench", None)  # nor this
'''
    assert comm_probes(snippet) == [
        "<snippet>:3 getattr(comm, 'register_all', None)",
        "<snippet>:4 getattr(self.comm, 'copy_stream', None)",
        "<snippet>:5 getattr(comm_, 'emulation', '')",
    ]
