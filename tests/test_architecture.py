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
    "wsharding.core.units": 0,
    "wsharding.runtime": 0,
    "wsharding.cuda_graph": 0,
    "wsharding.memory": 0,
    "wsharding.fatal": 0,
    "wsharding.io_checks": 0,
    "wsharding.empty_build": 0,
    "wsharding.core.errors": 0,
    "wsharding.core.emulation": 0,
    "wsharding.core.layout": 1,
    "wsharding.core.schedule": 1,
    "wsharding.core.resident": 1,
    "wsharding.core.contract": 1,
    "wsharding.core.trace": 1,
    "wsharding.core.observe": 1,
    "wsharding.core.replay": 1,
    "wsharding.safetensors_file": 1,
    "wsharding.core.comm": 2,
    "wsharding.core.groups": 2,
    "wsharding.core.torch_backend": 2,
    "wsharding.accel": 2,
    "wsharding.accel.mapped_slots": 3,
    "wsharding.accel.nccl.communicator": 4,
    "wsharding.accel.nccl.probe": 4,
    "wsharding.core.next_step": 4,
    "wsharding.core.first_layer": 4,
    "wsharding.costmodel": 2,
    "wsharding.presets": 3,
    "wsharding.core.context": 3,
    "wsharding.core.slots": 3,
    "wsharding.core.slot_state": 3,
    "wsharding.core.stamp": 3,
    "wsharding.core.planner": 4,
    "wsharding.core.step_owner": 4,
    "wsharding.core.options": 4,
    "wsharding.core.edits": 4,
    "wsharding.core.backpressure": 4,
    "wsharding.core.plugins": 4,
    "wsharding.core.graph_ops": 5,
    "wsharding.core.ties": 6,
    "wsharding.core.declare": 6,
    "wsharding.linear": 5,
    "wsharding.comm_by_name": 5,
    "wsharding.core.rowloaders": 1,
    "wsharding.core.replicas": 1,
    "wsharding.core.bound": 6,
    "wsharding.core.guards": 6,
    "wsharding.core.redistribute": 6,
    "wsharding.core.sharding": 6,
    "wsharding.core.runner": 6,
    "wsharding.checkpoint": 7,
    "wsharding.models": 8,
    "wsharding.serve": 9,
    "wsharding.engines": 9,
    "wsharding": 10,  # the package face: re-exports only
    # ---- the teaching layer ----
    "wsharding.lab": 20,
    "wsharding.lab.layout_presets": 20,
    "wsharding.lab.memory": 20,
    "wsharding.lab.tasks": 20,
    "wsharding.lab.cluster": 20,
    "wsharding.lab.emulation": 20,
    "wsharding.lab.viz": 21,
    "wsharding.lab.bench": 22,
    "wsharding.lab.demo": 22,
    "wsharding.lab.plan": 22,
    "wsharding.lab.soak": 22,
    "wsharding.lab.info": 22,
    "wsharding.lab.questions": 22,
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
    broken["wsharding.accel.nccl.symmetric"].add("wsharding.accel.nccl.communicator")
    broken["wsharding.core.slots"].add("wsharding.lab.viz.comm")
    assert sorted(map(tuple, circles_of(broken))) == [
        # the communicator's slot policy (mapped_slots) reads symmetric windows: one circle of three
        ("wsharding.accel.mapped_slots", "wsharding.accel.nccl.communicator", "wsharding.accel.nccl.symmetric"),
        ("wsharding.lab.bench.step", "wsharding.lab.viz.bench"),
    ]
    assert ("wsharding.core.slots", "wsharding.lab.viz.comm") in upward_imports(broken)
    assert library_to_teaching(broken) == [("wsharding.core.slots", "wsharding.lab.viz.comm")]


# ---- notes, and what the library's prose may hold ---------------------------------------------------
# A note is written once, where its reasoning belongs, and cited elsewhere by its name. It is written
# as a docstring paragraph that starts with ``[Note: X]`` -- alone on its line, or followed by its
# first sentence -- or as a comment line holding only ``# [Note: X]``, with the note's text in the
# comment lines right below it. Every other ``[Note: X]`` is a reference to a note.


def prose_blocks(source: str) -> list[tuple[str, int, list[str]]]:
    """``("docstring" | "comment", first line, lines of text)`` for every docstring of ``source`` (a
    statement that is a lone string: module, class, function and attribute docstrings) and every
    block of comment lines (consecutive lines holding only a comment; a comment after code is a block
    of its own)."""
    import inspect
    import io
    import tokenize

    blocks: list[tuple[str, int, list[str]]] = [
        ("docstring", node.lineno, inspect.cleandoc(node.value.value).splitlines())
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)]
    open_block: list[str] | None = None
    last = 0
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        text = tok.string.lstrip("#").removeprefix(":").strip()
        alone = tok.line.strip().startswith("#")
        if alone and open_block is not None and tok.start[0] == last + 1:
            open_block.append(text)
        else:
            blocks.append(("comment", tok.start[0], [text]))
            open_block = blocks[-1][2] if alone else None
        last = tok.start[0]
    return blocks


def note_name(raw: str) -> str:
    """A note's name as cited, wherever the citation was wrapped (a comment's ``#`` or ``#:`` dropped)."""
    import re

    return " ".join(re.sub(r"\n\s*#:?", " ", raw).split())


def note_definitions(source: str) -> list[str]:
    """The names of the notes that ``source`` writes (see above)."""
    import re

    alone = re.compile(r"\[Note: ([^\]]+)\]")
    with_text = re.compile(r"\[Note: ([^\]]+)\]\s+[A-Za-z`*]")  # not "[Note: X]: ..." nor "[Note: X] (in ...)"
    names = []
    for kind, _, lines in prose_blocks(source):
        for i, text in enumerate(lines):
            text = text.strip()
            followed = i + 1 < len(lines) and bool(lines[i + 1].strip())
            if kind == "comment":
                if (m := alone.fullmatch(text)) and followed:
                    names.append(note_name(m.group(1)))
            elif i == 0 or not lines[i - 1].strip():  # a docstring paragraph's first line
                if ((m := alone.fullmatch(text)) and followed) or (m := with_text.match(text)):
                    names.append(note_name(m.group(1)))
    return names


def note_references(source: str) -> list[str]:
    """The names of every ``[Note: X]`` in ``source`` -- code strings and wrapped citations included."""
    import re

    return [note_name(m.group(1)) for m in re.finditer(r"\[Note:\s*([^\]]+?)\s*\]", source)]


def unresolved_notes(sources: dict[str, str]) -> list[str]:
    """``name: where it is written`` for every note cited in ``sources`` (file -> text) that is not
    written exactly once among them."""
    from collections import Counter

    written = Counter(n for text in sources.values() for n in note_definitions(text))
    cited: dict[str, str] = {}
    for f, text in sorted(sources.items()):
        for n in note_references(text):
            cited.setdefault(n, f)
    return sorted(f"[Note: {n}] (cited in {f}): written {written[n]} times" for n, f in cited.items() if written[n] != 1)


def package_sources() -> dict[str, str]:
    return {str(p.relative_to(PKG.parent)): p.read_text() for p in sorted(PKG.rglob("*.py"))}


def test_every_cited_note_is_written_exactly_once():
    assert unresolved_notes(package_sources()) == [], (
        "write the note where its reasoning belongs (a docstring paragraph or comment block that starts with "
        "[Note: X]), or cite the note that exists")


def test_the_note_rule_sees_a_missing_and_a_doubled_note():
    source = '''"""A module.

[Note: the gate]
Why the gate exists.

[Note: backpressure] The host never runs far ahead.
"""
# [Note: the hot path]
# Decided at init.
x = 1  # [Note: the gate]
# [Note: backpressure]: a citation
def f():
    """[Note: the gate]: a citation too, as is [Note: the
    hot path]."""
'''
    assert sorted(note_definitions(source)) == ["backpressure", "the gate", "the hot path"]
    assert sorted(set(note_references(source))) == ["backpressure", "the gate", "the hot path"]
    assert unresolved_notes({"m.py": source}) == []
    assert unresolved_notes({"m.py": source + "# [Note: a missing note]\n"}) == [
        "[Note: a missing note] (cited in m.py): written 0 times"]
    assert unresolved_notes({"m.py": source, "n.py": source}) == [
        f"[Note: {n}] (cited in m.py): written 2 times" for n in ("backpressure", "the gate", "the hot path")]


#: What the library's docstrings and comments do not hold: the day of a measurement, the path of a
#: measurement, probe or figure file, an issue number. A measured fact stays, as a fact; its date
#: and files are in docs/measurements/.
STALE_PROSE = {
    "a date": r"\b20\d\d-\d\d-\d\d\b",
    "a measurement or probe path": r"figures/device|docs/measurements|scripts/gpu_probes|\bresearch/",
    "an issue number": r"(?i)\bissues?\s*#?\s*\d+|(?<![\w&#])#\d+\b",
}


def stale_prose(source: str, filename: str) -> list[str]:
    """``file:line: what`` for every docstring or comment of ``source`` that holds one of STALE_PROSE."""
    import re

    found = []
    for _, line, lines in prose_blocks(source):
        for i, text in enumerate(lines):
            found += [f"{filename}:{line + i}: {what}: {text.strip()}"
                      for what, pattern in STALE_PROSE.items() if re.search(pattern, text)]
    return found


def test_library_docstrings_and_comments_hold_no_dates_paths_or_issue_numbers():
    found = [hit for f, text in package_sources().items() for hit in stale_prose(text, f)]
    assert found == [], "say what and why; the date and the files of a measurement go to docs/measurements/"


def test_the_prose_rule_sees_a_date_a_path_and_an_issue():
    source = '''"""Measured on two H200s (2026-12-01)."""
# see figures/device/run.json
X = "2026-12-01, research/x.py, issue #6"  # a code string is data, not prose
def f():
    """Fixes issue #10; the copy hides behind a GEMM."""
'''
    assert [hit.split(": ")[1] for hit in stale_prose(source, "m.py")] == [
        "a date", "an issue number", "a measurement or probe path"]
    assert stale_prose('"""On two H200s the copy-engine gather hides behind a GEMM."""\n', "m.py") == []


# ---- the essential path: core stands alone, and the library's tests need no teaching layer ----------
TESTS = Path(__file__).resolve().parent
CORE = "wsharding.core"


#: The one teaching module the library's tests may import: the rank-process harness, which starts the
#: CPU ranks they run on and imports nothing of the teaching layer itself (checked below).
HARNESS = "wsharding.lab.cluster"


def names_lab(node: ast.AST) -> bool:
    """True for an import of ``wsharding.lab`` (or below) other than the rank-process harness,
    ``from wsharding import lab``, or a string naming it (``__import__``, ``python -m wsharding.lab.plan``)."""
    def is_lab(name: str) -> bool:
        if name == HARNESS or name.startswith(HARNESS + "."):
            return False
        return name == "wsharding.lab" or name.startswith(("wsharding.lab.", "wsharding.lab:"))

    if isinstance(node, ast.Import):
        return any(is_lab(a.name) for a in node.names)
    if isinstance(node, ast.ImportFrom) and node.module:
        return is_lab(node.module) or (node.module == "wsharding" and any(a.name == "lab" for a in node.names))
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and is_lab(node.value)


def lab_users_among_tests(sources: dict[str, str]) -> list[str]:
    """Test files (paths relative to tests/) outside ``lab/`` that import or name ``wsharding.lab``."""
    return sorted(path for path, source in sources.items()
                  if not path.startswith("lab/") and any(names_lab(n) for n in ast.walk(ast.parse(source))))


def core_reaching_out(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(core module, imported module) for every import -- inside functions too -- from
    ``wsharding.core`` to any package module outside it: the accelerations and the teaching layer
    above all, but also the rest of the library, so that the core reads (and runs) alone."""
    return sorted((m, t) for m, ts in graph.items() if m == CORE or m.startswith(CORE + ".")
                  for t in ts if t.startswith("wsharding") and not (t == CORE or t.startswith(CORE + ".")))


def test_library_tests_do_not_import_the_teaching_layer():
    # this file names the teaching layer's modules as data (FLOORS), importing none of them
    sources = {p.relative_to(TESTS).as_posix(): p.read_text() for p in TESTS.rglob("*.py") if p != Path(__file__)}
    assert lab_users_among_tests(sources) == [], "move the test to tests/lab/, or give it a rank task of its own"


def test_the_harness_imports_nothing_of_the_teaching_layer():
    # the library's tests import it: what it imports must be the library's (no widgets, no plotly)
    assert sorted(t for t in GRAPH[HARNESS] if is_teaching(t)) == []


def test_core_imports_only_the_core():
    assert core_reaching_out(GRAPH) == []


def test_the_essential_path_rules_see_a_violation():
    sources = {
        "core/test_ok.py": "import wsharding.core.layout\nfrom wsharding import models\n",
        "core/test_harness.py": "from wsharding.lab.cluster import RankCluster\n",  # the harness may
        "core/test_direct.py": "from wsharding.lab.tasks.model import model_equality\n",
        "models/test_in_function.py": "def f():\n    from wsharding import lab\n",
        "linear/test_by_name.py": "import importlib\nm = importlib.import_module('wsharding.lab.demo')\n",
        "lab/test_demo.py": "from wsharding.lab import demo\n",  # the teaching layer's own tests may
    }
    assert lab_users_among_tests(sources) == ["core/test_direct.py", "linear/test_by_name.py",
                                            "models/test_in_function.py"]
    graph = {"wsharding.core.slots": {"wsharding.core.layout", "wsharding.accel.cuda_vmm"},
             "wsharding.core.planner": {"wsharding.lab.viz.planner"},
             "wsharding.core.declare": {"wsharding.linear.base", "torch"},
             "wsharding.checkpoint": {"wsharding.accel.nccl"},  # the library outside core may
             "wsharding.core": {"wsharding.core.layout"}}
    assert core_reaching_out(graph) == [("wsharding.core.declare", "wsharding.linear.base"),
                                        ("wsharding.core.planner", "wsharding.lab.viz.planner"),
                                        ("wsharding.core.slots", "wsharding.accel.cuda_vmm")]
