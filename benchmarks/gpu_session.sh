#!/bin/bash
# The next GPU session's checks in one command (benchmarks/RESULTS-cuda.md, "For the next GPU
# session" of the third run), sized for 15 minutes of device time: about 520 s of limits in all.
#   bash benchmarks/gpu_session.sh          # on the GPU machine, from the repository root
# 1. FIRE bidirectional on CUDA, alone, with its traceback (still failing after the fix), 150 s;
# 2. flex_compile_check.py entries for inkling and inkling-temperature (the shared-memory retry), 100 s;
# 3. `posenc bench` of alibi, causal, L = 4 096, memory at 16 384 (the block mask's memory), 90 s;
# 4. the CUDA tests, all of them, 180 s.
# Writes into $OUT (default benchmarks/results-cuda/session): fire.txt, checks.txt, bench-bf16.md,
# bench/ and cuda-tests.txt. Uses python3 (the machine's torch); nothing is installed.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results-cuda/session}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
T0=$(date +%s)
PYTEST="python3 -m pytest -q -p no:cacheprovider -p no:benchmark -p no:logging -m cuda -rf"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch,sys,triton;print('torch',torch.__version__,'CUDA',torch.version.cuda,torch.cuda.get_device_name(),'triton',triton.__version__,'python',sys.version.split()[0])"
  timeout 150 $PYTEST -n 4 --tb=short -k "fire and bidir" tests/test_cuda.py
  echo "fire bidir rc=$? at $(( $(date +%s) - T0 )) s"; } 2>&1 | tee "$OUT"/fire.txt | tail -n 60
timeout 100 python3 benchmarks/flex_compile_check.py entries --encodings inkling,inkling-temperature --lengths 512,1024 2>&1 | tee "$OUT"/checks.txt
echo "entries rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$OUT"/checks.txt
timeout 90 python3 -m posenc.cli bench --device cuda --dtype bfloat16 --encodings alibi --lengths 4096 --masks causal \
  --no-references --no-throughput --warmup 2 --repeats 10 --memory-lengths 16384 \
  --out "$OUT"/bench --markdown "$OUT"/bench-bf16.md --notes "benchmarks/gpu_session.sh" 2>&1 | tail -n 20 | tee -a "$OUT"/checks.txt
echo "bench rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$OUT"/checks.txt
{ timeout 180 $PYTEST -n 14 --tb=line tests/test_cuda.py
  echo "cuda tests rc=$? at $(( $(date +%s) - T0 )) s"; } 2>&1 | tee "$OUT"/cuda-tests.txt | tail -n 30
