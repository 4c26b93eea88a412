#!/usr/bin/env bash
# One device call: build the extension, run the GPU tests, compute-sanitizer, then the benchmarks.
#   bash scripts/run_device.sh [tests|bench|prefill|all|users]   (results and logs go to $OUT, or benchmarks/results;
#   all: tests, bench and prefill)
#   bench: decode (benchmarks/bench_decode.py, BENCH_ARGS); prefill: chunked prefill + paged decode
#   (benchmarks/bench_prefill.py, PREFILL_ARGS); users: where users run models (a serving step,
#   bench_serving.py; the filled card, bench_generate.py --fill; speculative decoding,
#   bench_speculative.py, where the SmolLM2 assets are in $TQ_EVAL_DATA)
# EXTENSION_XZ=path: an extension built elsewhere for this machine's torch and Python (xz-compressed
# .so), unpacked instead of building (a build takes minutes of the call).
# Run from the repository root: Python runs the checkout's modules (python3 -m ...), so the package
# needs no install. Wheels carried in .whl/ (flashinfer for the FP8 column, say) are installed into
# python3's environment first; a path the run cannot measure is written as missing, with the reason.
set -uo pipefail
what=${1:-all}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} FLASH_ATTN_TQ_CUDA_ARCHS=${FLASH_ATTN_TQ_CUDA_ARCHS:-90a}
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps .whl/*.whl
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
t0=$SECONDS
if [ -n "${EXTENSION_XZ:-}" ]; then
  so=flash_attn_tq_cuda$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
  python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" "$EXTENSION_XZ" "$so"
  python3 -c "import torch, flash_attn_tq_cuda" || { echo "the carried extension does not load"; exit 1; }
  echo "carried extension: $((SECONDS - t0)) s"
else
  MAX_JOBS=16 python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  echo "build: $((SECONDS - t0)) s"
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
  t0=$SECONDS
  bash scripts/gpu_tests.sh "$OUT" ${GPU_TEST_SHARDS:-4}
  echo "gpu tests: $((SECONDS - t0)) s"
  for tool in memcheck racecheck; do
    cmd=(compute-sanitizer --tool $tool --print-limit 20 python3 -m scripts.sanitize_case)
    { python3 -m flash_attn_tq.testing "${cmd[@]}"; "${cmd[@]}" 2>&1; } > "$OUT/sanitizer_$tool.log"
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
    python3 -m benchmarks.bench_decode ${BENCH_ARGS:-} --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -50
  fi
  if [ "$what" = prefill ] || [ "$what" = all ]; then
    python3 -m benchmarks.bench_prefill ${PREFILL_ARGS:-} --out "$OUT" 2>&1 | tee "$OUT/bench_prefill.log" | tail -30
  fi
  if [ "$what" = users ]; then
    python3 -m benchmarks.bench_serving --out "$OUT" 2>&1 | tee "$OUT/bench_serving.log" | tail -20
    python3 -m benchmarks.bench_generate --fill --variants kv16_compiled,tq_compiled --out "$OUT" 2>&1 |
      tee "$OUT/bench_fill.log" | grep -E "^\[fill\]|TQCache:"
    if [ -n "${TQ_EVAL_DATA:-}" ]; then
      python3 -m benchmarks.bench_speculative --data "$TQ_EVAL_DATA" --out "$OUT" 2>&1 | tee "$OUT/bench_speculative.log" | tail -8
    fi
  fi
fi
