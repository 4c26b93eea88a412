#!/usr/bin/env bash
# One device call: build the extension, run the GPU tests, compute-sanitizer, then the benchmarks.
#   bash benchmarks/run_device.sh [tests|bench|prefill|all]   (results and logs go to $OUT, or benchmarks/results)
#   bench: decode (bench_decode.py, BENCH_ARGS); prefill: chunked prefill + paged decode (bench_prefill.py, PREFILL_ARGS)
set -uo pipefail
what=${1:-all}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} FLASH_ATTN_TQ_CUDA_ARCHS=${FLASH_ATTN_TQ_CUDA_ARCHS:-90a}
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
t0=$SECONDS
export PYTHONPATH=$PWD:${PYTHONPATH:-}
MAX_JOBS=16 python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "build: $((SECONDS - t0)) s"
if [ "$what" = tests ] || [ "$what" = all ]; then
  t0=$SECONDS
  bash benchmarks/gpu_tests.sh "$OUT" ${GPU_TEST_SHARDS:-4}
  echo "gpu tests: $((SECONDS - t0)) s"
  for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool --print-limit 20 python3 benchmarks/sanitize_case.py > "$OUT/sanitizer_$tool.log" 2>&1
    tail -3 "$OUT/sanitizer_$tool.log"
  done
fi
if [ "$what" != tests ]; then
  if [ -f .fa2/flash_attn-2.8.3.post2.tar.gz ]; then
    t0=$SECONDS
    python3 .fa2/build_upstream_fa2.py .fa2/flash_attn-2.8.3.post2.tar.gz /tmp/fa2 --hdims 64,128 > "$OUT/fa2_build.log" 2>&1 \
      && eval "$(tail -1 "$OUT/fa2_build.log")" && echo "upstream FA2 built in $((SECONDS - t0)) s" || tail -5 "$OUT/fa2_build.log"
  fi
  if [ "$what" = bench ] || [ "$what" = all ]; then
    python3 benchmarks/bench_decode.py ${BENCH_ARGS:-} --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -50
  fi
  if [ "$what" = prefill ] || [ "$what" = all ]; then
    python3 benchmarks/bench_prefill.py ${PREFILL_ARGS:-} --out "$OUT" 2>&1 | tee "$OUT/bench_prefill.log" | tail -30
  fi
fi
