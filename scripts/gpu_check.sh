#!/usr/bin/env bash
# The GPU check, one command, on a machine with a CUDA device and a CUDA build of torch:
#   bash scripts/gpu_check.sh
# 1. the CUDA-marked tests (tests/test_cuda.py: FlexAttention = eager in outputs and gradients
#    for every scalar bias in float32 and bfloat16, every backend = eager on CUDA, the KV cache
#    on CUDA), then the whole default suite on that machine;
# 2. `posenc bench --device cuda` (causal and bidirectional, float32 and bfloat16, peak memory
#    up to L = 16384, profiles, references) against plain SDPA/FlashAttention.
# Writes benchmarks/RESULTS-cuda.md (+ benchmarks/results-cuda/: tests.txt, JSON/CSV, plot).
# Env: PY (interpreter; default .venv/bin/python, else python3), LENGTHS, NOTES;
#      ENCODINGS (the benchmark's, comma-separated; default all); SKIP_SUITE=1 leaves the default
#      suite out (recorded as not run); CUDA_PYTEST_ARGS (extra arguments of the CUDA tests, "-n 8");
#      MEMORY_LENGTHS (16384); DEVICE=cpu runs everything on the CPU (a dry run of this script);
#      PYTEST_ARGS (extra arguments of the default suite, e.g. "-n 14" on a many-core GPU host);
#      CUDA_TESTS_TIMEOUT, TESTS_TIMEOUT, BENCH_TIMEOUT: seconds each part may run (per dtype for
#      the benchmark; default: no limit), for a GPU lent by the minute. A part cut off is recorded
#      as such in RESULTS-cuda.md and in the exit status (124), never as passed.
# Exit status: 3 without a CUDA device; else that of the tests, or of the benchmark.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
if [ "${DEVICE:-cuda}" = cuda ] && ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to $PY (torch $("$PY" -c 'import torch; print(torch.__version__)'))" >&2
    exit 3
fi
LENGTHS=${LENGTHS:-1024,2048,4096,8192}
OUT=benchmarks/results-cuda
mkdir -p "$OUT"
status=0
set +e
{
    "$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"
    # shellcheck disable=SC2086
    timeout "${CUDA_TESTS_TIMEOUT:-0}" "$PY" -m pytest -q -p no:cacheprovider -m cuda -rs ${CUDA_PYTEST_ARGS:-} tests/test_cuda.py
    cuda_tests=$?
    [ $cuda_tests = 124 ] && echo && echo "gpu_check: the CUDA tests ran past CUDA_TESTS_TIMEOUT=${CUDA_TESTS_TIMEOUT}s and were stopped"
    # with xdist workers (PYTEST_ARGS="-n N"), one torch thread each unless OMP_NUM_THREADS says
    # otherwise: 14 workers of 16 threads on 16 cores reached 15 % of the suite in 160 s (H100 host)
    threads=${OMP_NUM_THREADS:-}
    [ -z "$threads" ] && [ -n "${PYTEST_ARGS:-}" ] && threads=1
    if [ "${SKIP_SUITE:-0}" = 1 ]; then
        echo "gpu_check: the default suite was not run (SKIP_SUITE=1)"
        suite=0
    else
        # shellcheck disable=SC2086
        env ${threads:+OMP_NUM_THREADS=$threads} timeout "${TESTS_TIMEOUT:-0}" "$PY" -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-}
        suite=$?
    fi
    [ $suite = 124 ] && echo && echo "gpu_check: the default suite ran past TESTS_TIMEOUT=${TESTS_TIMEOUT}s and was stopped"
    [ $cuda_tests = 0 ] && exit $suite
    exit $cuda_tests
} 2>&1 | tee "$OUT/tests.txt"
status=${PIPESTATUS[0]}
set -e
for dtype in float32 bfloat16; do
    rm -f "$OUT/RESULTS-$dtype.md"
    # shellcheck disable=SC2086
    timeout "${BENCH_TIMEOUT:-0}" "$PY" -m posenc.cli bench ${ENCODINGS:+--encodings "$ENCODINGS"} --device "${DEVICE:-cuda}" --dtype "$dtype" --masks causal,bidir --lengths "$LENGTHS" \
        --memory-lengths "${MEMORY_LENGTHS:-16384}" --profile --warmup 2 --repeats 10 --no-throughput \
        --out "$OUT/$dtype" --markdown "$OUT/RESULTS-$dtype.md" --quiet \
        --notes "GPU check (scripts/gpu_check.sh), $dtype. ${NOTES:-}" || { rc=$?; [ $status = 0 ] && status=$rc; echo "gpu_check: bench $dtype exited $rc" >&2; }
done
{
    echo "# posenc on CUDA: scripts/gpu_check.sh"
    echo
    echo "Tests (\`pytest -m cuda tests/test_cuda.py\`, then the default suite), last lines:"
    echo
    echo '```'
    grep -E "^(torch |[0-9]+ (passed|failed|skipped|error)|FAILED |ERROR |gpu_check: )" "$OUT/tests.txt" | tail -n 20
    echo '```'
    echo
    echo "Full log: results-cuda/tests.txt."
    for dtype in float32 bfloat16; do
        echo
        if [ -f "$OUT/RESULTS-$dtype.md" ]; then
            sed -e 's/^## /### /' -e '1s/^# .*/## '"$dtype"'/' -e "s#]($dtype/#](results-cuda/$dtype/#" \
                "$OUT/RESULTS-$dtype.md"
        else
            echo "## $dtype"
            echo
            echo "The benchmark did not finish (stopped after BENCH_TIMEOUT=${BENCH_TIMEOUT:-none} s, or failed): no numbers."
        fi
    done
} > benchmarks/RESULTS-cuda.md
rm -f "$OUT"/RESULTS-*.md
echo "wrote benchmarks/RESULTS-cuda.md (status $status)"
exit $status
