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
    (repo / "pkg" / "edited.py").write_text("a = 1\nb = 2\nc = 3\nd = 5\n")  # changed after the GPU run
    cpu = {"files": {f"pkg/{n}": {"executed_lines": [1, 2], "missing_lines": [3, 4]} for n in ("same.py", "edited.py")}}
    gpu = {"meta": {"wsharding_commit": commit, "name": "coverage_gpu_x"},
           "files": {f"pkg/{n}": {"executed_lines": [1, 3, 4, 9], "missing_lines": [2]} for n in ("same.py", "edited.py")}}
    rows = {r["file"]: r for r in cu.union(cpu, [gpu], repo)}
    assert rows["pkg/same.py"]["cpu"] == 50.0 and rows["pkg/same.py"]["cpu_gpu"] == 100.0  # line 9 is no statement
    assert rows["pkg/edited.py"]["cpu_gpu"] == 50.0  # its GPU lines may point at other code now
    assert rows["pkg/edited.py"]["gpu_runs"] == ["coverage_gpu_x (file changed since: not counted)"]
    text = cu.format_rows(list(rows.values()))
    assert "pkg/same.py" in text and "100.0%" in text
