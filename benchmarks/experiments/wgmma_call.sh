#!/usr/bin/env bash
# One device call for the prefill kernel's wgmma variant: build (sm_90a), wgmma vs mma.sync on random
# caches (check_wgmma.py), prefill times of both in the same build (time_prefill.py), then the GPU
# tests (STAGE=full: all of them with FA2's quick prefill table; else the prefill ones).
set -uo pipefail
OUT=${OUT:-/tmp/wg}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-} CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} \
       FLASH_ATTN_TQ_CUDA_ARCHS=90a MAX_JOBS=16 GIT_COMMIT=${GIT_COMMIT:-unknown}
t0=$SECONDS
python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "built: $((SECONDS - t0)) s"
timeout 300 python3 benchmarks/experiments/check_wgmma.py 2>&1 | tee "$OUT/check.log" | grep -v "^OK" | head -60
echo "checked: $((SECONDS - t0)) s"
SHAPES=${SHAPES:-8192:64,8192:128,8192:256,32768:64,8192:512,32768:512,32768:2048}
FLASH_ATTN_TQ_PREFILL_WGMMA=0 python3 benchmarks/experiments/time_prefill.py mma.sync $SHAPES
FLASH_ATTN_TQ_PREFILL_WGMMA=1 python3 benchmarks/experiments/time_prefill.py wgmma $SHAPES
if [ -n "${PAGED_PATCH:-}" ]; then  # decode: paged overhead before and after the patch
  python3 benchmarks/experiments/time_paged.py paged-A
  git apply "$PAGED_PATCH" && python3 setup.py -q build_ext --inplace > "$OUT/build_paged.log" 2>&1 \
    && python3 benchmarks/experiments/time_paged.py "paged+$(basename "$PAGED_PATCH" .patch)" \
    && timeout 300 python3 -m pytest tests -m gpu -q -p no:cacheprovider -k "paged or page" 2>&1 | tail -2
  git apply -R "$PAGED_PATCH"
fi
echo "timed: $((SECONDS - t0)) s"
if [ "${STAGE:-}" = full ]; then
  if [ -f .fa2/flash_attn-2.8.3.post2.tar.gz ]; then
    python3 .fa2/build_upstream_fa2.py .fa2/flash_attn-2.8.3.post2.tar.gz /tmp/fa2 --hdims 128 > "$OUT/fa2.log" 2>&1 \
      && eval "$(tail -1 "$OUT/fa2.log")" || echo "upstream FA2 not built"
  fi
  python3 -m pytest tests -m gpu -q -p no:cacheprovider -rf > "$OUT/tests.log" 2>&1; grep -E "^FAILED|passed|failed" "$OUT/tests.log" | tail -15
  echo "tested: $((SECONDS - t0)) s"
  python3 benchmarks/bench_prefill.py ${PREFILL_ARGS:---quick} --out "$OUT" --name prefill_wgmma > "$OUT/bench.log" 2>&1 || tail -20 "$OUT/bench.log"
  grep -E "^\| [0-9]" "$OUT/prefill_wgmma.md" | head -40
else
  timeout 400 python3 -m pytest tests -m gpu -q -p no:cacheprovider -rf -k "prefill or long_cache or many_query" > "$OUT/tests.log" 2>&1
  grep -E "^FAILED|passed|failed" "$OUT/tests.log" | tail -15
fi
echo "done: $((SECONDS - t0)) s"
