#!/bin/bash
# The next GPU session's checks in one command (benchmarks/RESULTS-cuda.md, "For the next GPU
# session"), sized for 15 minutes of device time: about 510 s of limits in all.
#   bash benchmarks/gpu_session.sh          # on the GPU machine, from the repository root
# 1. the CUDA tests (the FIRE/FoX score_mod fix on CUDA), 200 s;
# 2. `posenc bench` of alibi and t5, causal, L = 4 096, bfloat16, compile in the warm-up, 110 s;
# 3. flex_compile_check.py decode with the dense row first (dense, auto, dense, flex), 60 s;
# 4. flex_compile_check.py entries on ten (encoding, length) cases, then with --no-limit, 140 s.
# Writes into $OUT (default benchmarks/results-cuda/session): cuda-tests.txt, checks.txt,
# bench-bf16.md and bench/. Uses python3 (the machine's torch); nothing is installed.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results-cuda/session}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch,sys,triton;print('torch',torch.__version__,'CUDA',torch.version.cuda,torch.cuda.get_device_name(),'triton',triton.__version__,'python',sys.version.split()[0])"
  timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:benchmark -m cuda -n 14 -rf --tb=short --durations=15 tests/test_cuda.py
  echo "cuda tests rc=$? at $(( $(date +%s) - T0 )) s"; } 2>&1 | tee "$OUT"/cuda-tests.txt
timeout 110 python3 -m posenc.cli bench --device cuda --dtype bfloat16 --encodings alibi,t5 --lengths 4096 --masks causal \
  --no-references --no-throughput --warmup 2 --repeats 10 --memory-lengths 16384 \
  --out "$OUT"/bench --markdown "$OUT"/bench-bf16.md --notes "benchmarks/gpu_session.sh: one case at a time" 2>&1 | tail -n 30 | tee "$OUT"/checks.txt
echo "bench rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$OUT"/checks.txt
timeout 60 python3 benchmarks/flex_compile_check.py decode --backends dense,auto,dense,flex 2>&1 | tee -a "$OUT"/checks.txt
echo "decode rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$OUT"/checks.txt
timeout 90 python3 benchmarks/flex_compile_check.py entries --encodings alibi,t5,kerple,inkling,fox --lengths 512,1024 2>&1 | tee -a "$OUT"/checks.txt
echo "entries rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$OUT"/checks.txt
timeout 50 python3 benchmarks/flex_compile_check.py entries --no-limit --encodings alibi,t5,kerple,inkling,fox --lengths 512,1024 2>&1 | tee -a "$OUT"/checks.txt
echo "entries --no-limit rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$OUT"/checks.txt
