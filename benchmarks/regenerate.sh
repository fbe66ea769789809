#!/usr/bin/env bash
# Regenerate the benchmark results with one command each (all of it is `posenc bench`):
#
#   bash benchmarks/regenerate.sh            # RESULTS.md: the speed targets (issue 15), causal and
#                                            #   bidirectional, L = 1024, 2048, 4096, fwd and fwd+bwd,
#                                            #   ratios to plain SDPA + profiles (~10 min quiet, 2 threads)
#   bash benchmarks/regenerate.sh all        # RESULTS-all.md: every encoding, the HF / x-transformers
#                                            #   references, memory, training throughput (packed, HF Llama
#                                            #   converted vs stock), graph breaks (~1 h)
#   bash benchmarks/regenerate.sh memory     # RESULTS-memory.md: peak resident memory of one fwd+bwd at
#                                            #   L = 16384, every encoding, each in a fresh process
#                                            #   (--memory-method rss; untimed, so any load will do; ~15 min;
#                                            #   add --memory-method profiler for live tensor bytes instead)
#
# Env: PY (interpreter; default .venv/bin/python, else python3), THREADS (2), LENGTHS,
# REPEATS (3), ENCODINGS (comma-separated, overrides the set), NOTES (free text recorded in
# the report: say whether the machine was shared). Extra arguments go to `posenc bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
WHAT=${1:-targets}
[ $# -gt 0 ] && shift
THREADS=${THREADS:-2}
REPEATS=${REPEATS:-3}
NOTES=${NOTES:-}
TARGETS=alibi,kerple,fire,t5,shaw,xl,deberta,cope,rope,fox,inkling,pope
common=(--threads "$THREADS" --repeats "$REPEATS" --warmup 1 --notes "$NOTES" --quiet)
case "$WHAT" in
targets)
    exec "$PY" -m posenc.cli bench --encodings "${ENCODINGS:-$TARGETS}" --lengths "${LENGTHS:-1024,2048,4096}" \
        --masks causal,bidir --profile --no-references --no-memory --no-throughput --max-seconds 30 "${common[@]}" \
        --out benchmarks/results --markdown benchmarks/RESULTS.md "$@" ;;
all)
    args=(--lengths "${LENGTHS:-512,1024,2048,4096}" --masks causal,bidir --profile --graph-breaks --max-seconds 20
        --train-packed --train-hf)
    [ -n "${ENCODINGS:-}" ] && args+=(--encodings "$ENCODINGS")
    exec "$PY" -m posenc.cli bench "${args[@]}" "${common[@]}" \
        --out benchmarks/results-all --markdown benchmarks/RESULTS-all.md "$@" ;;
memory)
    args=(--memory-only --memory-lengths "${LENGTHS:-16384}" --masks causal --memory-method rss)
    [ -n "${ENCODINGS:-}" ] && args+=(--encodings "$ENCODINGS")
    exec "$PY" -m posenc.cli bench "${args[@]}" "${common[@]}" \
        --out benchmarks/results-memory --markdown benchmarks/RESULTS-memory.md "$@" ;;
*)
    echo "usage: bash benchmarks/regenerate.sh [targets|all|memory] [posenc bench arguments]" >&2
    exit 2 ;;
esac
