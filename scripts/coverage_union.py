"""Per-module coverage of this CPU run together with saved GPU runs.

    python scripts/coverage_union.py reports/coverage_cpu.json figures/device/coverage_gpu_*.json

Why: the CUDA branches of the planner and of our NCCL communicator only run on GPUs, which CI does
not have. A GPU run (``scripts/gpu_coverage.sh`` on the GPU machine) saves its executed lines as
coverage's JSON with the commit it ran; here they count for a module only if that module is
unchanged since that commit (``git diff --quiet COMMIT -- FILE``), since line numbers move with
every edit. Prints one row per module: statements, CPU %, CPU + GPU %, and where the GPU lines
came from.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def unchanged_since(commit: str, path: str, repo: Path) -> bool:
    """True when ``path`` in the working tree is what it was at ``commit``."""
    r = subprocess.run(["git", "diff", "--quiet", commit, "--", path], cwd=repo, capture_output=True)
    return r.returncode == 0


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
            if not unchanged_since(run["meta"]["wsharding_commit"], path, repo):
                sources.append(f"{run['meta']['name']} (file changed since: not counted)")
                continue
            both |= set(g["executed_lines"]) & statements
            sources.append(run["meta"]["name"])
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
