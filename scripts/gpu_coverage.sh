#!/usr/bin/env bash
# The GPU tests under coverage, on the GPU machine; writes $OUT/coverage_gpu_NAME.json: the executed
# lines per module and the commit they ran at (scripts/coverage_union.py counts them only for modules
# unchanged since). Keep it in docs/measurements/MACHINE-DAY/ (.ci/run counts every
# docs/measurements/*/coverage_gpu_*.json). Run from the repository root:
#   bash scripts/gpu_coverage.sh COMMIT NAME [pytest arguments, e.g. test files]
# The GPU machine has torch but no coverage package and no network: download the wheel for its Python
# here (pip download coverage --python-version 3.12 --only-binary=:all: --no-deps -d .device/cov) and
# carry .device/cov; it is installed from there.
set -euo pipefail
commit=$1
name=$2
shift 2
python3 -c "import coverage" 2>/dev/null || python3 -m pip install -q --no-deps --no-index .device/cov/*.whl
export PYTHONPATH=.
mkdir -p reports
rm -f reports/.coverage reports/.coverage.*
python3 -m coverage run -m pytest -m gpu -q -p no:cacheprovider "$@" || echo "gpu_coverage: some tests failed (see above)"
python3 -m coverage combine -q
python3 -m coverage json -q -o reports/coverage_gpu_raw.json
python3 - "$commit" "$name" "${OUT:-reports}" <<'PY'
import json
import sys

commit, name, out = sys.argv[1:4]
raw = json.load(open("reports/coverage_gpu_raw.json"))
files = {p: {"executed_lines": f["executed_lines"], "missing_lines": f["missing_lines"]}
         for p, f in raw["files"].items()}
meta = {"wsharding_commit": commit, "name": f"coverage_gpu_{name}", "coverage": raw["meta"]["version"]}
path = f"{out}/coverage_gpu_{name}.json"
json.dump({"meta": meta, "files": files}, open(path, "w"), indent=0)
print("wrote", path)
PY
