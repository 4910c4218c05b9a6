"""Every error the package raises derives from ``WshardingError`` (and still from the built-in it has
always been, so ``except ValueError`` keeps working): one ``except`` catches all of them."""

from __future__ import annotations

import ast
import builtins
import importlib
import pkgutil
from pathlib import Path

import pytest

import wsharding
from wsharding.core.errors import WshardingError

PKG = Path(wsharding.__file__).parent
#: Built-in exceptions the package must not raise bare (an ``assert``-like invariant is not an error a
#: user handles, so AssertionError is not among them).
BUILTIN_ERRORS = {n for n, v in vars(builtins).items()
                  if isinstance(v, type) and issubclass(v, Exception) and not issubclass(v, Warning)} - {
    "AssertionError", "StopIteration", "StopAsyncIteration"}


def bare_builtin_raises(source: str, filename: str) -> list[str]:
    """``file:line: raise ValueError(...)`` for every raise of a built-in exception class."""
    out = []
    tree = ast.parse(source, filename)
    # a module's ``__getattr__`` (PEP 562) answers an unknown name with AttributeError: the protocol itself
    protocol = {id(n) for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "__getattr__"
                for n in ast.walk(f)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None and id(node) not in protocol:
            if isinstance(node.exc, ast.Name) and node.exc.id == "NotImplementedError":
                continue  # an abstract method's body: the subclass's to write, not an error a user handles
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id in BUILTIN_ERRORS:
                out.append(f"{filename}:{node.lineno}: raise {exc.id}")
    return out


def test_the_package_raises_no_bare_builtin_error():
    found = [line for f in sorted(PKG.rglob("*.py"))
             for line in bare_builtin_raises(f.read_text(), str(f.relative_to(PKG.parent)))]
    assert found == [], "raise an error of wsharding.core.errors (or a class deriving from WshardingError) instead"


def test_the_raise_check_sees_a_bare_builtin():
    assert bare_builtin_raises("def f():\n    raise ValueError('x')\n", "m.py") == ["m.py:2: raise ValueError"]
    assert bare_builtin_raises("def f():\n    raise InvalidArgument('x')\n", "m.py") == []
    assert bare_builtin_raises("def f():\n    raise NotImplementedError\n", "m.py") == []
    assert bare_builtin_raises("def __getattr__(name):\n    raise AttributeError(name)\n", "m.py") == []
    assert bare_builtin_raises("def g(name):\n    raise AttributeError(name)\n", "m.py") == ["m.py:2: raise AttributeError"]


def _modules() -> list[str]:
    names = [m.name for m in pkgutil.walk_packages(wsharding.__path__, "wsharding.") if not m.name.endswith("__main__")]
    return ["wsharding", *names]


@pytest.mark.parametrize("name", _modules())
def test_every_exception_class_of_the_package_derives_from_the_base(name):
    try:
        module = importlib.import_module(name)
    except ImportError as e:  # an optional extra this environment lacks (plotly, ipywidgets)
        pytest.skip(f"{name} needs {e.name}")
    own = [v for v in vars(module).values()
           if isinstance(v, type) and issubclass(v, BaseException) and not issubclass(v, Warning)
           and v.__module__ == name]
    assert [c.__name__ for c in own if not issubclass(c, WshardingError)] == []


def test_the_root_exports_the_user_api_and_the_base():
    from wsharding import (  # noqa: F401
        FlatLayout,
        WeightSharding,
        WshardingError,
        init_from_env,
        load_sharded,
        shard_blocks,
    )
    assert "Where to start" in wsharding.__doc__
