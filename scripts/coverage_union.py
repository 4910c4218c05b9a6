"""Per-module coverage of this CPU run together with saved GPU runs.

    python scripts/coverage_union.py reports/coverage_cpu.json docs/measurements/*/coverage_gpu_*.json

Why: the CUDA branches of the planner and of our NCCL communicator only run on GPUs, which CI does
not have. A GPU run (``scripts/gpu_coverage.sh`` on the GPU machine) saves its executed lines as
coverage's JSON with the commit it ran. Line numbers move with every edit, so a module changed
since that commit has its GPU lines carried over line by line: a line counts only where it lies in
a run of lines whose text is the same then and now (``difflib`` over the file at the commit and the
file now); an edited or new line gets no GPU credit. Prints one row per module: statements, CPU %,
CPU + GPU %, and where the GPU lines came from (with how many were carried over an edit).
"""

from __future__ import annotations

import difflib
import json
import subprocess
import sys
from pathlib import Path


def unchanged_since(commit: str, path: str, repo: Path) -> bool:
    """True when ``path`` in the working tree is what it was at ``commit`` (a file that did not exist
    at ``commit`` is not: ``git diff`` alone would call an untracked file unchanged)."""
    at_commit = subprocess.run(["git", "cat-file", "-e", f"{commit}:{path}"], cwd=repo, capture_output=True)
    r = subprocess.run(["git", "diff", "--quiet", commit, "--", path], cwd=repo, capture_output=True)
    return at_commit.returncode == 0 and r.returncode == 0


def line_map(commit: str, path: str, repo: Path) -> dict[int, int] | None:
    """Line number at ``commit`` -> line number now, for the lines inside runs of identical text
    (1-based); None when the file did not exist at ``commit``."""
    r = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=repo, capture_output=True, text=True)
    if r.returncode != 0:
        return None
    old = r.stdout.splitlines()
    new = (repo / path).read_text().splitlines()
    mapping = {}
    for a, b, size in difflib.SequenceMatcher(None, old, new, autojunk=False).get_matching_blocks():
        for k in range(size):
            mapping[a + k + 1] = b + k + 1
    return mapping


def union(cpu: dict, gpu_runs: list[dict], repo: Path) -> list[dict]:
    """One row per file of the CPU report: its statements, lines run on CPU, lines run on CPU or GPU."""
    rows = []
    for path, f in sorted(cpu["files"].items()):
        executed = set(f["executed_lines"])
        statements = executed | set(f["missing_lines"])
        both = set(executed)
        sources = []
        for run in gpu_runs:
            g = run["files"].get(path)
            if g is None:
                continue
            commit = run["meta"]["wsharding_commit"]
            if unchanged_since(commit, path, repo):
                both |= set(g["executed_lines"]) & statements
                sources.append(run["meta"]["name"])
                continue
            mapping = line_map(commit, path, repo)
            if mapping is None:
                sources.append(f"{run['meta']['name']} (file not at its commit: not counted)")
                continue
            carried = {mapping[n] for n in g["executed_lines"] if n in mapping} & statements
            both |= carried
            sources.append(f"{run['meta']['name']} (file edited since: {len(carried)} of its "
                           f"{len(g['executed_lines'])} lines on unchanged text)")
        n = len(statements)
        rows.append({"file": path, "statements": n, "cpu": 100.0 * len(executed) / n if n else 100.0,
                     "cpu_gpu": 100.0 * len(both) / n if n else 100.0, "gpu_runs": sources})
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'module':44s}{'stmts':>7}{'CPU':>8}{'CPU+GPU':>9}  GPU run"]
    for r in rows:
        lines.append(f"{r['file']:44s}{r['statements']:7d}{r['cpu']:7.1f}%{r['cpu_gpu']:8.1f}%  "
                     + (", ".join(r["gpu_runs"]) or "-"))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) < 1:
        print(__doc__)
        return 2
    cpu = json.loads(Path(argv[0]).read_text())
    gpu_runs = []
    for p in argv[1:]:
        run = json.loads(Path(p).read_text())
        run.setdefault("meta", {})["name"] = Path(p).stem
        if "wsharding_commit" not in run["meta"]:
            print(f"{p}: no wsharding_commit in its meta: skipped", file=sys.stderr)
            continue
        gpu_runs.append(run)
    print(format_rows(union(cpu, gpu_runs, Path.cwd())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
