"""scripts/coverage_union.py: GPU lines count only for modules unchanged since the GPU run's commit."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _union_module():
    spec = importlib.util.spec_from_file_location("coverage_union", ROOT / "scripts" / "coverage_union.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def test_gpu_lines_count_only_for_unchanged_modules(tmp_path):
    cu = _union_module()
    repo = tmp_path
    _git(repo, "init", "-q")
    _git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "--allow-empty", "-m", "root")
    (repo / "pkg").mkdir()
    for name in ("same.py", "edited.py"):
        (repo / "pkg" / name).write_text("a = 1\nb = 2\nc = 3\nd = 4\n")
    _git(repo, "add", "pkg")
    _git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "code")
    commit = _git(repo, "rev-parse", "HEAD")
    # changed after the GPU run: a line inserted on top (every number moves by one), line d edited
    (repo / "pkg" / "edited.py").write_text("z = 0\na = 1\nb = 2\nc = 3\nd = 5\n")
    cpu = {"files": {"pkg/same.py": {"executed_lines": [1, 2], "missing_lines": [3, 4]},
                     "pkg/edited.py": {"executed_lines": [1, 2, 3], "missing_lines": [4, 5]}}}
    gpu = {"meta": {"wsharding_commit": commit, "name": "coverage_gpu_x"},
           "files": {f"pkg/{n}": {"executed_lines": [1, 3, 4, 9], "missing_lines": [2]} for n in ("same.py", "edited.py")}}
    rows = {r["file"]: r for r in cu.union(cpu, [gpu], repo)}
    assert rows["pkg/same.py"]["cpu"] == 50.0 and rows["pkg/same.py"]["cpu_gpu"] == 100.0  # line 9 is no statement
    # GPU lines 1, 3, 4 were a, c, d: a and c carry over to their new numbers 2 and 4; d was edited,
    # so the GPU run says nothing of its new text (line 5 stays missing)
    assert rows["pkg/edited.py"]["cpu_gpu"] == 80.0
    assert rows["pkg/edited.py"]["gpu_runs"] == ["coverage_gpu_x (file edited since: 2 of its 4 lines on unchanged text)"]
    (repo / "pkg" / "new.py").write_text("a = 1\n")  # not in the GPU run's commit at all
    cpu["files"]["pkg/new.py"] = {"executed_lines": [], "missing_lines": [1]}
    gpu["files"]["pkg/new.py"] = {"executed_lines": [1], "missing_lines": []}
    new = next(r for r in cu.union(cpu, [gpu], repo) if r["file"] == "pkg/new.py")
    assert new["cpu_gpu"] == 0.0 and new["gpu_runs"] == ["coverage_gpu_x (file not at its commit: not counted)"]
    text = cu.format_rows(list(rows.values()))
    assert "pkg/same.py" in text and "100.0%" in text
