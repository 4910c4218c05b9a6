#!/usr/bin/env bash
# A smoke run in an isolated venv (no --system-site-packages), with the package installed as a user
# gets it (`pip install .`, not editable). The main .venv sees the system's packages, so a dependency
# missing from pyproject.toml can hide there; here it cannot: a module that fails to import, or a
# warning such as torch's "Failed to initialize NumPy", fails. Two stages:
#   1. the library alone (torch, safetensors, numpy): every module outside the teaching layer imports
#      without the extras present, and a torchrun job shards a model on 2 CPU ranks;
#   2. with the `lab` extra: every module but the notebooks' widgets imports, and the commands run.
#   bash scripts/smoke.sh            builds .venv-smoke once, then reuses it (SMOKE_VENV=DIR for another)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=$(realpath -m "${SMOKE_VENV:-.venv-smoke}")  # absolute: the runs below leave the checkout
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip_() {  # quiet unless it fails (this machine's pip config warns about its local indexes)
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" >"$VENV/pip.log" 2>&1 || { cat "$VENV/pip.log"; exit 1; }
}
# The CPU wheel first, so that resolving the package's "torch>=2.11" does not pull a CUDA build.
"$VENV/bin/python" -c "import torch" 2>/dev/null || pip_ "torch==2.13.0"
pip_ --force-reinstall --no-deps .
pip_ .
ROOT=$(pwd)
# Run from outside the checkout, so the installed copy is what gets imported.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
err="$work/stderr"
run() {
    echo "smoke: $*"
    if ! "$@" >"$work/stdout" 2>"$err"; then
        cat "$work/stdout" "$err"
        echo "smoke: FAILED: $*" >&2
        exit 1
    fi
    if grep -E "Warning|Error|Traceback|Failed to initialize" "$err"; then
        echo "smoke: FAILED: $* wrote the lines above to stderr" >&2
        exit 1
    fi
}
py="$VENV/bin/python"
# Stage 1: the library alone. A venv reused from an earlier run may hold the extras: take them out.
"$py" -m pip uninstall -q -y plotly ipywidgets pyyaml tqdm transformers jupyterlab >/dev/null 2>&1 || true
run "$py" -c "
import importlib, importlib.util, pkgutil, wsharding
for extra in ('plotly', 'ipywidgets', 'yaml', 'tqdm', 'transformers', 'jupyterlab'):
    assert importlib.util.find_spec(extra) is None, f'{extra} is installed: the core-only stage needs it absent'
names = [m.name for m in pkgutil.walk_packages(wsharding.__path__, 'wsharding.')
         if not m.name.startswith('wsharding.lab') and not m.name.endswith('__main__')]
for n in names:
    importlib.import_module(n)
from wsharding import FlatLayout
print(len(names), 'library modules imported without the extras')
"
cat "$work/stdout"
run "$VENV/bin/torchrun" --standalone --nproc-per-node 2 "$ROOT/examples/torchrun_shard.py" --out "$work/ranks"
"$py" -c "
import json, sys
reports = [json.load(open(f'$work/ranks/rank{r}.json')) for r in range(2)]
assert all(r['equal'] for r in reports), reports
print('core only: torchrun on 2 CPU ranks, sharded equal to the replica bit for bit')
" || exit 1
# Stage 2: with the command line's extra (plotly, pyyaml, tqdm). The notebooks' widgets are left out:
# JupyterLab is the largest install of all and the main .venv runs every notebook.
pip_ "$ROOT[lab]"
run "$py" -c "
import importlib, pkgutil, wsharding
assert 'site-packages' in wsharding.__file__, wsharding.__file__  # the installed copy, not the checkout
names = [m.name for m in pkgutil.walk_packages(wsharding.__path__, 'wsharding.')
         if not m.name.endswith('__main__') and not m.name.startswith('wsharding.lab.widgets')]
for n in names:
    importlib.import_module(n)
import numpy, torch
torch.zeros(3).numpy()  # torch's numpy bridge: needs numpy installed
from importlib.resources import files
assert files('wsharding.presets').joinpath('kimi-k3-b200-fp8.json').is_file()  # package data shipped
print(len(names), 'modules imported')
"
cat "$work/stdout"
run "$VENV/bin/wsharding" info --json -
run "$VENV/bin/wsharding" plan --preset kimi-k3-b200-fp8
run "$VENV/bin/wsharding" demo --ranks 2 --preset tiny --steps 2 --timed-steps 1 --figures "$work/figures"
grep -q "outputs equal bit for bit: yes" "$work/stdout" || { cat "$work/stdout"; exit 1; }
ls "$work/figures"/demo_timeline.html >/dev/null
echo "smoke: the isolated install runs (core only: imports and a torchrun job; with the lab extra: info, plan, demo on 2 CPU ranks with figures)"
