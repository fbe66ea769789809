#!/usr/bin/env bash
# Regenerate benchmarks/RESULTS.md (and the JSON/CSV/plot next to it) with one command:
#   bash benchmarks/regenerate.sh            # the settings below
#   THREADS=2 LENGTHS=512,1024,2048,4096,8192 bash benchmarks/regenerate.sh
# NOTES is free text recorded in RESULTS.md (say whether the machine was shared).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-/work/main/.venv/bin/python}
[ -x "$PY" ] || PY=python
LENGTHS=${LENGTHS:-512,1024,2048,4096}
THREADS=${THREADS:-2}
REPEATS=${REPEATS:-3}
MAX_SECONDS=${MAX_SECONDS:-20}
NOTES=${NOTES:-}
PYTHONPATH=$PWD/src exec "$PY" -m posenc.cli bench \
    --lengths "$LENGTHS" --threads "$THREADS" --repeats "$REPEATS" --warmup 1 --max-seconds "$MAX_SECONDS" \
    --out benchmarks/results --markdown benchmarks/RESULTS.md --notes "$NOTES" "$@"
