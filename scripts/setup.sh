#!/usr/bin/env bash
# Sets up .venv with wsharding installed in editable mode.
#   bash scripts/setup.sh          runtime + notebooks
#   bash scripts/setup.sh --test   runtime + notebooks + test tools
# The venv sees the system's packages, so a machine that already has torch (a GPU box with its own
# CUDA build) keeps it; where there is none, the CPU wheel torch==2.13.0 is installed. Seeing the
# system's packages can hide a dependency missing from pyproject.toml: scripts/smoke.sh (run by
# .ci/run) installs the package into an isolated venv to catch that.
# The browser test also needs Debian's chromium and fonts-noto-cjk (.ci/run installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv --system-site-packages .venv
extras=notebooks
[ "${1:-}" = "--test" ] && extras=notebooks,test
torch_pin=()
.venv/bin/python -c "import torch" 2>/dev/null || torch_pin=("torch==2.13.0")
.venv/bin/python -m pip install -q --disable-pip-version-check "${torch_pin[@]}" -e ".[${extras}]"
