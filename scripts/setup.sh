#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment in .venv: torch first, from the
# exact CPU build pinned here, so pip never pulls a multi-GB CUDA build; then posenc
# with its test extras and the reference implementations the parity tests run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
