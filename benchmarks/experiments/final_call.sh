#!/usr/bin/env bash
# Device calls at the end of a session (the machine stays warm in between, so the build and the FA2
# build carry over): STAGE=tests builds HEAD (sm_90a), starts upstream FA2's build in the background
# and runs the GPU tests; STAGE=bench runs the full chunked-prefill + paged table beside FA2.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD CUDA_HOME=/usr/local/cuda FLASH_ATTN_TQ_CUDA_ARCHS=90a MAX_JOBS=16
OUT=${OUT:-/tmp/final}; mkdir -p "$OUT"
t0=$SECONDS
if [ "${STAGE:-tests}" = tests ]; then
  python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  echo "build $((SECONDS - t0)) s"
  (python3 .fa2/build_upstream_fa2.py .fa2/flash_attn-2.8.3.post2.tar.gz /tmp/fa2 --hdims 128 > /tmp/fa2.log 2>&1 &)
  python3 -m pytest tests -m gpu -q -p no:cacheprovider -rf > "$OUT/gpu_tests.log" 2>&1; tail -3 "$OUT/gpu_tests.log"
  echo "tests $((SECONDS - t0)) s"
else
  for i in $(seq 90); do grep -q "^export" <(tail -1 /tmp/fa2.log 2>/dev/null) && break; sleep 2; done
  eval "$(tail -1 /tmp/fa2.log)" || echo "no FA2"
  timeout $((590 - SECONDS + t0)) python3 benchmarks/bench_prefill.py --out "$OUT" --name prefill > "$OUT/bench_prefill.log" 2>&1
  grep -E "^\| [0-9]" "$OUT/prefill.md"
fi
echo "total $((SECONDS - t0)) s"
