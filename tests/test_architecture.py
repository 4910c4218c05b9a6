"""The import rules of ARCHITECTURE.md, read from the code's own imports.

* the library never imports the teaching layer (``wsharding.lab``, ``wsharding.__main__``);
* every import goes to a module on the same floor or below (the floors are listed in FLOORS);
* no import circles, even through imports inside functions;
* no private name (``_x``) is imported from another module.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "wsharding"

#: Module prefix -> floor; a module takes the floor of its longest matching prefix. Library floors
#: first (the data path of ARCHITECTURE.md), the teaching layer above them.
FLOORS: dict[str, int] = {
    "wsharding.units": 0,
    "wsharding.runtime": 0,
    "wsharding.cuda_graph": 0,
    "wsharding.memory": 0,
    "wsharding.fatal": 0,
    "wsharding.errors": 0,
    "wsharding.layout": 1,
    "wsharding.trace": 1,
    "wsharding.safetensors_file": 1,
    "wsharding.comm": 2,
    "wsharding.costmodel": 2,
    "wsharding.presets": 3,
    "wsharding.cluster": 3,
    "wsharding.slots": 3,
    "wsharding.planner": 4,
    "wsharding.linear": 5,
    "wsharding.rowloaders": 6,
    "wsharding.bound": 6,
    "wsharding.guards": 6,
    "wsharding.redistribute": 6,
    "wsharding.mapped_slots": 6,
    "wsharding.shard": 6,
    "wsharding.runner": 6,
    "wsharding.checkpoint": 7,
    "wsharding.models": 8,
    "wsharding": 9,  # the package face: re-exports only
    # ---- the teaching layer ----
    "wsharding.lab": 20,
    "wsharding.lab.layout_presets": 20,
    "wsharding.lab.memory": 20,
    "wsharding.lab.tasks": 20,
    "wsharding.lab.viz": 21,
    "wsharding.lab.bench": 22,
    "wsharding.lab.demo": 22,
    "wsharding.lab.plan": 22,
    "wsharding.lab.soak": 22,
    "wsharding.lab.info": 22,
    "wsharding.lab.widgets": 23,
    "wsharding.lab.cli": 24,
    "wsharding.lab.bench.__main__": 24,
    "wsharding.__main__": 24,
}
TEACHING = ("wsharding.lab", "wsharding.__main__")


def module_files() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = module_files()


def floor_of(module: str) -> int:
    best = max((k for k in FLOORS if module == k or module.startswith(k + ".")), key=len, default=None)
    if best is None:
        raise AssertionError(f"{module} has no floor: add it to FLOORS in tests/test_architecture.py and ARCHITECTURE.md")
    return FLOORS[best]


def is_teaching(module: str) -> bool:
    return any(module == t or module.startswith(t + ".") for t in TEACHING)


def resolve(name: str) -> str:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def imports_of(module: str) -> list[tuple[str, str | None]]:
    """(imported module, imported name or None), for every import anywhere in the file."""
    out = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "wsharding":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.append((sub, None) if sub in MODULES else (resolve(node.module), a.name))
        elif isinstance(node, ast.Import):
            out += [(resolve(a.name), None) for a in node.names if a.name.split(".")[0] == "wsharding"]
    return out


GRAPH = {m: {t for t, _ in imports_of(m) if t != m} for m in MODULES}


def test_every_module_has_a_floor():
    for m in MODULES:
        floor_of(m)


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs that go to a higher floor; a package face may import its own
    submodules."""
    return sorted((m, t) for m, ts in graph.items() for t in ts
                  if floor_of(t) > floor_of(m) and not t.startswith(m + "."))


def library_to_teaching(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((m, t) for m, ts in graph.items() if not is_teaching(m) for t in ts if is_teaching(t))


def circles_of(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return circles


def test_library_never_imports_the_teaching_layer():
    assert library_to_teaching(GRAPH) == []


def test_imports_point_down():
    assert upward_imports(GRAPH) == [], "imports from a higher floor (fix the import, or the floor in ARCHITECTURE.md)"


def test_no_private_names_across_modules():
    bad = [(m, t, n) for m in MODULES for t, n in imports_of(m) if n and n.startswith("_") and t != m]
    assert bad == [], f"private names imported across modules: {bad}"


def test_no_import_circles():
    assert circles_of(GRAPH) == []


def test_the_rules_see_a_violation():
    # The checks are only worth something if they fail on a broken house: the two circles and the
    # upward import that the first wave had, replayed on a copy of today's graph.
    broken = {m: set(ts) for m, ts in GRAPH.items()}
    broken["wsharding.lab.viz.bench"].add("wsharding.lab.bench.step")
    broken["wsharding.comm.nccl.symmetric"].add("wsharding.comm.nccl.communicator")
    broken["wsharding.slots"].add("wsharding.lab.viz.comm")
    assert sorted(map(tuple, circles_of(broken))) == [
        ("wsharding.comm.nccl.communicator", "wsharding.comm.nccl.symmetric"),
        ("wsharding.lab.bench.step", "wsharding.lab.viz.bench"),
    ]
    assert ("wsharding.slots", "wsharding.lab.viz.comm") in upward_imports(broken)
    assert library_to_teaching(broken) == [("wsharding.slots", "wsharding.lab.viz.comm")]
